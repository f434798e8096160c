"""The fork server for ``flwr-clientapp`` (``clients.prestart``) and its shim: a handed-over start runs with the
shim's argv, environment, folder and stdio; children are reaped; a crashing child, a garbage request or a missing
server never lose a start (the shim then starts the real command); the launcher puts the shim first on the
SuperNode's PATH only for warm workers with the fork server."""

from __future__ import annotations

import json
import os
import socket
import stat
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from clients.launcher import WarmNode
from clients.prestart import hand_over, write_shim

HANG_S = 300.0  # bounds a hang only; every wait below normally ends within a second
ENTRY = '''
import json, os, sys
def main():
    if "--crash" in sys.argv:
        raise RuntimeError("boom")
    print(json.dumps({"argv": sys.argv, "x": os.environ.get("FEDCOMP_TEST_X"), "cwd": os.getcwd(),
                      "pid": os.getpid(), "ppid": os.getppid(),
                      "own": sorted(n for n in sys.modules if n.split(".")[0] == "clients")}), flush=True)
    print("to stderr", file=sys.stderr, flush=True)
    raise SystemExit(3)
'''


def wait_for(predicate, what: str):
    end = time.monotonic() + HANG_S
    while not (value := predicate()):
        assert time.monotonic() < end, f"timed out waiting for {what}"
        time.sleep(0.05)
    return value


@pytest.fixture
def server(tmp_path):
    """A fork server whose children run ``entry_mod:main`` (above) instead of Flower's ``flwr-clientapp``."""
    folder = tmp_path / "node"
    folder.mkdir(mode=0o700)
    (tmp_path / "entry_mod.py").write_text(ENTRY)
    sock = folder / "clientapp.sock"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(Path(__file__).parents[1])])}
    log = open(tmp_path / "server.log", "wb")
    proc = subprocess.Popen([sys.executable, "-m", "clients.prestart", "--socket", str(sock), "--entry",
                             "entry_mod:main"], stdout=log, stderr=subprocess.STDOUT, env=env)
    wait_for(lambda: sock.is_socket() or proc.poll() is not None, "the server's socket")
    assert proc.poll() is None, (tmp_path / "server.log").read_text()
    shim = write_shim(folder / "bin", sock, str(real_command(tmp_path)))
    yield proc, sock, shim, tmp_path
    proc.kill()
    proc.wait()
    log.close()


def real_command(tmp_path: Path) -> Path:
    """Stands in for Flower's real ``flwr-clientapp``: says it started cold, with its args, exit status 5."""
    path = tmp_path / "real-flwr-clientapp"
    path.write_text('#!/bin/sh\necho "cold $*"\nexit 5\n')
    path.chmod(0o700)
    return path


def run_shim(shim: Path, args: list[str], out: Path, cwd: Path) -> int:
    with open(out, "wb") as f:
        return subprocess.run([str(shim), *args], stdout=f, stderr=subprocess.STDOUT, cwd=cwd, timeout=HANG_S,
                              env={**os.environ, "FEDCOMP_TEST_X": "from-the-shim"}).returncode


def test_a_handed_over_start_runs_with_the_shims_argv_environment_folder_and_stdio(server):
    proc, _, shim, tmp = server
    out = tmp / "task.out"
    assert run_shim(shim, ["--token", "t 1"], out, tmp) == 0  # the shim is done once the child runs
    text = wait_for(lambda: "to stderr" in out.read_text() and out.read_text(), "the child's output")
    seen = json.loads(text.splitlines()[0])
    assert seen["argv"] == ["flwr-clientapp", "--token", "t 1"] and seen["x"] == "from-the-shim"
    assert seen["cwd"] == str(tmp) and seen["ppid"] == proc.pid and seen["pid"] != proc.pid
    assert "cold" not in text
    # the server itself was started as `python -m clients.prestart`; its child runs the run's app, so the
    # installed `clients` package must not be left in sys.modules for Flower's loader to reuse
    assert seen["own"] == [], seen["own"]


def test_children_are_reaped_and_a_crashing_child_leaves_the_server_serving(server):
    proc, _, shim, tmp = server
    outs = [tmp / f"task{i}.out" for i in range(4)]
    for i, out in enumerate(outs):
        assert run_shim(shim, ["--crash"] if i % 2 else ["--n", str(i)], out, tmp) == 0
    wait_for(lambda: all(("boom" if i % 2 else "to stderr") in o.read_text() for i, o in enumerate(outs)), "4 tasks")
    assert proc.poll() is None
    wait_for(lambda: not psutil.Process(proc.pid).children(), "the children to be reaped")
    assert psutil.Process(proc.pid).num_threads() == 1
    assert (tmp / "server.log").read_text().count("prestart: task process") == 4


@pytest.mark.parametrize("garbage", [b"{not json", b"[" * 100_000 + b"]" * 100_000], ids=["not-json", "deep-json"])
def test_a_garbage_request_is_refused_and_counted_and_the_next_start_still_works(server, garbage):
    proc, sock, shim, tmp = server
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
        conn.settimeout(HANG_S)
        conn.connect(str(sock))
        conn.sendall(garbage)  # and no descriptors (deep JSON: a RecursionError in json.loads)
        conn.shutdown(socket.SHUT_WR)
        assert conn.recv(4096).startswith(b"refused")
    with pytest.raises(ValueError):  # the shim's view of a refusal: it then starts cold
        hand_over(str(sock), [], timeout=HANG_S)
    out = tmp / "task.out"
    assert run_shim(shim, ["--ok"], out, tmp) == 0
    wait_for(lambda: "to stderr" in out.read_text(), "a start after the refusals")
    assert "refused a request" in (tmp / "server.log").read_text() and proc.poll() is None


def test_without_a_server_the_shim_starts_the_real_command(server):
    proc, sock, shim, tmp = server
    proc.kill()
    proc.wait()
    sock.unlink()
    out = tmp / "task.out"
    assert run_shim(shim, ["--token", "t"], out, tmp) == 5  # the real command's own exit status
    text = out.read_text()
    assert "cold --token t" in text and "starting" in text


def test_the_shim_is_owner_only_and_quotes_its_paths(tmp_path):
    folder = tmp_path / "it's here"
    shim = write_shim(folder / "bin", folder / "s.sock", str(real_command(tmp_path)))
    assert stat.S_IMODE(shim.stat().st_mode) == 0o700
    out = tmp_path / "out"
    with open(out, "wb") as f:
        code = subprocess.run([str(shim), "a b"], stdout=f, stderr=subprocess.STDOUT, timeout=HANG_S).returncode
    assert code == 5 and "cold a b" in out.read_text()  # no server at that path: the real command, args intact


@pytest.mark.parametrize("prestart", [True, False])
def test_only_a_warm_node_with_the_fork_server_puts_the_shim_first_on_the_supernodes_path(prestart):
    node = WarmNode(gpu=False, log=None, env={}, prestart=prestart)
    try:
        env = node.supernode_env({"PATH": "/usr/bin", "A": "1"})
        names = [h.name for h in node.helpers]
        if prestart:
            assert env["PATH"].split(os.pathsep) == [str(node.shim_dir), "/usr/bin"] and env["A"] == "1"
            assert (node.shim_dir / "flwr-clientapp").is_file() and names == ["worker", "prestart"]
            assert "--socket" in node.prestart.argv and node.prestart.env["PATH"] == node.supernode_env({})["PATH"]
        else:
            assert env == {"PATH": "/usr/bin", "A": "1"} and names == ["worker"]
    finally:
        node.stop()
    assert not node.folder.exists()

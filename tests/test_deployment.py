"""Deployment end to end on loopback: ``flower-server`` (real SuperLink) + two ``flower-client`` (real SuperNodes).

Async mode; after two versions one client's SuperNode is SIGKILLed. The server must go on: the dead node's
in-flight task is nacked (timed out, or NODE_UNAVAILABLE), the other client carries the run to the last
version, and the server exits 0. Private FLWR_HOMEs, free ports; every process started here (and every
descendant seen, such as a SIGKILLed SuperNode's ``flwr-clientapp``) is stopped by PID in the finalizer.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

import pytest

from fedcomp.tools.processes import ManagedProcess, command_line, descendants, free_port, signal_pids

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow

#: Deadlines of the end-to-end tests, sized for a 2-core machine at load average 18 (issue 14, item 11): they
#: bound a hang and never time a run. The tests wait on events (rows in metrics.jsonl, a process exit), and the
#: runs' own bounds (run-timeout, node-wait) are wider still, so a slow machine never fails a correct run.
PROGRESS_S = 900  # for the next expected event (a row, a log line)
FINISH_S = 1500  # for a server to finish its run
RUN_BOUNDS = ("-c", "run-timeout=3600", "-c", "node-wait=900")


def wait_for(condition, proc: ManagedProcess, what: str, deadline_s: float = PROGRESS_S, also=()) -> None:
    """Poll ``condition()`` until true; fail if ``proc`` exits first or after ``deadline_s`` (a hang)."""
    end = time.monotonic() + deadline_s
    while not condition():
        assert proc.poll() is None, f"{proc.name} exited ({proc.poll()}) before {what}:\n{proc.tail(60)}"
        assert time.monotonic() < end, f"no {what} in {deadline_s:.0f}s:\n{proc.tail(60)}" + "".join(
            f"\n{p.tail(20)}" for p in also
        )
        for p in (proc, *also):
            p.remember_children()
        time.sleep(0.5)


def command(module: str, script: str) -> list[str]:
    """The console script when installed next to this interpreter, else ``python -m module``."""
    exe = Path(sys.executable).with_name(script)
    return [str(exe)] if exe.exists() else [sys.executable, "-m", module]


def cmdline(pid: int) -> str:
    return command_line(pid)


@pytest.fixture
def started():
    procs: list[ManagedProcess] = []
    yield procs
    for p in reversed(procs):  # clients first, then the server
        p.stop()
    signal_pids([pid for p in procs for pid in p.known], signal.SIGKILL)


def async_server_cmd(port: int, out: Path, home: Path, versions: int, task_timeout: int, *extra: str) -> list[str]:
    """``flower-server`` on loopback in async mode, K = 1, waiting for two clients."""
    return [
        *command("server_app.launcher", "flower-server"),
        *("--insecure", "--port", str(port), "--mode", "async", "--versions", str(versions)),
        *("--buffer-size", "1", "--min-clients", "2", "--task-timeout", str(task_timeout)),
        *("--out", str(out), "--flwr-home", str(home)),
        *extra,
    ]


def read_rows(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.endswith("}")]


def start_deployment(tmp_path: Path, started: list, versions: int, task_timeout: int, *extra: str) -> Path:
    """``flower-server`` (async, K = 1, ``extra`` options) and two ``flower-client`` laptops on loopback, in
    ``started``; returns the server's ``--out`` folder."""
    port, out = free_port(), tmp_path / "out"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    server_cmd = async_server_cmd(port, out, tmp_path / "server-home", versions, task_timeout, *RUN_BOUNDS, *extra)
    started.append(ManagedProcess("flower-server", server_cmd, tmp_path / "server.log", env, cwd=ROOT))
    for i in (0, 1):
        client_cmd = [
            *command("clients.launcher", "flower-client"),
            *("--server", f"127.0.0.1:{port}", "--insecure", "--partition-id", str(i), "--num-partitions", "2"),
            *("--flwr-home", str(tmp_path / f"client{i}-home"), "--device-class", "laptop"),
        ]
        started.append(ManagedProcess(f"client{i}", client_cmd, tmp_path / f"client{i}.log", env, cwd=ROOT))
    return out


def finished(server: ManagedProcess) -> int:
    """The server's exit code; fails the test if it does not finish within ``FINISH_S``."""
    try:
        return server.proc.wait(timeout=FINISH_S)
    except Exception:
        pytest.fail(f"server did not finish:\n{server.tail(60)}")


def test_async_deployment_survives_a_sigkilled_client(tmp_path, started):
    versions = 16  # warm workers answer in about a second: the survivor must outlast the dead node's timeout
    out = start_deployment(tmp_path, started, versions, 10)
    server = started[0]
    victim = started[2]

    wait_for(lambda: len(read_rows(out / "metrics.jsonl")) >= 2, server, "version 2", also=[victim])
    supernodes = [p for p in victim.remember_children() if "flower-supernode" in cmdline(p)]
    assert supernodes, victim.tail()
    victim.known.update(descendants(supernodes[0]))
    os.kill(supernodes[0], signal.SIGKILL)  # the client machine dies: no goodbye to the SuperLink

    rc = finished(server)
    log = server.tail(60)
    assert rc == 0, log
    rows = read_rows(out / "metrics.jsonl")
    summary = json.loads((out / "summary.json").read_text())
    assert summary["versions"] == versions and [r["version"] for r in rows] == list(range(1, versions + 1))
    totals = summary["totals"]
    assert totals["timeout"] + totals["lost"] >= 1, totals  # the dead node's in-flight update was nacked
    assert totals["accepted"] == versions and totals["rejected"] == 0
    assert rows[-1]["accuracy"] > 0.4 and rows[-1]["accuracy"] > summary["initial_accuracy"] + 0.2
    assert summary["payload_bytes_up_per_reply"] < summary["dense_fp32_bytes"] / 4
    assert summary["flower_objects_up_per_reply"] == 3  # Message, RecordDict, one ConfigRecord (blob inline)
    print(
        "\nDEPLOYMENT",
        json.dumps({k: v for k, v in summary.items() if k not in ("totals", "federated_evaluation")}),
        "\nTOTALS",
        json.dumps(totals),
    )


def test_auto_density_reaches_real_supernodes(tmp_path, started):
    """``density=auto`` through a real SuperLink: each task's density (probes 30% then 10%) reaches the ClientApp,
    whose replies shrink accordingly, and the server reports what it chose per node."""
    out = start_deployment(tmp_path, started, 8, 60, "--compressor", "dgc+int8", "--compressor-options", "density=auto")
    server = started[0]
    assert finished(server) == 0, server.tail(60)
    auto = json.loads((out / "summary.json").read_text())["auto_density"]
    sizes = auto["reply_payload_bytes"]
    assert set(sizes) >= {"0.3", "0.1"} and sizes["0.1"] < 0.6 * sizes["0.3"], auto  # the client obeyed
    assert len(auto["nodes"]) == 2 and all(n["replies"] >= 2 for n in auto["nodes"].values()), auto
    print("\nAUTO", json.dumps(auto))

"""A user's own model, dataset and loss (a module in the test's folder, on PYTHONPATH only) through ``flwr run`` on
a simulation SuperLink and through a loopback deployment (``flower-server`` + two ``flower-client``), selected
only by run config."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest

from fedcomp.tools.processes import (
    ManagedProcess,
    flower_env,
    free_port,
    run_status,
    signal_pids,
    submit_run,
    superlink_argv,
    wait_http_ready,
    write_flower_config,
    write_overrides,
)
from tests.test_deployment import async_server_cmd, command, read_rows
from tests.test_plugins import USER_MODULE

ROOT = Path(__file__).resolve().parents[1]
PLUGIN = {"model": "winemod:make_net", "dataset": "winemod:make_data", "loss": "winemod:smooth_ce"}
pytestmark = pytest.mark.slow


@pytest.fixture
def procs():
    started: list[ManagedProcess] = []
    yield started
    for p in reversed(started):
        p.stop()
    signal_pids([pid for p in started for pid in p.known], signal.SIGKILL)


def user_env(tmp_path: Path, home: Path | None = None) -> dict[str, str]:
    (tmp_path / "user").mkdir(exist_ok=True)
    (tmp_path / "user" / "winemod.py").write_text(USER_MODULE)
    env = flower_env(home) if home is not None else dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path / "user"), str(ROOT)])
    env["FEDCOMP_ALLOW_PLUGINS"] = "winemod"  # the simulated nodes' operator allows the user's module
    return env


def test_user_module_through_flwr_run(tmp_path, procs):
    home, port, conn = tmp_path / "flwr-home", free_port(), "plugins-sim"
    write_flower_config(home, conn, f"127.0.0.1:{port}")
    env = user_env(tmp_path, home)
    link = ManagedProcess("superlink", superlink_argv(port, simulation=True, extra=["--insecure"]),
                          home / "superlink.log", env)
    procs.append(link)
    wait_http_ready(f"127.0.0.1:{port}", 120, link)
    out = tmp_path / "out"
    overrides = {**PLUGIN, "model-options": "hidden=16", "mode": "sync", "num-versions": 3, "min-clients": 2,
                 "out-dir": str(out), "node-wait": 300.0, "compressor": "dgc", "compressor-options": "density=0.1"}
    run_id = submit_run(ROOT, conn, env, write_overrides(home / "run.toml", overrides),
                        "num-supernodes=2 client-resources-num-cpus=1 init-args-num-cpus=2")
    end, status = time.monotonic() + 600, ""
    while time.monotonic() < end and not status.startswith("finished"):
        time.sleep(2)
        status = run_status(conn, run_id, env)
    assert status == "finished:completed", (home / "superlink.log").read_text()[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["versions"] == 3 and summary["accuracy"] > 0.6, summary
    assert summary["dense_fp32_bytes"] == 4 * (13 * 16 + 16 + 16 * 3 + 3)  # the user's model went over the wire
    assert summary["num_parameters"] == 13 * 16 + 16 + 16 * 3 + 3 and summary["model"] == PLUGIN["model"]


def test_user_module_in_a_loopback_deployment(tmp_path, procs):
    port, out = free_port(), tmp_path / "out"
    env = user_env(tmp_path)
    del env["FEDCOMP_ALLOW_PLUGINS"]  # each node allows it by its own flag here
    config = [arg for k, v in PLUGIN.items() for arg in ("-c", f"{k}={v}")]
    server = ManagedProcess(
        "flower-server",
        async_server_cmd(port, out, tmp_path / "server-home", 3, 60, *config, "-c", "node-wait=300",
                         "-c", "run-timeout=500"),
        tmp_path / "server.log", env, cwd=ROOT,
    )
    procs.append(server)
    for i in (0, 1):
        procs.append(ManagedProcess(
            f"client{i}",
            [*command("clients.launcher", "flower-client"), "--server", f"127.0.0.1:{port}", "--insecure",
             "--partition-id", str(i), "--num-partitions", "2", "--flwr-home", str(tmp_path / f"client{i}-home"),
             "--allow-plugin", "winemod"],
            tmp_path / f"client{i}.log", env, cwd=ROOT,
        ))
    try:
        rc = server.proc.wait(timeout=560)
    except Exception:
        pytest.fail(f"server did not finish:\n{server.tail(60)}")
    assert rc == 0, server.tail(60)
    summary = json.loads((out / "summary.json").read_text())
    rows = read_rows(out / "metrics.jsonl")
    assert summary["versions"] == 3 and [r["version"] for r in rows] == [1, 2, 3]
    assert summary["dense_fp32_bytes"] == 4 * (13 * 32 + 32 + 32 * 3 + 3)

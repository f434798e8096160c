"""Exit codes that tell the truth (issue 14, item 3): a run that stops short of its versions is not a success.

The loops name the cause that actually stopped them (run timeout while waiting for clients is a run timeout,
not "fewer than N clients after node-wait"); ``flower-server`` exits non-zero and says why in one line.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from fedcomp.flower.processes import free_port
from fedcomp.server_loop import LOOPS, LoopConfig, Reporter, Transport
from tests.faultkit import make_proto

ROOT = Path(__file__).resolve().parents[1]


class Empty(Transport):
    """No client ever connects; ``poll`` advances a fake clock."""

    def __init__(self) -> None:
        self.t = 0.0

    def now(self) -> float:
        return self.t

    def clients(self) -> list[int]:
        return []

    def send(self, task, model):  # pragma: no cover - never called
        raise AssertionError("no client")

    def poll(self, wait: float) -> list:
        self.t += max(wait, 0.01)
        return []


@pytest.mark.parametrize("mode", ["async", "sync"])
def test_run_timeout_while_waiting_for_clients_is_named_run_timeout(mode):
    tr = Empty()
    cfg = LoopConfig(num_versions=3, run_timeout=5.0, node_wait=300.0, min_clients=2, poll_interval=1.0)
    loop = LOOPS.get(mode)(make_proto(), tr, cfg, Reporter(None, clock=tr), clock=tr)
    loop.run()
    assert loop.proto.version == 0 and tr.t < 300
    assert "run timeout" in loop.stopped_reason and "0 of 2 clients" in loop.stopped_reason, loop.stopped_reason


def test_node_wait_names_node_wait():
    tr = Empty()
    cfg = LoopConfig(num_versions=3, run_timeout=0.0, node_wait=7.0, min_clients=1, poll_interval=1.0)
    loop = LOOPS.get("async")(make_proto(), tr, cfg, Reporter(None, clock=tr), clock=tr)
    loop.run()
    assert "node-wait" in loop.stopped_reason and "0 of 1 clients" in loop.stopped_reason, loop.stopped_reason


@pytest.mark.slow
def test_flower_server_with_no_clients_exits_nonzero_and_says_why(tmp_path):
    """0 of 3 versions (run timeout, no client ever came): exit 1 and one line naming the run timeout."""
    exe = Path(sys.executable).with_name("flower-server")
    argv = [str(exe)] if exe.exists() else [sys.executable, "-m", "server_app.launcher"]
    argv += ["--insecure", "--port", str(free_port()), "--versions", "3", "--min-clients", "1", "--quiet"]
    argv += ["--out", str(tmp_path / "out"), "-c", "run-timeout=4", "-c", "node-wait=300"]
    res = subprocess.run(
        argv, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True, timeout=900
    )
    text = res.stdout + res.stderr
    assert res.returncode == 1, text
    assert "finished:completed" not in text, text
    lines = [ln for ln in res.stderr.splitlines() if "stopped at version 0 of 3" in ln]
    assert len(lines) == 1 and "run timeout" in lines[0], text

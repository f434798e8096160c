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

from benchmarks.faultkit import make_proto
from fedcomp.server.loops import LOOPS, LoopConfig, Reporter, Transport
from fedcomp.tools.processes import free_port

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


class FakeLink:
    def poll(self):
        return None


def test_launcher_survives_status_checks_that_time_out(tmp_path, monkeypatch, capsys):
    """Issue 14, item 4: ``flwr ls`` timing out under load (or the SuperLink stalling) must not kill the
    launcher; it backs off and checks less often than once a second."""
    import server_app.launcher as launcher

    answers = [subprocess.TimeoutExpired("flwr ls", 30)] * 3 + [{"status": "running", "details": ""}] * 3
    answers += [launcher.FlwrCliError("flwr ls failed (1): busy")]
    answers += [{"status": "finished:completed", "details": ""}]
    calls, sleeps = [], []

    def run_info(connection, run_id, env, timeout=30.0):
        calls.append(len(sleeps))
        answer = answers[len(calls) - 1]
        if isinstance(answer, Exception):
            raise answer
        return answer

    monkeypatch.setattr(launcher, "run_info", run_info)
    status = launcher.watch(1, {}, FakeLink(), tmp_path / "metrics.jsonl", True, sleep=sleeps.append)
    assert status == ("finished:completed", "")
    assert len(calls) == len(answers)
    gaps = [b - a for a, b in zip(calls, calls[1:], strict=False)]
    assert gaps[0] < gaps[1] < gaps[2], gaps  # backs off while the checks time out
    assert all(g >= 2 for g in gaps), gaps  # never one `flwr ls` per second
    assert "status check" in capsys.readouterr().err

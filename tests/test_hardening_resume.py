"""After ``--resume`` (issue 14, item 7): metrics time goes on from the checkpoint's instead of restarting at 0,
and ``flower-server`` does not print the resumed run's old rows again as progress."""

from __future__ import annotations

import json

from fedcomp.server.loops import Reporter
from fedcomp.task.config import RunConfig
from fedcomp.task.serverside import build_server


class Clock:
    def __init__(self, t: float) -> None:
        self.t = t

    def now(self) -> float:
        return self.t


def test_resumed_rows_go_on_from_the_checkpoint_time(tmp_path):
    _, proto, _ = build_server(RunConfig())
    first = Reporter(tmp_path, clock=Clock(1000.0))
    first.clock.t = 1250.0  # 250 s into the run
    first.save_checkpoint(proto)
    resumed = Reporter(tmp_path / "again", clock=Clock(7.0))  # a new process: a new clock
    _, proto2, _ = build_server(RunConfig(resume=str(tmp_path / "checkpoint.pt")))
    resumed.resume_time(tmp_path / "checkpoint.pt")
    resumed.clock.t = 17.0
    row = resumed.on_version(proto2)
    assert row["time"] == 260.0, row


def row(version: int, t: float) -> str:
    keys = ("accepted", "stale", "rejected", "duplicate", "late", "timeout", "lost", "payload_bytes_up")
    return json.dumps({"version": version, "time": t, **dict.fromkeys(keys, 0), "flower_bytes_up": 0}) + "\n"


def test_flower_server_resume_does_not_print_old_rows_as_progress(tmp_path, monkeypatch, capsys):
    import server_app.launcher as launcher
    from fedcomp.tools.processes import free_port

    out = tmp_path / "out"
    out.mkdir()
    _, proto, _ = build_server(RunConfig())
    Reporter(out).save_checkpoint(proto)
    (out / "metrics.jsonl").write_text(row(1, 10.0) + row(2, 20.0) + row(3, 30.0))

    class Link:
        pid, log_path = 1, out / "superlink.log"

        def poll(self):
            return None

        def stop(self):
            pass

    def run_info(connection, run_id, env, timeout=30.0):
        with open(out / "metrics.jsonl", "a") as f:
            f.write(row(4, 40.0))
        (out / "summary.json").write_text(json.dumps({"versions": 4, "target_versions": 4}))
        return {"status": "finished:completed", "details": ""}

    monkeypatch.setattr(launcher, "ManagedProcess", lambda *a, **k: Link())
    monkeypatch.setattr(launcher, "wait_http_ready", lambda *a, **k: None)
    monkeypatch.setattr(launcher, "submit_run", lambda *a, **k: 5)
    monkeypatch.setattr(launcher, "run_info", run_info, raising=False)
    monkeypatch.setattr(launcher, "run_status", lambda *a, **k: run_info(*a, **k)["status"], raising=False)
    argv = ["--insecure", "--port", str(free_port()), "--out", str(out), "--versions", "4"]
    launcher.main([*argv, "--resume", str(out / "checkpoint.pt")])
    printed = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("version")]
    assert [int(ln.split()[1]) for ln in printed] == [4], printed

"""Server restart: the server dies (everything in memory and in flight is gone), a new one resumes from the last
checkpoint, the version continues, no update is applied twice, clients resync, and nothing computed is lost.

``test_restart_loses_nothing`` is Flower-free (protocol + loop + lossy transport, crash at several points);
``test_deployment_server_sigkill_and_resume`` SIGKILLs a real ``flower-server`` (launcher, SuperLink and
ServerApp process) on loopback and starts it again with ``--resume``.
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest
import torch

from benchmarks.faultkit import Client, Tally, conservation_error, drain, make_proto
from fedcomp.protocol import Outcome
from fedcomp.server.loops import LOOPS, LoopConfig, Reporter
from fedcomp.tools.check import check
from fedcomp.tools.processes import ManagedProcess, descendants, free_port, signal_pids
from tests.test_deployment import FINISH_S, RUN_BOUNDS, async_server_cmd, command, read_rows, wait_for
from tests.test_faults import LossyTransport

ROOT = Path(__file__).resolve().parents[1]


class TallyReporter(Reporter):
    """A reporter that remembers what the model held at each checkpoint (the tally a restart goes back to)."""

    def __init__(self, tally: Tally, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.tally, self.durable = tally, tally.snapshot()

    def save_checkpoint(self, proto) -> None:
        super().save_checkpoint(proto)
        self.durable = self.tally.snapshot()


def run_until(proto, transport, reporter, versions: int) -> None:
    cfg = LoopConfig(num_versions=versions, poll_interval=2.0, max_failures=0)
    LOOPS.get("async")(proto, transport, cfg, reporter, clock=transport).run()


@pytest.mark.parametrize("checkpoint_every, extra_replies", [(1, 0), (3, 1), (3, 4)])
def test_restart_loses_nothing(checkpoint_every, extra_replies, tmp_path):
    clients = {i: Client(i, seed=i) for i in (1, 2, 3)}
    tr = LossyTransport(clients, seed=checkpoint_every + extra_replies, loss=0.1, dup=0.1, late=0.05, kill=0.05)
    proto = make_proto(buffer_size=2, max_staleness=3, task_timeout=10.0, durable_acks=True)
    tally = Tally()
    tally.watch(proto)
    reporter = TallyReporter(tally, tmp_path, checkpoint_every=checkpoint_every, clock=tr)
    run_until(proto, tr, reporter, 7)
    for _ in range(extra_replies):  # the server keeps accepting (buffering, stepping) after the checkpoint...
        for ev in tr.poll(5.0):
            if hasattr(ev, "blob"):
                proto.on_reply(ev.client, ev.blob, ev.meta, tr.t)
    crashed_at = proto.version
    # ...and dies: its memory, its buffer and every message in flight are gone
    tr.queue.clear()
    tally.updates = reporter.durable
    resumed = make_proto(buffer_size=2, max_staleness=3, task_timeout=10.0, durable_acks=True)
    Reporter.load_checkpoint(tmp_path / "checkpoint.pt", resumed)
    checkpoint_version = resumed.version
    assert checkpoint_version <= crashed_at and checkpoint_version % checkpoint_every == 0
    resumed.restart()
    tally.watch(resumed)
    reporter2 = TallyReporter(tally, tmp_path, checkpoint_every=checkpoint_every, clock=tr)
    reporter2.save_checkpoint(resumed)
    assert torch.load(tmp_path / "checkpoint.pt", weights_only=True)["protocol"]["restarts"] == 1
    run_until(resumed, tr, reporter2, 14)
    assert resumed.version == 14 and [r["version"] for r in reporter2.rows][0] == checkpoint_version + 1
    assert min(resumed.tasks, default=1 << 40) >= 1 << 40  # fresh task-id range after the restart
    drain(resumed, clients, tr.t)
    assert all(not c.side.pipeline.pending for c in clients.values())
    assert conservation_error(resumed, clients, tally) <= 1e-5  # Tally also asserts: nothing applied twice


def test_a_restarted_server_acks_what_its_checkpoint_holds_and_the_client_restores_the_rest(tmp_path):
    """The resync task carries the durable acks; the client forgets those, nacks nothing blind (an update in
    flight may still be applied), and lists its other pending task ids in its reply: the resumed server nacks
    the one it knows nothing of, and the client restores it with the next task."""
    clients = {1: Client(1, seed=0)}
    p = make_proto(buffer_size=1, durable_acks=True)
    reporter = Reporter(tmp_path, checkpoint_every=1)
    t1 = p.dispatch(1, 0.0)
    blob, meta = clients[1].run(t1)
    assert p.on_reply(1, blob, meta, 0.0).stepped
    reporter.on_version(p)  # checkpoint at version 1, then the ack is released
    t2 = p.dispatch(1, 1.0)  # carries the ack of t1; the client sends update 2, which the server accepts...
    blob2, meta2 = clients[1].run(t2)
    p2 = make_proto(buffer_size=2, durable_acks=True)  # (K=2: buffered, never checkpointed)
    Reporter.load_checkpoint(tmp_path / "checkpoint.pt", p2)
    p2.restart()
    t3 = p2.dispatch(1, 2.0)
    assert t3.resync and t3.task_id > 1 << 40
    c = clients[1]
    blob3, meta3 = c.run(t3)
    assert meta3.pending == (t2.task_id,) and sorted(c.side.pipeline.pending) == [2, 3]
    assert p2.on_reply(1, blob3, meta3, 2.5).outcome == Outcome.APPLIED
    t4 = p2.dispatch(1, 3.0)
    assert [(r.task_id, r.outcome) for r in t4.resolutions] == [(t2.task_id, Outcome.LOST)]
    c.side.apply(t4.resolutions)
    assert list(c.side.pipeline.pending) == [3]  # update 2 restored into the residual, update 3 in flight
    assert p2.ledger(7).resync  # a client first seen after the restart resyncs too


# ------------------------------------------------------------------------------------------ deployment


def server_cmd(port: int, out: Path, home: Path, versions: int, *extra: str, database: bool = True) -> list[str]:
    return async_server_cmd(
        port,
        out,
        home,
        versions,
        40,
        "--checkpoint-every",
        "1",
        "--local-steps",
        "5",
        *(("--database", str(out / "superlink.db")) if database else ()),
        "--quiet",
        *RUN_BOUNDS,
        *extra,
    )


def kill_server_hard(server: ManagedProcess) -> None:
    """The server machine dies: SIGKILL the launcher, its SuperLink and the ServerApp process, no goodbye."""
    pids = [server.pid, *descendants(server.pid)]
    for p in list(pids):
        pids += descendants(p)
    server.known.update(pids)
    signal_pids(list(dict.fromkeys(pids)), signal.SIGKILL)
    server.proc.wait(timeout=10)


@pytest.mark.slow
@pytest.mark.parametrize("database", [True, False], ids=["superlink-database", "no-database"])
def test_deployment_server_sigkill_and_resume(tmp_path, database):
    """With ``--database`` the SuperNodes keep their node ids; without, the new SuperLink answers them 401, each
    SuperNode stops itself (exit 0) and ``flower-client`` starts it again under a new node id. Either way the
    resumed run reaches its last version and ``fedcomp check`` accounts for every update of both clients."""
    port, out = free_port(), tmp_path / "out"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    started: list[ManagedProcess] = []
    try:
        first = ManagedProcess(
            "server1",
            server_cmd(port, out, tmp_path / "home", 6, database=database),
            tmp_path / "server1.log",
            env,
            cwd=ROOT,
        )
        started.append(first)
        for i in (0, 1):
            argv = [*command("clients.launcher", "flower-client"), "--server", f"127.0.0.1:{port}", "--insecure"]
            argv += ["--partition-id", str(i), "--num-partitions", "2", "--flwr-home", str(tmp_path / f"c{i}")]
            argv += ["--state-dir", str(tmp_path / f"state{i}")]
            started.append(ManagedProcess(f"client{i}", argv, tmp_path / f"client{i}.log", env, cwd=ROOT))
        wait_for(lambda: len(read_rows(out / "metrics.jsonl")) >= 2, first, "version 2", also=started[1:])
        kill_server_hard(first)
        crashed_rows = read_rows(out / "metrics.jsonl")
        checkpoint = torch.load(out / "checkpoint.pt", weights_only=True)["protocol"]
        resumed_from = checkpoint["version"]
        assert resumed_from >= 2
        time.sleep(2)
        second = ManagedProcess(
            "server2",
            server_cmd(port, out, tmp_path / "home", resumed_from + 3, "--resume", str(out / "checkpoint.pt"),
                       database=database),
            tmp_path / "server2.log",
            env,
            cwd=ROOT,
        )
        started.append(second)
        clients, end = started[1:3], time.monotonic() + FINISH_S
        while (rc := second.poll()) is None:  # a client that gives up fails the test now, not at the node wait
            assert all(c.poll() is None for c in clients), [c.tail(30) for c in clients]
            assert time.monotonic() < end, f"server did not finish:\n{second.tail(60)}"
            time.sleep(0.5)
        assert rc == 0, second.tail(60)
        summary = json.loads((out / "summary.json").read_text())
        rows = read_rows(out / "metrics.jsonl")[len(crashed_rows) :]
        assert summary["versions"] == resumed_from + 3
        assert [r["version"] for r in rows] == list(range(resumed_from + 1, resumed_from + 4))
        after = torch.load(out / "checkpoint.pt", weights_only=True)["protocol"]
        assert after["restarts"] == 1 and after["next_task_id"] > 1 << 40
        assert summary["totals"]["duplicate"] == 0 and summary["accuracy"] > 0.4
        rejoined = ["starting it again" in c.log_path.read_text() for c in clients]
        assert rejoined == [not database] * 2, [c.tail(30) for c in clients]
        assert all(c.poll() is None for c in clients), [c.tail(30) for c in clients]
        report = check(out, [tmp_path / "state0", tmp_path / "state1"])
        assert report.exit_code == 0, report.problems
        print(
            "\nRESTART", json.dumps({"resumed_from": resumed_from, **{k: summary[k] for k in ("versions", "accuracy")}})
        )
    finally:
        for p in reversed(started):
            p.stop()
        signal_pids([pid for p in started for pid in p.known], signal.SIGKILL)

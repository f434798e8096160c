"""Server restart with queued tasks (``prefetch``): a task queued behind a resync task must not resync away the
update of the task ahead of it, nothing is lost or applied twice over several kills and resumes, and the run's
counters account for every task (``fedcomp check``: no negative count of tasks open at the end).

The transport is ``tests.test_prefetch.FifoTransport`` (a node runs its tasks one after another, the real
``ClientSide`` acks, nacks and resync requests); a crash drops every reply in flight, as a dead ServerApp's run is
read by nobody, while the nodes still compute the tasks they hold.
"""

from __future__ import annotations

import json

import pytest
import torch

from fedcomp.client.acks import ClientSide
from fedcomp.client.pipeline import build
from fedcomp.protocol import Outcome, ReplyMeta
from fedcomp.server import ServerProtocol
from fedcomp.server.loops import LOOPS, LoopConfig, Reporter
from fedcomp.tools.check import check
from tests.test_prefetch import SPEC, FifoTransport, make_proto


def test_a_node_in_resync_gets_no_task_queued_behind_its_resync_task():
    """After a restart a node's first task is a resync task, and its next one waits for that reply (it is queued
    only if the server allows it, as the async loop does). A client that nacked every pending update on a resync
    task counted the update of the task ahead twice this way; today's client nacks nothing blind, and the rule
    stays as a second guard. Either way: nothing lost, nothing applied twice."""
    p = make_proto(buffer_size=1, max_staleness=50, prefetch=1)
    resumed = make_proto(buffer_size=1, max_staleness=50, prefetch=1)
    resumed.load_state_dict(p.state_dict())
    resumed.restart()
    side = ClientSide(build("int8", SPEC, memory="residual"))
    gen = torch.Generator().manual_seed(3)
    computed = {n: torch.zeros(s) for n, s in SPEC.entries}

    def run(task):  # the node runs its tasks in order, as the product's client does
        side.apply(task.resolutions)
        delta = {n: torch.randn(s, generator=gen) for n, s in SPEC.entries}
        for n in computed:
            computed[n] += delta[n]
        blob, seq = side.send(task.task_id, delta, base_version=task.base_version, client_id=4)
        return blob, ReplyMeta(task.task_id, seq, 1, 77, pending=side.pending_tasks())

    first = resumed.dispatch(4, 0.0)
    second = resumed.dispatch(4, 0.0) if resumed.can_queue(4, 0.0) else None
    replies = [run(first)] + ([run(second)] if second is not None else [])
    for blob, meta in replies:
        assert resumed.on_reply(4, blob, meta, now=1.0).outcome is Outcome.APPLIED
    if second is None:  # sent when the first reply landed
        blob, meta = run(resumed.dispatch(4, 1.0))
        assert resumed.on_reply(4, blob, meta, now=2.0).outcome is Outcome.APPLIED
    side.apply(resumed.dispatch(4, 2.0).resolutions)
    assert not side.pipeline.pending
    for n in computed:  # Σ applied + residual = Σ computed
        held = side.pipeline.memory.residual(n)
        assert torch.allclose(-resumed.params[n] + held, computed[n], atol=1e-3), n
    assert second is None and not resumed.ledger(4).resync and resumed.can_queue(4, 2.0)  # resynced: queued again
    with pytest.raises(RuntimeError, match="in resync"):
        again = make_proto(buffer_size=1, prefetch=1)
        again.restart()
        again.dispatch(5, 0.0)
        again.dispatch(5, 0.0)


EVERY = 10  # checkpoint every 10 versions; each crash comes 8 versions after one: work the checkpoint lacks
CFG = dict(buffer_size=1, max_staleness=50, normalize="sum", task_timeout=40.0, backoff=0.0, prefetch=1,
           durable_acks=True)


def run_to(proto: ServerProtocol, tr: FifoTransport, reporter: Reporter, versions: int) -> None:
    cfg = LoopConfig(num_versions=versions, poll_interval=1.0, max_failures=0)
    LOOPS.get("async")(proto, tr, cfg, reporter, tr).run()


def crash_and_resume(tr: FifoTransport, out) -> tuple[ServerProtocol, Reporter]:
    """The server dies (its replies in flight are never read) and a new one resumes from its last checkpoint."""
    tr.queue.clear()
    proto = make_proto(**CFG)
    Reporter.load_checkpoint(out / "checkpoint.pt", proto)
    proto.restart()
    reporter = Reporter(out, checkpoint_every=EVERY, clock=tr)
    reporter.save_checkpoint(proto)  # the new task-id range is durable before any task is sent
    return proto, reporter


def test_three_kills_with_queued_tasks_lose_nothing_and_the_count_of_open_tasks_adds_up(tmp_path):
    tr = FifoTransport({1: 1.0, 2: 1.5, 3: 2.5})
    proto = make_proto(**CFG)
    reporter = Reporter(tmp_path, checkpoint_every=EVERY, clock=tr)
    for crash_at in (18, 38, 58):
        run_to(proto, tr, reporter, crash_at)
        assert proto.tasks and any(t.queued for t in proto.tasks.values())  # it dies with queued tasks open
        proto, reporter = crash_and_resume(tr, tmp_path)
    run_to(proto, tr, reporter, 70)
    assert proto.version == 70 and proto.restarts == 3 and proto.totals.prefetched > 0
    proto.totals.merge(proto.stats)  # the summary a finished server writes (server_app.app.run_summary)
    summary = {"versions": 70, "target_versions": 70, "completed": True, "totals": proto.totals.to_dict()}
    (tmp_path / "summary.json").write_text(json.dumps(summary))
    report = check(tmp_path)
    assert report.runs[0].open_at_end == len(proto.tasks), report.text()  # tasks with no outcome: never < 0
    # then every client hears the last acks and nacks: nothing was lost or applied twice
    proto.expire(1e12)
    proto.commit()
    for c, side in tr.sides.items():
        task = proto.dispatch(c, 1e12)
        side.apply(task.resolutions)
        assert not side.pipeline.pending, c
    for n in tr.computed:
        held = sum(side.pipeline.memory.residual(n) for side in tr.sides.values())
        assert torch.allclose(-proto.params[n] + held, tr.computed[n], atol=1e-3), n

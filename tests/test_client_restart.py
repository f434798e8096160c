"""A client killed after saving its update (before the server accepted it) and restarted with the same state comes
back under a new node id: the resolution of its last task must still reach it (issue 14, item 6).

The server learns which node holds an incarnation from the replies (``ReplyMeta.incarnation``) and sends every
ack/nack still owed to that incarnation to the node that holds it now. After the resync nothing stays pending
and ``Σ applied + Σ residuals + Σ pending = Σ computed`` holds. Two drivers: the product's loop
(``fedcomp.server.loops``, Flower-free) and ``Compressed(strategy)`` with ``compression_mod`` on the in-process
Flower federation (``benchmarks/flowerkit.py``).
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import pytest
import torch
from flwr.app import Context
from flwr.clientapp import ClientApp

from benchmarks.compatkit import Computed as Ledger  # what each train call computed, by node (.sums)
from benchmarks.faultkit import Client, Tally, conservation_error, drain, make_proto
from benchmarks.flowerkit import RUN_ID
from fedcomp.flower import ClientSession, compression_mod
from fedcomp.protocol import Outcome
from fedcomp.server.loops import LOOPS, FailureEvent, LoopConfig, ReplyEvent, Reporter, SendReceipt, Transport
from fedcomp.wire import decode
from tests.test_flower_api import Applied, fedavg, federation, run

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples" / "compressed-digits"))

from digits_app import client_app  # noqa: E402

VICTIM, REBORN = 2, 12  # node ids before and after the restart


class RestartingTransport(Transport):
    """Virtual clock; the victim's ClientApp is killed right after it saved the update of task ``kill_at`` (the
    reply never leaves) and the node comes back as ``REBORN`` with the same client state. ``report``: Flower
    reports the dead node (a ``lost`` failure event) instead of letting its task time out."""

    def __init__(self, clients: dict[int, Client], kill_at: int, report: bool, pending: bool) -> None:
        self.nodes, self.kill_at, self.report, self.pending = dict(clients), kill_at, report, pending
        self.t, self.sent, self.queue = 0.0, 0, []

    def now(self) -> float:
        return self.t

    def clients(self) -> list[int]:
        return sorted(self.nodes)

    def send(self, task, model):
        client = self.nodes[task.client]
        blob, meta = client.run(task)  # the ClientApp saves its state before the reply leaves
        if self.pending:  # the resync request: the task ids of its other pending updates
            meta = dataclasses.replace(meta, pending=tuple(t for t in client.side.pending_tasks() if t != task.task_id))
        self.sent += 1
        if task.client == VICTIM and self.sent >= self.kill_at:
            del self.nodes[VICTIM]  # SIGKILL: the reply is gone with the process
            client.cid = REBORN  # restarted with the same --state-dir, registered under a new node id
            self.nodes[REBORN] = client
            if self.report:
                self.queue.append((self.t + 3.0, FailureEvent(task.task_id, VICTIM, Outcome.LOST, "NODE_UNAVAILABLE")))
        else:
            self.queue.append((self.t + 1.0, ReplyEvent(task.task_id, task.client, blob, meta)))
        return SendReceipt(len(model), 6)

    def poll(self, wait):
        self.queue.sort(key=lambda e: e[0])
        if self.queue and self.queue[0][0] <= self.t + wait:
            t, ev = self.queue.pop(0)
            self.t = max(self.t, t)
            return [ev]
        self.t += wait
        return []


@pytest.mark.parametrize(
    "kill_at, pending", [(4, False), (4, True), (1, True)], ids=["replied-before", "pending-sent", "first-task"]
)
@pytest.mark.parametrize("report", [True, False], ids=["reported-lost", "timed-out"])
@pytest.mark.parametrize("durable", [False, True])
def test_server_loop_resyncs_a_client_restarted_under_a_new_node_id(kill_at, pending, report, durable, tmp_path):
    """``replied-before``: the server knows the old node's incarnation from an earlier reply (no resync request
    needed); ``first-task``: killed in its first task, found through the task ids the new node reports pending."""
    clients = {i: Client(i, seed=i) for i in (1, 2, 3)}
    victim = clients[VICTIM]
    tr = RestartingTransport(clients, kill_at=kill_at, report=report, pending=pending)
    proto = make_proto(buffer_size=2, max_staleness=8, task_timeout=10.0, durable_acks=durable)
    tally = Tally()
    tally.watch(proto)
    reporter = Reporter(tmp_path, checkpoint_every=1 if durable else 0, clock=tr)
    cfg = LoopConfig(num_versions=12, poll_interval=2.0, max_failures=0)
    LOOPS.get("async")(proto, tr, cfg, reporter, clock=tr).run()
    assert VICTIM not in tr.nodes and tr.nodes[REBORN] is victim
    assert proto.version == 12
    drain(proto, tr.nodes, tr.t)
    assert not victim.side.pipeline.pending  # the update saved before the kill came back (nacked) to the residual
    assert all(not c.side.pipeline.pending for c in tr.nodes.values())
    assert conservation_error(proto, tr.nodes, tally) <= 1e-5


def test_the_old_nodes_open_task_is_answered_once_it_resolves():
    """Still in flight when the new node first replies: the server waits; the nack follows when the task expires."""
    p = make_proto(buffer_size=1, task_timeout=10.0)
    c = Client(VICTIM, seed=0)
    t1 = p.dispatch(VICTIM, 0.0)
    c.run(t1)  # saved, then killed: no reply
    c.cid = REBORN
    t2 = p.dispatch(REBORN, 1.0)
    blob, meta = c.run(t2)
    meta = dataclasses.replace(meta, pending=(t1.task_id,))  # its first task on the old node: never replied
    assert p.on_reply(REBORN, blob, meta, 2.0).outcome is Outcome.APPLIED
    t3 = p.dispatch(REBORN, 3.0)
    assert [r.outcome for r in t3.resolutions] == [Outcome.APPLIED]  # t1 is still open: nothing to say yet
    c.run(t3)
    p.expire(20.0)  # t1 and t3 time out; both nacks go to the node that holds the incarnation now
    t4 = p.dispatch(REBORN, 21.0)  # (with t3's own resolutions again: they may never have reached the client)
    assert {(r.task_id, r.outcome) for r in t4.resolutions} == {
        (t1.task_id, Outcome.TIMEOUT), (t2.task_id, Outcome.APPLIED), (t3.task_id, Outcome.TIMEOUT)
    }
    c.side.apply(t4.resolutions)
    assert not c.side.pipeline.pending


@pytest.mark.parametrize("release", ["commit", "revoke"])
def test_the_old_nodes_late_reply_is_answered_at_the_new_node_when_its_held_ack_is_released(release):
    """With durable acks: the old node's reply (sent before the kill, read after the new node listed its task)
    is applied and its ack held for ``commit()``. The new node listed that task while it was open on a node that
    never replied, so it gets a copy of whatever leaves the hold: the ack on ``commit``, a nack on ``revoke``."""
    p = make_proto(buffer_size=1, task_timeout=10.0, durable_acks=True)
    c = Client(VICTIM, seed=0)
    t1 = p.dispatch(VICTIM, 0.0)
    late_blob, late_meta = c.run(t1)  # saved; the reply is still on its way when the node dies
    c.cid = REBORN
    t2 = p.dispatch(REBORN, 1.0)
    blob, meta = c.run(t2)
    assert p.on_reply(REBORN, blob, dataclasses.replace(meta, pending=(t1.task_id,)), 2.0).outcome is Outcome.APPLIED
    assert p.on_reply(VICTIM, late_blob, late_meta, 3.0).outcome is Outcome.APPLIED
    counts = lambda: ([(p.ledger(n).applied, p.ledger(n).nacked) for n in (VICTIM, REBORN)],
                      p.stats.accepted, p.stats.rejected, dict(p.stats.reject_reasons))
    assert counts() == ([(1, 0), (1, 0)], 2, 0, {})
    p.commit() if release == "commit" else p.revoke("aggregation failed")
    outcome = Outcome.APPLIED if release == "commit" else Outcome.REJECTED
    # revoked: the two applied updates count as rejected (what `fedcomp check` and `balance` read), not applied
    assert counts() == (([(1, 0), (1, 0)], 2, 0, {}) if release == "commit"
                        else ([(0, 1), (0, 1)], 0, 2, {"aggregation failed": 2}))
    t3 = p.dispatch(REBORN, 4.0)
    assert {(r.task_id, r.outcome) for r in t3.resolutions} == {(t1.task_id, outcome), (t2.task_id, outcome)}
    c.side.apply(t3.resolutions)
    assert not c.side.pipeline.pending


def test_compressed_resyncs_a_client_restarted_under_a_new_node_id():
    ledger = Ledger()
    app = ClientApp(mods=[compression_mod, ledger])
    app.train()(client_app.train)
    old, new = 101, 201
    killed = {"done": False, "train": 0}

    def kill_and_restart(node, reply):
        """Node ``old``'s second train reply is lost with the process; it restarts as ``new`` with its state."""
        if node != old or reply.metadata.message_type != "train":
            return False
        killed["train"] += 1
        if killed["train"] < 2:
            return False
        grid.apps[new] = grid.apps.pop(old)
        ctx = grid.contexts.pop(old)
        grid.contexts[new] = Context(RUN_ID, new, ctx.node_config, ctx.state, ctx.run_config)
        killed["done"] = True
        return True

    grid = federation(app, drop=kill_and_restart)
    strategy = Applied(fedavg(), "topk", density=0.05)
    strategy.strategy.min_train_nodes = 1
    run(strategy, grid, 5)
    assert killed["done"] and old not in grid.apps
    spec = strategy.spec
    session = ClientSession.load(grid.contexts[new], strategy.compression, spec)
    applied = {**strategy.applied.get(old, {}), **strategy.applied.get(new, {})}
    waiting = set(session.pipeline.pending) - set(applied)
    assert not waiting, waiting  # the update saved before the kill was nacked to the new node and restored
    assert set(session.pipeline.pending) <= {session.pipeline.last_seq}  # only the last ack is still on its way
    residual = {n: t.clone() for n, t in session.pipeline.memory.state_dict()["errors"].items()}
    for n in spec.names:
        computed = ledger.sums[old][n] + ledger.sums[new][n]
        held = sum((u[n] for u in applied.values()), torch.zeros(spec.shape(n))) + residual.get(
            n, torch.zeros(spec.shape(n))
        )
        for seq, blob in session.pipeline.pending.items():
            if seq not in applied:
                held += decode(blob, spec).to_dense()[n]
        assert float((computed - held).norm() / computed.norm()) <= 1e-5, n


def test_a_pending_task_unknown_to_the_server_is_nacked():
    p = make_proto(buffer_size=1)
    c = Client(1, seed=0)
    t1 = p.dispatch(1, 0.0)
    blob, meta = c.run(t1)
    meta = dataclasses.replace(meta, pending=(999,))  # a task id this server never issued
    assert p.on_reply(1, blob, meta, 1.0).outcome is Outcome.APPLIED
    res = {r.task_id: r.outcome for r in p.dispatch(1, 2.0).resolutions}
    assert res == {t1.task_id: Outcome.APPLIED, 999: Outcome.LOST}


def test_the_product_apps_resync_a_client_restarted_under_a_new_node_id(tmp_path):
    """The product's ServerApp and ClientApp: node 11 saves its first update, its reply is lost (killed before the
    server accepted it) and it comes back as node 99 with the same ``state-dir`` and an empty ``context.state``.
    The server never heard from node 11, so only the resync request (the pending task ids in the reply) can find
    the update: it must come back to the residual, and ``fedcomp check`` must find nothing stranded."""
    from flwr.app import Context as FlowerContext
    from flwr.app import RecordDict

    from benchmarks.flowerkit import LocalGrid, server_identity
    from clients.app import app as product_client
    from fedcomp.tools.check import check
    from server_app.app import main

    # Sync rounds over every node: round 1 loses node 11's reply (the round closes at its deadline), round 2 is the
    # first task of node 99 (its reply lists round 1's task as pending), round 3 delivers that task's nack.
    run_config = {"num-versions": 4, "mode": "sync", "fraction": 1.0, "min-clients": 3, "checkpoint-every": 1,
                  "round-timeout": 10.0, "task-timeout": 10.0, "poll-interval": 0.05, "node-wait": 60.0,
                  "out-dir": str(tmp_path / "out")}
    apps = {11 + i: (product_client, {"partition-id": i, "num-partitions": 3, "state-dir": str(tmp_path / f"c{i}")})
            for i in range(3)}
    grid: LocalGrid | None = None
    killed = []

    def kill_first_reply_of_node_11(node: int, reply) -> bool:
        if node != 11 or killed:
            return False
        killed.append(True)  # the update is saved in c0/; the reply never leaves; the node restarts as 99
        grid.apps[99] = grid.apps.pop(11)
        grid.contexts[99] = FlowerContext(RUN_ID, 99, dict(apps[99][1]), RecordDict(), dict(run_config))
        return True

    grid = LocalGrid(apps, run_config, drop=kill_first_reply_of_node_11)
    with server_identity():
        main(grid, FlowerContext(1, 0, {}, RecordDict(), dict(run_config)))
    assert killed and 11 not in grid.apps
    report = check(tmp_path / "out", [tmp_path / f"c{i}" for i in range(3)])
    victim = report.clients[0]
    assert 99 in victim.nodes, report.text()
    assert not victim.stranded and victim.unaccounted == 0, report.text()
    assert victim.conservation is not None and victim.conservation.conserved, report.text()
    # the lost first update came back into the residual during the run: a copy of its nack reached node 99. Node 11
    # never replied, so the server knows no incarnation for it and does not hand its ledger over (a task id can be
    # guessed): the original nack still waits there, for a node that will never poll again
    assert victim.nacked >= 1, report.text()
    assert [led.nacks_waiting for led in report.ledgers if led.node == 11] == [1], report.text()
    assert report.exit_code == 0, report.text()


@pytest.mark.parametrize("value", ["123", 7, [1, "2"], [True], [-1], [1.5], list(range(2000)), b"\x01"])
def test_a_malformed_resync_request_is_a_record_error(value):
    """Checked in the one reader both reply layouts use: a counted rejection, never a ledger walk per bogus id."""
    from fedcomp.flower.records import MAX_PENDING, RecordError, pending_tasks

    with pytest.raises(RecordError, match="pending"):
        pending_tasks(value)
    assert pending_tasks(None) == () and pending_tasks([3, 0]) == (3, 0)
    assert pending_tasks(list(range(MAX_PENDING))) == tuple(range(MAX_PENDING))


@pytest.mark.parametrize("mode", ["async", "sync"])
def test_a_product_reply_with_a_malformed_resync_request_is_rejected_and_the_run_goes_on(tmp_path, mode):
    from clients.app import app as product_client
    from tests.clientkit import run_beside_a_hostile_node

    def hostile(msg, context):  # node 11 claims 5,000 pending tasks in every reply
        reply = product_client(msg, context)
        if msg.metadata.message_type == "train":
            reply.content.config_records["fedcomp"]["pending"] = list(range(5000))
        return reply

    summary, rows = run_beside_a_hostile_node(tmp_path, hostile, mode)
    assert summary["completed"] and summary["versions"] == 3, summary
    assert sum(r.get("rejected", 0) for r in rows) >= 1, rows

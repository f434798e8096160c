"""The chaos soak, short: a loopback deployment (queued tasks, warm workers, ``density=auto``, three clients with
state dirs, checkpoints and a SuperLink database) takes at least one fault of every kind the machine allows
(client SIGKILL + restart, worker SIGKILL, client freeze, server SIGKILL + ``--resume``, and a slow loopback where
network namespaces and tc exist), finishes by itself, and ``fedcomp check`` accounts for every update.

The three Flower-free tests reproduce what the soak once found: a client that nacked every pending update on a
``resync`` task (the first after a server restart) also nacked one the server had applied or would still apply,
whose mass was then both in the model and back in the residual (``fedcomp check`` sees only the client's side).
Three ways in: a task queued behind the first resync task (prefetch) carried ``resync`` too; a client restarted
under a new node id after a server restart starts in resync while its old node's reply is on its way; and the acks
a checkpoint holds for that client's old node reach its new node only after the resync task. The client now nacks
nothing blind: the resumed server answers each task id its replies list as pending.
"""

from __future__ import annotations

import json

import psutil
import pytest

from benchmarks.chaos import FAULTS, SlowLink, Soak, SoakConfig
from benchmarks.faultkit import Client, Tally, conservation_error, drain, make_proto
from fedcomp.protocol import ReplyMeta
from fedcomp.server.loops import Reporter


@pytest.mark.slow
def test_a_short_chaos_soak_loses_nothing(tmp_path):
    cfg = SoakConfig(duration_s=120.0, gap_s=(10.0, 18.0), freeze_s=(8.0, 12.0), tail=4, work=str(tmp_path))
    soak = Soak(cfg)
    report = soak.run()
    shown = ("faults_by_kind", "versions", "updates", "check", "exit_codes")
    print("\nCHAOS", json.dumps({k: report[k] for k in shown}))
    by_kind = report["faults_by_kind"]
    kinds = [k for k in FAULTS if k != SlowLink.kind or report["links"]["shaped"]]
    assert set(by_kind) == set(kinds), report["links"]
    for kind, row in by_kind.items():
        assert row["count"] >= 1 and row["survived"] == row["count"], (kind, row)
    assert not report["hang"], report["events"]
    assert report["exit_codes"]["last_server"] == 0, report["exit_codes"]
    assert report["versions"]["reached"] == report["versions"]["target"] > 0, report["versions"]
    assert report["check"]["exit_code"] == 0, report["check"]
    assert report["updates"]["lost"] == 0 and report["updates"]["applied_twice"] == 0, report["updates"]
    assert report["conserved"] == [True] * cfg.clients, report["conserved"]
    left = [p for proc in soak.dep.all for p in [proc.pid, *proc.known] if psutil.pid_exists(p)
            and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
    assert not left, left  # every process the soak started (and each child seen) is gone


def test_a_queued_resync_task_does_not_nack_the_update_in_flight(tmp_path):
    client = Client(1, seed=0)
    first = make_proto(buffer_size=1, durable_acks=True, prefetch=1)
    tally = Tally()
    tally.watch(first)
    blob, meta = client.run(first.dispatch(1, 0.0))
    first.on_reply(1, blob, meta, 0.0)
    Reporter(tmp_path, checkpoint_every=1).on_version(first)  # version 1 is durable; then the server dies
    resumed = make_proto(buffer_size=1, durable_acks=True, prefetch=1)
    Reporter.load_checkpoint(tmp_path / "checkpoint.pt", resumed)
    resumed.restart()
    tally.watch(resumed)
    running = resumed.dispatch(1, 1.0)
    assert not resumed.can_queue(1, 1.0)  # the ledger queues nothing behind a resync task (a second guard)
    with pytest.raises(RuntimeError, match="in resync"):
        resumed.dispatch(1, 1.0)
    blob, meta = client.run(running)
    resumed.on_reply(1, blob, meta, 2.0)
    blob, meta = client.run(resumed.dispatch(1, 2.0))  # the next task, once the first reply landed
    resumed.on_reply(1, blob, meta, 2.5)
    drain(resumed, {1: client}, 3.0)
    assert conservation_error(resumed, {1: client}, tally) <= 1e-5


def test_a_client_restarted_under_a_new_node_id_keeps_the_update_its_old_node_sent(tmp_path):
    Reporter(tmp_path, checkpoint_every=1).save_checkpoint(make_proto(buffer_size=1, durable_acks=True))
    server = make_proto(buffer_size=1, durable_acks=True)
    Reporter.load_checkpoint(tmp_path / "checkpoint.pt", server)
    server.restart()  # the server restarted once, long before
    tally = Tally()
    tally.watch(server)
    client = Client(1, seed=0)
    blob, meta = client.run(server.dispatch(1, 0.0))
    server.on_reply(1, blob, meta, 0.5)
    in_flight = client.run(server.dispatch(1, 1.0))  # node 1 pushed this reply, then died
    client.cid = 2  # the client comes back on its state dir as node 2
    again = client.run(server.dispatch(2, 2.0))
    server.on_reply(1, *in_flight, 2.5)
    server.on_reply(2, *again, 3.0)
    server.expire(1e9)
    server.commit()
    for node in (1, 2):
        client.side.apply(server.dispatch(node, 2e9).resolutions)
    assert not client.side.pipeline.pending
    assert conservation_error(server, {1: client}, tally) <= 1e-5


def test_a_client_restarted_under_a_new_node_id_gets_the_acks_its_old_node_was_owed(tmp_path):
    client = Client(1, seed=0)
    first = make_proto(buffer_size=1, durable_acks=True)
    tally = Tally()
    tally.watch(first)
    blob, meta = client.run(first.dispatch(1, 0.0))
    first.on_reply(1, blob, meta, 0.5)
    Reporter(tmp_path, checkpoint_every=1).on_version(first)  # durable: the ack waits in node 1's outbox
    resumed = make_proto(buffer_size=1, durable_acks=True)  # the client came back as node 2, the server died
    Reporter.load_checkpoint(tmp_path / "checkpoint.pt", resumed)
    resumed.restart()
    tally.watch(resumed)
    client.cid = 2
    task = resumed.dispatch(2, 1.0)
    blob, meta = client.run(task)
    pending = tuple(t for t in client.side.pending_tasks() if t != task.task_id)  # as a real client reports it
    resumed.on_reply(2, blob, ReplyMeta(meta.task_id, meta.seq, meta.num_examples, meta.incarnation, pending), 1.5)
    resumed.expire(1e9)
    resumed.commit()
    client.side.apply(resumed.dispatch(2, 2e9).resolutions)
    assert not client.side.pipeline.pending
    assert conservation_error(resumed, {1: client}, tally) <= 1e-5

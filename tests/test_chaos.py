"""The chaos soak, short: a loopback deployment (queued tasks, warm workers, ``density=auto``, three clients with
state dirs, checkpoints and a SuperLink database) takes at least one fault of every kind the machine allows
(client SIGKILL + restart, worker SIGKILL, client freeze, server SIGKILL + ``--resume``, and a slow loopback where
network namespaces and tc exist), finishes by itself, and ``fedcomp check`` accounts for every update.

``test_a_queued_resync_task_does_not_nack_the_update_in_flight`` is the Flower-free reproduction of what the soak
found: after a server restart, a task queued behind the first (prefetch) also carries ``resync``, so the client
nacks the update it just sent for the first task, which the server then applies: that update's mass is both in
the model and back in the client's residual.
"""

from __future__ import annotations

import psutil
import pytest

from benchmarks.chaos import FAULTS, SlowLink, Soak, SoakConfig
from fedcomp.server.loops import Reporter
from tests.faultkit import Client, Tally, conservation_error, drain, make_proto


@pytest.mark.slow
def test_a_short_chaos_soak_loses_nothing(tmp_path):
    cfg = SoakConfig(duration_s=120.0, gap_s=(10.0, 18.0), freeze_s=(8.0, 12.0), tail=4, work=str(tmp_path))
    soak = Soak(cfg)
    report = soak.run()
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


@pytest.mark.xfail(strict=True, reason="a queued task after a server restart carries resync too (issue 37)")
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
    running, queued = resumed.dispatch(1, 1.0), resumed.dispatch(1, 1.0)  # the second waits behind the first
    replies = [client.run(running), client.run(queued)]  # the node runs them in order
    for blob, meta in replies:
        resumed.on_reply(1, blob, meta, 2.0)
    drain(resumed, {1: client}, 3.0)
    assert conservation_error(resumed, {1: client}, tally) <= 1e-5

"""Faults without loss: after a run with 30% message loss, disconnects, SIGKILLed ClientApps (mid-train and
mid-upload), availability churn, stale and duplicated replies, every computed update is either in the model or
back in its client's residual: ``Σ applied + Σ residuals = Σ computed`` to 1e-5 relative (float64 sums).

Two drivers, both Flower-free: the simulator's ``fedcomp.sim.virtual.VirtualTransport`` (its public API: link loss,
disconnects, availability windows, virtual clock) over an engine of real pipelines, and a small hand-rolled
transport that also duplicates and delays replies past their deadline.
"""

from __future__ import annotations

import random

import pytest

from benchmarks.faultkit import Client, PipelineEngine, Tally, conservation_error, drain, make_proto
from fedcomp.protocol import Outcome
from fedcomp.server import ClientSelection
from fedcomp.server.loops import LOOPS, FailureEvent, LoopConfig, ReplyEvent, Reporter, SendReceipt, Transport
from fedcomp.sim.links import Availability, DeviceProfile, LinkProfile
from fedcomp.sim.virtual import NodeProfile, TimingConfig, VirtualClock, VirtualTransport

LOSSY = LinkProfile("lossy", up_Bps=50_000, down_Bps=200_000, rtt_s=0.2, loss=0.3, disconnect=0.1)
DEVICES = [DeviceProfile(f"device{i}", 1e-3, startup) for i, startup in enumerate((0.2, 0.6, 1.2, 1.8, 2.6))]


@pytest.mark.parametrize("mode, durable", [("async", False), ("async", True), ("sync", True)])
def test_conservation_after_a_faulty_simulated_run(mode, durable, tmp_path):
    clients = {100 + i: Client(100 + i, seed=i) for i in range(5)}
    nodes = {
        cid: NodeProfile(i, LOSSY, DEVICES[i], Availability(60.0, 40.0, 13.0 * i) if i % 2 else Availability())
        for i, cid in enumerate(clients)
    }
    engine = PipelineEngine(clients, seed=7, kill_train=0.1, kill_upload=0.1)
    clock = VirtualClock()
    transport = VirtualTransport(
        engine, nodes, clock, TimingConfig(seed=3, count_bytes="payload", detect_s=5.0, rejoin_s=20.0)
    )
    cfg = {"async": dict(buffer_size=2, max_staleness=1), "sync": dict(buffer_size=0, max_staleness=0)}[mode]
    proto = make_proto(task_timeout=6.0, durable_acks=durable, **cfg)
    tally = Tally()
    tally.watch(proto)
    reporter = Reporter(tmp_path if durable else None, checkpoint_every=1 if durable else 0, clock=clock)
    loop_cfg = LoopConfig(
        num_versions=25, poll_interval=1.0, round_timeout=6.0, max_failures=0, selection=ClientSelection(fraction=1.0)
    )
    LOOPS.get(mode)(proto, transport, loop_cfg, reporter, clock=clock).run()
    assert proto.version == 25
    totals = proto.totals
    totals.merge(proto.stats)
    assert totals.timeout > 0 and totals.lost > 0 and engine.kills > 0  # the faults happened
    assert sum(s.lost_down + s.lost_up for s in transport.stats.values()) > 0
    assert sum(s.disconnects for s in transport.stats.values()) > 0
    drain(proto, clients, clock.now())
    assert all(not c.side.pipeline.pending for c in clients.values())
    assert conservation_error(proto, clients, tally) <= 1e-5


class LossyTransport(Transport):
    """Virtual-clock transport: each message is lost with ``loss`` (task or reply), a reply is duplicated with
    ``dup``, delayed past the deadline with ``late``; ClientApps are SIGKILLed mid-train / mid-upload."""

    def __init__(self, clients: dict[int, Client], seed: int, loss=0.3, dup=0.1, late=0.1, kill=0.1):
        self.nodes, self.rng = clients, random.Random(seed)
        self.loss, self.dup, self.late, self.kill = loss, dup, late, kill
        self.t = 0.0
        self.queue: list[tuple[float, int, object]] = []
        self.n = 0

    def now(self) -> float:
        return self.t

    def clients(self):
        return sorted(self.nodes)

    def _at(self, delay: float, ev) -> None:
        self.n += 1
        self.queue.append((self.t + delay, self.n, ev))

    def send(self, task, model):
        r, c = self.rng.random(), self.nodes[task.client]
        if r < self.loss:  # the task never arrives
            return SendReceipt(len(model), 6)
        if r < self.loss + self.kill / 2:  # SIGKILL mid-train: unsaved state gone, Flower reports the node lost
            c.kill_mid_train(task)
            self._at(3.0, FailureEvent(task.task_id, task.client, Outcome.LOST, "NODE_UNAVAILABLE"))
            return SendReceipt(len(model), 6)
        blob, meta = c.run(task)
        ev = ReplyEvent(task.task_id, task.client, blob, meta)
        r2 = self.rng.random()
        if r2 < self.kill / 2:  # SIGKILL mid-upload: state saved, reply never sent
            self._at(3.0, FailureEvent(task.task_id, task.client, Outcome.LOST, "NODE_UNAVAILABLE"))
        elif r2 < self.kill / 2 + self.loss:  # reply lost
            pass
        elif r2 < self.kill / 2 + self.loss + self.late:  # reply arrives after the deadline
            self._at(50.0, ev)
        else:
            self._at(self.rng.uniform(0.5, 2.0), ev)
            if self.rng.random() < self.dup:  # and once more (a retransmission)
                self._at(self.rng.uniform(2.0, 4.0), ev)
        return SendReceipt(len(model), 6)

    def poll(self, wait):
        self.queue.sort(key=lambda e: (e[0], e[1]))
        if self.queue and self.queue[0][0] <= self.t + wait:
            t, _, ev = self.queue.pop(0)
            self.t = max(self.t, t)
            return [ev]
        self.t += wait
        return []


@pytest.mark.parametrize("seed", [0, 1])
def test_conservation_over_a_lossy_duplicating_transport(seed, tmp_path):
    clients = {i: Client(i, seed=10 * seed + i) for i in (1, 2, 3, 4)}
    tr = LossyTransport(clients, seed)
    proto = make_proto(buffer_size=3, max_staleness=3, task_timeout=10.0, durable_acks=True)
    tally = Tally()
    tally.watch(proto)
    reporter = Reporter(tmp_path, checkpoint_every=2, clock=tr)
    LOOPS.get("async")(
        proto, tr, LoopConfig(num_versions=20, poll_interval=2.0, max_failures=0), reporter, clock=tr
    ).run()
    assert proto.version == 20
    t = proto.totals
    assert t.duplicate + t.late > 0 and t.timeout > 0 and t.lost > 0
    drain(proto, clients, tr.t)
    assert conservation_error(proto, clients, tally) <= 1e-5

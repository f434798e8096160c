"""Queued tasks (``prefetch``): several open tasks per node, FIFO on the node, every rule per task.

The transport below runs a node's tasks one after another (a task starts when the one before it on that node
finished), as Flower's SuperNode does; the client side is the real ``ClientSide`` (acks, nacks, residual).
"""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fedcomp.client.acks import ClientSide
from fedcomp.client.pipeline import build
from fedcomp.protocol import Outcome, ProtocolConfig, ReplyMeta
from fedcomp.registry import ConfigError
from fedcomp.server import ServerProtocol
from fedcomp.server.ledger import ClientLedger
from fedcomp.server.linkaware import AutoDensity, AutoDensityConfig
from fedcomp.server.loops import LOOPS, FailureEvent, LoopConfig, ReplyEvent, Reporter, SendReceipt, Transport
from fedcomp.server.optimizers import SERVER_OPTIMIZERS
from fedcomp.server.prefetch import PrefetchTimer
from fedcomp.server.staleness import STALENESS
from fedcomp.spec import ModelSpec

SPEC = ModelSpec((("w", (12, 5)), ("b", (5,))))


def make_proto(**cfg) -> ServerProtocol:
    params = {n: torch.zeros(s) for n, s in SPEC.entries}
    opt = SERVER_OPTIMIZERS.build("sgd", lr=1.0)
    return ServerProtocol(SPEC, params, opt, STALENESS.build("constant"), ProtocolConfig(**cfg))


class FifoTransport(Transport):
    """Node ``c`` runs its tasks in dispatch order, each taking ``delay(c)``; ``fate(task)`` says whether the reply
    is delivered (``"ok"``), lost on the way (``"lost_up"``) or an error reply (``"fail"``). After a server restart
    the client relies on the resync request (``ReplyMeta.pending``), as the product's does: it nacks nothing
    blind."""

    def __init__(self, delays: dict[int, float], fate=lambda task: "ok", seed: int = 0):
        self.delays, self.fate = delays, fate
        self.t = 0.0
        self.free = {c: 0.0 for c in delays}
        self.queue: list[tuple[float, int, object]] = []
        self.sides = {c: ClientSide(build("int8", SPEC, memory="residual")) for c in delays}
        self.gen = torch.Generator().manual_seed(seed)
        self.computed = {n: torch.zeros(s) for n, s in SPEC.entries}
        self.order: dict[int, list[int]] = {c: [] for c in delays}  # task ids in the order each node ran them
        self.started: dict[int, float] = {}
        self.sent_at: dict[int, float] = {}  # task id -> when the server sent it
        self.queued: dict[int, bool] = {}  # task id -> sent queued behind another open task of its node
        self.outcomes: dict[int, Outcome] = {}  # task id -> the resolution its node received for it

    def now(self) -> float:
        return self.t

    def delay(self, c: int) -> float:
        """How long node ``c`` takes for the task it is sent now."""
        return self.delays[c]

    def clients(self):
        return sorted(self.delays)

    def send(self, task, model):
        c = task.client
        start = max(self.t, self.free[c])
        self.free[c] = finish = start + self.delay(c)
        self.started[task.task_id] = start
        self.sent_at[task.task_id], self.queued[task.task_id] = self.t, task.queued
        self.order[c].append(task.task_id)
        side = self.sides[c]
        side.apply(task.resolutions)
        for r in task.resolutions:
            self.outcomes.setdefault(r.task_id, r.outcome)
        fate = self.fate(task)
        if fate == "fail":
            event = FailureEvent(task.task_id, c, Outcome.LOST, "CLIENT_APP_RAISED_EXCEPTION")
        else:
            delta = {n: torch.randn(s, generator=self.gen) for n, s in SPEC.entries}
            for n in self.computed:
                self.computed[n] += delta[n]
            blob = side.pipeline.send(delta, base_version=task.base_version, client_id=c)
            side.sent(task.task_id, side.pipeline.last_seq)
            meta = ReplyMeta(task.task_id, side.pipeline.last_seq, 1, c, pending=side.pending_tasks())
            event = ReplyEvent(task.task_id, c, blob, meta, {"train-seconds": self.delay(c) / 2})
        if fate != "lost_up":
            self.queue.append((finish, task.task_id, event))
        return SendReceipt(len(model), 1)

    def poll(self, wait):
        self.queue.sort(key=lambda e: (e[0], e[1]))
        if self.queue and self.queue[0][0] <= self.t + wait:
            t, _, event = self.queue.pop(0)
            self.t = max(self.t, t)
            return [event]
        self.t += wait
        return []


def run(transport, tmp_path, prefetch, versions=8, **proto_kw):
    cfg = dict(buffer_size=1, max_staleness=50, normalize="sum", task_timeout=40.0, backoff=0.0, prefetch=prefetch)
    cfg.update(proto_kw)
    p = make_proto(**cfg)
    reporter = Reporter(tmp_path, clock=transport)
    loop = LOOPS.get("async")(p, transport, LoopConfig(num_versions=versions, poll_interval=1.0), reporter, transport)
    loop.run()
    return p, loop


def test_ledger_holds_up_to_prefetch_plus_one_open_tasks_per_node():
    p = make_proto(buffer_size=1, task_timeout=10.0, prefetch=1)
    first = p.dispatch(3, 0.0)
    assert not p.available(3, 0.0) and p.can_queue(3, 0.0) and not first.queued
    second = p.dispatch(3, 1.0)
    assert second.queued and not p.can_queue(3, 1.0)
    assert second.deadline == first.deadline + 10.0  # it cannot start before the one ahead of it ends
    assert p.ledger(3).open_tasks == [first.task_id, second.task_id]
    with pytest.raises(RuntimeError, match="already has open tasks"):
        p.dispatch(3, 2.0)
    assert not make_proto(prefetch=0).can_queue(3, 0.0)


def test_prefetch_is_validated():
    with pytest.raises(ConfigError, match="prefetch"):
        ProtocolConfig(prefetch=-1)


def test_each_queued_task_resolves_on_its_own_and_its_ack_rides_the_next_task():
    p = make_proto(buffer_size=1, max_staleness=5, prefetch=1)
    side = ClientSide(build("int8", SPEC, memory="residual"))
    t1, t2 = p.dispatch(4, 0.0), p.dispatch(4, 0.0)
    seqs, blobs = [], []
    for task in (t1, t2):
        side.apply(task.resolutions)
        ones = {n: torch.ones(s) for n, s in SPEC.entries}
        blobs.append(side.pipeline.send(ones, base_version=task.base_version, client_id=4))
        side.sent(task.task_id, side.pipeline.last_seq)
        seqs.append(side.pipeline.last_seq)
    d1 = p.on_reply(4, blobs[1], ReplyMeta(t2.task_id, seqs[1], 1, 9), now=1.0)  # the later one first
    assert d1.outcome is Outcome.APPLIED and p.ledger(4).open_tasks == [t1.task_id]
    assert p.stats.prefetched_applied == 1 and p.stats.prefetched_staleness == 0
    # the earlier reply, overtaken (its read backed off): a new seq below the highest seen is judged, not dropped
    d0 = p.on_reply(4, blobs[0], ReplyMeta(t1.task_id, seqs[0], 1, 9), now=2.0)
    assert d0.outcome is Outcome.APPLIED and p.ledger(4).open_tasks == [] and p.ledger(4).last_seq == seqs[1]
    again = p.on_reply(4, blobs[0], ReplyMeta(t1.task_id, seqs[0], 1, 9), now=2.5)
    assert again.outcome is Outcome.DUPLICATE  # each seq once
    assert p.expire(1e9) == []
    side.apply(p.dispatch(4, 1e9).resolutions)
    assert not side.pipeline.pending  # both acked on the next task


def test_a_seq_is_judged_once_even_under_another_open_task():
    """A replay of an applied seq as the answer to another open task is a duplicate (ignored): replies may come
    out of order, never twice."""
    p = make_proto(buffer_size=1, max_staleness=5, prefetch=1)
    side = ClientSide(build("int8", SPEC, memory="residual"))
    t1, t2 = p.dispatch(4, 0.0), p.dispatch(4, 0.0)
    side.apply(t1.resolutions)
    blob = side.pipeline.send({n: torch.ones(s) for n, s in SPEC.entries}, base_version=0, client_id=4)
    seq = side.pipeline.last_seq
    assert p.on_reply(4, blob, ReplyMeta(t1.task_id, seq, 1, 9), now=1.0).outcome is Outcome.APPLIED
    replay = p.on_reply(4, blob, ReplyMeta(t2.task_id, seq, 1, 9), now=2.0)
    assert replay.outcome is Outcome.DUPLICATE and p.ledger(4).open_tasks == [t2.task_id]
    led = p.ledger(4)
    assert led.seen_before(seq) and not led.seen_before(seq + 1) and led.seen_before(seq + 5 - 64 - 5)


def test_checkpoint_turns_every_open_task_into_a_lost_nack(tmp_path):
    p = make_proto(buffer_size=1, prefetch=2)
    tasks = [p.dispatch(1, 0.0) for _ in range(3)]
    state = p.state_dict()
    assert state["clients"]["1"]["open_tasks"] == []
    q = make_proto(buffer_size=1, prefetch=2)
    q.load_state_dict(state)
    lost = [r.task_id for r in q.dispatch(1, 0.0).resolutions if r.outcome is Outcome.LOST]
    assert lost == [t.task_id for t in tasks]


def test_a_checkpoint_from_before_prefetch_still_loads():
    old = {"incarnation": 3, "last_seq": 7, "open_task": None, "outbox": [], "failures": 0,
           "unavailable_until": 0.0, "applied": 2, "nacked": 0, "resync": False, "moved_to": None}
    led = ClientLedger.from_dict(old)
    assert led.open_tasks == [] and led.last_seq == 7


def test_the_async_loop_keeps_one_task_queued_behind_each_running_one(tmp_path):
    tr = FifoTransport({1: 2.0, 2: 3.0})
    p, loop = run(tr, tmp_path, prefetch=1, versions=10)
    assert p.version == 10
    for c, ran in tr.order.items():  # every task after the first two started the moment the one before ended
        starts = [tr.started[t] for t in ran]
        assert all(b - a == pytest.approx(tr.delays[c]) for a, b in zip(starts, starts[1:], strict=False))
    assert p.totals.prefetched > 0 and p.totals.prefetched_applied > 0
    assert all(len(led.open_tasks) <= 2 for led in p.clients.values())


def test_without_prefetch_a_node_waits_for_its_next_task(tmp_path):
    tr = FifoTransport({1: 2.0, 2: 3.0})
    p, _ = run(tr, tmp_path, prefetch=0, versions=6)
    assert p.version == 6 and p.totals.prefetched == 0
    assert all(len(led.open_tasks) <= 1 for led in p.clients.values())


class SlowsDown(FifoTransport):
    """Node 4 runs 1 s tasks until ``at``, then ``slow`` s ones: what its past cycles predicted no longer holds."""

    def __init__(self, at: float, slow: float) -> None:
        super().__init__({1: 1.0, 2: 1.0, 3: 1.0, 4: 1.0})
        self.at, self.slow = at, slow

    def delay(self, c: int) -> float:
        return self.slow if c == 4 and self.t >= self.at else self.delays[c]


def queued_with(tr: FifoTransport, outcome: Outcome, nodes=None) -> list[int]:
    """The queued tasks (of ``nodes``, default all) whose node received ``outcome`` for them."""
    return [t for c, ran in tr.order.items() if nodes is None or c in nodes for t in ran
            if tr.queued[t] and tr.outcomes.get(t) is outcome]


def test_a_queued_task_that_grew_too_stale_is_nacked_and_its_update_restored(tmp_path):
    # node 4's tasks take 1 s, then 12 s: its queued tasks, sent on the strength of its 1 s cycles, wait behind a
    # 12 s task while the others make ~3 versions a second, and come back far more than 20 versions stale
    tr = SlowsDown(at=8.0, slow=12.0)
    p, _ = run(tr, tmp_path, prefetch=1, versions=120, max_staleness=20)
    stale = queued_with(tr, Outcome.STALE, nodes={4})
    assert stale, "no queued task of node 4 was nacked stale"  # queued ones: not the running tasks' stale nacks
    assert p.totals.prefetched_stale >= len(stale)
    side = tr.sides[4]
    p.expire(1e12)
    side.apply(p.dispatch(4, 1e12).resolutions)
    assert not side.pipeline.pending  # stale nacks and timeouts put every update back into the residual


def test_a_queued_task_that_would_come_back_too_stale_is_not_queued_its_node_gets_a_fresh_task(tmp_path):
    """Node 4 takes 3 s while three 1 s nodes make ~3 versions a second: a task sent when its reply lands comes back
    ~10 versions stale (applied, max 12); one queued 2 s ahead (prefetch-lead) waits 2 s more behind the running
    one and comes back ~15 stale. The server sees that coming and refreshes instead: no queued task is nacked
    stale, node 4's tasks still apply, and the fast nodes keep their queued tasks."""
    tr = FifoTransport({1: 1.0, 2: 1.0, 3: 1.0, 4: 3.0})
    p, _ = run(tr, tmp_path, prefetch=1, versions=80, max_staleness=12)
    assert queued_with(tr, Outcome.STALE) == [] and p.totals.prefetched_stale == 0
    assert sum(tr.outcomes.get(t) is Outcome.APPLIED for t in tr.order[4]) >= 3
    assert len(queued_with(tr, Outcome.APPLIED, nodes={1, 2, 3})) >= 20


def _conservation(transport, p):
    p.expire(1e12)
    for c, side in transport.sides.items():
        side.apply(p.dispatch(c, 1e12).resolutions)
    for n in transport.computed:
        held = sum(side.pipeline.memory.residual(n) for side in transport.sides.values())
        assert all(not side.pipeline.pending for side in transport.sides.values())
        assert torch.allclose(-p.params[n] + held, transport.computed[n], atol=1e-3)


@settings(max_examples=25, deadline=None)
@given(prefetch=st.integers(0, 2), seed=st.integers(0, 10_000), staleness=st.integers(0, 6))
def test_no_gradient_mass_is_lost_with_queued_tasks(tmp_path_factory, prefetch, seed, staleness):
    """Σ applied + Σ residuals = Σ computed, whatever is lost, failed, stale or queued."""
    rng = random.Random(seed)
    fate = lambda task: rng.choices(["ok", "lost_up", "fail"], [0.8, 0.1, 0.1])[0]  # noqa: E731
    tr = FifoTransport({1: 1.0, 2: 1.5, 3: 4.0}, fate=fate, seed=seed)
    p, _ = run(tr, tmp_path_factory.mktemp("c"), prefetch, versions=12, max_staleness=staleness, task_timeout=15.0)
    assert all(len(led.open_tasks) <= prefetch + 1 for led in p.clients.values())
    _conservation(tr, p)


def test_link_aware_density_times_a_queued_task_from_the_reply_before_it():
    auto = AutoDensity(AutoDensityConfig(probe=(0.3, 0.1), warmup=0))
    auto.dispatched(1, 7, now=0.0, density=0.3, down_bytes=1000)
    auto.dispatched(2, 7, now=0.0, density=0.1, down_bytes=1000)  # queued behind task 1
    auto.replied(1, now=5.0, up_bytes=3000, compute_s=4.0)
    auto.replied(2, now=10.0, up_bytes=1000, compute_s=4.0)
    comms = [c for _, _, _, c, _ in auto.links[7].obs]
    assert [round(c, 6) for c in comms] == [1.0, 1.0]  # not 6.0: task 2 waited 5 s behind task 1


def test_the_next_task_is_queued_lead_seconds_before_the_node_should_need_it(tmp_path):
    tr = FifoTransport({1: 20.0})
    p = make_proto(buffer_size=1, max_staleness=50, normalize="sum", task_timeout=100.0, prefetch=1)
    cfg = LoopConfig(num_versions=4, poll_interval=1.0, prefetch_lead=3.0)
    loop = LOOPS.get("async")(p, tr, cfg, Reporter(tmp_path, clock=tr), tr)
    loop.run()
    first_queued = min(t for t, queued in tr.queued.items() if queued)
    # task 2 went out at t=20 (the first reply); its successor was queued at 20 + 20 - 3, not at once
    assert tr.started[2] == 20.0 and loop.prefetch.cycle(1) == pytest.approx(20.0)
    assert p.totals.prefetched >= 1 and tr.sent_at[first_queued] == pytest.approx(37.0)
    assert all(b - a == pytest.approx(20.0) for a, b in zip(list(tr.started.values()), list(tr.started.values())[1:],
                                                              strict=False))


def test_prefetch_lead_is_validated():
    with pytest.raises(ConfigError, match="prefetch_lead"):
        LoopConfig(prefetch_lead=-1.0)


def test_the_cycle_is_the_shortest_recent_one_so_a_late_task_does_not_make_the_next_late():
    timer = PrefetchTimer(lead=0.5, window=3)
    t = 0.0
    for task_id, took in enumerate([4.5, 1.5, 4.5, 1.5], start=1):  # every other task found late (3 s sleep)
        timer.dispatched(task_id, 7, t)
        t += took
        timer.replied(task_id, t)
    assert timer.cycle(7) == pytest.approx(1.5)
    timer.dispatched(9, 7, t)
    assert timer.due(7, [9], t) == pytest.approx(t + 1.5 - 0.5)
    timer.failed(9)
    assert timer.start(9) is None


def test_a_busy_node_that_went_offline_when_its_next_task_is_due_does_not_make_the_loop_spin(tmp_path):
    # node 1 runs 10 s tasks and goes offline at t=15 holding task 2 (10 -> 20): its next task is due to be queued
    # at 10 + 10 - lead = 18, when fill cannot send it. The loop must wait for the next event, not poll(0) forever.
    class Vanishing(FifoTransport):
        def __init__(self) -> None:
            super().__init__({1: 10.0})
            self.idle_polls = 0  # polls in a row that neither advanced the clock nor returned an event

        def clients(self):
            return [] if self.t >= 15.0 else super().clients()

        def poll(self, wait):
            before = self.t
            events = super().poll(wait)
            self.idle_polls = 0 if events or self.t > before else self.idle_polls + 1
            assert self.idle_polls < 1000, f"the loop spins at t={self.t} with zero waits"
            return events

    tr = Vanishing()
    p = make_proto(buffer_size=1, max_staleness=50, normalize="sum", task_timeout=40.0, backoff=0.0, prefetch=1)
    cfg = LoopConfig(num_versions=8, poll_interval=1.0, run_timeout=60.0)  # prefetch_lead: the default 2 s
    loop = LOOPS.get("async")(p, tr, cfg, Reporter(tmp_path, clock=tr), tr)
    assert loop.run() is p  # it returned
    assert tr.order[1] == [1, 2] and tr.started[2] == 10.0  # task 2 ran; its successor was never sent
    assert p.version == 2 and not loop.completed  # both replies applied, then nothing more to run
    assert tr.now() >= 60.0 and "run timeout" in loop.stopped_reason  # the clock moved on to the run timeout


def _tracked(loop, task_id: int) -> list[str]:
    """The loop's trackers that still hold ``task_id``."""
    held = {"prefetch timer": loop.prefetch.sent, "downlink in flight": loop.downlink.in_flight,
            "link-aware in flight": loop.auto.open}
    return [name for name, tracker in held.items() if task_id in tracker]


def test_an_expired_task_leaves_the_prefetch_timer_and_the_in_flight_trackers(tmp_path):
    tr = FifoTransport({1: 5.0}, fate=lambda task: "lost_up")  # no reply ever comes back
    p = make_proto(buffer_size=1, task_timeout=10.0, prefetch=1)
    cfg = LoopConfig(num_versions=2, downlink="delta", auto_density=AutoDensityConfig())
    loop = LOOPS.get("async")(p, tr, cfg, Reporter(tmp_path, clock=tr), tr)
    running, queued = loop.dispatch(1, 0.0), loop.dispatch(1, 0.0)
    assert queued.queued and _tracked(loop, running.task_id) == _tracked(loop, queued.task_id) != []
    loop.expire(15.0)  # the running task's deadline (10 s) has passed, the queued one's (20 s) not yet
    assert _tracked(loop, running.task_id) == [] and _tracked(loop, queued.task_id) != []
    loop.expire(25.0)
    assert _tracked(loop, queued.task_id) == [] and p.tasks == {}


def test_a_task_of_a_closed_sync_round_leaves_the_trackers(tmp_path):
    tr = FifoTransport({1: 5.0, 2: 5.0}, fate=lambda task: "lost_up")
    p = make_proto(task_timeout=100.0)
    cfg = LoopConfig(num_versions=2, round_timeout=4.0, run_timeout=20.0, downlink="delta",
                     auto_density=AutoDensityConfig())
    loop = LOOPS.get("sync")(p, tr, cfg, Reporter(tmp_path, clock=tr), tr)
    loop.run()
    sent = [t for ran in tr.order.values() for t in ran]
    assert len(sent) >= 4 and p.tasks == {}  # every round timed out its tasks...
    assert [t for t in sent if _tracked(loop, t)] == []  # ...and the trackers let go of them


def test_a_reply_read_before_the_task_ahead_of_it_measures_no_cycle():
    """Replies of queued tasks may be read out of order: the task ahead was timed from the later reply (a cycle
    near 0), and ``cycle()``, the shortest of the recent ones, then queued tasks too early for ``window`` replies
    (real cycle 10 s: task 1 sent at 0, task 2 queued at 8, read at 20 and 20.5)."""
    timer = PrefetchTimer(lead=2.0)
    timer.dispatched(0, 4, -10.0)
    timer.replied(0, 0.0)  # one cycle of 10 s
    timer.dispatched(1, 4, 0.0)
    timer.dispatched(2, 4, 8.0)
    timer.replied(2, 20.0, timed=False)  # read first: it overtook task 1 (Ledger.overtakes)
    timer.replied(1, 20.5)
    assert timer.cycle(4) == 10.0, timer.cycles
    assert timer.last_reply[4] == 20.5


def test_the_loop_times_no_reply_read_before_the_task_ahead_of_it(tmp_path):
    """The ledger knows a node's open tasks in dispatch order: a reply read before the one ahead of it teaches the
    prefetch timer and the density policy no timing (``Ledger.overtakes``), only the one ahead does."""
    tr = FifoTransport({1: 10.0})
    p = make_proto(buffer_size=1, max_staleness=50, normalize="sum", task_timeout=100.0, prefetch=1)
    cfg = LoopConfig(num_versions=5, auto_density=AutoDensityConfig(warmup=0))
    loop = LOOPS.get("async")(p, tr, cfg, Reporter(tmp_path, clock=tr), tr)
    first, queued = loop.dispatch(1, 0.0), loop.dispatch(1, 0.0)
    assert queued.queued and p.overtakes(1, queued.task_id) and not p.overtakes(1, first.task_id)
    events = {task_id: event for _, task_id, event in tr.queue}
    loop.handle(events[queued.task_id], 20.0)  # read first
    loop.handle(events[first.task_id], 20.5)
    assert loop.prefetch.cycles[1] == [20.5], loop.prefetch.cycles  # the first task's, from its dispatch
    assert len(loop.auto.links[1].obs) == 1, loop.auto.links[1].obs

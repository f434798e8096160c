"""What Flower charges per task on the virtual clock (``fedcomp.sim.virtual``): the SuperExec's poll, the ClientApp
process start (cold or warm worker), the server's reply pull; and tasks queued on a node (prefetch): picked up by
the pull right after the previous push, run first dispatched first, all failed when the node vanishes. A fake
engine, no Flower, except for ``GridEngine``'s per-node order."""

from __future__ import annotations

import dataclasses
import itertools
import math
import random
from collections.abc import Collection
from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fedcomp.protocol import Outcome, ReplyMeta, Task
from fedcomp.registry import ConfigError
from fedcomp.server.loops import Event, FailureEvent, ReplyEvent, SendReceipt
from fedcomp.sim.links import LINKS, DeviceProfile, LinkProfile, draw_fate
from fedcomp.sim.virtual import (
    WARM_START_S,
    Engine,
    NodeProfile,
    NodeStats,
    TimingConfig,
    VirtualClock,
    VirtualTransport,
    server_seen,
)

LINK = LinkProfile("x", up_Bps=1000.0, down_Bps=4000.0, rtt_s=0.5)
DEV = DeviceProfile("d", s_per_sample=0.01, startup_s=1.0)
PARTS = ("poll_wait_s", "round_trip_s", "transfer_s", "superexec_wait_s", "process_start_s", "compute_s",
         "queue_s", "reply_check_s", "server_wait_s")
NO_CHARGES = dict(cold_start_s=0.0, warm_start_s=0.0, worker_start_s=0.0, superexec_poll_s=0.0, server_pull_s=0.0)
#: Flower 1.41's object reader: after a read that finds the reply's objects incomplete it waits 1 s, doubling, at
#: most 10 s
BACKOFF = (1.0, 2.0, 4.0, 8.0, 10.0)


def flower_reads(visible: float, pull_s: float):
    """The server's reads of a reply that became visible on the SuperLink at ``visible``: half a pull interval
    later, then 1, 2, 4, 8, 10, 10, ... s apart."""
    t = visible + pull_s / 2
    for step in itertools.chain(BACKOFF, itertools.repeat(BACKOFF[-1])):
        yield t
        t += step


def flower_seen(visible: float, finish: float, pull_s: float) -> float:
    """When the server holds the reply: its first read at or after ``finish`` (all objects uploaded)."""
    return next(r for r in flower_reads(visible, pull_s) if r >= finish)


def reply_wait(tid: int, link: LinkProfile, cfg: TimingConfig) -> float:
    """``seen - finish`` of ``Eager``'s reply to task ``tid`` on ``link``: the reply is visible one round trip after
    its push starts, and its objects are all up ``reply_trips - 1`` round trips and its transfer later."""
    up, down = cfg.wire.reply(2 * (1500 + 97 * (tid % 7)), 1)
    upload = (cfg.wire.reply_trips(1) - 1) * link.rtt_s + up / link.up_Bps + down / link.down_Bps
    return flower_seen(0.0, upload, cfg.server_pull_s) - upload


class Eager(Engine):
    """Runs each task at submit (in submit order: what the client state sees) and hands every reply over at once."""

    def __init__(self, samples: int = 100) -> None:
        self.samples = samples
        self.ran: list[int] = []
        self.done: dict[int, Event] = {}

    def submit(self, task: Task, model: bytes) -> SendReceipt:
        self.ran.append(task.task_id)
        n = self.samples + 13 * (task.task_id % 5)
        blob = b"u" * (1500 + 97 * (task.task_id % 7))
        self.done[task.task_id] = ReplyEvent(task.task_id, task.client, blob, ReplyMeta(task.task_id, 1, n),
                                             flower_bytes=2 * len(blob), flower_objects=1)
        return SendReceipt(8000 + task.task_id, 1)

    def gather(self, task_ids: Collection[int]) -> list[Event]:
        return [self.done.pop(t) for t in task_ids]


class Lazy(Eager):
    """Hands over one reply per ``gather_any``: a random one, or with ``seed=None`` the newest (a node's later
    tasks before its earlier ones)."""

    def __init__(self, seed: int | None, samples: int = 100) -> None:
        super().__init__(samples)
        self.rng = None if seed is None else random.Random(seed)

    def gather_any(self, task_ids: Collection[int]) -> list[Event]:
        return self.gather([self.rng.choice(sorted(task_ids)) if self.rng else max(task_ids)])


def transport(engine: Engine, nodes: dict[int, NodeProfile], **timing) -> tuple[VirtualTransport, VirtualClock]:
    clock = VirtualClock()
    timing.setdefault("read_phase", "half")  # exact timelines below; the random phase has tests of its own
    return VirtualTransport(engine, nodes, clock, TimingConfig(**timing)), clock


def task(tid: int, client: int, t: float) -> Task:
    return Task(tid, client, 0, t, t + 1000.0)


def drain(tr: VirtualTransport, clock: VirtualClock) -> list[tuple[int, str, float]]:
    out = []
    while evs := tr.poll(1e6):
        out += [(e.task_id, type(e).__name__, clock.now()) for e in evs]
    return out


def run_prefetch(engine: Engine, prefetch: int, n_tasks: int = 40, **timing: object) -> tuple[list, VirtualTransport]:
    """An async server in miniature: every online node holds up to ``1 + prefetch`` tasks; each event refills it."""
    nodes = {10 + i: NodeProfile(i, link, DEV) for i, link in enumerate(
        [LINK, LINKS["wifi"], LINKS["lte"], LINKS["3g"].with_options(loss=0.1, disconnect=0.1)])}
    timing = {"seed": 5, "detect_s": 20.0, "rejoin_s": 30.0, **timing}
    tr, clock = transport(engine, nodes, **timing)
    open_: dict[int, dict[int, float]] = {nid: {} for nid in nodes}  # node -> task id -> deadline
    sent, out = 0, []

    def fill() -> None:
        nonlocal sent
        now = clock.now()
        for nid in tr.clients():
            while len(open_[nid]) <= prefetch and sent < n_tasks:
                sent += 1
                tr.send(task(sent, nid, now), b"m" * 500)
                open_[nid][sent] = now + 200.0

    fill()
    while any(open_.values()) and clock.now() < 5000:
        for e in tr.poll(50.0):
            open_[e.client].pop(e.task_id, None)
            out.append((e.task_id, e.client, type(e).__name__, clock.now()))
        for tasks in open_.values():
            for tid in [t for t, dl in tasks.items() if dl <= clock.now()]:
                del tasks[tid]  # lost: the server's deadline
        fill()
    return out, tr


def test_a_queued_task_is_picked_up_when_the_previous_push_finishes():
    tr, clock = transport(Eager(), {7: NodeProfile(0, LINK, DEV)}, worker_start_s=0.0)
    tr.send(task(1, 7, 0.0), b"m")
    tr.send(task(2, 7, 0.0), b"m")  # queued behind task 1 (prefetch)
    [first] = tr.poll(1e6)
    # the server sees task 1's reply at its first read at or after the push finished (a ~6 s upload: back-off);
    # both tasks were scheduled once the engine handed their replies over, and each counts once the server reads it
    wait = reply_wait(1, LINK, TimingConfig())
    assert tr.stats[7].server_wait_s == pytest.approx(wait) and tr.stats[7].delivered == 1
    assert wait != TimingConfig().server_wait_s
    push_finish = clock.now() - wait
    [second] = tr.poll(1e6)
    assert (first.task_id, second.task_id) == (1, 2)
    assert tr.stats[7].server_wait_s == pytest.approx(wait + reply_wait(2, LINK, TimingConfig()))
    # task 1 is picked up at node 0's first poll (0 s), task 2 by the pull right after task 1's push: no 3 s poll,
    # its wait is the node's queue
    assert tr.stats[7].poll_wait_s == 0.0
    assert tr.stats[7].queue_s == pytest.approx(push_finish)
    single, clock1 = transport(Eager(), {7: NodeProfile(0, LINK, DEV)}, worker_start_s=0.0)
    single.send(task(2, 7, 0.0), b"m")
    single.poll(1e6)  # the same task alone, minus its poll wait (and the app bundle it fetched)
    b_up, b_down = TimingConfig().wire.bundle()
    bundle = b_down / LINK.down_Bps + b_up / LINK.up_Bps
    assert clock.now() - push_finish == pytest.approx(clock1.now() - bundle)


def test_a_task_sent_at_the_push_finish_or_later_waits_for_the_next_poll():
    def first_task() -> tuple[VirtualTransport, VirtualClock]:
        tr, clock = transport(Eager(), {7: NodeProfile(0, LINK, DEV)}, **NO_CHARGES)
        tr.send(task(1, 7, 0.0), b"m")
        return tr, clock

    # no pull interval, but the reply is still seen on Flower's read back-off, after its push finished
    tr, clock = first_task()
    [_] = tr.poll(1e6)
    wait = reply_wait(1, LINK, TimingConfig(**NO_CHARGES))
    finish = tr.poll_anchor[7]  # the push finish, exactly (the node's polls follow it)
    assert wait > 0 and tr.stats[7].server_wait_s == pytest.approx(wait)
    assert clock.now() - finish == pytest.approx(wait)
    tr.send(task(2, 7, clock.now()), b"m")  # the loop answers when it sees the reply: the node's next poll
    tr.poll(1e6)
    assert tr.stats[7].queue_s == 0.0
    assert tr.stats[7].poll_wait_s == pytest.approx(3.0 * math.ceil(wait / 3.0) - wait)  # polls at finish + 3k
    # a task sent at the very time of the push came after the pull that followed it: it waits a whole interval
    tr, clock = first_task()
    assert tr.poll(finish) == [] and clock.now() == finish
    tr.send(task(2, 7, finish), b"m")
    [_, _] = drain(tr, clock)
    assert tr.stats[7].queue_s == 0.0 and tr.stats[7].poll_wait_s == pytest.approx(3.0)


def test_a_node_runs_its_tasks_in_dispatch_order_whatever_order_the_engine_returns_them():
    eager, _ = run_prefetch(Eager(), prefetch=2)
    for seed in (None, 0, 1, 2):
        lazy, _ = run_prefetch(Lazy(seed), prefetch=2)
        assert lazy == eager  # the same timeline, float for float
    by_node: dict[int, list[int]] = {}
    for tid, nid, kind, _t in eager:
        if kind == "ReplyEvent":
            by_node.setdefault(nid, []).append(tid)
    assert all(tids == sorted(tids) for tids in by_node.values()) and len(by_node) == 4


@settings(max_examples=15, deadline=None)
@given(seed=st.integers(0, 10_000), prefetch=st.integers(0, 3), detect_s=st.sampled_from([0.2, 20.0]))
def test_the_lower_bound_holds_for_queued_tasks(seed, prefetch, detect_s):
    # a lazy engine makes poll rely on the lower bounds (a quick detect_s puts failures before fetches); the
    # clock would go back, or events come out in another order, if one were wrong
    lazy, _ = run_prefetch(Lazy(seed), prefetch, seed=seed, detect_s=detect_s)
    assert lazy == run_prefetch(Eager(), prefetch, seed=seed, detect_s=detect_s)[0]


def test_an_early_departure_is_not_overtaken_while_its_reply_is_unknown():
    # node 1 (GPRS: a slow fetch) vanishes early in its task; node 2's reply is known first (the engine hands the
    # newest over first) but comes later than node 1's failure: poll must not release it before
    gprs = LINKS["gprs"].with_options(loss=0.0, disconnect=0.999)
    seed = next(s for s in range(1000) if draw_fate(gprs, random.Random(s * 1_000_003)).disconnect_at < 0.2)
    nodes = {1: NodeProfile(0, gprs, DEV), 2: NodeProfile(1, LINKS["datacenter"], DEV)}
    tr, clock = transport(Lazy(None), nodes, seed=seed, detect_s=0.1)
    tr.send(task(1, 1, 0.0), b"m")
    tr.send(task(2, 2, 0.0), b"m")
    assert [(tid, kind) for tid, kind, _ in drain(tr, clock)] == [(1, "FailureEvent"), (2, "ReplyEvent")]


def test_a_vanished_node_fails_every_task_it_holds():
    flaky = LINK.with_options(disconnect=0.999)
    tr, clock = transport(Eager(), {1: NodeProfile(0, flaky, DEV), 2: NodeProfile(1, LINK, DEV)}, detect_s=60.0)
    for tid in (1, 2, 3):
        tr.send(task(tid, 1, 0.0), b"m")
    tr.send(task(4, 2, 0.0), b"m")
    events = drain(tr, clock)
    lost = [(tid, t) for tid, kind, t in events if kind == "FailureEvent"]
    assert [tid for tid, _ in lost] == [1, 2, 3]
    assert len({t for _, t in lost}) == 1  # all at once, detect_s after the node left
    gone = lost[0][1] - 60.0
    assert 0 <= gone and tr.stats[1].disconnects == 1 and tr.stats[1].delivered == 0
    assert [tid for tid, kind, _ in events if kind == "ReplyEvent"] == [4]


def test_a_task_lost_on_the_downlink_never_runs_and_never_blocks_the_next():
    lossy = LINK.with_options(loss=0.3)
    seed = next(s for s in range(1000) if _fates(lossy, s, 2) == ["lost_down", "delivered"])
    engine = Eager()
    tr, clock = transport(engine, {1: NodeProfile(0, lossy, DEV)}, seed=seed)
    tr.send(task(1, 1, 0.0), b"m")
    tr.send(task(2, 1, 0.0), b"m")
    assert [(tid, kind) for tid, kind, _ in drain(tr, clock)] == [(2, "ReplyEvent")]
    assert engine.ran == [2] and tr.stats[1].poll_wait_s == 0.0  # fetched at the node's first poll


def _fates(link: LinkProfile, seed: int, n: int) -> list[str]:
    rng = random.Random(seed * 1_000_003)
    fates = [draw_fate(link, rng) for _ in range(n)]
    return ["lost_down" if f.lost_down else "delivered" if f.delivered else "other" for f in fates]


@pytest.mark.parametrize("worker", ["warm", "cold"])
def test_the_charges_are_in_the_split_and_the_parts_add_up_to_each_tasks_time(worker):
    tr, clock = transport(Eager(), {7: NodeProfile(0, LINK, DEV)}, worker=worker)
    spans, sent = 0.0, {}
    for tid in range(1, 7):  # two at a time: one running, one queued
        sent[tid] = clock.now()
        tr.send(task(tid, 7, clock.now()), b"m")
        if tid % 2 == 0:
            for _ in range(2):
                [ev] = tr.poll(1e6)
                spans += clock.now() - sent[ev.task_id]  # dispatch -> the server sees it
    s, cfg = tr.stats[7], TimingConfig(worker=worker)
    assert s.delivered == 6
    assert sum(getattr(s, p) for p in PARTS) == pytest.approx(spans)
    assert s.superexec_wait_s == pytest.approx(6 * 0.1)
    assert s.server_wait_s == pytest.approx(sum(reply_wait(tid, LINK, cfg) for tid in range(1, 7)))
    # every task starts its process; a warm node's first also starts the worker
    assert s.process_start_s == pytest.approx(6 * cfg.process_start_s + cfg.first_task_s) and cfg.process_start_s > 0


def test_a_cold_worker_costs_more_per_task_than_a_warm_one():
    def per_task(worker: str) -> float:
        _, tr = run_prefetch(Eager(), prefetch=1, worker=worker)
        stats = list(tr.stats.values())
        return sum(sum(getattr(s, p) for p in PARTS) for s in stats) / sum(s.timed for s in stats)

    assert per_task("cold") > per_task("warm") > 0


def test_without_the_transport_model_there_is_no_per_task_charge():
    tr, clock = transport(Eager(), {7: NodeProfile(0, LINK, DEV)}, count_bytes="payload", worker="cold")
    tr.send(task(1, 7, 0.0), b"m")
    tr.poll(1e6)
    s = tr.stats[7]
    assert (s.superexec_wait_s, s.process_start_s, s.server_wait_s) == (0.0, 0.0, 0.0)


def test_zero_charges_give_the_plain_transport_timeline():
    # the charges only add: turning them off leaves poll wait, round trips, transfer, compute, reply check, and
    # as server wait only Flower's read back-off (first read when the reply is visible, no pull interval)
    out, tr = run_prefetch(Eager(), prefetch=0, **NO_CHARGES)
    replies = [(tid, nid) for tid, nid, kind, _ in out if kind == "ReplyEvent"]
    while evs := tr.poll(1e6):  # replies scheduled after the server stopped waiting
        replies += [(e.task_id, e.client) for e in evs if isinstance(e, ReplyEvent)]
    cfg = TimingConfig(**NO_CHARGES)
    for nid, s in tr.stats.items():
        assert (s.superexec_wait_s, s.process_start_s, s.queue_s) == (0.0, 0.0, 0.0)
        mine = [tid for tid, n in replies if n == nid]
        assert s.delivered == len(mine) > 0
        assert s.server_wait_s == pytest.approx(sum(reply_wait(tid, tr.nodes[nid].link, cfg) for tid in mine))
    assert sum(s.server_wait_s for s in tr.stats.values()) > 0


def test_a_slow_upload_is_seen_on_flowers_read_backoff():
    slow = LinkProfile("slow-up", up_Bps=100.0, down_Bps=4000.0, rtt_s=0.5)
    cfg = TimingConfig()
    tr, clock = transport(Eager(), {7: NodeProfile(0, slow, DEV)})
    tr.send(task(1, 7, 0.0), b"m")
    [ev] = tr.poll(1e6)
    seen = clock.now()
    # the task's timeline (module docstring): picked up at node 0's first poll (0 s), fetched with the app bundle,
    # SuperExec wait + warm start + compute, pushed at the next 0.5 s reply check, visible one round trip later
    t_up, t_down = cfg.wire.task(8001, 1)
    b_up, b_down = cfg.wire.bundle()
    fetched = cfg.wire.task_trips(1) * 0.5 + (t_down + b_down) / 4000 + (t_up + b_up) / 100
    on_node = cfg.superexec_wait_s + cfg.process_start_s + cfg.worker_start_s + DEV.compute_s(100 + 13)
    pushed = fetched + 0.5 * math.ceil(on_node / 0.5)
    r_up, r_down = cfg.wire.reply(2 * (1500 + 97), 1)
    visible, finish = pushed + 0.5, pushed + cfg.wire.reply_trips(1) * 0.5 + r_up / 100 + r_down / 4000
    assert finish - visible > 30.0  # far longer than half a pull interval, and than the first back-offs
    # the reads: half a pull interval after visible, then 1, 2, 4, 8, 10, 10, ... s; seen at the first one that
    # finds every object uploaded
    sums = list(itertools.accumulate(itertools.chain([0.0, 1.0, 2.0, 4.0, 8.0], itertools.repeat(10.0, 10))))
    k = next(i for i, s in enumerate(sums) if visible + cfg.server_pull_s / 2 + s >= finish)
    assert k >= 5  # it reached the 10 s cap
    assert seen - visible - cfg.server_pull_s / 2 == pytest.approx(sums[k])
    assert seen >= finish and visible + cfg.server_pull_s / 2 + sums[k - 1] < finish
    assert seen == pytest.approx(server_seen(visible, finish, cfg.server_pull_s))
    assert tr.stats[7].server_wait_s == pytest.approx(seen - finish) and ev.task_id == 1


@settings(max_examples=300, deadline=None)
@given(visible=st.floats(0.0, 1e4), upload=st.floats(0.0, 50.0), pull_s=st.floats(0.0, 30.0),
       phase=st.floats(0.0, 1.0, exclude_max=True))
def test_the_first_read_lands_at_its_phase_and_backs_off_only_inside_the_upload(visible, upload, pull_s, phase):
    finish, first = visible + upload, visible + phase * pull_s
    seen = server_seen(visible, finish, pull_s, phase)
    if first >= finish:
        assert seen == first  # read after the upload ended: no back-off
    else:
        steps = itertools.accumulate(itertools.chain(BACKOFF, itertools.repeat(BACKOFF[-1], 20)))
        assert seen >= finish and any(seen - first == pytest.approx(s, abs=1e-6) for s in steps)


def test_with_a_random_phase_a_short_upload_backs_off_in_proportion_to_its_length():
    """A 40 ms upload (one request after the reply became visible), reads every 0.25 s: about 16% of the replies
    are read inside the upload (and seen 1 s later); the draws come from each node's own seeded stream, so the
    same seed gives the same timeline."""

    def waits(seed: int, phase: str) -> list[float]:
        fast = LinkProfile("fast", up_Bps=1e12, down_Bps=1e12, rtt_s=0.04)
        tr, _ = transport(Eager(), {n: NodeProfile(n, fast, DEV) for n in range(400)}, seed=seed, read_phase=phase)
        for n in range(400):
            tr.send(task(n + 1, n, 0.0), b"m")
        drain(tr, tr.clock)
        return [tr.stats[n].server_wait_s for n in range(400)]

    late = [w for w in waits(0, "random") if w > 0.5]
    assert 0.10 * 400 < len(late) < 0.22 * 400, len(late)  # binomial(400, 0.16): 64 ± 7.3
    assert waits(0, "random") == waits(0, "random") and waits(0, "random") != waits(1, "random")
    assert not [w for w in waits(0, "half") if w > 0.5]  # the fixed phase never lands inside 40 ms


@settings(max_examples=300, deadline=None)
@given(visible=st.floats(0.0, 1e4), upload=st.floats(-50.0, 2000.0), pull_s=st.floats(0.0, 30.0))
def test_server_seen_is_the_first_read_at_or_after_the_upload(visible, upload, pull_s):
    finish = visible + upload
    seen = server_seen(visible, finish, pull_s)
    assert seen >= finish and seen >= visible + pull_s / 2
    assert seen == pytest.approx(flower_seen(visible, finish, pull_s), rel=1e-12, abs=1e-9)
    if finish >= visible:  # it overshoots the upload by less than one back-off step (or the first read's delay)
        assert seen - finish < max(pull_s / 2, 10.0) + 1e-6


@pytest.mark.parametrize("bad", [
    dict(read_phase="late"), dict(read_phase=""),
    dict(worker="hot"), dict(worker=""), dict(cold_start_s=-1.0), dict(warm_start_s=math.nan),
    dict(superexec_poll_s=math.inf), dict(server_pull_s=-0.25), dict(cold_start_s="3"), dict(warm_start_s=True),
    dict(detect_s=math.nan), dict(worker_start_s=1e308), dict(reply_check_s=1e-300), dict(rejoin_s=1e6),
])
def test_bad_charges_are_config_errors(bad):
    with pytest.raises(ConfigError):
        TimingConfig(**bad)


def test_node_stats_carry_the_new_parts():
    names = {f.name for f in dataclasses.fields(NodeStats)}
    assert {"superexec_wait_s", "process_start_s", "server_wait_s"} <= names


# ---- scenarios ----------------------------------------------------------------------------------------------


def test_a_scenario_sets_the_worker_per_method_and_the_charges_in_sim():
    from simulations import scenario as scenarios

    sc = scenarios.load("tiny", ["method.fedavg.worker=cold", "sim.cold_start_s=5", "sim.server_pull_s=0.5"])
    fedavg, dgc = sc.method("fedavg"), sc.method("dgc-async")
    assert (fedavg.worker, dgc.worker) == ("cold", "warm")
    assert sc.timing(fedavg).process_start_s == 5.0 and sc.timing(dgc).process_start_s == WARM_START_S == 0.16
    assert sc.timing(fedavg).server_wait_s == 0.25
    assert "worker" not in fedavg.flat  # the simulator's key, not a run-config one
    assert scenarios.load("tiny", ["run.worker=cold"]).method("dgc-async").worker == "cold"  # [run]: every method


@pytest.mark.parametrize("override, names", [
    ("method.fedavg.worker=hot", "method.fedavg.worker"),
    ("sim.cold_start_s=-1", "sim.cold_start_s"),
    ("sim.warm_start_s=nan", "sim.warm_start_s"),
    ("sim.superexec_poll_s=inf", "sim.superexec_poll_s"),
    ("sim.server_pull_s=fast", "sim.server_pull_s"),
    ("sim.read_phase=late", "sim.read_phase"),
    ("sim.worker_start_s=1e308", "sim.worker_start_s"),  # each of these overflowed the clock mid-run
    ("devices.phone={s_per_sample=inf}", "devices.phone"),
    ('devices.phone={base="phone",startup_s=1e306}', "devices.phone"),
    ("method.fedavg.over_selection=inf", "method.fedavg: over_selection"),
    ("method.fedavg.over_selection=1e308", "method.fedavg: over_selection"),
    # each of these failed only when its method started, after the methods before it had run
    ("method.dgc-async.max_update_norm=inf", "method.dgc-async: max_update_norm"),
    ('method.dgc-async.downlink_options="compressor=bogus"', "method.dgc-async: downlink mode 'delta'"),
    ('method.dgc-async.downlink_options="density=nan"', "method.dgc-async: downlink mode 'delta'"),
])
def test_bad_scenario_charges_fail_before_any_work(override, names):
    from simulations import scenario as scenarios

    extra = ["method.dgc-async.downlink=delta"] if "downlink_options" in override else []
    with pytest.raises(ConfigError, match=names.replace(".", r"\.")):
        scenarios.load("tiny", [*extra, override])


def test_prefetch_passes_through_as_a_run_key():
    from fedcomp.task.config import RunConfig
    from simulations import scenario as scenarios

    assert "prefetch" in {f.name for f in dataclasses.fields(RunConfig)}
    sc = scenarios.load("tiny", ["method.dgc-async.prefetch=2"])
    assert sc.method("dgc-async").run.prefetch == 2 and sc.method("dgc-async").flat["prefetch"] == 2


# ---- GridEngine: one task per node in Flower ------------------------------------------------------------------


class FakeGrid:
    """A ``GridTransport`` stand-in shaped like Flower's simulation runtime: everything pushed runs at once, and
    replies come back newest first."""

    def __init__(self) -> None:
        self.pushed: list[int] = []
        self.running: dict[int, Task] = {}
        self.most_at_once: dict[int, int] = {}

    def send(self, task: Task, model: bytes) -> SendReceipt:
        self.pushed.append(task.task_id)
        self.running[task.task_id] = task
        per_node = sum(t.client == task.client for t in self.running.values())
        self.most_at_once[task.client] = max(self.most_at_once.get(task.client, 0), per_node)
        return SendReceipt(777, 1)

    def content(self, task, model):
        from fedcomp.flower import records
        from fedcomp.spec import ModelSpec

        fmt = records.TaskFormat({"compressor": "dgc"}, records.ArrayLayout.of_spec(ModelSpec((("w", (4,)),))))
        return fmt.content(task, model)

    def poll(self, wait: float) -> list[Event]:
        out: list[Event] = [ReplyEvent(t.task_id, t.client, b"r", ReplyMeta(t.task_id, 1, 1))
                            for t in reversed(list(self.running.values()))]
        self.running.clear()
        return out


def test_grid_engine_keeps_one_task_per_node_in_flower_and_runs_them_in_order():
    from simulations.engines import GridEngine

    grid = FakeGrid()
    engine = GridEngine(grid, reply_timeout=5.0)  # type: ignore[arg-type]
    receipts = [engine.submit(task(tid, node, 0.0), b"m" * 100) for tid, node in ((1, 5), (2, 5), (3, 6), (4, 5))]
    assert grid.pushed == [1, 3]  # 2 and 4 wait for node 5's reply
    assert receipts[0].flower_bytes == 777 and receipts[1].flower_bytes > 100  # a held task is measured here
    got = [e.task_id for e in engine.gather_any([1, 2, 3, 4])]
    assert sorted(got) == [1, 3] and grid.pushed == [1, 3, 2]
    assert [e.task_id for e in engine.gather([2, 4])] == [2, 4]
    assert grid.pushed == [1, 3, 2, 4] and grid.most_at_once == {5: 1, 6: 1}


def test_grid_engine_gives_up_on_held_tasks_without_pushing_them():
    from simulations.engines import GridEngine

    class Silent(FakeGrid):
        def poll(self, wait: float) -> list[Event]:
            return []

    grid = Silent()
    engine = GridEngine(grid, reply_timeout=0.0)  # type: ignore[arg-type]
    for tid in (1, 2):
        engine.submit(task(tid, 5, 0.0), b"m")
    events = engine.gather([1, 2])
    assert all(isinstance(e, FailureEvent) and e.outcome is Outcome.LOST for e in events)
    assert grid.pushed == [1]


def test_replace_keeps_a_task_a_task():  # the engines rely on dataclasses.replace of a Task
    assert replace(task(1, 2, 0.0), deadline=5.0).deadline == 5.0

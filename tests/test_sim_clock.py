"""Virtual clock arithmetic and ordering of ``fedcomp.sim.virtual.VirtualTransport`` over a fake engine (no Flower)."""

from __future__ import annotations

import math

import pytest

from fedcomp.protocol import Outcome, ReplyMeta, Task
from fedcomp.server.loops import FailureEvent, ReplyEvent, SendReceipt
from fedcomp.sim.links import Availability, DeviceProfile, LinkProfile, finish_time
from fedcomp.sim.virtual import Engine, NodeProfile, TimingConfig, VirtualClock, VirtualTransport

LINK = LinkProfile("x", up_Bps=1000.0, down_Bps=4000.0, rtt_s=0.5)
DEV = DeviceProfile("d", s_per_sample=0.01, startup_s=1.0)


class FakeEngine(Engine):
    """Replies at once with ``up_bytes`` of blob and ``samples`` examples; records what ran."""

    def __init__(self, up_bytes: int = 3000, samples: int = 100, flower_bytes: int = 0) -> None:
        self.up_bytes, self.samples, self.flower_bytes = up_bytes, samples, flower_bytes
        self.ran: list[int] = []
        self.done: dict[int, ReplyEvent] = {}

    def submit(self, task: Task, model: bytes) -> SendReceipt:
        self.ran.append(task.task_id)
        meta = ReplyMeta(task.task_id, len(self.ran), self.samples)
        self.done[task.task_id] = ReplyEvent(task.task_id, task.client, b"u" * self.up_bytes, meta)
        return SendReceipt(self.flower_bytes, 2 if self.flower_bytes else 0)

    def gather(self, task_ids):
        return [self.done.pop(t) for t in task_ids]


def task(tid: int, client: int, t: float = 0.0) -> Task:
    return Task(tid, client, 0, t, t + 1000.0)


def transport(engine: Engine, nodes: dict[int, NodeProfile], **timing) -> tuple[VirtualTransport, VirtualClock]:
    clock = VirtualClock()
    return VirtualTransport(engine, nodes, clock, TimingConfig(count_bytes="payload", **timing)), clock


def test_finish_is_dispatch_plus_bytes_over_bandwidth_plus_compute_plus_rtt():
    tr, clock = transport(FakeEngine(), {7: NodeProfile(0, LINK, DEV)})
    clock.advance_to(10.0)
    tr.send(task(1, 7, 10.0), b"m" * 8000)
    [ev] = tr.poll(100.0)
    # 10 dispatch + 0.5 rtt + 8000/4000 down + (1 + 100 * 0.01) compute + 3000/1000 up
    assert clock.now() == pytest.approx(10 + 0.5 + 2 + 2 + 3)
    assert isinstance(ev, ReplyEvent) and ev.task_id == 1
    assert clock.now() == pytest.approx(finish_time(10, LINK, DEV, down_bytes=8000, up_bytes=3000, samples=100))
    st = tr.stats[7]
    assert (st.payload_down, st.payload_up, st.delivered) == (8000, 3000, 1)
    assert (st.wire_down, st.wire_up) == (0, 0)  # no wire model without count_bytes="wire"


def test_flower_bytes_are_counted_when_asked():
    clock = VirtualClock()
    tr = VirtualTransport(
        FakeEngine(flower_bytes=9000), {7: NodeProfile(0, LINK, DEV)}, clock, TimingConfig(count_bytes="flower")
    )
    tr.send(task(1, 7), b"m" * 8000)
    tr.poll(100.0)
    assert clock.now() == pytest.approx(0.5 + 9000 / 4000 + 2 + 3)


def test_poll_waits_in_virtual_time_and_releases_in_finish_order():
    slow = LinkProfile("slow", up_Bps=100.0, down_Bps=100.0, rtt_s=1.0)
    tr, clock = transport(FakeEngine(up_bytes=100), {1: NodeProfile(0, slow, DEV), 2: NodeProfile(1, LINK, DEV)})
    tr.send(task(1, 1), b"m" * 100)  # 1 + 1 + 2 + 1 = 5 s
    tr.send(task(2, 2), b"m" * 100)  # 0.5 + 0.025 + 2 + 0.1 = 2.625 s
    assert tr.poll(1.0) == [] and clock.now() == pytest.approx(1.0)
    first = tr.poll(10.0)
    assert [e.task_id for e in first] == [2] and clock.now() == pytest.approx(2.625)
    second = tr.poll(10.0)
    assert [e.task_id for e in second] == [1] and clock.now() == pytest.approx(5.0)
    assert tr.poll(3.0) == [] and clock.now() == pytest.approx(8.0)


def test_ties_go_by_task_id():
    tr, clock = transport(FakeEngine(), {1: NodeProfile(0, LINK, DEV), 2: NodeProfile(1, LINK, DEV)})
    tr.send(task(5, 2), b"m")
    tr.send(task(4, 1), b"m")
    assert [tr.poll(100)[0].task_id, tr.poll(100)[0].task_id] == [4, 5]


def test_a_busy_node_computes_one_task_at_a_time():
    tr, clock = transport(FakeEngine(up_bytes=0, samples=0), {1: NodeProfile(0, LINK, DEV)})
    tr.send(task(1, 1), b"")
    tr.send(task(2, 1), b"")  # arrives at 0.25 but the device is busy until 1.25
    assert [tr.poll(100)[0].task_id for _ in range(2)] == [1, 2]
    assert clock.now() == pytest.approx(0.25 + 1.0 + 1.0 + 0.25)


def test_lost_tasks_are_never_run_or_delivered():
    lossy = LINK.with_options(loss=0.99)
    engine = FakeEngine()
    tr, clock = transport(engine, {1: NodeProfile(0, lossy, DEV)})
    for i in range(1, 21):
        tr.send(task(i, 1, clock.now()), b"m" * 10)
    assert tr.poll(1e6) == []
    st = tr.stats[1]
    assert st.lost_down + st.lost_up == 20 and st.delivered == 0
    assert len(engine.ran) == st.lost_up  # a task lost on the downlink never reaches the ClientApp


def test_disconnect_becomes_a_lost_failure_after_detection_and_the_node_stays_away():
    flaky = LINK.with_options(disconnect=0.999)
    tr, clock = transport(FakeEngine(), {1: NodeProfile(0, flaky, DEV)}, detect_s=60.0, rejoin_s=300.0)
    tr.send(task(1, 1), b"m" * 8000)
    [ev] = tr.poll(1e6)
    assert isinstance(ev, FailureEvent) and ev.outcome is Outcome.LOST and "NODE_UNAVAILABLE" in ev.reason
    gone = clock.now() - 60.0
    assert 0 <= gone <= 7.5
    assert tr.clients() == []
    tr.poll(1e6)  # wakes up when the node is back
    assert clock.now() == pytest.approx(gone + 300.0) and tr.clients() == [1]


def test_availability_window_closes_clients_and_wakes_the_loop():
    avail = Availability(period_s=100.0, online_s=50.0)
    tr, clock = transport(FakeEngine(), {1: NodeProfile(0, LINK, DEV, avail), 2: NodeProfile(1, LINK, DEV)})
    assert tr.clients() == [1, 2]
    assert tr.poll(1000.0) == [] and clock.now() == pytest.approx(50.0)  # next availability change
    assert tr.clients() == [2]
    with pytest.raises(OSError):
        tr.send(task(1, 1, 50.0), b"m")
    tr.poll(1000.0)
    assert clock.now() == pytest.approx(100.0) and tr.clients() == [1, 2]
    # a task that runs past the window's end is lost with the node
    clock.advance_to(148.0)
    tr.send(task(2, 1, 148.0), b"m" * 8000)
    assert tr.poll(1e6) == [] and clock.now() == pytest.approx(150.0)  # the window closes: the loop wakes
    assert tr.poll(1e6) == [] and clock.now() == pytest.approx(200.0)  # and when it opens again
    [ev] = tr.poll(1e6)
    assert isinstance(ev, FailureEvent) and clock.now() == pytest.approx(150.0 + 60.0)


def test_availability_arithmetic():
    a = Availability(period_s=10.0, online_s=4.0, phase_s=1.0)
    assert [a.online(t) for t in (0, 2.9, 3.0, 8.9, 9.0)] == [True, True, False, False, True]
    assert a.next_change(0.0) == pytest.approx(3.0) and a.next_change(3.0) == pytest.approx(9.0)
    assert a.offline_at(0.0, 2.0) is None and a.offline_at(0.0, 5.0) == pytest.approx(3.0)
    assert Availability().next_change(5.0) == math.inf
    with pytest.raises(ValueError):
        Availability(period_s=10.0, online_s=0.0)


def test_clock_never_goes_back():
    c = VirtualClock(5.0)
    with pytest.raises(ValueError):
        c.advance_to(4.0)


def test_same_seed_same_fates_different_seed_different():
    lossy = LINK.with_options(loss=0.3, disconnect=0.1)

    def fates(seed: int) -> list[tuple[int, int, int]]:
        tr, clock = transport(FakeEngine(), {1: NodeProfile(0, lossy, DEV)}, seed=seed, rejoin_s=0.0)
        for i in range(1, 200):
            tr.send(task(i, 1, clock.now()), b"m")
        out = []
        while ev := tr.poll(1e7):
            out.append((ev[0].task_id, isinstance(ev[0], ReplyEvent), round(clock.now(), 9)))
        return out

    assert fates(3) == fates(3)
    assert fates(3) != fates(4)


def test_a_task_lost_on_its_way_down_counts_its_flower_message_and_never_runs():
    """Every task message crosses the link, delivered or lost: its payload and its Flower object bytes are
    counted alike (the lost one's measured by the engine without running it), so Flower object bytes are never
    fewer than payload bytes."""

    class Measured(FakeEngine):
        def measure(self, task, model):
            return SendReceipt(len(model) + 500, 3)

    engine = Measured(flower_bytes=8500)
    lossy = LinkProfile("lossy", up_Bps=1000.0, down_Bps=4000.0, rtt_s=0.5, loss=0.6)
    tr, clock = transport(engine, {7: NodeProfile(0, lossy, DEV)})
    for tid in range(1, 41):
        tr.send(task(tid, 7, clock.now()), b"m" * 8000)
        tr.poll(100.0)
    st = tr.stats[7]
    assert st.lost_down > 0 and len(engine.ran) == 40 - st.lost_down
    assert st.payload_down == 40 * 8000 and st.flower_down == 40 * 8500

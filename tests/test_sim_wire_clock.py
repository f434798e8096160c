"""The virtual clock with Flower's transport on it (``count_bytes="wire"``, ``fedcomp.sim.virtual``): wire bytes per
message, the app bundle once per node, idle polls, the poll wait before a task, one link round trip per request,
the SuperNode's reply check, and the per-task time split, over a fake engine (no Flower)."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fedcomp.protocol import ReplyMeta, Task
from fedcomp.server.loops import ReplyEvent, SendReceipt
from fedcomp.sim.links import Availability, DeviceProfile, LinkProfile
from fedcomp.sim.virtual import PHI, Engine, NodeProfile, TimingConfig, VirtualClock, VirtualTransport, server_seen
from fedcomp.sim.wirecost import FLOWER_1_41

LINK = LinkProfile("x", up_Bps=1000.0, down_Bps=4000.0, rtt_s=0.5)
DEV = DeviceProfile("d", s_per_sample=0.01, startup_s=1.0)
#: Flower 1.41's request costs; round numbers for polls (3 s, 30 B up / 6 B down, no heartbeats) and the bundle
WIRE = replace(FLOWER_1_41, poll_up=30, poll_down=6, poll_interval_s=3.0, heartbeat_up=0, heartbeat_down=0,
               bundle_up=0, bundle_down=4000)


class Engine1(Engine):
    """Replies at once: a task message of ``task_flower`` bytes in 1 object, a reply of ``reply_flower`` bytes in
    1 object, ``samples`` examples."""

    def __init__(self, task_flower: int = 8000, reply_flower: int = 3000, samples: int = 100) -> None:
        self.task_flower, self.reply_flower, self.samples = task_flower, reply_flower, samples
        self.done: dict[int, ReplyEvent] = {}

    def submit(self, task: Task, model: bytes) -> SendReceipt:
        meta = ReplyMeta(task.task_id, task.task_id, self.samples)
        blob = b"u" * (self.reply_flower // 2)
        self.done[task.task_id] = ReplyEvent(task.task_id, task.client, blob, meta, flower_bytes=self.reply_flower,
                                             flower_objects=1)
        return SendReceipt(self.task_flower, 1)

    def gather(self, task_ids):
        return [self.done.pop(t) for t in task_ids]


def transport(engine: Engine, nodes: dict[int, NodeProfile], **timing) -> tuple[VirtualTransport, VirtualClock]:
    clock = VirtualClock()
    timing.setdefault("read_phase", "half")  # exact timelines below (tests/test_sim_latency.py: the random phase)
    return VirtualTransport(engine, nodes, clock, TimingConfig(wire=WIRE, **timing)), clock


def task(tid: int, client: int, t: float = 0.0) -> Task:
    return Task(tid, client, 0, t, t + 1000.0)


def test_first_task_time_is_poll_round_trips_bundle_bytes_compute_reply_check_and_push():
    tr, clock = transport(Engine1(samples=110), {7: NodeProfile(0, LINK, DEV)})  # node 0 polls at 0, 3, 6, ...
    tr.send(task(1, 7), b"m" * 4000)
    [ev] = tr.poll(100.0)
    t_up, t_down = WIRE.task(8000, 1)
    r_up, r_down = WIRE.reply(3000, 1)
    assert t_down > 8000 and r_up > 3000  # protocol bytes on top of the Flower object bytes
    # one round trip per fixed request and per two objects; the bundle comes with the first task
    fetch = WIRE.task_trips(1) * 0.5 + (t_down + 4000) / 4000 + t_up / 1000
    # then the SuperExec's poll (0.1 s), the warm process start (0.16 s), the worker's start (2.4 s: the node's
    # first task) and the compute (2.1 s): 4.76 s; the SuperNode sees the reply at its next 0.5 s check after the
    # fetch (5 s) and pushes it: the reply is visible on the SuperLink one round trip later, its objects are all
    # up at the push finish
    cfg = TimingConfig()
    assert (cfg.process_start_s, cfg.first_task_s) == (0.16, 2.4)
    on_node = cfg.superexec_wait_s + cfg.process_start_s + cfg.first_task_s + 1.0 + 110 * 0.01
    pushed = fetch + 0.5 * math.ceil(on_node / 0.5)
    visible = pushed + 0.5
    finish = pushed + WIRE.reply_trips(1) * 0.5 + r_up / 1000 + r_down / 4000
    # the server reads it half a pull interval after it is visible (0.125 s), too early for a 5.9 s upload: it
    # backs off 1, 2, 4 s and holds the reply at the first read at or after the finish
    assert visible + 0.125 + 1 + 2 < finish <= visible + 0.125 + 1 + 2 + 4
    assert clock.now() == pytest.approx(visible + 0.125 + 1 + 2 + 4)
    assert clock.now() == pytest.approx(server_seen(visible, finish, cfg.server_pull_s))
    assert tr.stats[7].server_wait_s == pytest.approx(clock.now() - finish)
    assert tr.stats[7].reply_check_s == pytest.approx(0.5 * math.ceil(on_node / 0.5) - on_node)
    assert (tr.stats[7].superexec_wait_s, tr.stats[7].process_start_s) == pytest.approx((0.1, 0.16 + 2.4))
    st_ = tr.stats[7]
    assert (st_.wire_down, st_.wire_up) == (t_down + 4000 + r_down, t_up + r_up)
    assert (st_.flower_down, st_.flower_up, st_.payload_down, st_.payload_up) == (8000, 3000, 4000, 1500)
    assert st_.bundle_down == 4000


def test_the_next_task_waits_for_the_nodes_next_poll_and_the_bundle_is_fetched_once():
    tr, clock = transport(Engine1(), {7: NodeProfile(0, LINK, DEV)}, worker_start_s=0.0)
    tr.send(task(1, 7), b"m")
    tr.poll(100.0)
    f1 = clock.now()
    # the server sees the reply at its first read at or after the node's push finished: visible one round trip
    # after the push starts, its objects up one more round trip and the transfer later
    r_up, r_down = WIRE.reply(3000, 1)
    upload = (WIRE.reply_trips(1) - 1) * 0.5 + r_up / 1000 + r_down / 4000
    wait = server_seen(0.0, upload, TimingConfig().server_pull_s) - upload
    assert 0 < wait < 3.0 and tr.stats[7].server_wait_s == pytest.approx(wait)
    finished = f1 - wait
    # the pull right after the push came too early for task 2: the node polls again at finished + 3, + 6, ...
    tr.send(task(2, 7, f1), b"m")
    tr.poll(100.0)
    pickup = finished + 3.0 * math.ceil(wait / 3.0)
    second = clock.now() - pickup
    first_without_bundle = f1 - 4000 / 4000
    assert second == pytest.approx(first_without_bundle)
    assert tr.stats[7].bundle_down == 4000
    assert tr.stats[7].poll_wait_s == pytest.approx(pickup - f1)


def test_nodes_poll_on_their_own_phase_before_their_first_task():
    nodes = {1: NodeProfile(0, LINK, DEV), 2: NodeProfile(1, LINK, DEV), 3: NodeProfile(2, LINK, DEV)}
    tr, clock = transport(Engine1(), nodes)
    clock.advance_to(1.0)
    for nid in nodes:
        tr.send(task(nid, nid, 1.0), b"m")
    waits = {}
    while evs := tr.poll(100.0):
        waits[evs[0].client] = tr.stats[evs[0].client].poll_wait_s
    for nid, prof in nodes.items():
        phase = 3.0 * ((prof.index * PHI) % 1.0)
        assert waits[nid] == pytest.approx((phase - 1.0) % 3.0)


def test_the_split_adds_up_to_the_tasks_time():
    tr, clock = transport(Engine1(), {7: NodeProfile(0, LINK, DEV)})
    clock.advance_to(0.7)
    tr.send(task(1, 7, 0.7), b"m")
    tr.poll(100.0)
    s = tr.stats[7]
    parts = s.poll_wait_s + s.round_trip_s + s.transfer_s + s.compute_s + s.reply_check_s + s.queue_s
    parts += s.superexec_wait_s + s.process_start_s + s.server_wait_s
    assert parts == pytest.approx(clock.now() - 0.7)
    assert s.round_trip_s == pytest.approx((WIRE.task_trips(1) + WIRE.reply_trips(1)) * 0.5)
    assert s.compute_s == pytest.approx(2.0)
    assert s.in_task_s == pytest.approx(clock.now() - 0.7 - s.poll_wait_s - s.server_wait_s)


def test_idle_polls_are_wire_bytes_for_the_time_a_node_is_connected_and_idle():
    avail = Availability(period_s=100.0, online_s=50.0)
    tr, clock = transport(Engine1(), {1: NodeProfile(0, LINK, DEV), 2: NodeProfile(1, LINK, DEV, avail)})
    tr.poll(300.0)
    clock.advance_to(300.0)
    assert tr.idle_wire(1) == (3000, 600)  # 100 polls
    assert tr.idle_wire(2) == (1500, 300)  # online half the time
    tot = tr.totals()
    assert tot["wire_bytes_up"] == 4500 and tot["wire_bytes_total"] == 4500 + 900


def test_payload_and_flower_modes_keep_no_transport_model():
    clock = VirtualClock()
    tr = VirtualTransport(Engine1(), {7: NodeProfile(0, LINK, DEV)}, clock, TimingConfig(count_bytes="flower"))
    tr.send(task(1, 7), b"m")
    tr.poll(100.0)
    assert clock.now() == pytest.approx(0.5 + 8000 / 4000 + 2.0 + 3000 / 1000)
    assert tr.totals()["wire_bytes_total"] == 0 and tr.idle_wire(7) == (0, 0)


@settings(max_examples=40, deadline=None)
@given(small=st.integers(1, 50_000), extra=st.integers(1, 5_000_000), rtt=st.floats(0.0, 1.0),
       bw=st.floats(1e3, 1e8))
def test_more_bytes_never_finish_sooner_and_always_cost_more_wire(small, extra, rtt, bw):
    link = LinkProfile("l", up_Bps=bw, down_Bps=bw, rtt_s=rtt)

    def run(size: int) -> tuple[float, int]:
        tr, clock = transport(Engine1(task_flower=size, reply_flower=size), {1: NodeProfile(0, link, DEV)})
        tr.send(task(1, 1), b"m")
        tr.poll(1e9)
        # the wire bytes up to the push finish: the idle polls after it (while the server's read backs off, longer
        # or shorter with the reply's size) are not the message's
        finish = clock.now() - tr.stats[1].server_wait_s
        return clock.now(), tr.totals(now=finish)["wire_bytes_total"]

    (t_small, w_small), (t_big, w_big) = run(small), run(small + extra)
    assert t_big >= t_small and w_big - w_small == 2 * extra


def test_flower_1_41_is_the_default_wire_model():
    assert TimingConfig().wire is FLOWER_1_41 and TimingConfig().count_bytes == "wire"

"""What the virtual clock charges a client besides training and the link: its downlink decode and its update's
compress + encode (``fedcomp.sim.codeccost``, scaled by the device), a warm node's worker start on its first task,
objects moved two at a time, and the main job's ``fedbuff-today`` at Flower's defaults. A fake engine, no Flower.
"""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fedcomp.protocol import ReplyMeta, Task
from fedcomp.registry import ConfigError
from fedcomp.server.loops import COMPUTE_METRIC, ReplyEvent, SendReceipt
from fedcomp.sim.codeccost import NO_CODEC, CodecCost, codec_cost, load_table
from fedcomp.sim.links import DeviceProfile, LinkProfile
from fedcomp.sim.virtual import (
    FLOWER_SUPEREXEC_POLL_S,
    Engine,
    NodeProfile,
    TimingConfig,
    VirtualClock,
    VirtualTransport,
)
from fedcomp.sim.wirecost import FLOWER_1_41
from simulations import scenario as scenarios
from simulations.runner import split_summary

LINK = LinkProfile("x", up_Bps=1000.0, down_Bps=4000.0, rtt_s=0.5)
DEV = DeviceProfile("d", s_per_sample=0.01, startup_s=1.0)
#: 10 ms per sample on the calibration CPU: ``DEV`` runs at its speed, a device of 0.04 s/sample 4x slower
COST = CodecCost(train_s_per_sample=0.01, uplink=((0.01, 0.2), (0.1, 0.4), (0.3, 0.9)), downlink_s=0.3)


class Objects(Engine):
    """Replies at once: a task of ``task_objects`` Flower objects, a reply of ``reply_objects``, 100 samples."""

    def __init__(self, task_objects: int = 1, reply_objects: int = 1) -> None:
        self.task_objects, self.reply_objects = task_objects, reply_objects
        self.done: dict[int, ReplyEvent] = {}

    def submit(self, task: Task, model: bytes) -> SendReceipt:
        meta = ReplyMeta(task.task_id, task.task_id, 100)
        self.done[task.task_id] = ReplyEvent(task.task_id, task.client, b"u" * 1000, meta, flower_bytes=2000,
                                             flower_objects=self.reply_objects)
        return SendReceipt(4000, self.task_objects)

    def gather(self, task_ids):
        return [self.done.pop(t) for t in task_ids]


def run_tasks(n: int = 1, engine: Engine | None = None, device: DeviceProfile = DEV, density: float = 0.0,
              **timing) -> tuple[VirtualTransport, list[ReplyEvent], list[float]]:
    """``n`` tasks one after another on one node; the replies and each task's dispatch -> seen time."""
    clock = VirtualClock()
    timing.setdefault("read_phase", "half")
    tr = VirtualTransport(engine or Objects(), {7: NodeProfile(0, LINK, device)}, clock, TimingConfig(**timing))
    events, spans = [], []
    for tid in range(1, n + 1):
        t0 = clock.now()
        tr.send(Task(tid, 7, 0, t0, t0 + 1e4, density=density), b"m")
        [ev] = tr.poll(1e6)
        events.append(ev)
        spans.append(clock.now() - t0)
    return tr, events, spans


# ---- the codec charge ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("count_bytes", ["wire", "payload"])
def test_each_task_pays_its_decode_and_its_compress_at_the_configured_density(count_bytes):
    tr, events, _ = run_tasks(3, codec=COST, codec_density=0.1, count_bytes=count_bytes)
    bare, bare_events, _ = run_tasks(3, count_bytes=count_bytes)
    per_task = 0.3 + 0.4  # decode + compress at 10%, DEV at the calibration CPU's speed
    assert tr.stats[7].codec_s == pytest.approx(3 * per_task)
    assert bare.stats[7].codec_s == 0.0
    # the client's reported compute seconds (train-seconds) hold it, as a deployment's do
    for ev, plain in zip(events, bare_events, strict=True):
        assert ev.metrics[COMPUTE_METRIC] == pytest.approx(plain.metrics[COMPUTE_METRIC] + per_task)
    assert tr.stats[7].busy_s == pytest.approx(bare.stats[7].busy_s + 3 * per_task)


def test_the_codec_lengthens_the_task_and_the_split_still_adds_up():
    # no reply check or server read quantisation: the span difference is the charge itself
    flat = dict(count_bytes="payload")
    tr, _, spans = run_tasks(1, codec=COST, codec_density=0.01, **flat)
    _, _, bare = run_tasks(1, **flat)
    assert spans[0] - bare[0] == pytest.approx(0.3 + 0.2)
    wire, _, wspans = run_tasks(2, codec=COST, codec_density=0.01)
    s = wire.stats[7]
    parts = ("poll_wait_s", "round_trip_s", "transfer_s", "superexec_wait_s", "process_start_s", "compute_s",
             "codec_s", "queue_s", "reply_check_s", "server_wait_s")
    assert sum(getattr(s, p) for p in parts) == pytest.approx(sum(wspans))
    assert split_summary([s])["task_codec_s"] == pytest.approx(0.5)


def test_the_tasks_own_density_wins_over_the_configured_one():
    tr, _, _ = run_tasks(1, codec=COST, codec_density=0.01, density=0.3)
    assert tr.stats[7].codec_s == pytest.approx(0.3 + 0.9)


def test_a_slower_device_pays_the_codec_in_proportion_like_training():
    phone = DeviceProfile("p", s_per_sample=0.04, startup_s=1.0)
    fast, _, _ = run_tasks(1, codec=COST, codec_density=0.01)
    slow, _, _ = run_tasks(1, device=phone, codec=COST, codec_density=0.01)
    assert slow.stats[7].codec_s == pytest.approx(4 * fast.stats[7].codec_s) and fast.stats[7].codec_s > 0


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.floats(0.0, 1.0), st.floats(0.0, 10.0)), min_size=1, max_size=6,
                unique_by=lambda p: p[0]),
       st.floats(0.0, 1.0), st.floats(1e-6, 1.0), st.floats(1e-6, 1.0))
def test_uplink_seconds_lie_between_the_measured_points_and_scale_linearly(points, d, ref, dev):
    cost = CodecCost(ref, tuple(points), 0.5)
    s = cost.uplink_s(d)
    ys = [y for _, y in points]
    assert min(ys) - 1e-9 <= s <= max(ys) + 1e-9
    for x, y in points:  # a measured point is given back (to the nanosecond: seconds are rounded to 9 places)
        assert cost.uplink_s(x) == pytest.approx(y, abs=1e-9)
    xs, ys_sorted = zip(*sorted(points), strict=True)  # between points: the straight line; outside: the end point
    assert s == pytest.approx(float(np.interp(d, xs, ys_sorted)), abs=1e-9)
    scaled = cost.scaled(dev)
    assert scaled.uplink_s(d) == pytest.approx(s * dev / ref, rel=1e-6, abs=1e-9 * (1 + dev / ref))
    assert scaled.downlink_s == pytest.approx(0.5 * dev / ref)


def test_a_missing_calibration_is_none_not_zero():
    table = {"models": {"m": {"train_s_per_sample": 1e-3, "uplink": {"identity": {"0": 0.01}},
                              "downlink": {"dense": 0.001}}}}
    assert codec_cost("m", "identity", "dense", table) == CodecCost(1e-3, ((0.0, 0.01),), 0.001)
    assert codec_cost("m", "dgc", "dense", table) is None
    assert codec_cost("m", "identity", "int8", table) is None
    assert codec_cost("other", "identity", "dense", table) is None
    assert not NO_CODEC.charged


def test_a_model_built_wider_by_its_options_is_charged_its_own_calibration():
    """The 1.13M-parameter ``mlp`` (``hidden=1024,1024``) compresses 1.1M values, not the default mlp's 9,610: it
    has an entry of its own, and the options pick it (they once fell back to the 9,610-parameter figures)."""
    wide = codec_cost("mlp", "dgc+int8", "dense", options="hidden=1024,1024")
    small = codec_cost("mlp", "dgc+int8", "dense")
    assert wide is not None and small is not None
    assert wide.uplink_s(0.02) > 5 * small.uplink_s(0.02) and wide.train_s_per_sample > 5 * small.train_s_per_sample
    assert codec_cost("cnn1d", "dgc+int8", "dense", options="norm=group") == codec_cost("cnn1d", "dgc+int8", "dense")


# ---- the main job: every method calibrated, compression costs more than dense on every link ----------------------


@pytest.mark.parametrize("scenario", ["main", "mnist1d"])
def test_every_method_is_calibrated_and_compressing_costs_more_than_dense_on_every_device(scenario):
    sc = scenarios.load(scenario)
    dense = sc.method("fedbuff")
    assert dense.run.compressor == "identity" and dense.run.downlink == "dense"
    for m in sc.methods:
        assert m.codec is not None, m.name
        assert sc.timing(m).codec == m.codec
    for prof in sc.node_profiles():
        base = dense.codec.scaled(prof.device.s_per_sample)
        base_s = base.downlink_s + base.uplink_s(dense.codec_density)
        assert base_s > 0
        for m in sc.methods:
            if m.run.compressor == "identity" and m.run.downlink == "dense":
                continue
            c = m.codec.scaled(prof.device.s_per_sample)
            # auto-async: the cheapest density of its ladder
            d = min(0.01, m.codec_density) if "auto" in m.run.compressor_options else m.codec_density
            assert c.downlink_s + c.uplink_s(d) > base_s, (m.name, prof.link.name)


def test_the_table_is_a_measurement_of_this_repository_s_models():
    table = load_table()
    for model in ("mlp", "resnet-1m", "cnn1d"):
        e = table["models"][model]
        assert e["train_s_per_sample"] > 0 and e["numel"] > 0
        assert all(s > 0 for pts in e["uplink"].values() for s in pts.values())
        assert all(s > 0 for s in e["downlink"].values())


def test_codec_off_charges_nothing():
    sc = scenarios.load("main", ["sim.codec=off"])
    assert all(not sc.timing(m).codec.charged for m in sc.methods)
    with pytest.raises(ConfigError, match="sim.codec"):
        scenarios.load("main", ["sim.codec=maybe"])


# ---- the worker start, objects two at a time, Flower's defaults ---------------------------------------------------


def test_a_warm_node_pays_the_worker_start_on_its_first_task_only():
    warm, _, _ = run_tasks(3, worker="warm")
    cfg = TimingConfig(worker="warm")
    assert cfg.first_task_s == 2.4
    assert warm.stats[7].process_start_s == pytest.approx(3 * cfg.process_start_s + 2.4)
    cold, _, _ = run_tasks(3, worker="cold")
    assert cold.stats[7].process_start_s == pytest.approx(3 * TimingConfig(worker="cold").process_start_s)
    assert TimingConfig(worker="cold").first_task_s == 0.0
    free, _, _ = run_tasks(3, worker="warm", worker_start_s=0.0)
    assert free.stats[7].process_start_s == pytest.approx(3 * cfg.process_start_s)


def test_objects_move_two_at_a_time():
    assert [FLOWER_1_41.task_trips(k) for k in (0, 1, 2, 3, 4, 5)] == [2, 3, 3, 4, 4, 5]
    assert [FLOWER_1_41.reply_trips(k) for k in (1, 2, 3)] == [2, 2, 3]
    tr, _, _ = run_tasks(1, engine=Objects(task_objects=5, reply_objects=3))
    # 2 fixed + ceil(5/2) to fetch, 1 fixed + ceil(3/2) to push: 9 round trips, not the 11 requests
    assert tr.stats[7].round_trip_s == pytest.approx((5 + 3) * LINK.rtt_s)
    one, _, _ = run_tasks(1, engine=Objects(5, 3), wire=replace(FLOWER_1_41, object_streams=1))
    assert one.stats[7].round_trip_s == pytest.approx((7 + 4) * LINK.rtt_s)
    with pytest.raises(ValueError, match="object_streams"):
        replace(FLOWER_1_41, object_streams=0)


def test_fedbuff_today_runs_at_flowers_defaults_and_the_others_at_the_launchers():
    sc = scenarios.load("main")
    today = sc.timing(sc.method("fedbuff-today"))
    assert today.worker == "cold" and today.superexec_poll_s == FLOWER_SUPEREXEC_POLL_S == 1.0
    assert today.superexec_wait_s == 0.5 and today.first_task_s == 0.0
    for name in ("fedbuff", "dgc-async", "auto-async"):
        t = sc.timing(sc.method(name))
        assert t.worker == "warm" and t.superexec_poll_s == 0.2 and t.first_task_s == 2.4


def test_a_methods_superexec_poll_is_checked():
    with pytest.raises(ConfigError, match="superexec_poll_s"):
        scenarios.load("main", ["method.fedbuff.superexec_poll_s=-1"])
    sc = scenarios.load("main", ["method.fedbuff.superexec_poll_s=2.5"])
    assert sc.timing(sc.method("fedbuff")).superexec_wait_s == 1.25
    assert not math.isclose(sc.timing(sc.method("fedavg")).superexec_wait_s, 1.25)

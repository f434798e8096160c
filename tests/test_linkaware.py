"""density="auto": the server learns each node's link from its own tasks and gives slow links sparser updates."""

from __future__ import annotations

import math
import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fedcomp.client.pipeline import build
from fedcomp.flower import records
from fedcomp.registry import ConfigError
from fedcomp.server.linkaware import AutoDensity, AutoDensityConfig
from fedcomp.spec import ModelSpec
from fedcomp.task.config import Compression
from simulations import scenario as scenarios
from simulations.backends import run_scenario

N = 1_000_000  # parameters of the synthetic model: about 1.3 B per kept value (int8 + index)


def reply_bytes(density: float) -> int:
    return int(N * density * 1.3) + 200


def drive(auto: AutoDensity, client: int, up_Bps: float, latency_s: float, tasks: int, seed: int = 0) -> list[float]:
    """``tasks`` tasks of one node on a link (``latency_s`` + bytes / ``up_Bps``, a random poll wait up to 1 s):
    the densities the policy chose."""
    rng, now, chosen = random.Random(seed), 0.0, []
    for task_id in range(tasks):
        d = auto.choose(client)
        chosen.append(d)
        auto.dispatched(1000 * client + task_id, client, now, d, down_bytes=20_000)
        up = reply_bytes(d)
        took = latency_s + rng.uniform(0, 1.0) + 1.0 + (up + 20_000) / up_Bps
        now += took
        auto.replied(1000 * client + task_id, now, up, compute_s=1.0)
    return chosen


def test_probes_first_then_a_fast_link_goes_dense_and_a_slow_one_sparse():
    auto = AutoDensity(AutoDensityConfig(upload_budget=0.5, ladder=(1.0, 0.3, 0.1, 0.03, 0.01), probe=(0.3, 0.1)))
    fast = drive(auto, 1, up_Bps=30e6 / 8, latency_s=3.0, tasks=8)
    slow = drive(auto, 2, up_Bps=0.75e6 / 8, latency_s=3.0, tasks=8)
    assert fast[:2] == [0.3, 0.1] and slow[:2] == [0.3, 0.1]
    # slow: 0.75 Mbit/s; at 10% a 130 kB reply takes 1.4 s, within half of ~4.5 s (latency + poll + compute);
    # at 30% it would take 4.2 s
    assert fast[-1] == 1.0 and slow[2:] == [0.1] * 6, (fast, slow)
    s = auto.summary()
    # 30 Mbit/s: the upload's 0.1-0.3 s vanish in the poll's 1 s of noise, so no slope is claimed (and the
    # densest is right); 0.75 Mbit/s: the bytes explain the time
    assert s[1]["up_mbps"] is None and s[2]["up_mbps"] == pytest.approx(0.75, rel=0.5), s


@settings(max_examples=40, deadline=None)
@given(st.floats(0.05, 100.0), st.floats(0.1, 5.0), st.floats(0.1, 2.0))
def test_the_choice_is_the_densest_that_fits_the_budget(mbps, latency, budget):
    auto = AutoDensity(AutoDensityConfig(upload_budget=budget))
    drive(auto, 5, up_Bps=mbps * 1e6 / 8, latency_s=latency, tasks=10, seed=1)
    d = auto.choose(5)
    fit = auto.links[5].fit()
    if fit is None:  # the bytes explain none of the time: nothing to save by sending less
        assert d == auto.config.ladder[0]
        return
    latency_fit, s_per_byte = fit
    base = latency_fit + auto.links[5].compute_s
    fits = [x for x in auto.config.ladder if s_per_byte * auto.bytes_at(x) <= budget * base]
    assert d == (max(fits) if fits else min(auto.config.ladder))


def test_failed_and_unknown_tasks_teach_nothing():
    auto = AutoDensity()
    d = auto.choose(3)
    auto.dispatched(1, 3, 0.0, d, 1000)
    auto.failed(1)
    auto.replied(1, 50.0, 10, 1.0)  # late reply of a failed task
    auto.replied(99, 50.0, 10, float("nan"))  # never dispatched
    assert auto.links[3].replies == 0 and auto.choose(3) == auto.config.probe[0]


@pytest.mark.parametrize("compute", [float("nan"), float("inf"), -5.0, 1e300])
def test_a_hostile_compute_metric_is_harmless(compute):
    """A client reporting nonsense compute seconds cannot crash the server or poison the fit with non-finite
    numbers: the figure is read as 0 (not finite, negative) or clamps its communication time to 0."""
    auto = AutoDensity(AutoDensityConfig(probe=(0.3, 0.1)))
    for task_id, up in enumerate((300_000, 100_000, 300_000)):
        auto.dispatched(task_id, 4, 10.0 * task_id, auto.choose(4), 1000)
        auto.replied(task_id, 10.0 * task_id + 5.0, up, compute)
    link = auto.links[4]
    assert link.replies == 3 and math.isfinite(link.compute_s) and all(math.isfinite(t) for *_, t in link.probes)
    assert auto.choose(4) in auto.config.ladder


def test_probes_of_equal_size_mean_the_density_costs_nothing():
    auto = AutoDensity(AutoDensityConfig(probe=(0.3, 0.1)))
    for task_id in range(2):
        auto.dispatched(task_id, 4, 0.0, auto.choose(4), 0)
        auto.replied(task_id, 5.0, 1000, 1.0)  # a tiny model: every density gives the same reply
    assert auto.choose(4) == auto.config.ladder[0] == 0.3


@pytest.mark.parametrize(
    "kwargs",
    [dict(upload_budget=0), dict(upload_budget=float("inf")), dict(ladder=(0.0, 0.1)), dict(probe=(0.1, 0.1)),
     dict(window=0), dict(ladder=())],
)
def test_bad_policy_configs_are_refused(kwargs):
    with pytest.raises(ConfigError):
        AutoDensityConfig(**kwargs)


def test_compression_density_auto():
    c = Compression("dgc+int8", options="density=auto upload_budget=0.25")
    assert c.auto_density == AutoDensityConfig(upload_budget=0.25)
    spec = ModelSpec((("w", (100, 100)),))
    pipe = c.pipeline(spec)
    assert pipe.compressor.sparsifier.config.density == AutoDensityConfig().probe[0]
    assert Compression("dgc+int8", options="density=0.01").auto_density is None
    with pytest.raises(ConfigError, match="density=auto"):
        Compression("dgc+int8", options="density=0.01 upload_budget=0.5")
    with pytest.raises(ConfigError):
        Compression("int8", options="density=auto")  # nothing to make sparser
    with pytest.raises(ConfigError, match="upload_budget must be a number"):
        Compression("dgc+int8", options="density=auto upload_budget=abc")


def test_set_density_changes_what_is_sent_and_warmup_still_applies():
    spec = ModelSpec((("w", (200, 100)),))
    g = torch.randn(200, 100, generator=torch.Generator().manual_seed(0))
    pipe = build("topk+int8", spec, density=0.01)
    pipe.compressor.set_density(0.2)
    assert pipe.compress({"w": g})["w"].nnz == 4000
    dgc = build("dgc", spec, density=0.01, warmup_epochs=4, memory="residual")
    dgc.compressor.set_density(0.001)
    assert dgc.compressor.density_for("w") == 0.25  # epoch 0: the first warm-up stage
    dgc.set_epoch(10)
    assert dgc.compressor.density_for("w") == 0.001
    with pytest.raises(ValueError):
        pipe.compressor.set_density(1.5)


def test_task_density_travels_and_is_validated():
    from fedcomp.protocol import Task
    from fedcomp.spec import ModelSpec

    fmt = records.TaskFormat({}, records.ArrayLayout.of_spec(ModelSpec((("w", (2,)),))))
    content = fmt.content(Task(5, 1, 2, 0.0, 60.0, density=0.03), b"m")
    assert records.read_mod_task(content).density == 0.03
    assert records.read_mod_task(fmt.content(Task(5, 1, 2, 0.0, 60.0), b"m")).density == 0.0
    content.config_records[records.CONTROL][records.DENSITY] = 7.0
    with pytest.raises(records.RecordError, match="density"):
        records.read_mod_task(content)


@pytest.mark.slow
def test_simulated_auto_gives_the_slow_link_a_sparser_update():
    """The tiny scenario's links with a 1.1M-parameter MLP, learned from virtual timings: the 3G node ends sparser
    than the WiFi one (with the 10k-parameter default every density costs the same and both go dense; with a dense
    4.5 MB model download a 30% upload is a small share of a 3G task, so the model goes down as 10% deltas). 250
    versions: the fast nodes make most of them (a warm node's task is short), and the 3G node's replies reach the
    server late (Flower's read back-off behind its long uploads): 150 versions gave it exactly its two probes."""
    sc = scenarios.load(
        "tiny",
        ["sim.progress=false", "methods=dgc-async", "run.model_options=hidden=1024,1024",
         "method.dgc-async.compressor=dgc+int8", "method.dgc-async.compressor_options=density=auto upload_budget=0.2",
         "method.dgc-async.downlink=delta", "method.dgc-async.downlink_options=compressor=topk+int8 density=0.1",
         "method.dgc-async.num_versions=250", "method.dgc-async.run_timeout=0"],
    )
    (res,) = run_scenario(sc)
    by_link = {n["link"]: n for n in res.nodes}
    # two replies (the probes) give the fit; the density shown is the one chosen with it
    assert by_link["wifi"]["auto_replies"] >= 2 and by_link["flaky3g"]["auto_replies"] >= 2, res.nodes
    assert by_link["flaky3g"]["auto_density"] < by_link["wifi"]["auto_density"], res.nodes
    assert res.summary["versions"] == 250


def test_compressed_refuses_auto_density_with_the_reason():
    from flwr.serverapp.strategy import FedAvg

    from fedcomp.flower import Compressed

    with pytest.raises(ConfigError, match="reply arrives"):
        Compressed(FedAvg(), "dgc+int8", density="auto")

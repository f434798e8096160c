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
from fedcomp.server import linkaware
from fedcomp.server.linkaware import AutoDensity, AutoDensityConfig, LinkEstimate
from fedcomp.spec import ModelSpec
from fedcomp.task.config import Compression
from fedcomp.wire import decode
from simulations import scenario as scenarios
from simulations.backends import run_scenario

N = 1_000_000  # parameters of the synthetic model: about 1.3 B per kept value (int8 + index)


def reply_bytes(density: float) -> int:
    return int(N * density * 1.3) + 200


def drive(auto: AutoDensity, client: int, up_Bps: float, latency_s: float, tasks: int, seed: int = 0,
          start: int = 0, now: float = 0.0, stall: dict[int, float] | None = None) -> list[float]:
    """``tasks`` tasks of one node on a link (``latency_s`` + bytes / ``up_Bps``, a random poll wait up to 1 s, and
    ``stall[i]`` more seconds on task ``i``), task ids from ``start`` and clock from ``now``: the densities the
    policy chose."""
    rng, chosen = random.Random(seed), []
    for task_id in range(start, start + tasks):
        d = auto.choose(client)
        chosen.append(d)
        auto.dispatched(1000 * client + task_id, client, now, d, down_bytes=20_000)
        up = reply_bytes(d)
        took = latency_s + rng.uniform(0, 1.0) + 1.0 + (up + 20_000) / up_Bps + (stall or {}).get(task_id, 0.0)
        now += took
        auto.replied(1000 * client + task_id, now, up, compute_s=1.0)
    return chosen


def test_probes_first_then_a_fast_link_goes_dense_and_a_slow_one_sparse():
    auto = AutoDensity(AutoDensityConfig(upload_budget=0.5, ladder=(1.0, 0.3, 0.1, 0.03, 0.01), probe=(0.3, 0.1)))
    fast = drive(auto, 1, up_Bps=30e6 / 8, latency_s=3.0, tasks=8)
    slow = drive(auto, 2, up_Bps=0.75e6 / 8, latency_s=3.0, tasks=8)
    assert fast[:3] == [0.3, 0.3, 0.1] and slow[:3] == [0.3, 0.3, 0.1]  # the warm-up, then the probes
    # slow: 0.75 Mbit/s; at 10% a 130 kB reply takes 1.4 s, within half of ~4.5 s (latency + poll + compute);
    # at 30% it would take 4.2 s
    assert fast[-1] == 1.0 and slow[3:] == [0.1] * 5, (fast, slow)
    s = auto.summary()
    # 30 Mbit/s: the upload's 0.1-0.3 s vanish in the poll's 1 s of noise, so no slope is claimed (and the
    # densest is right); 0.75 Mbit/s: the bytes explain the time
    assert s[1]["up_mbps"] is None and s[2]["up_mbps"] == pytest.approx(0.75, rel=0.5), s
    # what the node got, task by task, counted per density (densest first)
    assert s[2]["tasks_by_density"] == {"0.3": 2, "0.1": 6}, s
    assert list(s[1]["tasks_by_density"]) == ["1", "0.3", "0.1"] and sum(s[1]["tasks_by_density"].values()) == 8


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
    assert link.replies == 3 and math.isfinite(link.compute_s) and all(math.isfinite(x) for o in link.obs for x in o)
    assert link.obs, "no observation kept"
    # each reply came 5 s after its task started: all of it communication when the figure reads as 0, none of it
    # when the figure is larger than the whole cycle
    read_as_zero = not math.isfinite(compute) or compute < 0
    assert all(o[3] == (5.0 if read_as_zero else 0.0) for o in link.obs), link.obs
    assert (link.compute_s == 0.0) == read_as_zero, link.compute_s
    assert auto.choose(4) in auto.config.ladder


def test_probes_of_equal_size_mean_the_density_costs_nothing():
    auto = AutoDensity(AutoDensityConfig(probe=(0.3, 0.1)))
    for task_id in range(3):  # the warm-up and two probes
        auto.dispatched(task_id, 4, 0.0, auto.choose(4), 0)
        auto.replied(task_id, 5.0, 1000, 1.0)  # a tiny model: every density gives the same reply
    assert auto.choose(4) == auto.config.ladder[0] == 0.3


@pytest.mark.parametrize("cold_s", [6.0, 60.0])
def test_a_cold_start_in_the_first_reply_does_not_hold_a_fast_link_at_the_sparsest(cold_s):
    """A node's first task pays the start of its ClientApp (6-7 s in Flower's in-process simulation, a worker's
    start in a deployment) on a link that then answers in 0.1 s. Fitted as link time, that one reply made the link
    look thousands of times slower, and since the probes stayed in the fit for good the node sent 1% forever."""
    auto = AutoDensity()
    now = 0.0
    for task_id in range(12):
        d = auto.choose(9)
        auto.dispatched(task_id, 9, now, d, down_bytes=20_000)
        now += 0.1 + (cold_s if task_id == 0 else 0.0) + (reply_bytes(d) + 20_000) / 100e6 + 0.05
        auto.replied(task_id, now, reply_bytes(d), compute_s=0.05)
    assert auto.choose(9) != min(auto.config.ladder), auto.summary()
    assert auto.choose(9) == auto.config.ladder[0] and auto.summary()[9]["replies"] == 12


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 20), st.floats(2.0, 120.0))
def test_a_one_off_stall_ages_out_of_the_fit(at, stall_s):
    """A stall in any one reply (a worker restart, a long pause) may move the density for a while, never for
    good: within a window and a re-probe of it a fast link is back at the densest."""
    auto = AutoDensity()
    fast = drive(auto, 3, up_Bps=100e6 / 8, latency_s=0.5, tasks=21 + auto.config.window + 2, stall={at: stall_s})
    assert fast[-1] == auto.config.ladder[0], fast


@pytest.mark.parametrize(("first", "then", "expect"), [(0.2e6, 50e6, "dense"), (50e6, 0.2e6, "sparse")])
def test_the_density_recovers_after_the_link_changes(first, then, expect):
    """The fit holds the last ``window`` replies, probes included: a link that got faster (or slower) is learned
    again, a sparsely settled node re-probes one step denser, and its density follows the link."""
    auto = AutoDensity()
    settled = {"dense": auto.config.ladder[0], "sparse": auto.config.ladder[-1]}
    was = settled["sparse" if expect == "dense" else "dense"]
    before = drive(auto, 6, up_Bps=first / 8, latency_s=1.0, tasks=20)
    assert auto.links[6].settled == was and before[3:].count(was) >= 15, before
    after = drive(auto, 6, up_Bps=then / 8, latency_s=1.0, tasks=40, start=20, now=1e4, seed=1)
    assert auto.links[6].settled == settled[expect] and after[-8:].count(settled[expect]) >= 7, after


def test_a_node_settled_at_one_density_re_probes_the_next_step_one_at_a_time():
    """After a window at one density the fit has lost its second size: one task takes the step next to it (10%
    after 3%, not a 30% probe a slow link would pay for), and a task queued behind that probe keeps the last
    choice."""
    auto = AutoDensity(AutoDensityConfig(window=4))
    link = auto.links.setdefault(2, LinkEstimate())
    link.planned, link.settled = list(auto.config.plan), 0.03  # the plan's tasks all answered long ago
    for _ in range(4):
        link.add((0.03, 40_000.0, 1000.0, 2.0, 1.0), warmup=0, window=4)
    assert link.unidentified()
    assert auto.choose(2) == 0.1 and auto.links[2].probing
    auto.dispatched(1, 2, 0.0, 0.1, 1000)
    assert auto.choose(2) == 0.03 and not auto.links[2].probing  # queued behind the probe
    auto.failed(1)
    assert auto.choose(2) == 0.1  # the probe never answered: another
    top = AutoDensity(AutoDensityConfig(window=2))
    top_link = top.links.setdefault(2, LinkEstimate())
    for _ in range(3):
        top_link.add((0.3, 400_000.0, 1000.0, 2.0, 1.0), warmup=0, window=2)
    top_link.planned = list(top.config.plan)
    assert top.choose(2) == 0.1  # at the top of the ladder: the next sparser step


def test_docstring_examples_hold():
    import doctest

    result = doctest.testmod(linkaware)
    assert result.failed == 0 and result.attempted > 0


def test_the_plan_counts_tasks_dispatched_not_replies():
    """With prefetch a node's next tasks leave before its first reply: the plan is the warm-up, then the 30% and
    10% probes, in dispatch order. Counted by replies, every task before the first reply took the first probe
    density, and the 10% probe came so late that a short run never saw a reply at 10%."""
    auto = AutoDensity(AutoDensityConfig(probe=(0.3, 0.1)))
    chosen = []
    for task_id in range(5):  # five tasks queued before any reply
        chosen.append(auto.choose(1))
        auto.dispatched(task_id, 1, 0.0, chosen[-1], 1000)
    assert chosen[:3] == [0.3, 0.3, 0.1]  # warm-up, probes
    assert chosen[3:] == [0.3, 0.3] and auto.links[1].probes_out == 3  # queued behind the probes: the densest
    for task_id, up in enumerate((300_000, 300_000, 100_000)):
        auto.replied(task_id, 5.0 * (task_id + 1), up, compute_s=1.0)
    assert auto.links[1].densities() == {0.3, 0.1} and auto.links[1].replies == 3  # the warm-up is not fitted


def test_a_task_never_sent_takes_nothing_from_the_plan():
    auto = AutoDensity()
    assert auto.choose(1) == auto.choose(1) == 0.3  # the send failed: no dispatched()
    auto.dispatched(1, 1, 0.0, auto.choose(1), 1000)
    assert auto.choose(1) == 0.3  # the first probe, after the warm-up
    auto.dispatched(2, 1, 0.0, auto.choose(1), 1000)
    assert auto.choose(1) == 0.1


@pytest.mark.parametrize(("lost", "again"), [(0, 0.3), (1, 0.3), (2, 0.1)])
def test_a_failed_planned_task_gives_its_density_to_the_next_task(lost, again):
    """The warm-up (0), the 30% probe (1) or the 10% probe (2) is lost while all three are queued: the node's next
    task takes that density again, then the plan is done."""
    auto = AutoDensity(AutoDensityConfig(probe=(0.3, 0.1)))
    for task_id in range(3):
        auto.dispatched(task_id, 1, 0.0, auto.choose(1), 1000)
    auto.failed(lost)
    assert auto.choose(1) == again and auto.links[1].probing
    auto.dispatched(3, 1, 0.0, again, 1000)
    assert auto.choose(1) == 0.3 and not auto.links[1].probing  # plan done: hold until the probes answer
    for task_id in sorted({0, 1, 2, 3} - {lost}):
        auto.replied(task_id, 5.0 * (task_id + 1), reply_bytes(auto.open[task_id][2]), compute_s=1.0)
    assert auto.links[1].densities() == {0.3, 0.1}


def test_a_probe_whose_reply_was_the_warm_up_is_taken_again_by_a_re_probe():
    """The warm-up and the 30% probe are both lost: the 10% probe answers first and is the warm-up, the 30% tasks
    planned again leave the window with one density, and a re-probe at 10% follows."""
    auto = AutoDensity(AutoDensityConfig(probe=(0.3, 0.1)))
    for task_id in range(3):
        auto.dispatched(task_id, 1, 0.0, auto.choose(1), 1000)
    auto.failed(0)
    auto.failed(1)
    for task_id in (3, 4):
        auto.dispatched(task_id, 1, 0.0, auto.choose(1), 1000)
    assert [auto.open[t][2] for t in (2, 3, 4)] == [0.1, 0.3, 0.3]
    for task_id in (2, 3, 4):
        auto.replied(task_id, 5.0 * task_id, reply_bytes(auto.open[task_id][2]), compute_s=1.0)
    assert auto.links[1].densities() == {0.3} and auto.choose(1) == 0.1 and auto.links[1].probing


@settings(max_examples=300, deadline=None)
@given(st.lists(st.sampled_from(["send", "reply", "fail"]), max_size=40), st.integers(0, 10_000))
def test_every_probe_density_reaches_the_fit_whatever_is_queued_or_lost(events, seed):
    """Any interleaving of dispatches, in-order replies and lost tasks for one node, then a quiet run: the tasks
    dispatched before a planned one was lost follow the plan; the plan's tasks that answered are exactly the plan
    (nothing planned twice, nothing skipped); and the fit's window comes to hold both probe densities."""
    cfg = AutoDensityConfig(probe=(0.3, 0.1))
    auto, rng = AutoDensity(cfg), random.Random(seed)
    link = auto.links.setdefault(1, LinkEstimate())
    queue: list[int] = []  # open tasks, oldest first (a node runs its queue in order)
    sent: list[float] = []
    answered_planned: list[float] = []
    now, lost_planned = 0.0, False

    def step(event: str) -> None:
        nonlocal now, lost_planned
        now += 1.0
        if event == "send" or not queue:
            d = auto.choose(1)
            auto.dispatched(len(sent), 1, now, d, 1000)
            queue.append(len(sent))
            sent.append(d)
            if not lost_planned and len(sent) <= len(cfg.plan):
                assert d == cfg.plan[len(sent) - 1], sent
        elif event == "reply":
            task_id = queue.pop(0)
            _, _, d, _, planned, _ = auto.open[task_id]
            auto.replied(task_id, now, reply_bytes(d), compute_s=0.5)
            answered_planned.extend([d] * planned)
        else:
            task_id = queue.pop(rng.randrange(len(queue)))
            lost_planned = lost_planned or auto.open[task_id][4]
            auto.failed(task_id)

    for event in events:
        step(event)
    for _ in range(200):  # answer what is queued; send while the plan or the window wants more
        if not queue and auto.next_planned(link) is None and not link.unidentified():
            break
        step("reply" if queue else "send")
    assert sorted(answered_planned) == sorted(cfg.plan), (events, sent)
    assert set(cfg.probe) <= link.densities() and link.probes_out == 0, (events, sent)


@pytest.mark.parametrize(
    "kwargs",
    [dict(upload_budget=0), dict(upload_budget=float("inf")), dict(ladder=(0.0, 0.1)), dict(probe=(0.1, 0.1)),
     dict(window=0), dict(window=1), dict(ladder=()), dict(warmup=-1), dict(warmup=True), dict(warmup=0.5)],
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
    for hostile in (7.0, -0.1, float("nan"), float("inf"), True, "0.1", [0.1]):  # what a server could send
        content.config_records[records.CONTROL][records.DENSITY] = hostile
        with pytest.raises(records.RecordError, match="density"):
            records.read_mod_task(content)


def test_the_sparsest_density_a_server_can_send_still_sends_at_once():
    """A density in (0, 1] the client accepts, however small, sends at least one value and cannot stall the send
    (DGC's sampled threshold): a server's choice never hangs a node."""
    spec = ModelSpec((("w", (1000, 100)), ("b", (100,))))
    for density in (5e-324, 1e-12):
        pipe = build("dgc+int8", spec)
        pipe.compressor.set_density(density)
        blob = pipe.send({"w": torch.randn(1000, 100), "b": torch.randn(100)}, base_version=0, client_id=1)
        kept = {n: int((t != 0).sum()) for n, t in decode(blob, spec).to_dense().items()}
        assert kept == {"w": 1, "b": 1}, (density, kept)


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


def test_one_nodes_larger_replies_do_not_move_the_size_expected_at_a_density():
    """The size a density costs is shared by every node: one that replies far larger (denser than its task asked,
    or junk the server rejects) moved the mean for all, and with it an honest node's density. The median of the
    recent replies holds while such a node is the fewer."""
    auto = AutoDensity(AutoDensityConfig(probe=(0.3, 0.1)))
    replies = [(1, 1000), (2, 1100), (3, 10_000_000)] * 3
    for task_id, (client, size) in enumerate(replies):
        auto.dispatched(task_id, client, float(task_id), 0.3, 0)
        auto.replied(task_id, task_id + 1.0, size, 0.0)
    assert auto.bytes_at(0.3) == 1100.0 and auto.bytes_at(0.1) == pytest.approx(1100 / 3)
    assert auto.report()["reply_payload_bytes"] == {"0.3": 1100.0}


def test_a_reply_read_before_the_task_ahead_of_it_teaches_no_timing():
    """A queued task's reply may be read before that of the task ahead of it: timed from the wrong start it showed
    no link time at all (a cycle near 0), and the queued task's predecessor one inflated by it."""
    auto = AutoDensity(AutoDensityConfig(probe=(0.3, 0.1), warmup=0))
    auto.dispatched(1, 4, 0.0, 0.3, 0)
    auto.dispatched(2, 4, 8.0, 0.1, 0)  # queued behind task 1
    auto.replied(2, 20.0, 1000, 5.0, timed=False)  # read first (Ledger.overtakes)
    auto.replied(1, 20.5, 3000, 5.0)
    link = auto.links[4]
    assert [o[0] for o in link.obs] == [0.3], link.obs  # only task 1 is timed (from its dispatch)
    assert sorted(auto.sizes) == [0.1, 0.3]  # both sizes count
    assert auto.last_reply[4] == 20.5


def test_the_loop_feeds_density_auto_no_rejected_reply():
    """A reply the server rejects (oversized junk) fed its size to every node's estimate; it is a failed task for
    the policy now."""
    from flwr.app import ConfigRecord, MetricRecord
    from flwr.serverapp.strategy import FedAvg

    from benchmarks import compatkit
    from benchmarks.flowerkit import server_identity
    from fedcomp.flower import Compressed, compression_mod, records

    family = compatkit.FAMILIES["mlp"]

    def junk(msg, context, call_next):
        reply = call_next(msg, context)
        if context.node_id == 103 and reply.has_content() and records.CONTROL in reply.content.config_records:
            reply.content.array_records.pop(records.UPDATE, None)
            reply.content.config_records[records.CONTROL][records.UPDATE] = bytes(2_000_000)  # past the bound
        return reply

    app = compatkit.client_app(family, [junk, compression_mod])  # outside the mod: what leaves the node
    grid = compatkit.StagedGrid({100 + i: (app, {"partition-id": i, "num-partitions": 4}) for i in range(4)}, {})
    strategy = Compressed(FedAvg(min_available_nodes=4), "dgc+int8", density="auto", mode="async", buffer_size=2,
                          max_staleness=3)
    with server_identity():
        strategy.start(grid, family.record(family.build()), num_rounds=6, timeout=30.0,
                       train_config=ConfigRecord({"lr": compatkit.LR}),
                       evaluate_fn=lambda v, arrays: MetricRecord({"accuracy": 0.0}))
    assert strategy.proto.totals.reject_reasons, "the junk was not rejected"
    assert max(max(sizes) for sizes in strategy.loop.auto.sizes.values()) < 100_000  # honest: a few kB

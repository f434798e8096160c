"""``Compressed(..., mode="async")``: the product's async loop for an ordinary Flower app (compression_mod on the
client, the user's own train function), on the in-process federation of benchmarks/flowerkit.py; the same app on
Flower's simulation engine is in tests/test_flower_async_sim.py."""

from __future__ import annotations

import pytest
import torch
from flwr.app import ConfigRecord, Message, MetricRecord, RecordDict
from flwr.serverapp.strategy import FedAdam, FedAvg, FedAvgM, FedMedian, FedProx, Krum, QFedAvg

from benchmarks import compatkit
from benchmarks.flowerkit import server_identity
from fedcomp.downlink import receive
from fedcomp.flower import Compressed, compression_mod, records
from fedcomp.flower.loopmode import LoopOptions
from fedcomp.registry import ConfigError

FAMILY = compatkit.FAMILIES["mlp"]


class Audited(Compressed):
    """Records every update the async loop applied (for conservation) and its staleness."""

    def __init__(self, *args, **kw) -> None:
        super().__init__(*args, **kw)
        self.applied: dict[int, dict[int, dict[str, torch.Tensor]]] = {}
        self.staleness: list[int] = []

    def audit(self, update, staleness: int) -> None:
        self.applied.setdefault(update.client_id, {})[update.seq] = update.to_dense()
        self.staleness.append(staleness)


# ---- configuration checks -----------------------------------------------------------------------------------
def test_async_options_are_refused_in_sync_mode():
    with pytest.raises(ConfigError, match="buffer_size: options of fedcomp's loop"):
        Compressed(FedAvg(), "dgc+int8", density=0.02, buffer_size=2)


def test_an_unknown_mode_is_refused():
    with pytest.raises(ConfigError, match="mode must be one of sync, async"):
        Compressed(FedAvg(), mode="asynchronous")


REFUSED = [FedMedian(), Krum(), QFedAvg(client_learning_rate=0.1)]


@pytest.mark.parametrize("strategy", REFUSED, ids=lambda s: type(s).__name__)
def test_strategies_that_judge_each_client_are_refused_in_async_mode(strategy):
    with pytest.raises(ConfigError, match=f"{type(strategy).__name__} judges each client's update on its own"):
        Compressed(strategy, mode="async")


def test_a_subclass_of_fedavg_is_refused_in_async_mode():
    class MyAvg(FedAvg):
        pass

    with pytest.raises(ConfigError, match="MyAvg judges each client"):
        Compressed(MyAvg(), mode="async")


@pytest.mark.parametrize(
    ("options", "match"),
    [
        ({"buffer_size": 0}, "buffer_size must be an int >= 1"),
        ({"buffer_size": 2.5}, "buffer_size must be an int >= 1"),
        ({"max_staleness": -1}, "max_staleness must be an int >= 0"),
        ({"staleness": "linear"}, "unknown staleness function 'linear'"),
        ({"staleness": "polynomial", "staleness_options": "b=2"}, "b"),
        ({"normalize": "mean"}, "normalize must be 'count'"),
        ({"prefetch_lead": float("nan")}, "prefetch_lead must be a finite number"),
        ({"poll_interval": 0}, "poll_interval must be > 0"),
        ({"aggregation": "dense"}, "aggregation='dense'"),
    ],
)
def test_bad_async_options_are_refused_before_any_message(options, match):
    with pytest.raises(ConfigError, match=match):
        Compressed(FedAvg(), "dgc+int8", density=0.02, mode="async", **options)


def test_fraction_train_zero_is_refused_in_async_mode():
    with pytest.raises(ConfigError, match="fraction_train=0"):
        Compressed(FedAvg(fraction_train=0.0), mode="async")


@pytest.mark.parametrize("strategy", [FedAvg(), FedProx(), FedAvgM(), FedAdam()], ids=lambda s: type(s).__name__)
def test_the_fedavg_family_and_density_auto_are_accepted_in_async_mode(strategy):
    wrapped = Compressed(strategy, "dgc+int8", density="auto", mode="async", buffer_size=3, max_staleness=1)
    assert wrapped.options.loop_options == LoopOptions(buffer_size=3, max_staleness=1)
    assert wrapped.compression.auto_density is not None


def test_density_auto_stays_refused_in_sync_mode():
    with pytest.raises(ConfigError, match="mode='async'"):
        Compressed(FedAvg(), "dgc+int8", density="auto")


# ---- runs on the in-process federation ----------------------------------------------------------------------
def _run(strategy: Audited, versions: int, drop=None, timeout: float = 30.0):
    computed = compatkit.Computed()
    app = compatkit.client_app(FAMILY, [compression_mod, computed])
    apps = {100 + i: (app, {"partition-id": i, "num-partitions": 4}) for i in range(4)}
    grid = compatkit.StagedGrid(apps, {}, drop=drop)
    seen: list[int] = []

    def evaluate(version, arrays):
        seen.append(version)
        return MetricRecord({"accuracy": compatkit.accuracy(FAMILY, arrays)})

    with server_identity():
        result = strategy.start(grid, FAMILY.record(FAMILY.build()), num_rounds=versions, timeout=timeout,
                                train_config=ConfigRecord({"lr": compatkit.LR}), evaluate_fn=evaluate)
    return result, grid, computed, seen


def test_async_fedavg_reaches_its_versions_with_conservation_and_the_staleness_bound():
    strategy = Audited(FedAvg(min_available_nodes=4), "dgc+int8", density=0.05, mode="async", buffer_size=2,
                       max_staleness=1)
    result, grid, computed, seen = _run(strategy, versions=12)
    assert seen == list(range(13))  # evaluate_fn once per version, 0 = the initial model
    acc = {v: float(m["accuracy"]) for v, m in result.evaluate_metrics_serverapp.items()}
    assert acc[12] > acc[0] + 0.4, acc
    assert sorted(result.train_metrics_clientapp) == list(range(1, 13))
    assert all(m["fedcomp-applied"] == 2 for m in result.train_metrics_clientapp.values())
    assert strategy.proto.version == 12 and strategy.totals.accepted == 24
    # in-process, every node answers at once, so 4 tasks in flight make staleness 1 for most; the bound holds
    assert max(strategy.staleness) <= 1 and strategy.staleness.count(1) > 0
    assert strategy.totals.stale > 0  # the bound was needed: some replies were 2 versions old and nacked
    assert compatkit.conservation_error(strategy, grid, computed) < 1e-5
    # the task carried the model as one fp32 blob of the task's version, in place of the strategy's ArrayRecord of
    # one Flower object per array, and the strategy's config (server-round = version+1) folded into fedcomp's record
    train = [m for m in grid.sent if m.metadata.message_type == "train"]
    last = train[-1].content
    assert set(last.config_records) == {records.CONTROL} and "arrays" not in last.array_records
    task = records.read_mod_task(last)
    model = receive(records.model_blob(last), task.layout.spec(), None)
    assert model.version == task.base_version and set(model.tensors) == set(task.layout.spec().names)
    for m in train:
        content = RecordDict(dict(m.content))
        records.unfold(content)
        assert content["config"]["lr"] == compatkit.LR
    assert content["config"]["server-round"] == task.base_version + 1


def test_a_lost_reply_times_out_is_nacked_and_its_update_conserved():
    lost: list[int] = []

    def drop(node: int, reply: Message) -> bool:
        if node == 101 and not lost:
            lost.append(records.read_mod_reply(reply.content)[1].seq)
            return True
        return False

    strategy = Audited(FedAvg(min_available_nodes=4), "topk", density=0.1, mode="async", buffer_size=2,
                       max_staleness=3)
    # 5 s: long beside a task of this tiny model even on a loaded machine, short beside 120 versions
    _, grid, computed, _ = _run(strategy, versions=120, drop=drop, timeout=5.0)
    assert strategy.proto.version == 120 and lost
    assert strategy.totals.timeout >= 1  # the lost task was nacked after its timeout
    client = 101 % (1 << 64)
    assert lost[0] not in strategy.applied[client]  # never applied
    assert max(strategy.applied[client]) > lost[0]  # the node went on with later tasks
    assert compatkit.conservation_error(strategy, grid, computed) < 1e-5


def test_the_async_server_step_is_the_wrapped_strategys_fedavgm():
    """FedAvgM's server momentum makes a different model from FedAvg on the same replies order."""
    runs = {}
    for name, base in (("avg", FedAvg(min_available_nodes=4)),
                       ("avgm", FedAvgM(min_available_nodes=4, server_momentum=0.9))):
        strategy = Audited(base, "topk", density=0.1, mode="async", buffer_size=4, max_staleness=2,
                           concurrency=4)
        result, *_ = _run(strategy, versions=3)
        runs[name] = result.arrays["0.weight"].numpy()
    assert abs(runs["avg"] - runs["avgm"]).max() > 1e-4


def test_density_auto_gives_each_task_the_servers_density():
    strategy = Audited(FedAvg(min_available_nodes=4), "topk", density="auto", mode="async", buffer_size=2,
                       max_staleness=3)
    _, grid, computed, _ = _run(strategy, versions=8)
    densities = [records.read_mod_task(m.content).density for m in grid.sent if m.metadata.message_type == "train"]
    assert densities[:4] == [0.3] * 4  # every node's first task: the first probe density
    assert 0.1 in densities  # the second probe
    sizes = {d: [] for d in (0.3, 0.1)}
    for sent, reply in zip([m for m in grid.sent if m.metadata.message_type == "train"], grid.replies, strict=False):
        d = records.read_mod_task(sent.content).density
        if d in sizes and reply.metadata.reply_to_message_id == sent.metadata.message_id:
            sizes[d].append(len(records.read_mod_reply(reply.content)[0]))
    assert min(sizes[0.3]) > 2 * max(sizes[0.1])  # the client compressed at the task's density
    assert strategy.loop.auto is not None and strategy.loop.auto.report()
    assert compatkit.conservation_error(strategy, grid, computed) < 1e-5


def test_a_compressed_downlink_in_async_mode():
    strategy = Audited(FedAvg(min_available_nodes=4), "topk", density=0.1, mode="async", buffer_size=2,
                       max_staleness=2, downlink="int8")
    result, grid, computed, seen = _run(strategy, versions=6)
    train = [m for m in grid.sent if m.metadata.message_type == "train"]
    assert all("arrays" not in m.content.array_records for m in train)  # the model went as a blob ...
    for m in train:  # ... of int8 values: a byte per element and a scale per block, against fp32's 4 bytes
        spec = records.read_mod_task(m.content).layout.spec()
        blob = records.model_blob(m.content)
        assert len(blob) < spec.dense_bytes / 3, (len(blob), spec.dense_bytes)
    assert strategy.proto.version == 6 and seen == list(range(7))
    assert compatkit.conservation_error(strategy, grid, computed) < 1e-5


@pytest.mark.parametrize("options", [{"mode": "async"}, {"loop": "fedcomp"}], ids=["async", "sync"])
def test_a_client_app_without_compression_mod_is_named_when_its_tasks_fail(options):
    """On fedcomp's loop the model reaches the train function only through compression_mod: a ClientApp without it
    raises on every task, and the failures say so (Flower's rounds say it of the reply instead)."""
    strategy = Compressed(FedAvg(min_available_nodes=4), "dgc+int8", density=0.05, max_failures=4, **options)
    app = compatkit.client_app(FAMILY, [])  # the mod forgotten
    grid = compatkit.StagedGrid({100 + i: (app, {"partition-id": i, "num-partitions": 4}) for i in range(4)}, {})
    with server_identity():
        strategy.start(grid, FAMILY.record(FAMILY.build()), num_rounds=3, timeout=30.0,
                       train_config=ConfigRecord({"lr": compatkit.LR}))
    assert not strategy.loop.completed and strategy.proto.version == 0
    reason = strategy.loop.stopped_reason
    assert "4 failed tasks in a row" in reason and "CLIENT_APP_RAISED_EXCEPTION" in reason, reason
    assert "is it in the ClientApp's mods?" in reason and "KeyError" in reason, reason

"""``Compressed(strategy, loop="fedcomp")``: sync rounds run by fedcomp's loop (``fedcomp.flower.looprun``).

The same rounds as Flower's (the model of every round equal to the last bit on the same replies), plus what Flower's
round loop does not have: over-selection that closes a round at its target, the run files, checkpoints and resume,
``density="auto"``; and what it refuses, before any message."""

from __future__ import annotations

import json

import numpy as np
import pytest
from flwr.app import ConfigRecord, MetricRecord, RecordDict
from flwr.serverapp.strategy import FedAvg, FedAvgM, FedMedian

from benchmarks import compatkit
from benchmarks.flowerkit import LocalGrid, server_identity
from fedcomp.flower import Compressed, compression_mod, records
from fedcomp.registry import ConfigError
from fedcomp.tools.check import check

FAMILY = compatkit.FAMILIES["mlp"]


class Slow(LocalGrid):
    """A ``LocalGrid`` whose ``slow`` nodes' replies land only when the server sends a message of a later round
    (a phone among laptops): a round that waits for every node never ends before its timeout."""

    def __init__(self, *args, slow=(), **kw) -> None:
        super().__init__(*args, **kw)
        self.slow, self.held = set(slow), {}

    def push_messages(self, messages):
        messages = list(messages)
        for mid, (reply, group) in list(self.held.items()):
            if any(m.metadata.group_id != group for m in messages):
                self.outbox[mid] = reply
                del self.held[mid]
        ids = list(super().push_messages(messages))
        for mid, msg in zip(ids, messages, strict=True):
            if msg.metadata.dst_node_id in self.slow and mid in self.outbox:
                self.held[mid] = (self.outbox.pop(mid), msg.metadata.group_id)
        return ids


def _run(strategy, rounds, grid=None, nodes=4, out=None, timeout=30.0):
    computed = compatkit.Computed()
    app = compatkit.client_app(FAMILY, [compression_mod, computed])
    apps = {100 + i: (app, {"partition-id": i, "num-partitions": nodes}) for i in range(nodes)}
    grid = grid(apps) if grid is not None else LocalGrid(apps, {})
    seen: dict[int, float] = {}

    def evaluate(version, arrays):
        seen[version] = compatkit.accuracy(FAMILY, arrays)
        return MetricRecord({"accuracy": seen[version]})

    with server_identity():
        result = strategy.start(grid, FAMILY.record(FAMILY.build()), num_rounds=rounds, timeout=timeout,
                                train_config=ConfigRecord({"lr": compatkit.LR}), evaluate_fn=evaluate)
    return result, grid, computed, seen


@pytest.mark.parametrize("base", [FedAvg, FedAvgM], ids=lambda b: b.__name__)
def test_fedcomps_loop_makes_the_models_of_flowers_rounds_to_the_last_bit(base):
    """Every node each round, the same replies: the example-weighted mean and the wrapped strategy's step are the
    same on both loops, so is every round's model (a loop that weighed by count, skipped a node or sent another
    round's model would differ)."""
    results = {}
    for loop in ("flower", "fedcomp"):
        strategy = compatkit.Recorded(base(min_available_nodes=4), "topk", density=0.1, loop=loop)
        result, grid, computed, seen = _run(strategy, rounds=4)
        results[loop] = (result.arrays, seen)
        assert sorted(seen) == [0, 1, 2, 3, 4]
        assert compatkit.conservation_error(strategy, grid, computed) < 1e-5
    (a, acc_a), (b, acc_b) = results["flower"], results["fedcomp"]
    assert acc_a == acc_b and acc_b[4] > acc_b[0] + 0.3
    for name in a.keys():
        assert np.array_equal(a[name].numpy(), b[name].numpy()), name


def test_over_selection_closes_a_round_at_its_target_without_the_slow_node():
    """Half the nodes per round (target 2), over-selected to all 4: the two slow nodes' replies come after the
    round closed, are nacked (late) and their updates stay with their clients (conservation); no round waits for
    them (with a round timeout of an hour, a loop that waited would stop at the run timeout, short of 5)."""
    half = FedAvg(fraction_train=0.5, min_train_nodes=2, min_available_nodes=4)
    strategy = compatkit.Recorded(half, "topk", density=0.1, loop="fedcomp", over_selection=1.0, poll_interval=0.05,
                                  run_timeout=300.0)
    result, grid, computed, _ = _run(strategy, rounds=5, grid=lambda apps: Slow(apps, {}, slow=(102, 103)),
                                     timeout=3600.0)
    assert strategy.proto.version == 5
    rows = result.train_metrics_clientapp
    assert sorted(rows) == [1, 2, 3, 4, 5] and all(m["fedcomp-applied"] == 2 for m in rows.values()), rows
    assert not {102 % (1 << 64), 103 % (1 << 64)} & set(strategy.applied)  # the slow nodes never made a round
    sent = [m for m in grid.sent if m.metadata.message_type == "train"]
    assert {m.metadata.dst_node_id for m in sent} == {100, 101, 102, 103}  # but every round asked them
    assert strategy.totals.timeout + strategy.totals.late >= 8  # closed without them, or answered too late
    assert compatkit.conservation_error(strategy, grid, computed) < 1e-5


def test_sync_rounds_on_fedcomps_loop_write_the_run_files_and_resume(tmp_path):
    out = tmp_path / "out"

    def start(rounds, **kw):
        strategy = Compressed(FedAvg(min_available_nodes=3), "topk", density=0.1, loop="fedcomp", out_dir=str(out),
                              checkpoint_every=1, **kw)
        return strategy, _run(strategy, rounds, grid=lambda apps: grid, nodes=3)

    app = compatkit.client_app(FAMILY, [compression_mod])
    grid = LocalGrid({100 + i: (app, {"partition-id": i, "num-partitions": 3}) for i in range(3)}, {})
    first, _ = start(3)
    assert first.proto.version == 3 and (out / "checkpoint.pt").exists()
    second, (_, _, _, seen) = start(6, resume=str(out / "checkpoint.pt"))
    assert min(seen) == 3 and second.proto.version == 6
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["version"] for r in rows] == [1, 2, 3, 4, 5, 6] and all(r["accepted"] == 3 for r in rows), rows
    summary = json.loads((out / "summary.json").read_text())
    assert summary["mode"] == "sync" and summary["completed"] and summary["versions"] == 6
    assert summary["wire_bytes_up_per_reply"] > summary["flower_bytes_up_per_reply"] > 0
    report = check(out, [])
    assert report.exit_code == 0, report.text()
    assert report.runs[0].applied >= 18, report.text()  # both halves, three updates a round


def test_density_auto_picks_each_nodes_density_in_sync_rounds_on_fedcomps_loop():
    strategy = compatkit.Recorded(FedAvg(min_available_nodes=4), "topk", density="auto", loop="fedcomp")
    _, grid, computed, _ = _run(strategy, rounds=3)
    assert strategy.loop.auto is not None and strategy.proto.version == 3
    train = [m for m in grid.sent if m.metadata.message_type == "train"]
    densities = [records.read_mod_task(m.content).density for m in train]
    assert densities[:4] == [0.3] * 4 and 0.1 in densities, densities  # round 1: the first probe; then the second
    assert compatkit.conservation_error(strategy, grid, computed) < 1e-5


@pytest.mark.parametrize(("strategy", "kw", "match"), [
    (FedMedian(), {"loop": "fedcomp"}, "FedMedian judges each client's update on its own.*loop='flower'"),
    (FedAvg(), {"loop": "fedcomp", "buffer_size": 2}, "buffer_size: options of mode='async'"),
    (FedAvg(), {"mode": "async", "over_selection": 0.5}, "over_selection: options of mode='sync'"),
    (FedAvg(), {"over_selection": 0.5}, "options of fedcomp's loop.*runs Flower's rounds"),
    (FedAvg(), {"mode": "async", "loop": "flower"}, "runs on fedcomp's loop"),
    (FedAvg(), {"loop": "ray"}, "loop must be one of flower, fedcomp"),
    (FedAvg(), {"loop": "fedcomp", "over_selection": -1.0}, "over_selection must be a finite fraction"),
    (FedAvg(), {"loop": "fedcomp", "aggregation": "dense"}, "needs Flower's rounds"),
], ids=lambda x: x if isinstance(x, str) else "")
def test_what_fedcomps_loop_cannot_run_is_refused_before_any_message(strategy, kw, match):
    with pytest.raises(ConfigError, match=match):
        Compressed(strategy, "topk", density=0.1, **kw)


def test_a_message_from_the_loop_carries_the_strategys_round_config():
    strategy = Compressed(FedAvg(min_available_nodes=2), "topk", density=0.1, loop="fedcomp")
    _, grid, _, _ = _run(strategy, rounds=2, nodes=2)
    rounds = []
    for m in grid.sent:
        content = RecordDict(dict(m.content))
        records.unfold(content)  # the strategy's config, folded into fedcomp's record as in async mode
        rounds.append(int(content["config"]["server-round"]))
        assert content["config"]["lr"] == compatkit.LR
    assert rounds == [1, 1, 2, 2]

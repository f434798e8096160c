"""``Compressed(..., mode="async", out_dir=..., checkpoint_every=..., resume=...)``: a Flower app's async run
leaves the product's files (metrics.jsonl, checkpoint.pt, summary.json), goes on from its checkpoint after a
server restart, and ``fedcomp check`` accounts for every update of both halves."""

from __future__ import annotations

import json

import numpy as np
import pytest
from flwr.app import ConfigRecord, MetricRecord
from flwr.serverapp.strategy import FedAvg

from benchmarks import compatkit
from benchmarks.flowerkit import server_identity
from fedcomp.flower import Compressed, compression_mod
from fedcomp.registry import ConfigError
from fedcomp.tools.check import check
from fedcomp.tools.summary import DEPLOYMENT_FIGURES, FIGURES

FAMILY = compatkit.FAMILIES["bn-cnn"]  # BatchNorm: arrays outside the update, which a checkpoint must keep too


def test_checkpoint_every_needs_out_dir_and_resume_a_readable_checkpoint(tmp_path):
    with pytest.raises(ConfigError, match="checkpoint_every needs out_dir"):
        Compressed(FedAvg(), mode="async", checkpoint_every=2)
    (tmp_path / "torn.pt").write_bytes(b"not a checkpoint")
    with pytest.raises(ConfigError, match="not a readable checkpoint"):
        Compressed(FedAvg(), mode="async", out_dir=str(tmp_path), resume=str(tmp_path / "torn.pt"))


@pytest.mark.parametrize(("options", "match"), [
    ({"eval_every": -1}, "eval_every must be an int >= 0"),
    ({"balance": 0.5}, "balance must be finite and >= 1"),
    ({"aggregate_device": "tpu"}, "aggregate_device must be 'cpu' or 'cuda"),
    ({"run_timeout": float("inf")}, "run_timeout must be a finite number"),
])
def test_the_product_run_options_are_checked_before_any_message(options, match):
    with pytest.raises(ConfigError, match=match):
        Compressed(FedAvg(), mode="async", **options)


def test_eval_every_evaluates_every_nth_version_and_the_last():
    app = compatkit.client_app(FAMILY, [compression_mod])
    grid = compatkit.StagedGrid({100 + i: (app, {"partition-id": i, "num-partitions": 2}) for i in range(2)}, {})
    seen = []
    strategy = Compressed(FedAvg(min_available_nodes=2), "topk", density=0.1, mode="async", buffer_size=1,
                          eval_every=3)
    with server_identity():
        strategy.start(grid, FAMILY.record(FAMILY.build()), num_rounds=7, timeout=30.0,
                       train_config=ConfigRecord({"lr": compatkit.LR}),
                       evaluate_fn=lambda v, arrays: seen.append(v) or MetricRecord({"x": 1.0}))
    assert seen == [0, 3, 6, 7]


def test_an_async_run_checkpoints_resumes_and_fedcomp_check_accounts_for_it(tmp_path):
    out = tmp_path / "out"
    computed = compatkit.Computed()
    app = compatkit.client_app(FAMILY, [compression_mod, computed])
    apps = {100 + i: (app, {"partition-id": i, "num-partitions": 3}) for i in range(3)}
    grid = compatkit.StagedGrid(apps, {})  # the same nodes (and their context.state) across the server restart
    models = {}

    def start(versions: int, **kw):
        seen: dict[int, list] = {}

        def evaluate(version, arrays):
            seen[version] = [np.array(arrays[n].numpy()) for n in arrays.keys()]
            return MetricRecord({"accuracy": compatkit.accuracy(FAMILY, arrays)})

        strategy = Compressed(FedAvg(min_available_nodes=3), "topk", density=0.1, mode="async", buffer_size=2,
                              max_staleness=3, out_dir=str(out), **{"checkpoint_every": 1, **kw})
        with server_identity():
            strategy.start(grid, FAMILY.record(FAMILY.build()), num_rounds=versions, timeout=30.0,
                           train_config=ConfigRecord({"lr": compatkit.LR}), evaluate_fn=evaluate)
        return strategy, seen

    first, seen = start(4)
    models["first"] = seen[4]
    dense = [n for n in FAMILY.record(FAMILY.build()).keys() if n not in first.spec.names]
    assert dense, "the model has no arrays outside the update: the test would not check their resume"
    assert first.proto.version == 4 and (out / "checkpoint.pt").exists()
    assert check(out, []).exit_code == 0, check(out, []).text()
    half = json.loads((out / "summary.json").read_text())  # the three byte figures, each named, per reply
    assert half["wire_bytes_up_per_reply"] > half["flower_bytes_up_per_reply"] > half["payload_bytes_up_per_reply"] > 0

    second, seen = start(8, resume=str(out / "checkpoint.pt"))
    # the resumed run starts from the first run's final model (every array, dense ones too), not the initial one
    assert min(seen) == 4 and all(np.array_equal(a, b) for a, b in zip(seen[4], models["first"], strict=True))
    assert second.proto.version == 8
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["version"] for r in rows] == [1, 2, 3, 4, 5, 6, 7, 8]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["completed"] and summary["versions"] == 8 and summary["target_versions"] == 8
    assert set(FIGURES) <= set(summary) <= set(FIGURES) | set(DEPLOYMENT_FIGURES), sorted(set(summary))

    report = check(out, [])
    assert report.exit_code == 0, report.text()
    run = report.runs[0]
    assert run.versions == 8 and run.applied >= 16, report.text()  # both halves counted, K = 2 per version
    with pytest.raises(ConfigError, match="is at version 8 and the run stops at version 8"):
        start(8, resume=str(out / "checkpoint.pt"))  # no version left: refused, not a run that ends at once

    # a fresh run in the same folder, without checkpoints: the earlier run's checkpoint is moved aside, so neither
    # fedcomp check nor a resume takes it for this run's
    start(2, checkpoint_every=0)
    assert not (out / "checkpoint.pt").exists() and (out / "checkpoint.earlier.pt").exists()
    report = check(out, [])
    assert report.checkpoint_version is None and report.runs[0].versions == 2, report.text()


def test_federated_evaluation_runs_between_versions_on_the_version_model(tmp_path):
    app = compatkit.client_app(FAMILY, [compression_mod])
    grid = compatkit.StagedGrid({100 + i: (app, {"partition-id": i, "num-partitions": 2}) for i in range(2)}, {})
    models = {}

    def evaluate(version, arrays):
        models[version] = compatkit.accuracy(FAMILY, arrays)
        return None

    strategy = Compressed(FedAvg(min_available_nodes=2, min_evaluate_nodes=2), "topk", density=0.1, mode="async",
                          buffer_size=1, fed_eval_every=2, fed_eval_timeout=12.5, out_dir=str(tmp_path))
    waits, send_and_receive = [], grid.send_and_receive

    def recorded(messages, *, timeout=None):
        messages = list(messages)
        waits.extend(timeout for m in messages if m.metadata.message_type == "evaluate")
        return send_and_receive(messages, timeout=timeout)

    grid.send_and_receive = recorded
    with server_identity():
        result = strategy.start(grid, FAMILY.record(FAMILY.build()), num_rounds=5, timeout=30.0,
                                train_config=ConfigRecord({"lr": compatkit.LR}),
                                evaluate_config=ConfigRecord({"tag": 7}), evaluate_fn=evaluate)
    fed = result.evaluate_metrics_clientapp
    assert sorted(fed) == [2, 4, 5]  # every 2nd version and the last
    # both nodes evaluated the model of that version (the app's eval-acc: accuracy on the held-out images)
    assert all(fed[v]["eval-acc"] == pytest.approx(models[v], abs=1e-9) for v in fed), (dict(fed), models)
    asked = [m for m in grid.sent if m.metadata.message_type == "evaluate"]
    assert len(asked) == 6 and {int(m.content["config"]["server-round"]) for m in asked} == {2, 4, 5}
    assert all(m.content["config"]["tag"] == 7 for m in asked)
    assert waits == [12.5] * 6  # fed_eval_timeout, not the tasks' 30 s
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["version"] for r in rows if "fed_eval-acc" in r] == [2, 4, 5]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert [(r["version"], r["clients"]) for r in summary["federated_evaluation"]] == [(2, 2), (4, 2), (5, 2)]
    assert check(tmp_path, []).exit_code == 0, check(tmp_path, []).text()  # the run's files still check out


def test_federated_evaluation_needs_a_strategy_that_evaluates():
    with pytest.raises(ConfigError, match="fraction_evaluate=0 turns off"):
        Compressed(FedAvg(fraction_evaluate=0.0), mode="async", fed_eval_every=2)
    with pytest.raises(ConfigError, match="fed_eval_every must be an int >= 0"):
        Compressed(FedAvg(), mode="async", fed_eval_every=-1)

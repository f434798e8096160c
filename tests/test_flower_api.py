"""The Flower-native way in: ``ClientApp(mods=[compression_mod])`` and ``Compressed(strategy)``.

The app is the shipped example (``examples/compressed-digits``: own model, own data, stock strategies), run on
an in-process federation (``benchmarks/flowerkit.py``) with its uncompressed twin as the reference.
"""

from __future__ import annotations

import random
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.serverapp.strategy import (
    DifferentialPrivacyServerSideFixedClipping,
    FedAdam,
    FedAvg,
    FedMedian,
    FedProx,
)

from benchmarks.compatkit import Computed
from benchmarks.compatkit import Recorded as Applied  # Compressed that records the updates it applied
from benchmarks.flowerkit import LocalGrid, server_identity
from fedcomp.flower import ClientSession, Compressed, Compression, compression_mod, records
from fedcomp.protocol import Outcome
from fedcomp.registry import ConfigError
from fedcomp.spec import ModelSpec

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples" / "compressed-digits"))

from digits_app import client_app, server_app  # noqa: E402
from digits_app.task import Net  # noqa: E402

RUN_CONFIG = {"local-epochs": 1, "lr": 0.1}
NODES = 4


def plain_client() -> ClientApp:
    """The example's ClientApp without the mod: its uncompressed twin."""
    app = ClientApp()
    app.train()(client_app.train)
    app.evaluate()(client_app.evaluate)
    return app


def federation(app, n: int = NODES, **kw) -> LocalGrid:
    return LocalGrid({100 + i: (app, {"partition-id": i, "num-partitions": n}) for i in range(n)}, RUN_CONFIG, **kw)


def run(strategy, grid: LocalGrid, rounds: int):
    """``strategy.start`` on ``grid``; returns (final accuracy, Result)."""
    torch.manual_seed(0)
    with server_identity():
        result = strategy.start(
            grid,
            ArrayRecord(Net().state_dict()),
            num_rounds=rounds,
            train_config=ConfigRecord({"lr": 0.05}),
            evaluate_fn=server_app.central_evaluate,
        )
    return result.evaluate_metrics_serverapp[rounds]["accuracy"], result


def fedavg(**kw) -> FedAvg:
    return FedAvg(**{"fraction_evaluate": 0.0, "min_train_nodes": NODES, "min_available_nodes": NODES, **kw})


def reply_bytes(grid: LocalGrid) -> float:
    """Mean Flower object bytes of the train replies the server received."""
    train = [r for r in grid.replies if not r.has_error() and r.metadata.message_type == "train"]
    sizes = [records.flower_size(r)[0] for r in train]
    return sum(sizes) / len(sizes)


def test_import_fedcomp_stays_flower_free():
    code = "import sys, fedcomp; assert 'flwr' not in sys.modules; import fedcomp.flower; assert 'flwr' in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)


def test_compressed_fedavg_learns_like_plain_fedavg_with_a_tenth_of_the_bytes():
    plain_grid, comp_grid = federation(plain_client()), federation(client_app.app)
    plain_acc, _ = run(fedavg(), plain_grid, 20)
    comp_acc, result = run(Compressed(fedavg(), "dgc+int8", density=0.01), comp_grid, 20)
    assert plain_acc > 0.85
    assert comp_acc >= plain_acc - 0.03, (comp_acc, plain_acc)
    ratio = reply_bytes(plain_grid) / reply_bytes(comp_grid)
    assert ratio >= 10, ratio
    last = result.train_metrics_clientapp[20]
    assert last["fedcomp-applied"] == NODES and last["fedcomp-rejected"] == 0 and last["fedcomp-lost"] == 0
    assert last["fedcomp-dense-bytes"] == 4 * sum(p.numel() for p in Net().parameters())
    assert 0 < last["fedcomp-payload-bytes-up"] < last["fedcomp-dense-bytes"] * NODES / 10
    assert "train-loss" in last  # the user's metrics are aggregated as FedAvg would


def test_a_rounds_aggregate_does_not_depend_on_the_order_its_replies_arrive():
    """The prompt grid reads replies on threads, so they arrive in any order: the same round with its replies
    handed over reversed gives the same model to the bit (they are judged and summed in node order)."""

    def one_round(reverse: bool) -> ArrayRecord:
        strategy, grid = Compressed(fedavg(), "dgc+int8", density=0.01), federation(client_app.app)
        with server_identity():
            torch.manual_seed(0)
            messages = strategy.configure_train(1, ArrayRecord(Net().state_dict()), ConfigRecord({"lr": 0.05}), grid)
            replies = list(grid.send_and_receive(messages))
            assert len(replies) == NODES
            arrays, _ = strategy.aggregate_train(1, replies[::-1] if reverse else replies)
        assert arrays is not None
        return arrays

    a, b = one_round(False), one_round(True)
    for key in a:
        assert np.array_equal(a[key].numpy(), b[key].numpy()), key


def test_sync_tasks_carry_the_runs_key():
    """Compressed's sync rounds send the server run's key, as its async mode and the product's loops do, so a node
    keeps each run's session apart (without it a sync run continued whatever session the node's state dir held, and
    its task ids collided with that run's pending ones)."""
    strategy, grid = Compressed(fedavg(), "topk", density=0.05), federation(client_app.app)
    with server_identity():
        messages = strategy.configure_train(1, ArrayRecord(Net().state_dict()), ConfigRecord({"lr": 0.05}), grid)
    assert strategy.proto is not None and strategy.proto.book.run_key
    assert [records.read_mod_task(m.content).run_key for m in messages] == [strategy.proto.book.run_key] * NODES


@pytest.mark.parametrize(
    "make",
    [
        lambda: FedAdam(fraction_evaluate=0.0, min_train_nodes=NODES, min_available_nodes=NODES, eta=0.03),
        lambda: FedProx(fraction_evaluate=0.0, min_train_nodes=NODES, min_available_nodes=NODES, proximal_mu=0.01),
        lambda: FedMedian(fraction_evaluate=0.0, min_train_nodes=NODES, min_available_nodes=NODES),
    ],
    ids=["fedadam", "fedprox", "fedmedian"],
)
def test_wraps_other_strategies(make):
    strategy = Compressed(make(), "topk+int8", density=0.05)
    acc, result = run(strategy, federation(client_app.app), 6)
    assert acc > 0.7, acc
    assert strategy.options.sparse is (type(strategy.strategy) is not FedMedian)
    assert all(result.train_metrics_clientapp[r]["fedcomp-applied"] == NODES for r in range(1, 7))


def test_wrapped_dp_strategy_still_clips():
    clip = 0.05
    dp = DifferentialPrivacyServerSideFixedClipping(fedavg(), noise_multiplier=0.0, clipping_norm=clip,
                                                    num_sampled_clients=NODES)
    strategy = Compressed(dp, "topk", density=0.1)
    assert not strategy.options.sparse
    grid = federation(client_app.app)
    torch.manual_seed(0)
    start = ArrayRecord(Net().state_dict())
    with server_identity():
        result = strategy.start(grid, start, num_rounds=1, train_config=ConfigRecord({"lr": 0.05}))
    moved = np.sqrt(sum(((result.arrays[k].numpy() - start[k].numpy()) ** 2).sum() for k in start))
    assert 0 < moved <= clip * 1.0001, moved


def lossy(rate: float, seed: int):
    """A mod that loses replies after the node has computed them (as a dropped connection would)."""
    rng = random.Random(seed)

    def mod(msg: Message, ctx: Context, call_next) -> Message:
        reply = call_next(msg, ctx)
        if msg.metadata.message_type == "train" and rng.random() < rate:
            raise ConnectionError("reply lost on the way back")
        return reply

    return mod


@pytest.mark.parametrize("compressor", ["dgc+int8", "topk", "qsgd"])
def test_mass_conserved_when_replies_are_lost(compressor):
    ledger = Computed()  # inside compression_mod: what each train call computed (received - trained)
    app = ClientApp(mods=[lossy(0.3, seed=1), compression_mod, ledger])
    app.train()(client_app.train)
    drops = random.Random(2)
    grid = federation(app, drop=lambda node, reply: drops.random() < 0.15)  # lost without an error reply too
    options = {"density": 0.02} if compressor != "qsgd" else {}
    strategy = Applied(fedavg(), compressor, **options)
    strategy.strategy.min_train_nodes = 1  # rounds go on with whoever replied
    _, result = run(strategy, grid, 8)
    lost = sum(result.train_metrics_clientapp[r]["fedcomp-lost"] for r in result.train_metrics_clientapp)
    assert lost >= 4  # the test exercised losses
    spec = strategy.spec
    compression = strategy.compression
    checked = 0
    for node, computed in ledger.sums.items():
        session = ClientSession.load(grid.contexts[node], compression, spec)
        residual = {n: torch.zeros(spec.shape(n)) for n in spec.names}
        for n, t in session.pipeline.memory.state_dict()["errors"].items():
            residual[n] += t
        applied = strategy.applied.get(node, {})
        waiting = set(session.pipeline.pending) - set(applied)
        assert waiting <= {session.pipeline.last_seq}, waiting  # every lost update but the newest came back
        for seq, update in session.pipeline.pending.items():
            if seq not in applied:  # applied ones are pending until their ack arrives with the next task
                for n, t in update.to_dense().items():
                    residual[n] += t
        for n in spec.names:
            total = sum(u[n] for u in applied.values()) + residual[n]
            err = (computed[n] - total).norm() / computed[n].norm()
            assert err <= 1e-5, (node, n, float(err))
            checked += 1
    assert checked == len(ledger.sums) * len(spec)


def test_replies_without_the_mod_or_with_a_corrupt_blob_are_counted_rejections():
    def corrupt(msg, ctx, call_next):
        reply = call_next(msg, ctx)
        blob = bytearray(records.read_blob(reply.content, records.UPDATE))
        blob[len(blob) // 2] ^= 0xFF
        reply.content[records.UPDATE] = records.blob_record(bytes(blob))
        return reply

    bad = ClientApp(mods=[corrupt, compression_mod])
    bad.train()(client_app.train)
    apps = {100: (client_app.app, {"partition-id": 0, "num-partitions": 3}),
            101: (plain_client(), {"partition-id": 1, "num-partitions": 3}),
            102: (bad, {"partition-id": 2, "num-partitions": 3})}
    strategy = Compressed(fedavg(min_train_nodes=3), "topk", density=0.05)
    strategy.strategy.min_available_nodes = 3
    acc, result = run(strategy, LocalGrid(apps, RUN_CONFIG), 3)
    for r in (1, 2, 3):
        m = result.train_metrics_clientapp[r]
        assert (m["fedcomp-applied"], m["fedcomp-rejected"]) == (1, 2)
    reasons = strategy.totals.reject_reasons
    assert reasons.get("records", 0) == 3 and reasons.get("wire/crc", 0) == 3, reasons
    assert acc > 0.3


@pytest.mark.parametrize("downlink", ["int8", "delta"])
def test_compressed_downlink(downlink):
    grid = federation(client_app.app)
    strategy = Compressed(fedavg(), "topk+int8", density=0.05, downlink=downlink)
    acc, result = run(strategy, grid, 6)
    assert acc > 0.75
    dense = 4 * sum(p.numel() for p in Net().parameters())
    last = result.train_metrics_clientapp[6]
    assert last["fedcomp-payload-bytes-down"] < dense * NODES / 3
    model_arrays = [m.content.array_records.get("arrays") for m in grid.sent if m.metadata.message_type == "train"]
    assert all(a is None for a in model_arrays)  # the float arrays travel in the blob only


def test_a_lost_sync_reply_costs_its_node_no_full_copy_of_the_model():
    """Node 100's round-2 reply is lost (no error reply). Its client still holds the replica that task carried or
    the one before, so round 3 sends it deltas from what the server knows it holds; closing the round used to
    forget that (as for an error reply), and every late reply cost a full copy, counted as a resync."""
    seen, lost = [], []

    def drop(node, reply):
        if node == 100 and reply.metadata.message_type == "train":
            seen.append(reply)
            if len(seen) == 2:  # its round-2 reply
                lost.append(reply)
                return True
        return False

    grid = federation(client_app.app, n=2, drop=drop)
    strategy = Compressed(fedavg(min_train_nodes=2, min_available_nodes=2), "topk+int8", density=0.05,
                          downlink="delta")
    run(strategy, grid, 4)
    assert lost
    down = strategy.broadcaster.summary()
    assert down["resyncs"] == 0 and down["full"] == 2 and down["delta"] == 6, down


def test_a_node_that_lost_its_replica_gets_a_full_copy_after_its_error_reply():
    """Node 100 loses its state and its ClientApp raises in round 2. Flower makes that error reply at the SuperLink,
    under its node id: the server has to find the node by the message the reply answers. Read as the SuperLink's,
    the node kept its replica view, every later delta failed ("holds no replica"), and it never trained again."""
    calls = []

    def crashing(msg, ctx):
        if ctx.node_id == 100 and msg.metadata.message_type == "train":
            calls.append(msg)
            if len(calls) == 2:
                ctx.state = RecordDict()  # a SuperNode that came back without its state
                raise RuntimeError("node 100 crashed")
        return client_app.app(msg, ctx)

    grid = federation(crashing, n=2)
    strategy = Compressed(fedavg(min_train_nodes=2, min_available_nodes=2), "topk+int8", density=0.05,
                          downlink="delta")
    _, result = run(strategy, grid, 4)
    errors = [r for r in grid.replies if r.has_error()]
    assert len(errors) == 1 and int(errors[0].metadata.src_node_id) not in grid.apps  # the SuperLink's reply
    down = strategy.broadcaster.summary()
    assert down["resyncs"] == 1 and down["full"] == 3 and down["delta"] == 5, down
    applied = {r: m["fedcomp-applied"] for r, m in result.train_metrics_clientapp.items()}
    assert applied == {1: 2, 2: 1, 3: 2, 4: 2}, applied


def test_evaluate_and_plain_messages_pass_through():
    seen = []

    def echo(msg, ctx):
        seen.append(msg)
        return Message(RecordDict({"metrics": MetricRecord({"num-examples": 1})}), reply_to=msg)

    app = ClientApp(mods=[compression_mod])
    app.train()(echo)
    app.evaluate()(echo)
    grid = federation(app, n=2)
    with server_identity():
        arrays = ArrayRecord(Net().state_dict())
        msgs = FedAvg(min_train_nodes=2, min_available_nodes=2).configure_train(1, arrays, ConfigRecord(), grid)
        msgs += FedAvg(min_evaluate_nodes=2, min_available_nodes=2).configure_evaluate(1, arrays, ConfigRecord(), grid)
        replies = grid.send_and_receive(msgs)
    assert len(replies) == 4 and not any(r.has_error() for r in replies)
    assert all(set(m.content.keys()) == {"arrays", "config"} for m in seen)
    assert all(set(r.content.keys()) == {"metrics"} for r in replies)


def test_config_is_checked_before_any_message():
    for bad in (dict(compressor="nosuch"), dict(density=2.0), dict(downlink="zip"), dict(aggregation="fast"),
                dict(max_update_norm="x"), dict(max_update_norm=None), dict(max_update_norm=True),
                dict(warmup_epochs=float("nan")), dict(warmup_epochs=float("inf"))):
        with pytest.raises(ConfigError):
            Compressed(fedavg(), **bad)
    with pytest.raises(ConfigError):
        Compressed(object())
    assert Compressed(fedavg()).compression == Compression("dgc+int4", "residual", "density=0.1 warmup_epochs=4")


def test_client_session_refuses_a_state_made_for_other_settings():
    spec = ModelSpec.from_module(Net())
    made = ClientSession.fresh(Compression("topk", "residual", "density=0.1"), spec)
    with pytest.raises(ConfigError, match="client state was made for"):
        ClientSession.from_bytes(made.to_bytes(), Compression("topk", "residual", "density=0.2"), spec)


def test_a_state_survives_a_run_resumed_with_other_server_only_options():
    """The delta downlink's ``history`` (the encoded deltas the server keeps) and the ``density=auto`` policy are
    the server's: a run resumed with others continues the clients' states (every task failed to load them, and
    the run stopped). The downlink's own coding still makes another state."""
    spec = ModelSpec.from_module(Net())
    made = ClientSession.fresh(Compression("dgc+int8", "", "density=auto", "delta", "history=4"), spec)
    made.steps_done = 7
    resumed = Compression("dgc+int8", "", "density=auto upload_budget=0.3", "delta", "history=8")
    assert ClientSession.from_bytes(made.to_bytes(), resumed, spec).steps_done == 7
    with pytest.raises(ConfigError, match="client state was made for"):
        ClientSession.from_bytes(made.to_bytes(), Compression("dgc+int8", "", "density=auto", "delta",
                                                              "history=4 density=0.05"), spec)


def test_nacked_outcomes_reach_the_client():
    """A lost reply is nacked in the node's next task and the node restores it (pending empties)."""
    drop_first = {"done": False}

    def drop(node, reply):
        if node == 100 and not drop_first["done"]:
            drop_first["done"] = True
            return True
        return False

    grid = federation(client_app.app, n=2, drop=drop)
    strategy = Compressed(fedavg(min_train_nodes=1), "topk", density=0.05)
    strategy.strategy.min_available_nodes = 2
    run(strategy, grid, 3)
    tasks = [records.read_mod_task(m.content) for m in grid.sent if m.metadata.dst_node_id == 100]
    outcomes = [r.outcome for t in tasks for r in t.resolutions]
    assert outcomes[:2] == [Outcome.LOST, Outcome.APPLIED], outcomes
    session = ClientSession.load(grid.contexts[100], strategy.compression, strategy.spec)
    assert list(session.pipeline.pending) == [3]  # only the last round's update awaits its ack


def test_flower_size_counts_every_object_once_as_flower_serializes_it():
    from flwr.app import Metadata
    from flwr.supercore.inflatable.inflatable_object import get_all_nested_objects

    content = RecordDict(
        {
            "model": ArrayRecord({"w": torch.randn(600, 1000, generator=torch.Generator().manual_seed(0))}),
            "fedcomp": ConfigRecord({"blob": bytes(range(256)) * 400, "seq": 3}),
            "metrics": MetricRecord({"loss": 0.5}),
        }
    )
    meta = Metadata(1, "m", 1, 2, "", "0", 0.0, 60.0, "train")
    msg = Message(content=content, metadata=meta)
    size, count = records.flower_size(msg)
    objects = get_all_nested_objects(msg)  # Flower's own walk, every id recomputed
    assert count == len(objects) >= 6  # Message, RecordDict, three records, an Array and its chunks
    assert size == sum(len(o.deflate()) for o in objects.values()) > 600 * 1000 * 4

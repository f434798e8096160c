"""The wrapped strategy's server state (FedAvgM's momentum, FedOpt's moments) across an async checkpoint: a resumed
run makes the model an uninterrupted one makes; a strategy whose state is not known is refused for checkpoints."""

from __future__ import annotations

import io
import pickle

import numpy as np
import pytest
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
from flwr.serverapp.strategy import FedAdam, FedAvg, FedAvgM

from benchmarks import compatkit
from benchmarks.flowerkit import server_identity
from fedcomp.flower import Compressed, compression_mod, records, strategystate
from fedcomp.flower.loopmode import _OneRound
from fedcomp.flower.options import WEIGHTED_MEAN_STRATEGIES
from fedcomp.registry import ConfigError

FAMILY = compatkit.FAMILIES["mlp"]
HALF = 3  # versions before the restart; the runs go to 2 * HALF


def _grid() -> compatkit.StagedGrid:
    app = compatkit.client_app(FAMILY, [compression_mod])
    return compatkit.StagedGrid({100 + i: (app, {"partition-id": i, "num-partitions": 2}) for i in range(2)}, {})


def _run(name: str, grid, out, versions: int, **kw) -> list[np.ndarray]:
    # one task at a time (concurrency 1), K = 2: nothing is in flight when a version is made, so the restart loses
    # no update and both runs see the same replies in the same order (the train seed is the version)
    strategy = Compressed(compatkit.STRATEGIES[name](2), "topk", density=0.1, mode="async", buffer_size=2,
                          concurrency=1, out_dir=str(out), checkpoint_every=1, **kw)
    with server_identity():
        result = strategy.start(grid, FAMILY.record(FAMILY.build()), num_rounds=versions, timeout=30.0,
                                train_config=ConfigRecord({"lr": compatkit.LR}))
    assert strategy.proto.version == versions
    return [np.array(result.arrays[n].numpy()) for n in result.arrays.keys()]


@pytest.mark.parametrize("name", ["FedAvgM", "FedAdam", "FedYogi", "FedAdagrad"])
def test_a_resumed_run_makes_the_model_an_uninterrupted_run_makes(name, tmp_path, monkeypatch):
    whole = _run(name, _grid(), tmp_path / "whole", 2 * HALF)

    def halves(out):
        grid = _grid()  # the same nodes (their context.state) across the server restart
        _run(name, grid, out, HALF)
        return _run(name, grid, out, 2 * HALF, resume=str(out / "checkpoint.pt"))

    resumed = halves(tmp_path / "kept")
    assert all(np.array_equal(a, b) for a, b in zip(whole, resumed, strict=True))
    # the same restart with the strategy's state lost (momentum / moments from zero) makes another model: the
    # assertion above is one this test can fail
    monkeypatch.setattr(strategystate, "restore", lambda strategy, saved: None)
    lost = halves(tmp_path / "lost")
    assert max(float(np.abs(a - b).max()) for a, b in zip(whole, lost, strict=True)) > 1e-4


def _reply(arrays: ArrayRecord) -> Message:
    content = RecordDict({"arrays": arrays, "metrics": MetricRecord({"num-examples": 10})})
    return Message(content, 0, records.TRAIN)


@pytest.mark.parametrize("cls", list(strategystate.STRATEGY_STATE), ids=lambda c: c.__name__)
def test_the_registry_names_every_attribute_a_round_changes(cls):
    """Two rounds of configure_train + aggregate_train change no attribute of the strategy outside
    ``STRATEGY_STATE[cls]`` (a Flower release that adds state fails here), and every one it names exists."""
    strategy = cls(min_available_nodes=1, min_train_nodes=1)
    names = strategystate.STRATEGY_STATE[cls]
    assert all(hasattr(strategy, n) for n in names)
    before = {k: pickle.dumps(v) for k, v in vars(strategy).items() if k not in names}
    rng = np.random.default_rng(0)
    model = ArrayRecord({"w": Array(rng.normal(size=(3, 4)).astype(np.float32))})
    with server_identity():
        for version in (1, 2):
            list(strategy.configure_train(version, model, ConfigRecord(), _OneRound(1)))
            moved = ArrayRecord({"w": Array(model["w"].numpy() - 0.1 * rng.normal(size=(3, 4)).astype(np.float32))})
            model, _ = strategy.aggregate_train(version, [_reply(moved)])
    after = {k: pickle.dumps(v) for k, v in vars(strategy).items() if k not in names}
    assert after == before, sorted(k for k in after if after[k] != before.get(k))


def _flat(value) -> list[tuple[object, np.ndarray]] | None:
    """(key or index, array) pairs of a state value, in order; None for None."""
    if value is None:
        return None
    if isinstance(value, ArrayRecord):
        return [(k, a.numpy()) for k, a in value.items()]
    return list(value.items()) if isinstance(value, dict) else list(enumerate(value))


def test_the_state_round_trips_exactly_through_a_weights_only_checkpoint():
    adam = FedAdam()
    adam.current_arrays = {"a": np.arange(6, dtype=np.float32).reshape(2, 3), "b": np.ones(2, dtype=np.float64)}
    adam.m_t = {"a": np.full((2, 3), 0.25, dtype=np.float32), "b": np.zeros(2)}
    momentum = FedAvgM(server_momentum=0.9)
    momentum.current_arrays = ArrayRecord({"z": Array(np.arange(4, dtype=np.float16))})
    momentum.momentum_vector = [np.full(4, 3.0, dtype=np.float16)]
    for strategy in (adam, momentum):
        buf = io.BytesIO()
        torch.save(strategystate.save(strategy), buf)
        buf.seek(0)
        back = type(strategy)()
        strategystate.restore(back, torch.load(buf, weights_only=True))
        for n in strategystate.STRATEGY_STATE[type(strategy)]:
            want, got = _flat(getattr(strategy, n)), _flat(getattr(back, n))
            assert type(getattr(back, n)) is type(getattr(strategy, n)), n
            if want is None:
                continue
            assert [k for k, _ in want] == [k for k, _ in got], n
            assert all(a.dtype == b.dtype and np.array_equal(a, b) for (_, a), (_, b) in zip(want, got, strict=True))


def test_every_strategy_async_mode_takes_has_its_state_known():
    assert set(strategystate.STRATEGY_STATE) == set(WEIGHTED_MEAN_STRATEGIES)


def test_the_state_of_another_class_or_an_unknown_one_is_refused(tmp_path, monkeypatch):
    with pytest.raises(ConfigError, match="holds the state of 'FedAvgM', this run wraps FedAdam"):
        strategystate.restore(FedAdam(), strategystate.save(FedAvgM()))
    assert strategystate.save(FedAvg()) == {"class": "FedAvg", "state": {}}
    # a class whose state is not known: no checkpoints (and no resume) rather than one that loses its state
    monkeypatch.delitem(strategystate.STRATEGY_STATE, FedAvgM)
    with pytest.raises(ConfigError, match="FedAvgM keeps between rounds is not known"):
        Compressed(FedAvgM(), mode="async", out_dir=str(tmp_path), checkpoint_every=2)
    Compressed(FedAvgM(), mode="async", out_dir=str(tmp_path))  # without checkpoints it runs


def test_a_version_is_stepped_from_the_current_model_even_when_no_task_of_it_was_sent(monkeypatch):
    """FedOpt notes the model it sends in ``configure_train`` and steps from it in ``aggregate_train``. A run stops
    right after its last version, before any task of it is sent; one more step then (as when the replies of tasks
    queued earlier make a version before a task of the current one leaves) must still start from the current
    model, not from the one before (``StrategyBuffer.prepare``)."""
    updates, seen = [], []
    wrapped = Compressed(compatkit.STRATEGIES["FedAdam"](2), "topk", density=0.1, mode="async", buffer_size=1)
    monkeypatch.setattr(type(wrapped), "audit", lambda self, update, staleness: updates.append(update))
    real = FedAdam.aggregate_train

    def spy(self, server_round, replies):
        current = wrapped.proto.buffer.current
        seen.append(all(np.array_equal(self.current_arrays[k], current[k].numpy()) for k in current.keys()))
        return real(self, server_round, replies)

    monkeypatch.setattr(FedAdam, "aggregate_train", spy)
    with server_identity():
        wrapped.start(_grid(), FAMILY.record(FAMILY.build()), num_rounds=3, timeout=30.0,
                      train_config=ConfigRecord({"lr": compatkit.LR}))
        buffer = wrapped.proto.buffer
        buffer.add(updates[-1], 1.0)
        buffer.step()
    assert buffer.version == 4 and len(seen) == 4 and all(seen), seen

"""A method run by fedcomp's public strategy: ``Compressed(FedAvg(), mode=..., ...)`` on fedcomp's loop (sync
rounds: ``loop="fedcomp"``), started with the
simulator's runtime (``fedcomp.flower.looprun.Runtime``: a ``VirtualTransport`` over the in-process engine, which
sends the strategy's own messages to the product's ClientApp, and the virtual clock). The row is what a Flower
user's app gets from the two lines, in the time and bytes the simulator charges any row; the method's scenario key
``server = "strategy"`` picks it (``simulations.scenario.SERVERS``).

The method's run config becomes the strategy's keywords (``compressed_for``); what has no counterpart there is
refused before anything runs (``ConfigError``): the Ray engine. The server optimizer picks the
wrapped strategy (``fedcomp.task.strategyargs``: ``sgd`` at rate 1 is FedAvg, FedBuff's step).

    >>> strategy = compressed_for(method.run)  # doctest: +SKIP
    >>> strategy.options.loop_options.buffer_size == method.run.buffer_size  # doctest: +SKIP
    True
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
from flwr.app import ArrayRecord, MetricRecord
from flwr.common.logger import FLOWER_LOGGER
from flwr.serverapp import strategy as strategies

from fedcomp.flower import Compressed
from fedcomp.flower.identity import server_identity
from fedcomp.flower.looprun import Runtime
from fedcomp.registry import ConfigError
from fedcomp.sim.virtual import Engine, VirtualClock, VirtualTransport
from fedcomp.task.config import RunConfig
from fedcomp.task.heap import keep_freed_memory
from fedcomp.task.strategyargs import compressed_kwargs, wrapped_strategy
from fedcomp.task.training import datasets, evaluate, make_model, run_loss
from simulations.engines import RUN_ID
from simulations.runner import MethodResult, RowWriter, method_result, node_profiles
from simulations.scenario import Method, Scenario


def compressed_for(run: RunConfig) -> Compressed:
    """``Compressed(<Flower strategy>, mode=run.mode)`` on fedcomp's loop for ``run`` (``fedcomp.task.strategyargs``:
    the strategy by ``server_optimizer``, FedAvg for FedBuff's; ``ConfigError`` for what it has no counterpart of)."""
    name, kwargs = wrapped_strategy(run)
    return Compressed(getattr(strategies, name)(**kwargs), **compressed_kwargs(run))


@contextlib.contextmanager
def _flower_quiet() -> Iterator[None]:
    """Flower's and the strategy's per-round INFO lines off (the simulator shows its own progress); warnings stay."""
    level = FLOWER_LOGGER.level
    FLOWER_LOGGER.setLevel(max(level, logging.WARNING))
    try:
        yield
    finally:
        FLOWER_LOGGER.setLevel(level)


def drive_strategy(
    scenario: Scenario, method: Method, engine: Engine, node_index: dict[int, int], out_dir: Path | None,
    times: Callable[[], dict[str, float]] = dict,
) -> MethodResult:
    """``method`` run by ``compressed_for(method.run)`` over ``engine`` (in process: its ``messages`` become the
    strategy's) in virtual time; the same rows, summary and per-node figures as the product's loops give."""
    run = method.run
    if not hasattr(engine, "messages"):
        raise ConfigError(f"method {method.name}: server = \"strategy\" runs on the in-process engine")
    strategy = compressed_for(run)
    torch.set_num_threads(scenario.sim.threads)
    keep_freed_memory()
    t0 = time.perf_counter()
    train, test = datasets(run)
    model = make_model(run, train)
    nodes = node_profiles(scenario, node_index)
    clock = VirtualClock()
    rows = RowWriter(scenario, method, out_dir, t0)
    made: list[VirtualTransport] = []

    def transport(mod: Any) -> VirtualTransport:
        engine.messages = mod  # type: ignore[attr-defined]  # the engine sends the strategy's messages
        made.append(VirtualTransport(engine, nodes, clock, scenario.timing(method)))
        return made[0]

    def server_eval(version: int, arrays: ArrayRecord) -> MetricRecord:
        state = {k: torch.from_numpy(np.asarray(arrays[k].numpy())) for k in arrays}
        model.load_state_dict(state, strict=False)
        res = evaluate(model, test, torch.device("cpu"), loss=run_loss(run))
        return MetricRecord({"accuracy": res["accuracy"], "loss": res["loss"]})

    arrays = ArrayRecord(model.state_dict())
    runtime = Runtime(transport, clock, on_row=lambda row: rows(row, made[0]))
    try:
        with server_identity(RUN_ID), _flower_quiet():
            timeout = run.round_timeout if run.mode == "sync" else run.task_timeout
            strategy.start(grid=None, initial_arrays=arrays, num_rounds=run.num_versions, timeout=timeout,
                           evaluate_fn=server_eval, runtime=runtime)
    finally:
        rows.close()
        for t in made:
            t.close()
    return method_result(scenario, method, strategy.proto, strategy.loop, strategy.reporter, clock, made[0], t0,
                         times)

"""A method run by fedcomp's public strategy: ``Compressed(FedAvg(), mode="async", ...)``, started with the
simulator's runtime (``fedcomp.flower.asyncrun.Runtime``: a ``VirtualTransport`` over the in-process engine, which
sends the strategy's own messages to the product's ClientApp, and the virtual clock). The row is what a Flower
user's app gets from the two lines, in the time and bytes the simulator charges any row; the method's scenario key
``server = "strategy"`` picks it (``simulations.scenario.SERVERS``).

The method's run config becomes the strategy's keywords (``compressed_for``); what has no counterpart there is
refused before anything runs (``ConfigError``): a sync method, a server step other than FedAvg's (``sgd``, rate 1,
no momentum: FedBuff), the Ray engine.

    >>> strategy = compressed_for(method.run)  # doctest: +SKIP
    >>> strategy.options.async_config.buffer_size == method.run.buffer_size  # doctest: +SKIP
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
from flwr.serverapp.strategy import FedAvg

from fedcomp.downlink import DOWNLINKS
from fedcomp.flower import Compressed
from fedcomp.flower.asyncrun import Runtime
from fedcomp.flower.identity import server_identity
from fedcomp.registry import ConfigError
from fedcomp.sim.virtual import Engine, VirtualClock, VirtualTransport
from fedcomp.task.config import RunConfig
from fedcomp.task.heap import keep_freed_memory
from fedcomp.task.training import datasets, evaluate, make_model, run_loss
from simulations.engines import RUN_ID
from simulations.runner import MethodResult, RowWriter, method_result, node_profiles
from simulations.scenario import Method, Scenario


def compressed_for(run: RunConfig) -> Compressed:
    """``Compressed(FedAvg(), mode="async")`` with ``run``'s compression, downlink, FedBuff rules and loop options;
    ``ConfigError`` for what the strategy has no counterpart of."""
    if run.mode != "async":
        raise ConfigError(f"the public strategy runs async methods here, not mode {run.mode!r}")
    if (run.server_optimizer, float(run.server_lr), float(run.server_momentum)) != ("sgd", 1.0, 0.0):
        raise ConfigError("the public strategy's server step is FedAvg's (server_optimizer sgd, server_lr 1, "
                          f"no momentum), not {run.server_optimizer} lr {run.server_lr} momentum {run.server_momentum}")
    history = run.downlink_kwargs.get("history")
    default = getattr(DOWNLINKS.make_config(run.downlink), "history", history)
    if history != default:  # the strategy's downlink keeps its own default history
        raise ConfigError(f"the public strategy's {run.downlink} downlink keeps {default} versions, not {history}: "
                          f"set downlink_options history={history}")
    return Compressed(
        FedAvg(min_available_nodes=max(1, run.min_clients)), run.compressor, memory=run.memory,
        downlink=run.downlink, downlink_options=run.downlink_options, max_update_bytes=run.max_update_bytes,
        max_update_norm=run.max_update_norm, mode="async", buffer_size=run.buffer_size,
        max_staleness=run.max_staleness, staleness=run.staleness, staleness_options=run.staleness_options,
        normalize=run.effective_normalize, concurrency=run.concurrency, prefetch=run.prefetch,
        prefetch_lead=run.prefetch_lead, poll_interval=run.poll_interval, node_wait=run.node_wait,
        max_failures=run.max_failures, run_timeout=run.run_timeout, eval_every=run.eval_every,
        balance=run.balance, aggregate_device=run.aggregate_device, **run.compressor_kwargs,
    )


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
            strategy.start(grid=None, initial_arrays=arrays, num_rounds=run.num_versions, timeout=run.task_timeout,
                           evaluate_fn=server_eval, runtime=runtime)
    finally:
        rows.close()
        for t in made:
            t.close()
    return method_result(scenario, method, strategy.proto, strategy.loop, strategy.reporter, clock, made[0], t0,
                         times)

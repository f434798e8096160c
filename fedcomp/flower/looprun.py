"""One run of ``Compressed`` on fedcomp's loop (``mode="async"``, or sync with ``loop="fedcomp"``): ``start``
builds the ledger (``ServerProtocol``), the strategy's buffer, the task messages (``ModTransport``), the run files
and federated evaluation, and runs the product's loop of the mode (``fedcomp.server.loops.LOOPS``: ``AsyncLoop``,
``SyncLoop``) for ``num_rounds`` versions (the rules: ``fedcomp.flower.loopmode``).

Where the tasks travel and whose time the run keeps is its ``Runtime``: by default the ``Grid`` Flower gives
``Compressed.start`` (a deployment, ``flwr run``, ``run_simulation``) and the wall clock, every task and reply
metered for the wire figures (``fedcomp.sim.wirecost.MeteredTransport``). The one-machine simulator passes its own:
a virtual transport over its engines, which send ``ModTransport``'s messages to the product's ClientApp, and its
virtual clock, so the simulator's ``server = "strategy"`` rows are this very strategy's runs::

    runtime = Runtime(lambda mod: VirtualTransport(engine.speaking(mod), nodes, clock, timing), clock)
    strategy.start(grid=None, initial_arrays=arrays, num_rounds=50, evaluate_fn=evaluate, runtime=runtime)
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from logging import INFO, WARNING
from typing import Any

import numpy as np
import torch
from flwr.app import ArrayRecord, ConfigRecord, MetricRecord
from flwr.common.logger import log
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Result

from fedcomp.flower import meter, runfiles
from fedcomp.flower.asynceval import FederatedEvaluation
from fedcomp.flower.loopmode import LoopOptions, ModTransport, StrategyBuffer
from fedcomp.protocol import ProtocolConfig
from fedcomp.registry import ConfigError
from fedcomp.server import ServerProtocol
from fedcomp.server.loops import LOOPS, Clock, LoopConfig, Reporter, Transport
from fedcomp.server.optimizers import SERVER_OPTIMIZERS
from fedcomp.server.selection import ClientSelection
from fedcomp.server.staleness import STALENESS
from fedcomp.server.stats import VersionStats
from fedcomp.sim.wirecost import MeteredTransport, TaskClock
from fedcomp.task.serverside import check_versions_left


@dataclass(frozen=True)
class Runtime:
    """Where a run's tasks travel, when not over the Grid: ``transport(mod)`` is the ``Transport`` the loop
    uses, around ``mod`` (the ``ModTransport`` that writes every task and reads every reply); ``clock`` the loop's
    and the rows' clock; ``on_row(row)`` is called with each version's row (after the run's own bookkeeping).
    Such a run writes no run files (``out_dir``) and has no federated evaluation (both need the Grid)."""

    transport: Callable[[ModTransport], Transport]
    clock: Clock
    on_row: Callable[[dict[str, Any]], None] | None = None


def _check_budget(num_rounds: Any, timeout: Any) -> None:
    """``start``'s ``num_rounds`` (versions) and ``timeout`` (seconds a task may take): ``ConfigError`` if bad."""
    if isinstance(num_rounds, bool) or not isinstance(num_rounds, int) or num_rounds < 1:
        raise ConfigError(f"num_rounds must be an int >= 1 (model versions on fedcomp's loop), got {num_rounds!r}")
    if not (isinstance(timeout, (int, float)) and timeout > 0 and math.isfinite(timeout)):
        raise ConfigError(f"timeout must be a finite number of seconds > 0, got {timeout!r}")


def start(
    wrapper: Any,
    grid: Grid | None,
    initial_arrays: ArrayRecord,
    num_rounds: int,
    timeout: float,
    train_config: ConfigRecord | None,
    evaluate_fn: Callable[[int, ArrayRecord], MetricRecord | None] | None,
    evaluate_config: ConfigRecord | None = None,
    runtime: Runtime | None = None,
) -> Result:
    """``Compressed.start`` on fedcomp's loop: ``num_rounds`` versions of the mode's loop. ``timeout``: the seconds
    a task may take before it is nacked (a sync round's deadline; a federated evaluation's too). Returns Flower's
    ``Result`` (the final model, per-version train metrics with fedcomp's counts, ``evaluate_fn``'s metrics per
    version, with ``fed_eval_every`` the federated evaluations' metrics). The run's ``ServerProtocol``, loop and
    reporter stay on ``wrapper`` (``proto``, ``loop``, ``reporter``) for the caller's figures."""
    cfg: LoopOptions = wrapper.options.loop_options
    if runtime is not None and (cfg.out_dir or cfg.fed_eval_every):
        raise ConfigError("out_dir and fed_eval_every need the Grid's runtime (Compressed.start without runtime=)")
    _check_budget(num_rounds, timeout)
    started = time.monotonic()
    current = wrapper.begin(initial_arrays)
    mode = wrapper.options.mode
    proto = _protocol(wrapper, cfg, float(timeout), current)
    wire_before = None
    if cfg.resume:
        current, wire_before = runfiles.resume(proto, cfg.resume, current, wrapper.layout, wrapper.strategy,
                                               wrapper.compression)
        check_versions_left(proto.version, num_rounds, cfg.resume)
    buffer = proto.buffer = StrategyBuffer(proto, wrapper, current, proto.config)
    wrapper.proto = proto
    result = Result()
    mod = ModTransport(grid, wrapper, buffer, train_config or ConfigRecord(), pull_interval=cfg.poll_interval,
                       max_reads_per_s=cfg.max_reads_per_s)
    buffer.prepare = mod.template
    clock = TaskClock(start=started)  # which node held which task when: the wire model's polls (summary.json)
    if wire_before is not None:
        clock.resumed(wire_before, proto.totals.to_dict())  # the wire bytes before the checkpoint count too
    transport = MeteredTransport(mod, clock) if runtime is None else runtime.transport(mod)
    reporter = wrapper.reporter = _reporter(wrapper, cfg, buffer, evaluate_fn, result, runtime,
                                            lambda: clock.counts(_totals_now(proto), time.monotonic()))
    fed = _federated(wrapper, grid, reporter, num_rounds, evaluate_config, float(timeout), result)
    loop = wrapper.loop = LOOPS.get(mode)(proto, transport, _loop_config(wrapper, cfg, num_rounds, float(timeout)),
                                          reporter, clock=runtime.clock if runtime is not None else None,
                                          log=lambda s: log(WARNING, "[fedcomp] %s", s))
    _announce(mode, cfg, num_rounds, float(timeout))
    loop.run()
    unread = transport.drain() if isinstance(transport, MeteredTransport) else 0  # on the wire, never handled
    proto.roll_stats()
    wrapper.totals = proto.totals
    if cfg.out_dir:
        runfiles.write_summary(cfg, wrapper, reporter, loop, num_rounds, time.monotonic() - started, clock,
                               fed_eval=fed.rows if fed is not None else None, meter=transport, unread=unread)
    if not loop.completed:
        log(WARNING, "[fedcomp] %s run stopped at version %d of %d: %s", mode, proto.version, num_rounds,
            loop.stopped_reason)
    result.arrays = buffer.current
    return result


def _announce(mode: str, cfg: LoopOptions, num_rounds: int, timeout: float) -> None:
    """The run's first log line: its mode and the rules it runs by."""
    if mode == "async":
        log(INFO, "[fedcomp] async: %d versions, K=%d, max staleness %d, staleness %s %s", num_rounds,
            cfg.buffer_size, cfg.max_staleness, cfg.staleness, cfg.staleness_options)
    else:
        log(INFO, "[fedcomp] sync rounds on fedcomp's loop: %d versions, over-selection %g, round timeout %gs",
            num_rounds, cfg.over_selection, timeout)


def _totals_now(proto: ServerProtocol) -> dict[str, Any]:
    """The run's totals so far: those of the versions made and the counters since the last one."""
    totals = VersionStats()
    totals.merge(proto.totals)
    totals.merge(proto.stats)
    return totals.to_dict()


def _reporter(wrapper: Any, cfg: LoopOptions, buffer: StrategyBuffer,
              evaluate_fn: Callable[[int, ArrayRecord], MetricRecord | None] | None, result: Result,
              runtime: Runtime | None, wire: Callable[[], Any]) -> Reporter:
    """The run's rows: ``evaluate_fn`` of each evaluated version and the train metrics of each version go into
    ``result``; then the runtime's ``on_row``. ``wire``: the run's wire counts so far, for its checkpoints (none
    on a runtime's transport, which meters no wire)."""
    proto = wrapper.proto

    def evaluate(params: dict[str, torch.Tensor]) -> dict[str, float]:
        del params  # the full model (dense arrays too) is the buffer's
        res = evaluate_fn(proto.version, buffer.current) if evaluate_fn is not None else None
        if res is None:
            return {}
        result.evaluate_metrics_serverapp[proto.version] = res
        return {k: float(v) for k, v in res.items() if isinstance(v, (int, float))}

    def progress(row: dict[str, Any]) -> None:
        result.train_metrics_clientapp[row["version"]] = meter.round_metrics(
            buffer.metrics, row, wrapper.spec.dense_bytes, row["version"]
        )
        if runtime is not None and runtime.on_row is not None:
            runtime.on_row(row)

    clock = runtime.clock if runtime is not None else None
    return runfiles.reporter(cfg, proto, buffer, evaluate if evaluate_fn is not None else None, progress, clock,
                             wire if runtime is None else None)


def _federated(wrapper: Any, grid: Grid | None, reporter: Reporter, num_rounds: int, config: ConfigRecord | None,
               timeout: float, result: Result) -> FederatedEvaluation | None:
    """The run's federated evaluation between versions, run by ``reporter`` as it writes each version's row,
    waiting ``fed_eval_timeout`` (else ``timeout``) for the replies (``None`` without ``fed_eval_every``)."""
    every, proto = wrapper.options.loop_options.fed_eval_every, wrapper.proto
    if not every or grid is None:
        if getattr(wrapper.strategy, "fraction_evaluate", 0.0):
            log(INFO, "[fedcomp] no federated evaluation (fed_eval_every=0): fraction_evaluate is not used")
        return None
    wait = wrapper.options.loop_options.fed_eval_timeout or timeout
    fed = FederatedEvaluation(wrapper.strategy, grid, lambda: proto.buffer.current, every, num_rounds,
                              config or ConfigRecord(), wait, result)
    reporter.row_hooks.append(lambda: fed(proto.version))  # its metrics go into the version's metrics.jsonl row
    return fed


def _protocol(wrapper: Any, cfg: LoopOptions, timeout: float, current: ArrayRecord) -> ServerProtocol:
    """The ledger and buffer of the run: FedBuff's rules (K, S, the staleness weight) in async mode; sync rounds
    step when a round closes, every reply weighed by its examples (FedAvg's mean); ``timeout`` per task, acks held
    until a checkpoint holds their update when there are checkpoints."""
    sync = wrapper.options.mode == "sync"
    config = ProtocolConfig.of_mode(
        wrapper.options.mode, buffer_size=cfg.buffer_size, max_staleness=cfg.max_staleness, normalize=cfg.normalize,
        task_timeout=timeout, max_blob_bytes=wrapper.options.protocol.max_blob_bytes,
        max_update_norm=wrapper.options.protocol.max_update_norm, prefetch=cfg.prefetch,
        durable_acks=cfg.checkpoint_every > 0, balance=cfg.balance, aggregate_device=cfg.aggregate_device,
    )
    floats = {n: torch.from_numpy(current[n].numpy().astype(np.float32)) for n in wrapper.spec.names}
    staleness = STALENESS.build("constant") if sync else STALENESS.build(cfg.staleness, **cfg.staleness_kwargs)
    return ServerProtocol(wrapper.spec, floats, SERVER_OPTIMIZERS.build("sgd", lr=1.0), staleness, config)


def _loop_config(wrapper: Any, cfg: LoopOptions, num_rounds: int, timeout: float) -> LoopConfig:
    """The loop's options; a sync round selects as the wrapped strategy samples (``fraction_train``, at least
    ``min_train_nodes``) times ``1 + over_selection`` and lasts at most ``timeout`` seconds."""
    strategy = wrapper.strategy
    minimum = max(int(getattr(strategy, "min_train_nodes", 1)), 1)
    selection = ClientSelection(float(getattr(strategy, "fraction_train", 1.0)), minimum, cfg.over_selection)
    return LoopConfig(
        num_versions=num_rounds, concurrency=cfg.concurrency, selection=selection, round_timeout=timeout,
        min_clients=max(_min_nodes(strategy), minimum if wrapper.options.mode == "sync" else 1),
        run_timeout=cfg.run_timeout, node_wait=cfg.node_wait, poll_interval=cfg.poll_interval,
        max_failures=cfg.max_failures, downlink=wrapper.compression.downlink,
        downlink_options=wrapper.options.downlink_kwargs, auto_density=wrapper.compression.auto_density,
        prefetch_lead=cfg.prefetch_lead,
    )


def _min_nodes(strategy: Any) -> int:
    return max(int(getattr(strategy, "min_available_nodes", 1)), 1)

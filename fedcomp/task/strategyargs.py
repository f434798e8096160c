"""The product's run config as fedcomp's public strategy: ``Compressed(<Flower strategy>, mode=..., ...)`` on
fedcomp's loop (async, or sync rounds with ``loop="fedcomp"``).

The product's ServerApp and the simulator's ``server = "strategy"`` methods build their strategy from a
``RunConfig`` here, so both read the run's keys the same way:

* ``wrapped_strategy(run)``: the Flower strategy ``Compressed`` wraps, by ``server-optimizer`` (``WRAPPED``):
  ``sgd`` at rate 1 without momentum is ``FedAvg`` (FedBuff); ``sgd`` otherwise ``FedAvgM`` (its
  ``server_learning_rate`` and ``server_momentum``: the same step as fedcomp's ``sgd``); ``adam``, ``yogi`` and
  ``adagrad`` are Flower's ``FedAdam``, ``FedYogi`` and ``FedAdagrad`` with ``eta`` = ``server-lr`` and
  fedcomp's defaults for the rest, under Flower's rules (Flower's FedAdam corrects its rate for the moments'
  bias, fedcomp's sync ``adam`` does not);
  a sync run samples as the run config selects (``fraction``, at least ``min-clients``);
* ``compressed_kwargs(run)``: ``Compressed``'s keywords (compression, downlink, FedBuff's rules or the sync
  rounds' over-selection, the loop's options); what has no counterpart there is a ``ConfigError`` before anything
  runs;
* ``unused_keys(run)``: the keys only the other mode reads (``MODE_KEYS``) set to other than their default (the
  product's ServerApp warns of them).

No Flower import here: the caller builds the strategy (``getattr(flwr.serverapp.strategy, name)(**kwargs)``).

>>> wrapped_strategy(RunConfig(server_lr=0.5, server_momentum=0.9))
('FedAvgM', {'min_available_nodes': 1, 'server_learning_rate': 0.5, 'server_momentum': 0.9})
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from fedcomp.downlink import DOWNLINKS
from fedcomp.registry import ConfigError
from fedcomp.server.optimizers import AdaptiveConfig
from fedcomp.task.config import RunConfig, parse_options

#: Seconds between the server's reads of the replies it awaits, as the product's sync loop reads them (the Grid
#: transport's default, what the simulator charges): ``Compressed``'s ``poll_interval`` is both the loop's longest
#: wait and this interval, the run config's ``poll-interval`` the loop's longest wait only.
READ_INTERVAL_S = 0.25


def _sgd(run: RunConfig) -> tuple[str, dict[str, Any]]:
    if (float(run.server_lr), float(run.server_momentum)) == (1.0, 0.0):
        return "FedAvg", {}
    return "FedAvgM", {"server_learning_rate": float(run.server_lr), "server_momentum": float(run.server_momentum)}


def _adaptive(name: str) -> Callable[[RunConfig], tuple[str, dict[str, Any]]]:
    defaults = AdaptiveConfig()

    def wrapped(run: RunConfig) -> tuple[str, dict[str, Any]]:
        return name, {"eta": float(run.server_lr), "beta_1": defaults.beta1, "beta_2": defaults.beta2,
                      "tau": defaults.eps}

    return wrapped


#: ``server-optimizer`` -> the Flower strategy (class name in ``flwr.serverapp.strategy``) and its keywords.
WRAPPED: dict[str, Callable[[RunConfig], tuple[str, dict[str, Any]]]] = {
    "sgd": _sgd,
    "adam": _adaptive("FedAdam"),
    "yogi": _adaptive("FedYogi"),
    "adagrad": _adaptive("FedAdagrad"),
}


def wrapped_strategy(run: RunConfig) -> tuple[str, dict[str, Any]]:
    """The Flower strategy ``Compressed`` wraps for ``run``: its class name and keywords (``WRAPPED``); it waits
    for ``min-clients`` nodes, and a sync round trains ``fraction`` of them, at least ``min-clients`` (federated
    evaluation: ``fed-eval``, ``compressed_kwargs``)."""
    if run.server_optimizer not in WRAPPED:
        raise ConfigError(f"server-optimizer {run.server_optimizer!r} has no Flower strategy to run it async "
                          f"(known: {', '.join(WRAPPED)})")
    name, own = WRAPPED[run.server_optimizer](run)
    nodes = max(1, run.min_clients)
    rounds = {"fraction_train": float(run.fraction), "min_train_nodes": nodes} if run.mode == "sync" else {}
    return name, {"min_available_nodes": nodes} | rounds | own


#: The run config's keys that one mode reads and the other does not (``normalize`` is ``RunConfig``'s own check;
#: a config may give both deadlines, ``task-timeout`` and ``round-timeout``: each mode reads its own)
MODE_KEYS: dict[str, tuple[str, ...]] = {
    "async": ("buffer_size", "max_staleness", "staleness", "staleness_options", "balance", "concurrency", "prefetch",
              "prefetch_lead"),
    "sync": ("fraction", "over_selection"),
}


def unused_keys(run: RunConfig) -> str:
    """The keys only the other mode reads (``MODE_KEYS``) that ``run`` sets to other than their default, as
    ``key=value`` (``""``: none): the product's ServerApp warns of them, where ``Compressed`` refuses the other
    mode's keywords (a run config is layered, and one may hold the keys of both modes).

    >>> unused_keys(RunConfig(mode="sync", buffer_size=4, concurrency=3))
    'buffer-size=4, concurrency=3'
    """
    other = "sync" if run.mode == "async" else "async"
    defaults = {f.name: f.default for f in dataclasses.fields(RunConfig)}
    return ", ".join(f"{n.replace('_', '-')}={getattr(run, n)!r}" for n in MODE_KEYS[other]
                     if getattr(run, n) != defaults[n])


def compressed_kwargs(run: RunConfig, **files: Any) -> dict[str, Any]:
    """``Compressed``'s keywords for ``run`` on fedcomp's loop: the compression and downlink, FedBuff's rules
    (async) or the rounds' over-selection (sync), and the loop's options; ``files``: ``out_dir``,
    ``checkpoint_every``, ``resume`` (``LoopOptions``). ``downlink-history`` reaches the strategy in its
    ``downlink_options`` (only when it is not the downlink's default: the tasks' config stays as it was)."""
    downlink_options, history = run.downlink_options, run.downlink_kwargs.get("history")
    given = "history" in parse_options(run.downlink_options, "downlink-options")
    if not given and history != getattr(DOWNLINKS.make_config(run.downlink), "history", history):
        downlink_options = f"{downlink_options} history={history}".strip()  # downlink-history, not the default
    if run.mode == "async":
        mode = {
            "mode": "async", "buffer_size": run.buffer_size, "max_staleness": run.max_staleness,
            "staleness": run.staleness, "staleness_options": run.staleness_options,
            "normalize": run.effective_normalize, "concurrency": run.concurrency, "prefetch": run.prefetch,
            "prefetch_lead": run.prefetch_lead, "balance": run.balance,
        }
    else:
        mode = {"mode": "sync", "loop": "fedcomp", "over_selection": run.over_selection}
    return {
        "compressor": run.compressor, "memory": run.memory, "downlink": run.downlink,
        "downlink_options": downlink_options, "max_update_bytes": run.max_update_bytes,
        "max_update_norm": run.max_update_norm, **mode, "poll_interval": min(run.poll_interval, READ_INTERVAL_S),
        "node_wait": run.node_wait, "max_failures": run.max_failures, "run_timeout": run.run_timeout,
        "eval_every": run.eval_every, "fed_eval_every": (run.eval_every or run.num_versions) if run.fed_eval else 0,
        "fed_eval_timeout": run.fed_eval_timeout,
        "max_reads_per_s": run.max_reads_per_s, "aggregate_device": run.aggregate_device, "model_name": run.model,
        **files, **run.compressor_kwargs,
    }

"""``CompressionOptions``: what ``Compressed(strategy, ...)`` is asked to do, checked once, before any message.

A frozen record of the wrapper's configuration (the compression the clients run, how replies reach the wrapped
strategy, the ledger's rules, and on fedcomp's loop ``loopmode.LoopOptions``), built by ``CompressionOptions.of``
from ``Compressed``'s arguments: an unknown name, a bad option, a strategy that cannot be wrapped or cannot run
async all raise ``ConfigError`` there, so a run never starts with a configuration it would refuse later.

    >>> from flwr.serverapp.strategy import FedAvg
    >>> o = CompressionOptions.of(FedAvg(), "topk+int8", density=0.05)
    >>> o.compression.compressor, o.sparse, o.loop_options is None
    ('topk+int8', True, True)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from flwr.serverapp.strategy import (
    FedAdagrad,
    FedAdam,
    FedAvg,
    FedAvgM,
    FedProx,
    FedXgbBagging,
    FedXgbCyclic,
    FedYogi,
    Strategy,
)

from fedcomp.flower import loopmode, records
from fedcomp.flower.passthrough import StrategyWrapper
from fedcomp.protocol import ProtocolConfig
from fedcomp.registry import ConfigError
from fedcomp.task.config import Compression, parse_options

#: Strategies whose aggregation is the example-weighted mean of the replies (then their own server step): the
#: wrapper hands them that mean as one reply, computed in O(nnz). Exact types: a subclass may aggregate otherwise.
WEIGHTED_MEAN_STRATEGIES: frozenset[type] = frozenset({FedAvg, FedProx, FedAvgM, FedAdam, FedYogi, FedAdagrad})
AGGREGATIONS = ("auto", "sparse", "dense")
#: Strategies of ``flwr.serverapp.strategy`` with nothing to compress, and why (refused before the first round).
NOT_WRAPPABLE: dict[type, str] = {
    FedXgbBagging: "it exchanges serialized XGBoost models as one byte array, not float arrays",
    FedXgbCyclic: "it exchanges serialized XGBoost models as one byte array, not float arrays",
}
#: Other server-side objects people try to wrap, by class-name prefix.
REFUSED_NAMES = {
    "SecAgg": (
        "SecAgg+ masks and sums dense integer vectors of one fixed length, and fedcomp's updates are sparse, with "
        "indices of their own per client, so they cannot be masked-summed; use SecAgg+ without compression, "
        "or Compressed(...) without SecAgg+ (docs/flower.md, 'Secure aggregation')"
    ),
}

#: ``Compressed``'s compressor and its options when none are given (benchmarks/frontier.py decides them).
DEFAULT_COMPRESSOR = "dgc+int4"
DEFAULT_OPTIONS = {"density": 0.1, "warmup_epochs": 4}


def _fixed_density(compression: Compression) -> Compression:
    """``compression``, unless it asks for ``density=auto`` (``ConfigError``): that policy learns each node's link
    from when each reply arrives, which a strategy does not see."""
    if compression.auto_density is not None:
        raise ConfigError(
            "Compressed: density='auto' learns each node's link from when each reply arrives, which Flower's rounds "
            "do not show (Grid.send_and_receive returns a round's replies together); use a fixed density here, or "
            "fedcomp's loop (mode='async', or loop='fedcomp' for sync rounds), which sees each reply as it arrives"
        )
    return compression



def _protocol_config(max_update_bytes: int, max_update_norm: float) -> ProtocolConfig:
    """The ledger's rules under a round-based strategy: every reply of the round is weighed by its examples."""
    if isinstance(max_update_bytes, bool) or not isinstance(max_update_bytes, int) or max_update_bytes < 0:
        raise ConfigError(f"max_update_bytes must be an int >= 0 (0: the codec's bound), got {max_update_bytes!r}")
    return ProtocolConfig(
        buffer_size=0,
        max_staleness=0,
        normalize="weights",
        task_timeout=1e9,  # Flower's send_and_receive times the round out; the wrapper nacks what did not come
        backoff=0.0,
        max_blob_bytes=max_update_bytes,
        max_update_norm=max_update_norm,
        durable_acks=True,  # acks wait until the wrapped strategy returned a model
    )


def _loop(
    strategy: Strategy, aggregation: str, mode: str, loop: str, options: dict[str, Any], compression: Compression
) -> loopmode.LoopOptions | None:
    """The options of fedcomp's loop (``None`` under Flower's rounds); ``ConfigError`` for loop options or
    ``density=auto`` under Flower's rounds and for what fedcomp's loop cannot run (``loopmode.check``)."""
    if loop == "fedcomp":
        return loopmode.check(strategy, aggregation, type(strategy) in WEIGHTED_MEAN_STRATEGIES, options, mode)
    if options:
        raise ConfigError(f"{', '.join(sorted(options))}: options of fedcomp's loop (mode='async', or "
                          "loop='fedcomp' for sync rounds); this Compressed runs Flower's rounds")
    _fixed_density(compression)
    return None


def _check(strategy: object, aggregation: str, mode: str = "sync", loop: str = "flower") -> None:
    """``ConfigError`` saying why, for an unknown ``aggregation``, ``mode`` or ``loop``, for async mode on Flower's
    rounds and for what ``Compressed`` cannot wrap (``NOT_WRAPPABLE``, ``REFUSED_NAMES``)."""
    if aggregation not in AGGREGATIONS:
        raise ConfigError(f"aggregation must be one of {', '.join(AGGREGATIONS)}, got {aggregation!r}")
    if mode not in loopmode.MODES:
        raise ConfigError(f"mode must be one of {', '.join(loopmode.MODES)}, got {mode!r}")
    if loop not in loopmode.LOOPS:
        raise ConfigError(f"loop must be one of {', '.join(loopmode.LOOPS)}, got {loop!r}")
    if mode == "async" and loop == "flower":
        raise ConfigError("mode='async' runs on fedcomp's loop (Flower's rounds are sync): leave loop out")
    if isinstance(strategy, StrategyWrapper):  # Compressed(Compressed(...)): the inner one would take every reply
        raise ConfigError(f"Compressed wraps a Flower strategy once: {type(strategy).__name__}(...) is a fedcomp "
                          "wrapper already; wrap the strategy it holds")
    if isinstance(strategy, Strategy) and type(strategy) not in NOT_WRAPPABLE:
        return
    name = type(strategy).__name__
    why = NOT_WRAPPABLE.get(type(strategy)) or next(
        (w for prefix, w in REFUSED_NAMES.items() if name.startswith(prefix)), "it is not one"
    )
    raise ConfigError(f"Compressed wraps a flwr.serverapp.strategy.Strategy that trains arrays, not {name}: {why}")


@dataclass(frozen=True)
class CompressionOptions:
    """``Compressed``'s configuration (see ``Compressed`` for the parameters): ``compression`` (what each task
    tells the clients to run), ``sparse`` (the wrapped strategy gets one reply, the O(nnz) weighted mean) or one
    dense reply per client, the arrays that travel dense, the ledger's rules (``protocol``) and
    ``loop_options`` (fedcomp's loop: async mode, or ``loop="fedcomp"``; ``None``: Flower's rounds);
    ``weighted_by_key`` and ``arrays_key`` are the wrapped strategy's record keys."""

    compression: Compression
    sparse: bool
    dense_arrays: tuple[str, ...]
    protocol: ProtocolConfig
    loop_options: loopmode.LoopOptions | None
    mode: str = "sync"
    weighted_by_key: str = "num-examples"
    arrays_key: str = "arrays"
    downlink_kwargs: dict[str, Any] = field(default_factory=dict)

    @staticmethod
    def of(
        strategy: Strategy,
        compressor: str = DEFAULT_COMPRESSOR,
        *,
        memory: str = "residual",
        downlink: str = "dense",
        downlink_options: str = "",
        aggregation: str = "auto",
        max_update_bytes: int = 0,
        max_update_norm: float = 0.0,
        dense_arrays: tuple[str, ...] = records.DENSE_SUFFIXES,
        mode: str = "sync",
        loop: str | None = None,
        **options: Any,
    ) -> CompressionOptions:
        """Check every name and option (``ConfigError``); ``options``: the compressor's, and on fedcomp's loop
        those of ``loopmode.LoopOptions`` (fedcomp's loop; ``loop``: default ``"flower"`` in sync mode, async mode runs
        only on ``"fedcomp"``)."""
        loop = loop or ("fedcomp" if mode == "async" else "flower")
        _check(strategy, aggregation, mode, loop)
        if not isinstance(compressor, str):
            raise ConfigError(f"compressor must be a name such as 'dgc+int8', got {compressor!r}")
        if isinstance(dense_arrays, str) or not all(isinstance(n, str) for n in dense_arrays):
            raise ConfigError(f"dense_arrays must be a tuple of array-name suffixes, got {dense_arrays!r}")
        timing = loopmode.LoopOptions.take(options)
        if options == {} and compressor == DEFAULT_COMPRESSOR:
            options = dict(DEFAULT_OPTIONS)
        text = " ".join(f"{k}={v}" for k, v in options.items())
        compression = Compression(compressor, memory, text, downlink, downlink_options)
        return CompressionOptions(
            compression=compression,
            sparse=aggregation == "sparse" or (aggregation == "auto" and type(strategy) in WEIGHTED_MEAN_STRATEGIES),
            dense_arrays=tuple(dense_arrays),
            protocol=_protocol_config(max_update_bytes, max_update_norm),
            loop_options=_loop(strategy, aggregation, mode, loop, timing, compression),
            mode=mode,
            weighted_by_key=str(getattr(strategy, "weighted_by_key", "num-examples")),
            arrays_key=str(getattr(strategy, "arrayrecord_key", "arrays")),
            downlink_kwargs=parse_options(downlink_options, "downlink-options"),
        )

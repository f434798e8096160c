"""``Compressed(strategy)``: compressed uplink (and optionally downlink) for any Flower message-API strategy.

Wrap the strategy the app already uses, the way Flower's DP wrappers do::

    strategy = Compressed(FedAvg(fraction_train=0.5), compressor="dgc+int8", density=0.01)
    strategy.start(grid, ArrayRecord(model.state_dict()), num_rounds=10)

and add ``compression_mod`` to the ClientApp. Per round the wrapper

* **configure_train**: lets the wrapped strategy pick nodes and build its messages, opens one task per node in
  the ledger (``fedcomp.protocol.ServerProtocol``) and adds fedcomp's ConfigRecord: the compression to use and
  the acks/nacks of that node's earlier updates; with ``downlink=`` other than ``"dense"`` the model's float
  arrays travel as one compressed blob (``fedcomp.downlink``: ``fp16``, ``int8``, ``delta``);
* **aggregate_train**: decodes and validates every reply once (``ServerProtocol.admit``: duplicates, stale or
  malformed blobs, wrong model, NaN/Inf, oversize are counted rejections, never a crash), rebuilds what the
  wrapped strategy expects and calls its ``aggregate_train``. For the FedAvg family (FedAvg, FedProx, FedAvgM,
  FedAdam, FedYogi, FedAdagrad) the updates are summed sparsely (O(nnz), no dense copy per client) and the
  strategy sees one reply holding their weighted mean; any other strategy (FedMedian, Krum, the DP wrappers, your
  own) gets one dense reply per client, ``current - update``.
* keeps the ack/nack ledger: an update is acknowledged only once the wrapped strategy returned a model; replies
  that never came, were rejected, or a round whose aggregation returned nothing are nacked, and the client puts
  those updates back into its residual. ``Σ applied + Σ residuals + Σ pending = Σ computed`` at every round.

Per-round metrics are added to the train MetricRecord under ``fedcomp-*`` keys (payload and Flower object bytes
up and down, dense fp32 bytes, applied/rejected/lost counts); ``totals`` holds the whole run.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from logging import INFO, WARNING
from typing import Any

import numpy as np
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
from flwr.common.logger import log
from flwr.serverapp import Grid
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

from fedcomp.aggregate import SparseAccumulator
from fedcomp.downlink import build_broadcaster
from fedcomp.flower import records
from fedcomp.flower.config import Compression, parse_options
from fedcomp.payload import Update
from fedcomp.protocol import Outcome, ProtocolConfig
from fedcomp.registry import ConfigError
from fedcomp.server import ServerProtocol, VersionStats
from fedcomp.server_opt import SERVER_OPTIMIZERS
from fedcomp.spec import ModelSpec
from fedcomp.staleness import STALENESS

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


class Compressed(Strategy):
    """Wrap ``strategy`` so that clients running ``compression_mod`` send compressed updates with error feedback.

    ``compressor``, ``memory`` and ``**options`` name the client pipeline (``fedcomp.build``: ``"dgc+int8"``,
    ``density=0.01`` ...; clients send model deltas after local training, so the default memory is the plain
    ``residual``; ``"dgc"`` adds momentum correction); ``downlink`` / ``downlink_options`` the model broadcast
    (``"dense"``, ``"fp16"``, ``"int8"``, ``"delta"``); ``aggregation``: ``"auto"`` (sparse for the FedAvg
    family), ``"sparse"`` or ``"dense"``; ``max_update_bytes`` / ``max_update_norm``: reject larger blobs or
    updates (0 = the codec's cap / no bound); ``dense_arrays``: name suffixes of float arrays that travel dense,
    as values, outside the update (default: BatchNorm's running statistics; ``records.ArrayLayout`` states the
    rule). Every name and option is checked here (``ConfigError``).

    >>> Compressed(FedAvg(), compressor="topk+int8", density=0.05, downlink="int8")  # doctest: +SKIP
    """

    def __init__(
        self,
        strategy: Strategy,
        compressor: str = "dgc+int8",
        *,
        memory: str = "residual",
        downlink: str = "dense",
        downlink_options: str = "",
        aggregation: str = "auto",
        max_update_bytes: int = 0,
        max_update_norm: float = 0.0,
        dense_arrays: tuple[str, ...] = records.DENSE_SUFFIXES,
        **options: Any,
    ) -> None:
        _check_wrappable(strategy)
        if aggregation not in AGGREGATIONS:
            raise ConfigError(f"aggregation must be one of {', '.join(AGGREGATIONS)}, got {aggregation!r}")
        if options == {} and compressor == "dgc+int8":
            options = {"density": 0.01}
        text = " ".join(f"{k}={v}" for k, v in options.items())
        self.strategy = strategy
        self.dense_arrays = tuple(dense_arrays)
        self.compression = Compression(compressor, memory, text, downlink, downlink_options)
        self.downlink_kwargs = parse_options(downlink_options, "downlink-options")
        self.sparse = aggregation == "sparse" or (aggregation == "auto" and type(strategy) in WEIGHTED_MEAN_STRATEGIES)
        self.protocol_config = ProtocolConfig(
            buffer_size=0,
            max_staleness=0,
            normalize="weights",
            task_timeout=1e9,  # Flower's send_and_receive times the round out; the wrapper nacks what did not come
            backoff=0.0,
            max_blob_bytes=max_update_bytes,
            max_update_norm=max_update_norm,
            durable_acks=True,  # acks wait until the wrapped strategy returned a model
        )
        self.weighted_by_key = str(getattr(strategy, "weighted_by_key", "num-examples"))
        self.arrays_key = str(getattr(strategy, "arrayrecord_key", "arrays"))
        self.proto: ServerProtocol | None = None
        self.layout: records.ArrayLayout | None = None
        self.broadcaster: Any = None
        self.current = ArrayRecord()
        self.current_floats: dict[str, torch.Tensor] = {}
        self.round_tasks: dict[int, int] = {}  # node -> task id opened this round
        self.totals = VersionStats()

    def __repr__(self) -> str:
        return f"Compressed({self.strategy!r}, {self.compression})"

    def summary(self) -> None:
        c = self.compression
        log(INFO, "\t├──> fedcomp compression: %s (%s), memory %s", c.compressor, c.options, c.memory or "default")
        log(INFO, "\t│\t├── downlink: %s %s", c.downlink, c.downlink_options)
        log(INFO, "\t│\t└── aggregation: %s", "sparse weighted mean" if self.sparse else "dense, per client")
        self.strategy.summary()

    # ---- model and ledger -----------------------------------------------------------------------------------
    @property
    def spec(self) -> ModelSpec:
        if self.layout is None:
            raise RuntimeError("no model yet: configure_train was not called")
        return self.layout.spec()

    def _floats(self, arrays: ArrayRecord) -> dict[str, torch.Tensor]:
        return {n: torch.from_numpy(arrays[n].numpy().astype(np.float32)) for n in self.spec.names}

    def _start(self, arrays: ArrayRecord) -> ArrayRecord:
        """The round's model in the layout pinned at the first round (``ArrayLayout.conform``: same names and
        shapes, else ``ConfigError``; first-round dtypes). The first round also builds the ledger and the
        downlink broadcaster."""
        if self.layout is not None:
            return self.layout.conform(arrays)
        self.layout = records.ArrayLayout.of(arrays, self.dense_arrays)
        spec = self.spec
        if not spec.names:
            raise ConfigError(f"ArrayRecord {self.arrays_key!r} has no float arrays to compress")
        params = self._floats(arrays)
        self.proto = ServerProtocol(
            spec, params, SERVER_OPTIMIZERS.build("sgd", lr=1.0), STALENESS.build("constant"), self.protocol_config
        )
        if self.compression.downlink != "dense":
            self.broadcaster = build_broadcaster(self.compression.downlink, spec, **self.downlink_kwargs)
        return arrays

    # ---- train ----------------------------------------------------------------------------------------------
    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        sent = self._start(arrays)
        assert self.proto is not None and self.layout is not None
        self.current = sent
        self.current_floats = self._floats(sent)  # once per round: the downlink and every dense reply use it
        self._close_round("lost: no reply before the next round")
        now = time.monotonic()
        out = []
        for msg in self.strategy.configure_train(server_round, arrays, config, grid):
            node = int(msg.metadata.dst_node_id)
            record = msg.content.array_records.get(self.arrays_key)
            if record is not None:  # the model as the client takes its update from, in the pinned dtypes
                msg.content[self.arrays_key] = sent if record is arrays else self.layout.conform(record)
            task = self.proto.dispatch(node, now)
            blob = None
            if self.broadcaster is not None:
                blob = self.broadcaster.message(node, task.task_id, self.current_floats, self.proto.version)
            meta = records.ModTask(
                task.task_id, task.base_version, task.resolutions, task.resync, self.arrays_key,
                self.compression_record, self.layout if self.broadcaster is not None else None, self.dense_arrays,
            )
            msg.content = records.add_mod_task(msg.content, meta, blob)
            size, objects = records.flower_size(msg)
            s = self.proto.stats
            s.payload_bytes_down += len(blob) if blob is not None else _arrays_bytes(msg.content, self.arrays_key)
            s.flower_bytes_down += size
            s.flower_objects_down += objects
            s.messages_down += 1
            self.round_tasks[node] = task.task_id
            out.append(msg)
        return out

    @property
    def compression_record(self) -> dict[str, str]:
        return self.compression.to_flat()

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        if self.proto is None:
            return self.strategy.aggregate_train(server_round, replies)
        accepted: list[tuple[Message, Update, float]] = []
        now = time.monotonic()
        for reply in replies:
            if reply.has_error():
                continue  # its task is nacked below (error replies may carry the SuperLink's node id)
            taken = self._admit(reply, now)
            if taken is not None:
                accepted.append(taken)
        self._close_round(f"lost: no reply in round {server_round}")
        arrays, metrics = None, None
        try:
            if accepted:
                arrays, metrics = self._aggregate(server_round, accepted)
        finally:
            if arrays is None:
                n = self.proto.revoke("aggregation: the wrapped strategy returned no model")
                if n:
                    log(WARNING, "[fedcomp] round %d: no model aggregated, %d updates nacked", server_round, n)
        self.proto.commit()
        if arrays is not None:
            self.proto.version += 1  # the wrapped strategy's new model: the base of the next round's tasks
        row = self.proto.roll_stats()
        self.totals.merge(VersionStats.from_dict(row))
        log(
            INFO,
            "[fedcomp] round %d: %d applied, %d rejected, %d lost; %d payload bytes up (%.0fx smaller than dense fp32)",
            server_round, row["accepted"], row["rejected"], row["lost"] + row["timeout"], row["payload_bytes_up"],
            self.spec.dense_bytes * max(row["messages_up"], 1) / max(row["payload_bytes_up"], 1),
        )
        return arrays, self._with_metrics(metrics, row)

    def _admit(self, reply: Message, now: float) -> tuple[Message, Update, float] | None:
        """Judge one reply; the accepted ones come back with their decoded update and example weight."""
        assert self.proto is not None
        node = int(reply.metadata.src_node_id)
        size, objects = records.flower_size(reply)
        s = self.proto.stats
        s.flower_bytes_up += size
        s.flower_objects_up += objects
        s.messages_up += 1
        try:
            blob, meta = records.read_mod_reply(reply.content)
            records.restore_dense(reply.content, self.arrays_key)  # the running statistics, counters and masks
            weight = _example_weight(reply.content, self.weighted_by_key)
        except records.RecordError as exc:
            task_id = self.round_tasks.get(node, 0)
            self.proto.reject(node, task_id, f"records: {exc}")
            log(WARNING, "[fedcomp] reply from node %d rejected: %s", node, exc)
            return None
        decision, update = self.proto.admit(node, blob, meta, now, weight=weight)
        if self.broadcaster is not None:
            self.broadcaster.on_reply(node, meta.task_id)
        if update is None:
            if decision.outcome is Outcome.REJECTED:
                log(WARNING, "[fedcomp] update from node %d rejected: %s", node, decision.reason)
            return None
        return reply, update, weight

    def _close_round(self, reason: str) -> None:
        """Nack every task of the round that got no usable reply (error reply, timeout, node gone)."""
        assert self.proto is not None
        for node, task_id in self.round_tasks.items():
            if self.proto.fail_task(node, task_id, Outcome.LOST, reason, time.monotonic()):
                if self.broadcaster is not None:
                    self.broadcaster.on_failure(node, task_id)
        self.round_tasks = {}

    def _aggregate(
        self, server_round: int, accepted: list[tuple[Message, Update, float]]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        if not self.sparse:
            for reply, update, _ in accepted:
                reply.content = self._dense_reply(reply.content, update.to_dense())
            return self.strategy.aggregate_train(server_round, [r for r, _, _ in accepted])
        acc = SparseAccumulator(self.spec)
        for _, update, weight in accepted:
            acc.add(update, weight=weight, trusted=True)  # decoded and weight-bounded once, in ``admit``
        mean = acc.result(normalize="weights")
        contents = [r.content for r, _, _ in accepted]
        metrics_fn = getattr(self.strategy, "train_metrics_aggr_fn", None)
        metrics = metrics_fn(contents, self.weighted_by_key) if metrics_fn else MetricRecord()
        metrics[self.weighted_by_key] = float(sum(w for _, _, w in accepted))
        one = accepted[0][0]
        one.content = self._dense_reply(
            RecordDict({"metrics": metrics, **_others(contents, self.arrays_key, [w for _, _, w in accepted])}), mean
        )
        return self.strategy.aggregate_train(server_round, [one])

    def _dense_reply(self, content: RecordDict, delta: dict[str, torch.Tensor]) -> RecordDict:
        """``content`` in the layout the wrapped strategy expects: the model's ArrayRecord = current - delta
        (the update's arrays, in their dtype) and the reply's other arrays (integers and bools as float64);
        fedcomp's records removed."""
        assert self.layout is not None
        out = RecordDict({k: v for k, v in content.items() if k not in (records.UPDATE, records.CONTROL)})
        others = content.array_records.get(self.arrays_key, {})
        current = self.current_floats
        arrays = {}
        for name, shape, dtype in self.layout.entries:
            if self.layout.compresses(name, dtype):
                arrays[name] = Array((current[name] - delta[name].reshape(shape)).numpy().astype(dtype))
            else:
                arr = others[name] if name in others else self.current[name]
                # integers and bools as float64: a strategy's float arithmetic on them (QFedAvg scales in place)
                # cannot fail; they go back to the clients in their first-round dtype (ArrayLayout.conform)
                arrays[name] = arr if self.layout.is_float(arr.dtype) else Array(arr.numpy().astype(np.float64))
        out[self.arrays_key] = ArrayRecord(arrays)
        return out

    def _with_metrics(self, metrics: MetricRecord | None, row: dict[str, Any]) -> MetricRecord:
        out = MetricRecord(dict(metrics) if metrics is not None else {})
        out["fedcomp-applied"] = int(row["accepted"])
        out["fedcomp-rejected"] = int(row["rejected"] + row["duplicate"] + row["late"])
        out["fedcomp-lost"] = int(row["lost"] + row["timeout"] + row["stale"])
        for key in ("payload_bytes_up", "flower_bytes_up", "payload_bytes_down", "flower_bytes_down"):
            out["fedcomp-" + key.replace("_", "-")] = int(row[key])
        out["fedcomp-dense-bytes"] = int(self.spec.dense_bytes)
        return out

    # ---- evaluate: passes through ---------------------------------------------------------------------------
    def configure_evaluate(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        return self.strategy.configure_evaluate(server_round, arrays, config, grid)

    def aggregate_evaluate(self, server_round: int, replies: Iterable[Message]) -> MetricRecord | None:
        return self.strategy.aggregate_evaluate(server_round, replies)


def _check_wrappable(strategy: object) -> None:
    """``ConfigError`` saying why, for what ``Compressed`` cannot wrap (``NOT_WRAPPABLE``, ``REFUSED_NAMES``)."""
    if isinstance(strategy, Strategy) and type(strategy) not in NOT_WRAPPABLE:
        return
    name = type(strategy).__name__
    why = NOT_WRAPPABLE.get(type(strategy)) or next(
        (w for prefix, w in REFUSED_NAMES.items() if name.startswith(prefix)), "it is not one"
    )
    raise ConfigError(f"Compressed wraps a flwr.serverapp.strategy.Strategy that trains arrays, not {name}: {why}")


def _example_weight(content: RecordDict, key: str) -> float:
    """The reply's ``key`` metric (FedAvg's ``num-examples``): a finite number >= 0, else ``RecordError``."""
    if not content.metric_records:
        raise records.RecordError("reply has no MetricRecord")
    value = next(iter(content.metric_records.values())).get(key, None)
    if not isinstance(value, (int, float)) or not np.isfinite(value) or value < 0:
        raise records.RecordError(f"metric {key!r} must be a finite number >= 0, got {value!r}")
    return float(value)


def _arrays_bytes(content: RecordDict, key: str) -> int:
    return sum(len(a.data) for a in content.array_records[key].values()) if key in content.array_records else 0


def _others(contents: list[RecordDict], key: str, weights: list[float]) -> dict[str, ArrayRecord]:
    """The replies' non-float model arrays (integer counters, bool masks), example-weighted means rounded to
    their dtype (a bool mask: the weighted majority)."""
    if not any(key in c.array_records for c in contents):
        return {}
    total = sum(weights) or 1.0
    names = list(contents[0].array_records[key].keys()) if key in contents[0].array_records else []
    out = {}
    for name in names:
        values = [c.array_records[key][name].numpy().astype(np.float64) for c in contents]
        acc = sum(w * v for v, w in zip(values, weights, strict=True))
        dtype = contents[0].array_records[key][name].numpy().dtype
        out[name] = Array(np.asarray(np.rint(acc / total) if dtype.kind in "iub" else acc / total).astype(dtype))
    return {key: ArrayRecord(out)}

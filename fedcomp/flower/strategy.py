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

``mode="async"`` runs the same ledger in fedcomp's async loop instead of rounds (``fedcomp.flower.loopmode``:
K updates per version, a staleness bound, ``density="auto"``; the wrapped strategy's ``aggregate_train`` makes
each version from the buffer's mean); ``loop="fedcomp"`` runs sync rounds on fedcomp's sync loop (over-selection,
run files, checkpoints, ``density="auto"``).

Per-round metrics are added to the train MetricRecord under ``fedcomp-*`` keys (payload and Flower object bytes
up and down, dense fp32 bytes, applied/rejected/lost counts); ``totals`` holds the whole run.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from logging import INFO, WARNING
from typing import Any

import numpy as np
import torch
from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord
from flwr.common.logger import log
from flwr.serverapp import Grid
from flwr.serverapp.strategy import (
    Result,
    Strategy,
)

from fedcomp.downlink import Broadcaster, build_broadcaster
from fedcomp.flower import looprun, meter, records, replies
from fedcomp.flower.options import DEFAULT_COMPRESSOR, CompressionOptions
from fedcomp.flower.passthrough import StrategyWrapper
from fedcomp.payload import Update
from fedcomp.protocol import Outcome
from fedcomp.registry import ConfigError
from fedcomp.server import ServerProtocol, VersionStats
from fedcomp.server.optimizers import SERVER_OPTIMIZERS
from fedcomp.server.staleness import STALENESS
from fedcomp.spec import ModelSpec

#: One accepted reply: the message, its decoded update, its example weight.
Accepted = tuple[Message, Update, float]
#: Why a round's updates are nacked when the wrapped strategy returned no model.
NO_MODEL = "aggregation: the wrapped strategy returned no model"


def _by_node(reply: Message) -> int:
    return int(reply.metadata.src_node_id)


class Compressed(StrategyWrapper):
    """Wrap ``strategy`` so that clients running ``compression_mod`` send compressed updates with error feedback.

    Parameters
    ----------
    strategy : Strategy
        Any ``flwr.serverapp.strategy`` strategy that trains arrays (FedXgb* and SecAgg+ are refused).
    compressor : str (default: "dgc+int4")
        The client pipeline (``fedcomp.COMPRESSORS`` names, "a+b" composes); ``**options`` are its options
        (``density=0.02``, ``warmup_epochs=4``). Without options: ``DEFAULT_OPTIONS`` (10%, int4 values, warm-up
        over each client's first 4 tasks), chosen by ``benchmarks/frontier.py`` (docs/results.md).
    memory : str (default: "residual")
        The client's error-feedback memory ("dgc" adds momentum correction).
    downlink, downlink_options : str (default: "dense", "")
        The model: "dense" (sync: the strategy's own arrays; async: one fp32 blob), "fp16", "int8", "delta".
    aggregation : str (default: "auto")
        "sparse" (one reply: the O(nnz) weighted mean; the FedAvg family under "auto") or "dense" (one reply
        per client, ``current - update``).
    max_update_bytes, max_update_norm : int, float (default: 0)
        Reject larger blobs or updates, counted (0 = the codec's cap / no bound). Each task carries the norm
        bound and ``compression_mod`` sends at most it (the rest stays in the node's residual).
    dense_arrays : tuple[str, ...] (default: ``records.DENSE_SUFFIXES``)
        Name suffixes of float arrays that travel dense, outside the update (docs/flower.md).
    mode, loop : str (default: "sync", "flower")
        "sync" rounds by Flower's ``Strategy.start`` (any strategy) or, with ``loop="fedcomp"``, by fedcomp's loop;
        "async": staleness-bounded FedBuff on fedcomp's loop. fedcomp's loop (``fedcomp.flower.loopmode``, FedAvg
        family) takes ``loopmode.LoopOptions``: ``buffer_size`` (K), ``max_staleness`` (S), ``over_selection``,
        ``out_dir``, ``resume``, ... and ``density="auto"``; ``num_rounds`` counts versions.

    Every name and option is checked here (``ConfigError``): ``self.options``, a frozen ``CompressionOptions``.

    >>> Compressed(FedAvg(), compressor="topk+int8", density=0.05, downlink="int8")  # doctest: +SKIP
    >>> Compressed(FedAvg(), "dgc+int8", density=0.02, mode="async", buffer_size=2, max_staleness=4)  # doctest: +SKIP
    >>> Compressed(FedAvg(fraction_train=0.5), loop="fedcomp", over_selection=0.3, out_dir="out")  # doctest: +SKIP
    """

    def __init__(self, strategy: Strategy, compressor: str = DEFAULT_COMPRESSOR, **kwargs: Any) -> None:
        self.options = CompressionOptions.of(strategy, compressor, **kwargs)  # ConfigError before anything else
        super().__init__(strategy)
        self.compression = self.options.compression
        self.proto: ServerProtocol | None = None  # built at the first round (fedcomp's loop: at the start)
        self.layout: records.ArrayLayout | None = None
        self.broadcaster: Any = None
        self.current = ArrayRecord()  # this round's model and tasks
        self.current_floats: dict[str, torch.Tensor] = {}
        self.round_tasks: dict[int, int] = {}  # node -> task id opened this round
        self.round_sent: list[Message] = []  # this round's messages (the grid gives them their ids)
        self.totals = VersionStats()  # the run's counts (fedcomp's loop: its loop, ``stopped_reason``, rows)
        self.loop: Any = None
        self.reporter: Any = None

    def summary(self) -> None:
        c, how = self.compression, "sparse weighted mean" if self.options.sparse else "dense, per client"
        log(INFO, "\t├──> fedcomp compression: %s (%s), memory %s", c.compressor, c.options, c.memory or "default")
        log(INFO, "\t│\t└── downlink: %s %s; aggregation: %s", c.downlink, c.downlink_options, how)
        super().summary()

    @property
    def spec(self) -> ModelSpec:
        if self.layout is None:
            raise RuntimeError("no model yet: configure_train was not called")
        return self.layout.spec()

    def begin(self, arrays: ArrayRecord) -> ArrayRecord:
        """The model in the layout pinned at the first call (``ArrayLayout.conform``: same names and shapes, else
        ``ConfigError``; first-call dtypes)."""
        if self.layout is not None:
            return self.layout.conform(arrays)
        self.layout = records.ArrayLayout.of(arrays, self.options.dense_arrays)
        if not self.spec.names:
            raise ConfigError(f"ArrayRecord {self.options.arrays_key!r} has no float arrays to compress")
        return arrays

    def start(self, grid: Grid | None, initial_arrays: ArrayRecord, num_rounds: int = 3, timeout: float = 3600,
              train_config: ConfigRecord | None = None, evaluate_config: ConfigRecord | None = None,
              evaluate_fn: Callable[[int, ArrayRecord], MetricRecord | None] | None = None,
              runtime: looprun.Runtime | None = None) -> Result:
        """Flower's rounds; on fedcomp's loop (async mode, ``loop="fedcomp"``): ``looprun.start`` (``num_rounds``
        counts versions; ``timeout``: a task's seconds, a sync round's; ``runtime``: the simulator's)."""
        if self.options.loop_options is None:
            return super().start(grid, initial_arrays, num_rounds, timeout, train_config, evaluate_config,
                                 evaluate_fn)
        return looprun.start(self, grid, initial_arrays, num_rounds, timeout, train_config, evaluate_fn,
                              evaluate_config, runtime)

    def audit(self, update: Update, staleness: int) -> None:
        """Async mode: called once per update applied, with its staleness (a hook; does nothing)."""

    def _start(self, arrays: ArrayRecord) -> ArrayRecord:
        """``begin``; round 1 also builds the ledger and the downlink broadcaster."""
        if self.layout is not None:
            return self.begin(arrays)
        arrays, spec = self.begin(arrays), self.spec
        sgd, constant = SERVER_OPTIMIZERS.build("sgd", lr=1.0), STALENESS.build("constant")
        self.proto = ServerProtocol(spec, _floats(arrays, spec), sgd, constant, self.options.protocol)
        if self.compression.downlink != "dense":
            self.broadcaster = build_broadcaster(self.compression.downlink, spec, **self.options.downlink_kwargs)
        return arrays

    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """The wrapped strategy's messages, each with a ledger task and fedcomp's ConfigRecord (docs/protocol.md)."""
        sent = self._start(arrays)
        assert self.proto is not None and self.layout is not None
        self.current = sent
        self.current_floats = _floats(sent, self.spec)  # once per round: the downlink and every dense reply use it
        _close_round(self.proto, self.broadcaster, self.round_tasks, "lost: no reply before the next round")
        now = time.monotonic()
        out = self.round_sent = []
        for msg in self.strategy.configure_train(server_round, arrays, config, grid):
            node = int(msg.metadata.dst_node_id)
            record = msg.content.array_records.get(self.options.arrays_key)
            if record is not None:  # the model as the client takes its update from, in the pinned dtypes
                msg.content[self.options.arrays_key] = sent if record is arrays else self.layout.conform(record)
            task = self.proto.dispatch(node, now)
            blob = None
            if self.broadcaster is not None:
                blob = self.broadcaster.message(node, task.task_id, self.current_floats, self.proto.version)
            meta = records.ModTask(  # run_key: the node keeps this run's session apart; max_norm: it bounds its update
                task.task_id, task.base_version, task.resolutions, task.resync, self.options.arrays_key,
                self.compression.to_flat(), self.layout if self.broadcaster is not None else None,
                self.options.dense_arrays, run_key=task.run_key, max_norm=self.options.protocol.max_update_norm)
            msg.content = records.add_mod_task(msg.content, meta, blob)
            meter.task_sent(self.proto.stats, msg, blob, self.options.arrays_key)
            self.round_tasks[node] = task.task_id
            out.append(msg)
        return out

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """1. admit every reply (decode and validate once); 2. nack the round's tasks without a usable reply;
        3. hand the wrapped strategy what it expects; 4. release the acks only if it returned a model."""
        if self.proto is None:
            return self.strategy.aggregate_train(server_round, replies)
        now, replies = time.monotonic(), sorted(replies, key=_by_node)  # node order: sums independent of arrival
        accepted = [a for a in (self._admit(r, now) for r in replies if not r.has_error()) if a is not None]
        failed = _failed_nodes(replies, self.round_sent)  # it may have lost its replica
        _close_round(self.proto, self.broadcaster, self.round_tasks, f"lost: no reply in round {server_round}", failed)
        arrays, metrics, why = None, None, _why_no_model(accepted, self.options.weighted_by_key)
        try:
            if accepted and why == NO_MODEL:
                arrays, metrics = self._aggregate(server_round, accepted)
        finally:
            if arrays is None and (n := self.proto.revoke(why)):
                log(WARNING, "[fedcomp] round %d: no model aggregated, %d updates nacked (%s)", server_round, n, why)
        self.proto.commit()
        if arrays is not None:
            self.proto.version += 1  # the wrapped strategy's new model: the base of the next round's tasks
        row = self.proto.roll_stats()
        self.totals.merge(VersionStats.from_dict(row))
        return arrays, meter.round_metrics(metrics, row, self.spec.dense_bytes, server_round)

    def _admit(self, reply: Message, now: float) -> Accepted | None:
        """Judge one reply; the accepted ones come back with their decoded update and example weight."""
        assert self.proto is not None
        node = int(reply.metadata.src_node_id)
        meter.reply_received(self.proto.stats, reply)
        try:
            blob, meta = records.read_mod_reply(reply.content)
            records.restore_dense(reply.content, self.options.arrays_key, self.layout)  # running stats, counters, masks
            weight = replies.admitted_weight(reply.content, self.options)
        except records.RecordError as exc:
            self.proto.reject(node, self.round_tasks.get(node, 0), f"records: {exc}")
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

    def _aggregate(
        self, server_round: int, accepted: list[Accepted]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """Dense: one reply per client. Sparse (the FedAvg family): one reply, the weighted mean of the updates."""
        assert self.layout is not None
        rebuild = lambda content, delta: replies.dense_reply(  # noqa: E731
            content, self.layout, self.current, self.current_floats, delta, self.options.arrays_key
        )
        if not self.options.sparse:
            for reply, update, _ in accepted:
                reply.content = rebuild(reply.content, update.to_dense())
            return _aggregate_dense(self, server_round, [r for r, _, _ in accepted])
        contents, weights = [r.content for r, _, _ in accepted], [w for _, _, w in accepted]
        mean = replies.mean_update(self.spec, [u for _, u, _ in accepted], weights)
        one = accepted[0][0]
        one.content = replies.mean_reply(self, contents, weights, self.current, self.current_floats, mean)
        return self.strategy.aggregate_train(server_round, [one])


def _close_round(proto: ServerProtocol, broadcaster: Broadcaster | None, round_tasks: dict[int, int], reason: str,
                 failed: set[int] | frozenset[int] = frozenset()) -> None:
    """Nack every task of the round (``round_tasks``: node -> task id, emptied) that got no usable reply (error
    reply, timeout, node gone). The downlink sends a full copy next only to a node that replied with an error
    (``failed``: it may have lost its replica); one whose reply did not come keeps what it is known to hold
    (``Broadcaster.forget``: a full copy to every node whose reply was late made a sync run resync them all)."""
    for node, task_id in round_tasks.items():
        if proto.fail_task(node, task_id, Outcome.LOST, reason, time.monotonic()) and broadcaster is not None:
            if node in failed:
                broadcaster.on_failure(node, task_id)
            else:
                broadcaster.forget(task_id)
    round_tasks.clear()


def _failed_nodes(replies: list[Message], sent: list[Message]) -> set[int]:
    """The nodes whose task got an error reply. Flower makes the error replies of a node that is gone or whose
    ClientApp raised at the SuperLink, under its node id: the message each answers (``reply_to_message_id``, the id
    the grid gave a message of ``sent``) names the node; a reply to none of them, its source."""
    to = {m.metadata.message_id: int(m.metadata.dst_node_id) for m in sent if m.metadata.message_id}
    return {to.get(r.metadata.reply_to_message_id, int(r.metadata.src_node_id)) for r in replies if r.has_error()}


def _why_no_model(accepted: list[Accepted], key: str) -> str:
    """Why a round's accepted replies get no model: ``NO_MODEL`` (if the wrapped strategy returns none), or they
    weigh 0 in all (an empty partition: nothing to weigh by; their updates are nacked as for ``NO_MODEL``)."""
    if accepted and not sum(w for _, _, w in accepted) > 0:
        return f"aggregation: the accepted replies weigh 0 in all ({key!r})"
    return NO_MODEL


def _aggregate_dense(
    wrapper: Compressed, server_round: int, dense: list[Message]
) -> tuple[ArrayRecord | None, MetricRecord | None]:
    """The wrapped strategy's ``aggregate_train`` of one dense reply per client, their metrics cut to the keys they
    share (``replies.shared_metrics``); its metrics aggregation of the replies never ends the run
    (``replies.metrics_guarded``)."""
    replies.shared_metrics(wrapper, [r.content for r in dense])
    with replies.metrics_guarded(wrapper):
        return wrapper.strategy.aggregate_train(server_round, dense)


def _floats(arrays: ArrayRecord, spec: ModelSpec) -> dict[str, torch.Tensor]:
    return {n: torch.from_numpy(arrays[n].numpy().astype(np.float32)) for n in spec.names}

"""fedcomp's loop for any Flower app: ``Compressed(strategy, mode="async")`` (staleness-bounded FedBuff) and
``Compressed(strategy, loop="fedcomp")`` (sync rounds run by fedcomp's loop).

The client side is unchanged (``ClientApp(mods=[compression_mod])`` and the app's own train function); on the
server one line changes::

    strategy = Compressed(FedAvg(), "dgc+int8", density=0.02, mode="async", buffer_size=2, max_staleness=4)
    result = strategy.start(grid=grid, initial_arrays=arrays, num_rounds=40, evaluate_fn=evaluate)

``num_rounds`` counts model versions and ``evaluate_fn(version, arrays)`` is called for each (0 = the initial
model). Nothing here is a second server loop: ``start`` (``fedcomp.flower.looprun``: one run) runs the product's
own ``fedcomp.server.loops`` loop of the mode (``AsyncLoop``, ``SyncLoop``) and ``ServerProtocol`` (ledger,
staleness bound, acks/nacks, prefetch, ``density="auto"``, downlink modes) over a ``GridTransport`` that speaks
``compression_mod``'s message layout (``ModTransport``, this module), and the server step of each version is the
wrapped strategy's own ``aggregate_train`` (``StrategyBuffer``, this module).

How the wrapped strategy applies to a buffer of K replies (docs/flower.md, "Async for your app"):

* every node is kept busy (``concurrency`` C, 0 = all): a node whose reply arrived gets its next task at once,
  built from the wrapped strategy's ``configure_train`` of the current version (its config: ``lr``,
  FedProx's ``proximal-mu``, ``server-round`` = version + 1; ``fraction_train`` and node sampling do not apply);
* a reply based on version v arriving at version V is applied iff ``V - v <= max_staleness`` (else nacked
  ``stale``: the client puts it back into its residual), weighted ``s(V - v)`` (``staleness``);
* K applied updates make one version: their mean ``u = Σ s(τᵢ)·uᵢ / K`` (``normalize="count"``, FedBuff; or
  ``"weights"``: ÷ Σ s(τᵢ)) goes to the wrapped strategy as **one reply**, ``current - u``, and its
  ``aggregate_train`` makes the new model: FedAvg / FedProx give ``current - u`` (FedBuff with server rate 1),
  FedAvgM applies its server learning rate and momentum to ``u``, FedAdam / FedYogi / FedAdagrad their adaptive
  step. The arrays that travel dense (BatchNorm statistics, counters) are the example-weighted mean of the K
  replies', as in a sync round.
* federated evaluation runs only with ``fed_eval_every`` = N: every N versions and at the last, the wrapped
  strategy's ``configure_evaluate`` / ``aggregate_evaluate`` between versions (``fedcomp.flower.asynceval``);
* Strategies that judge each client's update on its own (FedMedian, FedTrimmedAvg, Krum, Bulyan, QFedAvg, the DP
  wrappers, subclasses) are refused (``ConfigError``): a buffer of updates from different versions has no round
  of replies side by side to take a median of or to clip and noise per client.

Sync rounds on fedcomp's loop (``loop="fedcomp"``; FedAvg family, as async) are the product's sync rounds: the
wrapped strategy's ``fraction_train`` of the connected nodes, at least ``min_train_nodes``, times
``1 + over_selection``, each sent the same model; the round closes once ``fraction_train`` x nodes (at least
``min_train_nodes``) updates were applied, or at ``start``'s ``timeout``; the updates' example-weighted mean goes
to the wrapped strategy as one reply, as under Flower's rounds; the tasks still open are nacked. What Flower's
rounds do not have comes with it: over-selection, ``node_wait``, ``run_timeout``, ``max_failures``, the run files,
checkpoints and resume, ``density="auto"`` and the wire figures.

Acks are sent as soon as an update is in the buffer (it is in the next version); every task that fails (error
reply, timeout, stale, rejected) is nacked, and the client restores that update: ``Σ applied + Σ residuals +
Σ pending = Σ computed`` holds as in sync mode.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
from flwr.common.constant import ErrorCode
from flwr.common.logger import FLOWER_LOGGER
from flwr.serverapp import Grid

from fedcomp.flower import records, replies, strategystate
from fedcomp.flower.grid import DEFAULT_MAX_READS_PER_S, check_rate
from fedcomp.flower.transport import GridTransport, reply_event
from fedcomp.payload import Update
from fedcomp.protocol import NORMALIZATIONS, ProtocolConfig, ReplyMeta, Task
from fedcomp.registry import ConfigError
from fedcomp.server import ServerProtocol
from fedcomp.server.buffer import UpdateBuffer
from fedcomp.server.loops import COMPUTE_METRIC, Event, ReplyEvent
from fedcomp.server.staleness import STALENESS
from fedcomp.task.config import parse_options
from fedcomp.task.serverside import check_resume

MODES = ("sync", "async")
#: Whose loop runs a sync ``Compressed``: Flower's rounds (``Strategy.start``, any strategy) or fedcomp's.
LOOPS = ("flower", "fedcomp")
#: ``LoopOptions`` that only async mode reads, and those only sync rounds read.
ASYNC_ONLY = frozenset({"buffer_size", "max_staleness", "staleness", "staleness_options", "normalize",
                        "concurrency", "prefetch", "prefetch_lead", "balance"})
SYNC_ONLY = frozenset({"over_selection"})
#: Said with a ClientApp's exception while no node has replied with fedcomp's records: on fedcomp's loop the model
#: reaches the train function only through compression_mod, so a ClientApp without it fails every task.
NO_MOD_HINT = (" (no node has answered with fedcomp's records yet: on fedcomp's loop the train function gets the "
               "model only through compression_mod; is it in the ClientApp's mods?)")
#: Replies kept for the buffer between their arrival and their judgement (more means a leak, not work).
_KEEP = 4096


@dataclass(frozen=True)
class LoopOptions:
    """The options of fedcomp's loop (given to ``Compressed`` as keywords; ``ASYNC_ONLY`` and ``SYNC_ONLY`` name
    those of one mode).

    ``buffer_size``: K, applied updates per model version. ``max_staleness``: S, an update based on version v is
    applied at version V iff ``V - v <= S``. ``staleness`` / ``staleness_options``: the weight ``s(τ)``
    (``fedcomp.server.staleness.STALENESS``: ``constant``, ``polynomial`` ``(1+τ)^-a``, ``hinge``, ``fedbuff``).
    ``normalize``: ``"count"`` (÷K, FedBuff), ``"weights"`` (÷Σ s(τ)) or ``"sum"`` (Σ s(τ)·uᵢ).
    ``concurrency``: nodes kept busy (0 = every connected node). ``prefetch``: tasks queued per node behind the
    one it runs, ``prefetch_lead`` seconds before it should need it (for deployment: a SuperNode runs one message
    at a time; Flower's simulation runs a node's messages at once, so keep 0 there). ``poll_interval``: longest
    wait of the loop and the reply reads.
    ``node_wait``: seconds to wait for the wrapped strategy's ``min_available_nodes``. ``max_failures``: stop after
    this many failed tasks in a row (error replies, timeouts, rejected replies; 0 = never). ``run_timeout``:
    stop after this many seconds (0 = never).
    ``eval_every``: call ``evaluate_fn`` every this many versions (and at the start and the end; 0 = only then).
    ``fed_eval_every``: federated evaluation every this many versions and at the last (0 = none; > 0 needs the
    wrapped strategy's ``fraction_evaluate`` > 0): its ``configure_evaluate`` / ``aggregate_evaluate`` between
    versions (``fedcomp.flower.asynceval``), waiting ``fed_eval_timeout`` seconds for the replies (0: the task's
    or round's timeout).
    ``over_selection``: sync rounds send ``1 + over_selection`` times the round's target (Bonawitz et al. 2019;
    ``fedcomp.server.selection.ClientSelection``).
    ``balance``, ``aggregate_device``: as the product's run config (``fedcomp.protocol.ProtocolConfig``).
    ``max_reads_per_s``: the reply reads' rate limit (``fedcomp.flower.transport.GridTransport``).
    ``out_dir``: write ``metrics.jsonl``, ``summary.json`` and (every ``checkpoint_every`` versions)
    ``checkpoint.pt`` there, as the product's ServerApp does (``fedcomp check OUT`` reads them); ``resume``: a
    checkpoint to go on from (``fedcomp.flower.runfiles``); ``model_name``: the model's name in ``summary.json``.

    >>> LoopOptions(buffer_size=3).max_staleness
    4
    """

    buffer_size: int = 2
    max_staleness: int = 4
    staleness: str = "polynomial"
    staleness_options: str = ""
    normalize: str = "count"
    concurrency: int = 0
    prefetch: int = 0
    prefetch_lead: float = 2.0
    poll_interval: float = 0.1
    node_wait: float = 300.0
    max_failures: int = 50
    run_timeout: float = 0.0
    eval_every: int = 1
    fed_eval_every: int = 0
    balance: float = 1.0
    aggregate_device: str = "cpu"
    max_reads_per_s: float = DEFAULT_MAX_READS_PER_S
    fed_eval_timeout: float = 0.0
    out_dir: str = ""
    checkpoint_every: int = 0
    resume: str = ""
    model_name: str = ""
    over_selection: float = 0.0

    def __post_init__(self) -> None:
        ints = ("buffer_size", "max_staleness", "concurrency", "prefetch", "max_failures", "checkpoint_every",
                "eval_every", "fed_eval_every")
        for name in ints:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < (name == "buffer_size"):
                raise ConfigError(f"{name} must be an int >= {int(name == 'buffer_size')}, got {value!r}")
        seconds = ("prefetch_lead", "poll_interval", "node_wait", "run_timeout", "over_selection", "fed_eval_timeout")
        for name in seconds:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
                unit = "fraction" if name == "over_selection" else "number of seconds"
                raise ConfigError(f"{name} must be a finite {unit} >= 0, got {value!r}")
        if not self.poll_interval > 0:
            raise ConfigError(f"poll_interval must be > 0, got {self.poll_interval!r}")
        if self.normalize not in NORMALIZATIONS:
            raise ConfigError(f"normalize must be 'count' (FedBuff), 'weights' or 'sum', got {self.normalize!r}")
        STALENESS.make_config(self.staleness, **self.staleness_kwargs)  # unknown name or option: ConfigError
        ProtocolConfig(balance=self.balance, aggregate_device=self.aggregate_device)  # bad values: ConfigError
        check_rate(self.max_reads_per_s)
        if self.checkpoint_every and not self.out_dir:
            raise ConfigError("checkpoint_every needs out_dir (the folder of checkpoint.pt)")
        if self.resume:
            check_resume(self.resume)  # missing, foreign or torn: ConfigError now, not at the first version

    @property
    def staleness_kwargs(self) -> dict[str, Any]:
        return parse_options(self.staleness_options, "staleness_options")

    @staticmethod
    def take(options: dict[str, Any]) -> dict[str, Any]:
        """Remove this config's keys from ``options`` (``Compressed``'s keywords) and return them."""
        names = {f.name for f in dataclasses.fields(LoopOptions)}
        return {k: options.pop(k) for k in list(options) if k in names}


def check(strategy: object, aggregation: str, weighted_mean: bool, options: dict[str, Any],
          mode: str = "async") -> LoopOptions:
    """The ``LoopOptions`` of ``options`` for ``mode`` on fedcomp's loop, or ``ConfigError`` saying why
    ``strategy`` cannot run there or which option the mode does not read."""
    name = type(strategy).__name__
    if not weighted_mean:
        what = ("a buffer of K updates based on different versions (FedBuff)" if mode == "async"
                else "the round's updates, summed sparsely")
        instead = "mode='sync'" if mode == "async" else "loop='flower' (Flower's rounds)"
        raise ConfigError(
            f"fedcomp's loop ({mode}) hands the wrapped strategy one reply per version, the mean of {what}; "
            f"{name} judges each client's update on its own (a median, trimming, Krum scores, per-client clipping "
            f"and noise, a subclass's own rule), which needs the replies of one round side by side: use it with "
            f"{instead}. fedcomp's loop takes FedAvg, FedProx, FedAvgM, FedAdam, FedYogi, FedAdagrad"
        )
    if aggregation == "dense":
        raise ConfigError("aggregation='dense' (one reply per client) needs Flower's rounds (mode='sync')")
    if getattr(strategy, "fraction_train", 1.0) == 0.0:
        raise ConfigError(f"{name}(fraction_train=0) trains nothing: fedcomp's loop needs it > 0")
    other = sorted(set(options) & (ASYNC_ONLY if mode == "sync" else SYNC_ONLY))
    if other:
        raise ConfigError(f"{', '.join(other)}: options of mode={'async' if mode == 'sync' else 'sync'!r} "
                          f"(this Compressed is {mode})")
    try:
        config = LoopOptions(**options)
    except TypeError as exc:
        raise ConfigError(f"mode={mode!r}: {exc}") from None
    if config.checkpoint_every or config.resume:
        strategystate.check(strategy)  # a checkpoint holds the strategy's server state, or there is none
    if config.fed_eval_every and not getattr(strategy, "fraction_evaluate", 0.0):
        raise ConfigError(
            f"fed_eval_every={config.fed_eval_every} asks for federated evaluation, which {name}'s "
            "fraction_evaluate=0 turns off: set fraction_evaluate > 0, or fed_eval_every=0"
        )
    return config


class _OneRound(Grid):
    """What the wrapped strategy's ``configure_train`` samples from in async mode: ``count`` copies of one
    placeholder node, so its sampling never waits; only the content of its first message is used (the async
    loop picks the nodes)."""

    def __init__(self, count: int) -> None:
        self.count = max(int(count), 1)

    def get_node_ids(self) -> Iterable[int]:
        return [0] * self.count

    def set_run(self, run_id: int) -> None:  # pragma: no cover - not used by configure_train
        raise NotImplementedError

    @property
    def run(self):  # pragma: no cover
        raise NotImplementedError

    def create_message(self, content, message_type, dst_node_id, group_id, ttl=None):  # pragma: no cover
        raise NotImplementedError

    def push_messages(self, messages):  # pragma: no cover
        raise NotImplementedError

    def pull_messages(self, message_ids):  # pragma: no cover
        raise NotImplementedError

    def send_and_receive(self, messages, *, timeout=None):  # pragma: no cover
        raise NotImplementedError


class StrategyBuffer(UpdateBuffer):
    """The update buffer whose step is the wrapped strategy's ``aggregate_train``: the K updates' mean (by
    ``normalize``) as one reply ``current - mean`` with the replies' dense arrays and metrics; the model it returns
    (cast to the layout pinned at the start) becomes the protocol's params and ``current``.

    ``received`` maps ``(client id, seq)`` to the reply and its example count (filled by ``ModTransport``);
    ``audit(update, staleness)`` sees every update added. ``prepare(version)``, when set, runs before each
    ``aggregate_train``: the wrapped strategy's ``configure_train`` of that version (``ModTransport.template``),
    so that, as in Flower's rounds, a strategy that notes the model it sent there (FedOpt's ``current_arrays``)
    steps from the current model even when no task of this version was sent yet."""

    def __init__(self, proto: ServerProtocol, wrapper: Any, current: ArrayRecord, config: ProtocolConfig) -> None:
        super().__init__(proto.spec, proto.params, proto.optimizer, config)
        self.wrapper, self.current = wrapper, current
        self.received: dict[tuple[int, int], tuple[Message, float]] = {}
        self.batch: list[tuple[Message, float]] = []
        self.version = proto.version  # a resumed run's: the server round the wrapped strategy sees goes on
        self.metrics: MetricRecord | None = None
        self.prepare: Callable[[int], Any] | None = None

    def add(self, update: Update, weight: float) -> None:
        super().add(update, weight)
        got = self.received.pop((update.client_id, update.seq), None)
        if got is not None:
            self.batch.append(got)
        self.wrapper.audit(update, self.version - update.base_version)

    def step(self) -> None:
        if not self.count:
            raise RuntimeError("step() with an empty buffer")
        w = self.wrapper
        if self.prepare is not None:
            self.prepare(self.version)
        mean = {n: t.to("cpu") for n, t in self.accumulator.result(normalize=self.normalize).items()}
        contents, weights = [r.content for r, _ in self.batch], [e for _, e in self.batch]
        floats = {n: self.params[n].detach().to("cpu", torch.float32) for n in w.spec.names}
        content = replies.mean_reply(w, contents, weights, self.current, floats, mean)
        carrier = self.batch[-1][0] if self.batch else Message(content, 0, records.TRAIN)
        carrier.content = content
        arrays, self.metrics = w.strategy.aggregate_train(self.version + 1, [carrier])
        if arrays is None:
            raise RuntimeError(f"{type(w.strategy).__name__}.aggregate_train returned no model for one valid reply")
        self.current = w.layout.conform(arrays)
        with torch.no_grad():
            for n in w.spec.names:
                x = torch.from_numpy(np.asarray(self.current[n].numpy(), dtype=np.float32))
                self.params[n].copy_(x.reshape(self.params[n].shape))
        self.accumulator.reset()
        self.batch = []
        self.version += 1


class ModTransport(GridTransport):
    """``GridTransport`` in ``compression_mod``'s layout: each task is the wrapped strategy's train message of the
    current version (``template``) with fedcomp's ConfigRecord (``records.add_mod_task``: task id, base version,
    acks/nacks, the compression, the task's density, the model's blob); each reply is
    read with ``records.read_mod_reply`` and kept for the buffer (its dense arrays, metrics, examples)."""

    def __init__(self, grid: Grid, wrapper: Any, buffer: StrategyBuffer, train_config: ConfigRecord, **kw: Any):
        w = wrapper
        tasks = records.TaskFormat(w.compression.to_flat(), w.layout, w.options.arrays_key, w.options.dense_arrays,
                                   w.options.protocol.max_update_norm)
        super().__init__(grid, tasks=tasks, **kw)
        self.wrapper, self.buffer, self.train_config = wrapper, buffer, train_config
        self._template: tuple[int, RecordDict] | None = None
        self.answered = False  # a node has replied with fedcomp's records in this run

    def template(self, version: int) -> RecordDict:
        """The wrapped strategy's train content for ``version`` (its ``configure_train``, once per version)."""
        if self._template is None or self._template[0] != version:
            strategy = self.wrapper.strategy
            count = max(getattr(strategy, "min_available_nodes", 1), getattr(strategy, "min_train_nodes", 1))
            level = FLOWER_LOGGER.level
            FLOWER_LOGGER.setLevel(max(level, logging.WARNING))  # its "Sampled 2 nodes" line would be false here
            try:
                config = ConfigRecord(dict(self.train_config))
                messages = list(strategy.configure_train(version + 1, self.buffer.current, config, _OneRound(count)))
            finally:
                FLOWER_LOGGER.setLevel(level)
            if not messages:
                raise RuntimeError(f"{type(strategy).__name__}.configure_train made no train message")
            self._template = (version, messages[0].content)
        return self._template[1]

    def content(self, task: Task, model: bytes) -> RecordDict:
        """The strategy's train content of the task's version in fedcomp's record: the model as the loop's
        downlink blob, whatever the downlink (``"dense"``: the fp32 model as one blob, one Flower object where the
        strategy's ArrayRecord is one per array), its Config- and MetricRecords folded in (``records.fold``).
        Every node of an async run runs ``compression_mod``, which gives the train function the strategy's
        records back."""
        meta = self.require_tasks().mod_task(task)
        return records.add_mod_task(self.template(task.base_version), meta, model, task_folds=True)

    def message(self, task: Task, model: bytes, ttl: float) -> Message:
        return Message(self.content(task, model), task.client, records.TRAIN, ttl=ttl, group_id=str(task.base_version))

    def to_event(self, task: Task, reply: Message) -> Event:
        """The loop's event (``meta.num_examples``: the reply's example weight, what a clock charges compute by;
        async mode weighs by staleness alone), the reply kept for the buffer. A reply whose records or metrics
        are malformed, or of 0 examples, is an event with ``error`` set: rejected, nacked, counted."""
        if reply.has_error():
            event = reply_event(task, reply)
            if not self.answered and reply.error.code == ErrorCode.CLIENT_APP_RAISED_EXCEPTION:
                event = dataclasses.replace(event, reason=event.reason + NO_MOD_HINT)
            return event
        size, objects = records.flower_size(reply)
        try:
            blob, meta = records.read_mod_reply(reply.content)
            self.answered = True
            seconds = records.mod_reply_seconds(reply.content)
            records.restore_dense(reply.content, self.wrapper.options.arrays_key, self.wrapper.layout)
            examples = replies.example_weight(reply.content, self.wrapper.options.weighted_by_key)
        except records.RecordError as exc:
            meta = ReplyMeta(task.task_id, 0)
            return ReplyEvent(task.task_id, task.client, b"", meta, {}, size, objects, error=f"records: {exc}")
        if meta.task_id != task.task_id:
            error = f"records: reply claims task {meta.task_id}, answers {task.task_id}"
            return ReplyEvent(task.task_id, task.client, b"", meta, {}, size, objects, error=error)
        if not examples > 0:  # its dense arrays and metrics would weigh nothing (an empty partition)
            error = f"weight: {examples:g} examples (an update of no examples is not applied)"
            return ReplyEvent(task.task_id, task.client, b"", meta, {}, size, objects, error=error)
        kept = self.buffer.received
        kept[(task.client % (1 << 64), meta.seq)] = (reply, examples)
        while len(kept) > _KEEP:
            del kept[next(iter(kept))]
        meta = dataclasses.replace(meta, num_examples=int(examples))
        return ReplyEvent(task.task_id, task.client, blob, meta, {COMPUTE_METRIC: seconds}, size, objects)

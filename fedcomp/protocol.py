"""The server side of the update protocol, without Flower: ledger, dedup, staleness bound, FedBuff buffer, acks.

One ``ServerProtocol`` owns the model parameters, the server optimizer and the per-client ledger. The transport
(Flower's Grid in ``server_app``, a virtual-clock simulator elsewhere) calls three methods and nothing else
decides what is applied:

* ``dispatch(client, now)`` opens a ``Task`` for ``client`` at the current version. The task carries the
  ``Resolution`` (ack or nack, with a reason) of every earlier update of that client not yet reported.
* ``on_reply(client, task_id, blob, meta, now)`` decodes and judges one reply. It is applied **at most once**:
  it must answer the client's open task, its ``seq`` must be new for that client, the blob must decode against
  the model spec (``WireError`` -> rejected), be finite and carry the task's base version and sequence number,
  and its staleness ``tau = V - v`` must satisfy ``tau <= max_staleness`` (else nack "stale"). An accepted
  update is scatter-added (O(nnz)) into the buffer with weight ``staleness(tau) * (examples or 1)``; when the
  buffer holds ``buffer_size`` updates (async, FedBuff's K) the server optimizer steps and the version grows.
* ``fail_task(client, task_id, outcome, reason)`` resolves a task that will never be applied (timed out, node
  unavailable, ClientApp raised): the client gets a nack by task id and restores that update into its
  residual. A reply that arrives for an already resolved task is ignored ("late") and never applied.

Normalisation (docs/protocol.md): the aggregate of one step is ``Σ w_i Δ_i / Z`` with ``Z = count`` (FedBuff,
``÷K``) or ``Z = Σ w_i`` (FedAvg over examples), chosen by ``ProtocolConfig.normalize``. The optimizer then does
``params -= lr * aggregate`` (SGD with lr 1 on deltas is FedAvg).

Sign convention: clients send pseudo-gradients (``old - new`` after local steps, or gradients/velocities).
"""

from __future__ import annotations

import ast
import dataclasses
import math
import random
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field
from enum import Enum
from typing import Any, Protocol

import torch

from fedcomp.aggregate import NORMALIZATIONS, SparseAccumulator
from fedcomp.payload import Update
from fedcomp.registry import ConfigError
from fedcomp.spec import ModelSpec
from fedcomp.wire import WireError, decode


class Outcome(str, Enum):
    """What became of one update (or of one task, when its reply never came)."""

    APPLIED = "applied"  # accepted into the buffer; it is (or will be at the next step) in the model
    STALE = "stale"  # tau > max_staleness: nack
    TIMEOUT = "timeout"  # no reply before the deadline (or the round closed): nack
    LOST = "lost"  # node unavailable, ClientApp raised, message lost, server restarted: nack
    REJECTED = "rejected"  # malformed, wrong model, non-finite, wrong base version, ...: nack
    DUPLICATE = "duplicate"  # seq already seen from this client: ignored, nothing sent back
    LATE = "late"  # reply to a task already resolved (e.g. timed out): ignored, the client has its nack

    @property
    def is_nack(self) -> bool:
        return self in _NACKS

    @property
    def reported(self) -> bool:
        """Whether the client hears about it in its next task."""
        return self is Outcome.APPLIED or self.is_nack


_NACKS = frozenset({Outcome.STALE, Outcome.TIMEOUT, Outcome.LOST, Outcome.REJECTED})


@dataclass(frozen=True)
class Resolution:
    """Ack or nack of one earlier task of a client. ``seq`` is 0 when the server never saw the update."""

    task_id: int
    seq: int
    outcome: Outcome
    reason: str = ""

    def to_dict(self) -> dict[str, Any]:
        return {"task_id": self.task_id, "seq": self.seq, "outcome": self.outcome.value, "reason": self.reason}

    @staticmethod
    def from_dict(d: Mapping[str, Any]) -> Resolution:
        return Resolution(int(d["task_id"]), int(d["seq"]), Outcome(d["outcome"]), str(d.get("reason", "")))


@dataclass
class Task:
    """One unit of work sent to a client: train from model ``base_version`` and reply once."""

    task_id: int
    client: int
    base_version: int
    sent_at: float
    deadline: float
    round: int = 0
    resolutions: list[Resolution] = field(default_factory=list)
    resync: bool = False  # first task after a server restart: the client nacks every update still pending


@dataclass(frozen=True)
class ReplyMeta:
    """The small control part of a reply (one ConfigRecord on Flower).

    ``incarnation`` is a random id the client draws when its state is created: a client that lost its state
    (restarted node, resumed run) starts its sequence numbers again and the ledger resets for it; a client that
    kept it but came back under a new node id is recognised by it (``ServerProtocol.adopt``). ``pending``: the
    task ids of the client's other updates still waiting for an ack or nack (the resync request; empty when
    none, or from a client that does not send it); the server answers each one it can (``resync_pending``).

    >>> ReplyMeta(task_id=7, seq=3, num_examples=32, incarnation=1002, pending=(4,))  # doctest: +SKIP
    """

    task_id: int
    seq: int
    num_examples: int = 1
    incarnation: int = 0
    pending: tuple[int, ...] = ()


@dataclass(frozen=True)
class Decision:
    """What ``on_reply`` did with one reply."""

    outcome: Outcome
    reason: str = ""
    staleness: int | None = None
    weight: float = 0.0
    stepped: bool = False
    seq: int = 0


@dataclass
class ClientLedger:
    """Per-client protocol state: sequence numbers seen, the open task, the ack/nack outbox, health."""

    incarnation: int = 0
    last_seq: int = 0
    open_task: int | None = None
    outbox: list[Resolution] = field(default_factory=list)
    failures: int = 0  # consecutive failed tasks (error replies, timeouts)
    unavailable_until: float = 0.0
    applied: int = 0
    nacked: int = 0
    resync: bool = False  # the server restarted and this client has not had an update applied since
    moved_to: int | None = None  # the node that holds this ledger's incarnation now (restarted under a new id)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["outbox"] = [r.to_dict() for r in self.outbox]
        return d

    @staticmethod
    def from_dict(d: Mapping[str, Any]) -> ClientLedger:
        led = ClientLedger(**{k: v for k, v in d.items() if k != "outbox"})
        led.outbox = [Resolution.from_dict(r) for r in d["outbox"]]
        return led


class ServerOptimizer(Protocol):
    def step(self, params: dict[str, torch.Tensor], pseudo_grad: Mapping[str, torch.Tensor]) -> None: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


@dataclass(frozen=True)
class ProtocolConfig:
    """Protocol options.

    ``buffer_size``: K updates per server step (FedBuff); ``0`` = the caller steps explicitly (sync rounds).
    ``max_staleness``: apply iff ``V - v <= max_staleness``. ``weight_by_examples``: multiply the staleness
    weight by the reply's example count. ``normalize``: how ``SparseAccumulator.result`` divides
    (``"count"`` = FedBuff ÷K, ``"weights"`` = ÷Σw, ``"sum"``). ``task_timeout``: seconds
    from dispatch to deadline. ``backoff``: seconds a node is left alone after a failure (doubles per
    consecutive failure, capped at 16x). ``max_blob_bytes``: decode size cap (0 = the codec's default,
    2 x dense fp32 + slack). ``max_update_norm``: reject (reason ``norm``) an update whose L2 norm exceeds it
    (0 = no bound; the weighted norm must stay below ``WEIGHTED_NORM_LIMIT`` regardless). ``durable_acks``:
    hold every ack until ``commit()`` (called once the version holding the update is in a checkpoint), so a
    client never forgets an update that a server crash could still lose. ``aggregate_device``: where the
    update buffer lives (``"cpu"``, or ``"cuda"``/``"cuda:N"``: the GPU decode + scatter-add kernel); the model
    and optimizer state stay where the params are.
    """

    buffer_size: int = 0
    max_staleness: int = 4
    weight_by_examples: bool = False
    normalize: str = "count"
    task_timeout: float = 120.0
    backoff: float = 5.0
    max_blob_bytes: int = 0
    max_update_norm: float = 0.0
    durable_acks: bool = False
    aggregate_device: str = "cpu"

    def __post_init__(self) -> None:
        if self.buffer_size < 0:
            raise ConfigError(f"buffer_size must be >= 0, got {self.buffer_size}")
        if self.max_staleness < 0:
            raise ConfigError(f"max_staleness must be >= 0, got {self.max_staleness}")
        if self.normalize not in NORMALIZATIONS:
            raise ConfigError(f"normalize must be one of {NORMALIZATIONS}, got {self.normalize!r}")
        if not self.task_timeout > 0:
            raise ConfigError(f"task_timeout must be > 0, got {self.task_timeout}")
        if self.backoff < 0 or self.max_blob_bytes < 0:
            raise ConfigError("backoff and max_blob_bytes must be >= 0")
        if not (self.max_update_norm >= 0 and math.isfinite(self.max_update_norm)):
            raise ConfigError(f"max_update_norm must be finite and >= 0, got {self.max_update_norm}")
        try:
            device = torch.device(self.aggregate_device)
        except (RuntimeError, TypeError) as exc:
            raise ConfigError(f"aggregate_device must be 'cpu' or 'cuda[:N]', got {self.aggregate_device!r}") from exc
        if device.type not in ("cpu", "cuda"):
            raise ConfigError(f"aggregate_device must be 'cpu' or 'cuda[:N]', got {self.aggregate_device!r}")
        if device.type == "cuda" and not torch.cuda.is_available():
            raise ConfigError(f"aggregate_device={self.aggregate_device!r} but torch sees no CUDA device here")


@dataclass
class VersionStats:
    """Counters since the last version (one JSONL row per version), plus byte and message totals.

    ``payload_*`` are the fedcomp blob sizes; ``flower_*`` the serialized Flower objects of the messages
    (see docs/protocol.md for how they are measured).
    """

    accepted: int = 0
    stale: int = 0
    duplicate: int = 0
    late: int = 0
    rejected: int = 0
    timeout: int = 0
    lost: int = 0
    reject_reasons: dict[str, int] = field(default_factory=dict)
    staleness_hist: dict[int, int] = field(default_factory=dict)
    payload_bytes_up: int = 0
    payload_bytes_down: int = 0
    flower_bytes_up: int = 0
    flower_bytes_down: int = 0
    flower_objects_up: int = 0
    flower_objects_down: int = 0
    messages_up: int = 0
    messages_down: int = 0

    def count(self, outcome: Outcome, reason: str = "", staleness: int | None = None) -> None:
        key = {Outcome.APPLIED: "accepted"}.get(outcome, outcome.value)
        setattr(self, key, getattr(self, key) + 1)
        if outcome is Outcome.REJECTED:
            short = reason.split(":")[0][:60]
            self.reject_reasons[short] = self.reject_reasons.get(short, 0) + 1
        if outcome is Outcome.APPLIED and staleness is not None:
            self.staleness_hist[staleness] = self.staleness_hist.get(staleness, 0) + 1

    def merge(self, other: VersionStats) -> None:
        for k, v in asdict(other).items():
            if isinstance(v, dict):
                mine = getattr(self, k)
                for kk, vv in v.items():
                    mine[kk] = mine.get(kk, 0) + vv
            else:
                setattr(self, k, getattr(self, k) + v)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["staleness_hist"] = {str(k): v for k, v in sorted(self.staleness_hist.items())}
        return d

    @staticmethod
    def from_dict(d: Mapping[str, Any]) -> VersionStats:
        s = VersionStats(**{k: v for k, v in d.items() if k != "staleness_hist"})
        s.staleness_hist = {int(k): int(v) for k, v in d.get("staleness_hist", {}).items()}
        s.reject_reasons = dict(d.get("reject_reasons", {}))
        return s


#: Largest ``weight x ||update||`` accepted (float32 headroom for the buffer and the optimizer step).
WEIGHTED_NORM_LIMIT = 1e30

#: WireError message fragment -> rejection category (first match wins); reasons read ``wire/<category>: ...``
#: and ``VersionStats.reject_reasons`` counts them per category.
WIRE_REASONS: tuple[tuple[str, str], ...] = (
    ("exceeds max_bytes", "oversized"),
    ("CRC mismatch", "crc"),
    ("truncated", "truncated"),
    ("bad magic", "magic"),
    ("unknown codec version", "codec version"),
    ("fingerprint mismatch", "fingerprint"),
    ("tensor count", "shape"),
    ("numel", "shape"),
    ("shape", "shape"),
    ("NaN or Inf", "non-finite"),
)


def wire_reason(exc: WireError) -> str:
    """``"wire/<category>: <message>"`` for a decode failure (category ``malformed`` when none matches)."""
    text = str(exc)
    category = next((cat for frag, cat in WIRE_REASONS if frag in text), "malformed")
    return f"wire/{category}: {text}"


def update_norm(update: Update) -> float:
    """L2 norm of the dequantized update in float64; ``inf``/``nan`` when a value or a code x scale is not finite."""
    total = 0.0
    for p in update.tensors.values():
        if p.values.scales is not None and not bool(torch.isfinite(p.values.scales).all()):
            return math.nan
        vals = p.values.dequantize()
        if not bool(torch.isfinite(vals).all()):
            return math.nan
        total += float(vals.double().square().sum())
    return math.sqrt(total)


class ServerProtocol:
    """Ledger + buffer + optimizer over one model. Not thread-safe; one event at a time, in clock order.

    ``params`` (name -> float32 tensor, the spec's tensors) are updated in place by the optimizer.
    ``staleness`` maps ``tau`` to a weight (``fedcomp.staleness.STALENESS`` instances fit).
    """

    def __init__(
        self,
        spec: ModelSpec,
        params: dict[str, torch.Tensor],
        optimizer: ServerOptimizer,
        staleness: Callable[[int], float],
        config: ProtocolConfig,
    ) -> None:
        missing = set(spec.names) - set(params)
        if missing:
            raise ConfigError(f"params lack spec tensors {sorted(missing)}")
        self.spec, self.params, self.optimizer, self.staleness, self.config = spec, params, optimizer, staleness, config
        self.version = 0
        self.round = 0
        self.next_task_id = 1
        self.clients: dict[int, ClientLedger] = {}
        self.tasks: dict[int, Task] = {}  # open tasks by id
        self.accumulator = SparseAccumulator(spec, device=config.aggregate_device)
        self.buffered = 0
        self.buffered_weight = 0.0
        self.stats = VersionStats()  # since the last version
        self.totals = VersionStats()  # whole run (merged at every version)
        self.rng = random.Random(0)
        self.held: dict[int, list[Resolution]] = {}  # durable_acks: acks waiting for commit(), by client
        self.restarts = 0

    # ---- tasks -------------------------------------------------------------------------------------------
    def ledger(self, client: int) -> ClientLedger:
        """The client's ledger; a client first seen after a restart starts in resync (it may hold updates the
        dead server acknowledged to nobody)."""
        led = self.clients.get(int(client))
        if led is None:
            led = self.clients[int(client)] = ClientLedger(resync=self.restarts > 0)
        return led

    def owner(self, client: int) -> int:
        """The node that holds ``client``'s incarnation now: ``client`` itself, unless that client restarted
        under a new node id and replied from there (``adopt``); resolutions owed to ``client`` go to it."""
        node, seen = int(client), set()
        while (led := self.clients.get(node)) is not None and led.moved_to is not None and node not in seen:
            seen.add(node)
            node = led.moved_to
        return node

    def adopt(self, client: int, node: int) -> None:
        """``client`` holds the client state that ran as ``node`` before (a restart under a new node id): ``node``
        now forwards to ``client``. Its undelivered resolutions (and acks held for ``commit()``) move here and
        resolutions of its tasks still open follow when they resolve, so an update saved before the restart is
        acked or nacked, never stranded. The seq ledger continues (``last_seq``: the highest seen).

        >>> proto.adopt(12, 2)  # doctest: +SKIP  (node 2 restarted as node 12)
        """
        led, old = self.ledger(client), self.ledger(node)
        old.moved_to = int(client)
        led.last_seq = max(led.last_seq, old.last_seq)
        led.resync = led.resync or old.resync
        led.outbox.extend(old.outbox)
        old.outbox = []
        if int(node) in self.held:
            self.held.setdefault(int(client), []).extend(self.held.pop(int(node)))

    def adopt_incarnation(self, client: int, incarnation: int, seq: int) -> int:
        """Adopt every other node that replied as ``incarnation`` with seqs below ``seq`` (a client state's seqs
        only grow, so only those can be the same state before a restart). Returns how many."""
        self.ledger(client).moved_to = None
        if not incarnation:
            return 0
        olds = [
            cid for cid, other in self.clients.items()
            if cid != int(client) and other.incarnation == incarnation and other.last_seq < seq
            and other.moved_to != int(client)
        ]
        for cid in olds:
            self.adopt(client, cid)
        return len(olds)

    def resync_pending(self, client: int, meta: ReplyMeta) -> int:
        """Answer the client's ``meta.pending`` task ids (other than the one it answers now): a task still open
        on another node waits (its resolution will follow here), a resolution queued for another node moves
        here (that node is adopted: it held this client's state before a restart under a new node id), and a
        task the server holds nothing about is nacked ``lost`` (the client restores that update). Another node
        is adopted only if it never replied or replied with the same incarnation. Returns how many were nacked.

        >>> proto.resync_pending(12, ReplyMeta(9, 4, incarnation=1002, pending=(5,)))  # doctest: +SKIP
        0
        """
        led, nacked = self.ledger(client), 0
        here = {r.task_id for r in led.outbox} | {r.task_id for r in self.held.get(int(client), [])}
        for task_id in meta.pending:
            if task_id == meta.task_id or task_id in here:
                continue
            holder = self._holder(int(task_id))
            if holder is None:
                led.outbox.append(Resolution(int(task_id), 0, Outcome.LOST, "lost: unknown to the server"))
                self.stats.count(Outcome.LOST, "unknown task")
                nacked += 1
            elif self.owner(holder) != int(client) and self.clients[holder].incarnation in (0, meta.incarnation):
                self.clients[holder].incarnation = meta.incarnation
                self.adopt(client, holder)
        return nacked

    def _holder(self, task_id: int) -> int | None:
        """The node whose open task, outbox or held acks hold (the resolution of) ``task_id``; None if none."""
        task = self.tasks.get(task_id)
        if task is not None:
            return task.client
        for t in self.tasks.values():
            if any(r.task_id == task_id for r in t.resolutions):
                return t.client
        for cid, led in self.clients.items():
            if any(r.task_id == task_id for r in (*led.outbox, *self.held.get(cid, []))):
                return cid
        return None

    def busy(self, client: int) -> bool:
        led = self.clients.get(int(client))
        return led is not None and led.open_task is not None

    def available(self, client: int, now: float) -> bool:
        """Not busy and not backing off after a failure."""
        led = self.clients.get(int(client))
        return led is None or (led.open_task is None and now >= led.unavailable_until)

    def dispatch(self, client: int, now: float, timeout: float | None = None) -> Task:
        """Open a task for ``client`` at the current version; it carries (and clears) the client's outbox."""
        led = self.ledger(client)
        if led.open_task is not None:
            raise RuntimeError(f"client {client} already has open task {led.open_task}")
        task = Task(
            task_id=self.next_task_id,
            client=int(client),
            base_version=self.version,
            sent_at=now,
            deadline=now + (self.config.task_timeout if timeout is None else timeout),
            round=self.round,
            resolutions=led.outbox,
            resync=led.resync,
        )
        self.next_task_id += 1
        led.outbox = []
        led.open_task = task.task_id
        self.tasks[task.task_id] = task
        return task

    def undo_dispatch(self, task: Task) -> None:
        """The task could not be sent at all (transport refused it): forget it, give the outbox back."""
        self.tasks.pop(task.task_id, None)
        led = self.ledger(task.client)
        if led.open_task == task.task_id:
            led.open_task = None
        led.outbox = task.resolutions + led.outbox

    def _resolve(self, task: Task, seq: int, outcome: Outcome, reason: str) -> None:
        led = self.ledger(task.client)
        if led.open_task == task.task_id:
            led.open_task = None
        self.tasks.pop(task.task_id, None)
        resolution = Resolution(task.task_id, seq, outcome, reason)
        owner = self.owner(task.client)
        if outcome is Outcome.APPLIED:
            led.applied += 1
            if task.resync:
                led.resync = False  # the client nacked its old updates before sending this one
            if self.config.durable_acks:
                self.held.setdefault(owner, []).append(resolution)
                return
        else:
            led.nacked += 1
        self.ledger(owner).outbox.append(resolution)

    def fail_task(self, client: int, task_id: int, outcome: Outcome, reason: str, now: float) -> bool:
        """Resolve an open task that will not be applied (timeout / lost). False if it was not open."""
        if not outcome.is_nack:
            raise ValueError(f"fail_task needs a nack outcome, got {outcome}")
        task = self.tasks.get(task_id)
        if task is None or task.client != int(client):
            return False
        self._resolve(task, 0, outcome, reason)
        self.stats.count(outcome, reason)
        led = self.ledger(client)
        # The task's own acks/nacks may never have reached the client: send them again (idempotent there).
        self.ledger(self.owner(client)).outbox[:0] = task.resolutions
        led.failures += 1
        led.unavailable_until = now + self.config.backoff * min(16, 2 ** (led.failures - 1))
        return True

    def reject(self, client: int, task_id: int, reason: str) -> Decision:
        """A reply to an open task that could not even be read (malformed records): nack it as rejected."""
        task = self.tasks.get(task_id)
        if task is None or task.client != int(client):
            return self._ignore(Outcome.LATE, f"task {task_id} is not open for this client", 0)[0]
        return self._nack(task, 0, Outcome.REJECTED, reason)[0]

    def expire(self, now: float) -> list[Task]:
        """Time out every open task whose deadline has passed; returns them."""
        due = [t for t in self.tasks.values() if t.deadline <= now]
        for t in due:
            self.fail_task(t.client, t.task_id, Outcome.TIMEOUT, f"no reply within {t.deadline - t.sent_at:.0f}s", now)
        return due

    def close_round(self, now: float, reason: str = "round closed") -> list[Task]:
        """Sync mode: time out the round's open tasks without penalising the nodes; then step if anything came."""
        closing = [t for t in self.tasks.values() if t.round == self.round]
        for t in closing:
            self._resolve(t, 0, Outcome.TIMEOUT, reason)
            self.stats.count(Outcome.TIMEOUT, reason)
            self.ledger(self.owner(t.client)).outbox[:0] = t.resolutions
        if self.buffered:
            self.step()
        self.round += 1
        return closing

    # ---- replies -----------------------------------------------------------------------------------------
    def on_reply(self, client: int, blob: bytes, meta: ReplyMeta, now: float) -> Decision:
        """Judge one reply and buffer it if accepted; never raises on bad input (the reason says what was wrong)."""
        decision, update = self.admit(client, blob, meta, now)
        if update is None:
            return decision
        self.accumulator.add(update, weight=decision.weight)
        self.buffered += 1
        self.buffered_weight += decision.weight
        stepped = bool(self.config.buffer_size) and self.buffered >= self.config.buffer_size
        if stepped:
            self.step()
        return dataclasses.replace(decision, stepped=stepped)

    def admit(self, client: int, blob: bytes, meta: ReplyMeta, now: float) -> tuple[Decision, Update | None]:
        """Judge one reply without buffering it: ``(decision, decoded update)``, the update only when accepted.

        An accepted update is resolved as applied (its ack goes out, or waits for ``commit()`` with durable
        acks): the caller must aggregate it (``on_reply`` does) or take the ack back with ``revoke()``."""
        client = int(client)
        self.stats.payload_bytes_up += len(blob)
        led = self.clients.get(client)
        if led is None:
            return self._ignore(Outcome.REJECTED, "unknown client: no task was ever sent to it", meta.seq)
        if meta.incarnation != led.incarnation and led.open_task == meta.task_id:
            # Another client state on this node: a fresh one (node restarted without its state, run resumed)
            # starts its sequence numbers again; a saved one that ran on another node id continues there.
            led.incarnation, led.last_seq = meta.incarnation, 0
            self.adopt_incarnation(client, meta.incarnation, meta.seq)
        task = self.tasks.get(meta.task_id)
        if task is None or task.client != client:
            if meta.seq and meta.seq <= led.last_seq and meta.incarnation == led.incarnation:
                return self._ignore(Outcome.DUPLICATE, f"seq {meta.seq} already seen", meta.seq)
            return self._ignore(Outcome.LATE, f"task {meta.task_id} is not open for this client", meta.seq)
        if meta.seq <= led.last_seq:
            # Same task answered twice with an old seq cannot be applied twice.
            return self._ignore(Outcome.DUPLICATE, f"seq {meta.seq} <= last seen {led.last_seq}", meta.seq)
        led.last_seq = meta.seq
        led.failures = 0
        self.resync_pending(client, meta)
        try:
            update = decode(blob, self.spec, max_bytes=self.config.max_blob_bytes or None)
        except WireError as exc:
            return self._nack(task, meta.seq, Outcome.REJECTED, wire_reason(exc))
        if update.seq != meta.seq:
            return self._nack(task, meta.seq, Outcome.REJECTED, f"seq: blob says {update.seq}, meta {meta.seq}")
        if update.client_id != client % (1 << 64):
            return self._nack(task, meta.seq, Outcome.REJECTED, f"client id: blob says {update.client_id}")
        if update.base_version != task.base_version:
            return self._nack(
                task, meta.seq, Outcome.REJECTED, f"base version: blob {update.base_version}, task {task.base_version}"
            )
        norm = update_norm(update)
        if not math.isfinite(norm):
            return self._nack(task, meta.seq, Outcome.REJECTED, "non-finite: NaN or Inf in the (dequantized) values")
        bound = self.config.max_update_norm
        if bound and norm > bound:
            return self._nack(task, meta.seq, Outcome.REJECTED, f"norm: {norm:.4g} > bound {bound:.4g}")
        tau = self.version - task.base_version
        if tau > self.config.max_staleness:
            return self._nack(task, meta.seq, Outcome.STALE, f"staleness {tau} > {self.config.max_staleness}")
        weight = float(self.staleness(tau))
        if self.config.weight_by_examples:
            weight *= max(int(meta.num_examples), 0)
        if not (math.isfinite(weight) and weight > 0):
            return self._nack(task, meta.seq, Outcome.REJECTED, f"weight: {weight} (examples {meta.num_examples})")
        if weight * norm > WEIGHTED_NORM_LIMIT:
            return self._nack(task, meta.seq, Outcome.REJECTED, f"norm: weighted norm {weight * norm:.4g} overflows")
        self._resolve(task, meta.seq, Outcome.APPLIED, f"in version {self.version + 1}")
        self.stats.count(Outcome.APPLIED, staleness=tau)
        return Decision(Outcome.APPLIED, "", tau, weight, False, meta.seq), update

    def _ignore(self, outcome: Outcome, reason: str, seq: int) -> tuple[Decision, None]:
        self.stats.count(outcome, reason)
        return Decision(outcome, reason, seq=seq), None

    def _nack(self, task: Task, seq: int, outcome: Outcome, reason: str) -> tuple[Decision, None]:
        self._resolve(task, seq, outcome, reason)
        self.stats.count(outcome, reason)
        return Decision(outcome, reason, seq=seq), None

    # ---- the server step ----------------------------------------------------------------------------------
    def step(self) -> None:
        """Apply the buffer: ``params -= lr * direction(Σ w Δ / Z)``; version += 1; stats roll over."""
        if not self.buffered:
            raise RuntimeError("step() with an empty buffer")
        aggregate = self.accumulator.result(normalize=self.config.normalize)
        aggregate = {name: t.to(self.params[name].device) for name, t in aggregate.items()}
        with torch.no_grad():
            self.optimizer.step(self.params, aggregate)
        self.accumulator.reset()
        self.buffered, self.buffered_weight = 0, 0.0
        self.version += 1

    def roll_stats(self) -> dict[str, Any]:
        """The counters since the last call (one JSONL row); they are merged into ``totals`` and reset."""
        row = self.stats.to_dict()
        self.totals.merge(self.stats)
        self.stats = VersionStats()
        return row

    # ---- checkpoint ---------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Everything needed to resume, as plain types and tensors (``torch.load(weights_only=True)``-safe).

        Take it right after a step (the buffer is then empty; a non-empty buffer is refused). Open tasks are
        saved as nacks "lost: server restarted" so their clients restore those updates after a resume; acks
        held for ``commit()`` are saved as acks (their updates are in the saved model).
        """
        if self.buffered:
            raise RuntimeError("checkpoint with a non-empty buffer; take it right after step()")
        clients = {}
        for cid, led in self.clients.items():
            d = led.to_dict()
            d["outbox"] += [r.to_dict() for r in self.held.get(cid, [])]
            d["open_task"] = None
            clients[str(cid)] = d
        for cid, led in self.clients.items():
            if led.open_task is not None:  # nacked to the node holding the client's incarnation now
                outbox = clients[str(self.owner(cid))]["outbox"]
                carried = self.tasks[led.open_task].resolutions if led.open_task in self.tasks else []
                outbox[:0] = [r.to_dict() for r in carried]
                outbox.append(Resolution(led.open_task, 0, Outcome.LOST, "lost: server restarted").to_dict())
        return {
            "version": self.version,
            "round": self.round,
            "next_task_id": self.next_task_id,
            "clients": clients,
            "totals": self.totals.to_dict(),
            "params": {n: t.detach().clone() for n, t in self.params.items()},
            "optimizer": self.optimizer.state_dict(),
            "rng": repr(self.rng.getstate()),
            "fingerprint": self.spec.fingerprint.hex(),
            "restarts": self.restarts,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if state["fingerprint"] != self.spec.fingerprint.hex():
            raise ConfigError("checkpoint was made for another model (fingerprint differs)")
        self.version, self.round, self.next_task_id = (
            int(state["version"]),
            int(state["round"]),
            int(state["next_task_id"]),
        )
        self.clients = {int(k): ClientLedger.from_dict(v) for k, v in state["clients"].items()}
        self.tasks = {}
        self.held = {}
        self.restarts = int(state.get("restarts", 0))
        self.totals = VersionStats.from_dict(state["totals"])
        with torch.no_grad():
            for n, t in state["params"].items():
                self.params[n].copy_(t)
        self.optimizer.load_state_dict(state["optimizer"])
        self.rng.setstate(_literal_rng_state(state["rng"]))


    def commit(self) -> int:
        """The model holding every accepted update is durable (checkpointed): release the held acks to the
        clients' outboxes. Returns how many were released."""
        n = 0
        for cid, acks in self.held.items():
            self.ledger(self.owner(cid)).outbox.extend(acks)
            n += len(acks)
        self.held = {}
        return n

    def revoke(self, reason: str) -> int:
        """The acks held for ``commit()`` will never be true (the aggregation that was to hold their updates
        failed): turn them into nacks (``rejected``) so the clients restore those updates. Returns how many."""
        n = 0
        for cid, acks in self.held.items():
            led = self.ledger(self.owner(cid))
            for ack in acks:
                led.applied -= 1
                led.nacked += 1
                led.outbox.append(Resolution(ack.task_id, ack.seq, Outcome.REJECTED, reason))
                self.stats.accepted -= 1
                self.stats.count(Outcome.REJECTED, reason)
                n += 1
        self.held = {}
        return n

    def restart(self) -> None:
        """Continue after a crash, right after ``load_state_dict`` of the last checkpoint.

        Task ids jump to a fresh range (``restarts << TASK_ID_BITS``) so no reply to a task the dead server
        issued after its checkpoint can match a new task, and every client (also one first seen later) gets
        ``resync`` tasks until an update of it is applied: the client first applies the task's resolutions
        (acks of what the checkpointed model holds, "lost: server restarted" nacks), then nacks every update
        still pending, since the resumed server cannot apply or acknowledge it. Checkpoint right after this
        call so the new range is durable before any task is sent.
        """
        self.restarts += 1
        self.next_task_id = max(self.next_task_id, (self.restarts << TASK_ID_BITS) + 1)
        for led in self.clients.values():
            led.resync = True


#: Task ids of the n-th restart start at ``n << TASK_ID_BITS``.
TASK_ID_BITS = 40


def _literal_rng_state(text: str) -> Any:
    return ast.literal_eval(text)


class ClientSide:
    """The client half of the ack protocol over a ``Pipeline``: remembers which task each pending ``seq`` answered
    and applies the server's resolutions (ack -> forget, nack -> restore into the error-feedback memory).

    Resolutions may arrive twice (the server re-sends those of a task that failed); applying one again is a
    no-op because the pipeline no longer holds that ``seq``.
    """

    def __init__(self, pipeline: Any, task_seqs: Mapping[int, int] | None = None) -> None:
        self.pipeline = pipeline
        self.task_seqs: dict[int, int] = {int(k): int(v) for k, v in (task_seqs or {}).items()}

    def apply(self, resolutions: list[Resolution]) -> dict[str, int]:
        """Apply acks/nacks; returns counts per outcome actually applied (repeats are not counted)."""
        counts: dict[str, int] = {}
        for r in resolutions:
            # Only tasks this state answered count: a resolution for another incarnation's task (a resumed
            # server, a restarted node) is ignored even if its seq number happens to be pending here.
            seq = self.task_seqs.pop(r.task_id, 0)
            if not seq or (r.seq and r.seq != seq):
                continue
            done = self.pipeline.ack(seq) if r.outcome is Outcome.APPLIED else self.pipeline.nack(seq)
            if done:
                counts[r.outcome.value] = counts.get(r.outcome.value, 0) + 1
        return counts

    def pending_tasks(self) -> tuple[int, ...]:
        """Task ids whose update is still pending here (``ReplyMeta.pending``: the resync request).

        >>> side.sent(7, 3); side.pending_tasks()  # doctest: +SKIP
        (7,)
        """
        return tuple(sorted(t for t, seq in self.task_seqs.items() if seq in self.pipeline.pending))

    def sent(self, task_id: int, seq: int) -> None:
        """Record that ``seq`` answers ``task_id``."""
        self.task_seqs[int(task_id)] = int(seq)

    def resync(self) -> int:
        """The server restarted (a task with ``resync``; call after ``apply`` of its resolutions): nack every
        update still pending (the resumed server will never apply or ack it) and forget old task ids.
        Returns how many were restored."""
        restored = sum(bool(self.pipeline.nack(seq)) for seq in list(self.pipeline.pending))
        self.task_seqs.clear()
        return restored


@dataclass(frozen=True)
class Selection:
    """Sync-round client selection: ``fraction`` of the available clients, at least ``min_clients``, times
    ``1 + over_selection`` (Bonawitz et al. 2019); the round closes once ``target`` replies were accepted."""

    fraction: float = 1.0
    min_clients: int = 1
    over_selection: float = 0.0

    def __post_init__(self) -> None:
        if not 0 < self.fraction <= 1:
            raise ConfigError(f"fraction must be in (0, 1], got {self.fraction}")
        if self.min_clients < 1 or self.over_selection < 0:
            raise ConfigError("min_clients must be >= 1 and over_selection >= 0")

    def target(self, available: int) -> int:
        return min(available, max(self.min_clients, math.ceil(self.fraction * available)))

    def choose(self, clients: list[int], rng: random.Random) -> tuple[list[int], int]:
        """Returns (selected clients, target number of accepted replies)."""
        target = self.target(len(clients))
        n = min(len(clients), math.ceil(target * (1 + self.over_selection)))
        return sorted(rng.sample(sorted(clients), n)), target

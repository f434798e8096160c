"""The protocol's vocabulary, shared by the server (``fedcomp.server``) and the client (``fedcomp.client.acks``).

An update's life: the server opens a ``Task`` for a client; the client replies once (blob + ``ReplyMeta``); the
server judges the reply into a ``Decision`` and reports the ``Outcome`` back to the client as a ``Resolution``
(ack or nack) in a later task. ``ProtocolConfig`` holds the server's options. Rules: docs/protocol.md.

>>> Resolution(task_id=3, seq=2, outcome=Outcome.STALE, reason="staleness 5 > 4").outcome.is_nack
True
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

import torch

from fedcomp.registry import ConfigError, check_ranges


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
        """The resolution ``to_dict`` wrote; ``ValueError`` unless ``task_id`` and ``seq`` are whole numbers in
        ``[0, 2**64)`` (not bools, not floats: a task's JSON may come from anywhere) and ``outcome`` is one."""
        ids = (d["task_id"], d["seq"])
        if any(isinstance(v, bool) or not isinstance(v, int) or not 0 <= v < 1 << 64 for v in ids):
            raise ValueError(f"a resolution's task_id and seq must be whole numbers in [0, 2**64), got {str(ids)[:60]}")
        return Resolution(ids[0], ids[1], Outcome(d["outcome"]), str(d.get("reason", "")))


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
    density: float = 0.0  # the density the server chose for this task (density="auto"); 0 = the run's setting
    queued: bool = False  # dispatched while its node still had an open task (prefetch): it runs after that one
    run_key: int = 0  # the server run's random id (kept across resumes): a client state of another run is set aside


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
    and optimizer state stay where the params are. ``prefetch``: tasks a node may hold queued behind the one it
    runs (async mode), so the pull right after its reply push finds work; ``0`` = one open task per node. A queued
    task carries the newest model at its dispatch; its reply is judged like any other. The async loop queues no task
    it expects back more than ``max_staleness`` versions stale (the node's next task then leaves with its reply),
    and one that grew that stale anyway is nacked ``stale`` and its client restores the update into its residual:
    compute is lost, no gradient mass. ``balance``: async only; ``B > 1`` multiplies each
    update's weight by ``clip((mean applied + 1) / (node's applied + 1), 1/B, B)`` (``fedcomp.server.balance``), so
    nodes applied less often than the average count more; ``1`` = off.
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
    prefetch: int = 0
    balance: float = 1.0

    def __post_init__(self) -> None:
        if not (math.isfinite(self.balance) and self.balance >= 1.0):
            raise ConfigError(f"balance must be finite and >= 1, got {self.balance!r}")
        if not isinstance(self.prefetch, int) or self.prefetch < 0:
            raise ConfigError(f"prefetch must be an int >= 0, got {self.prefetch!r}")
        if self.buffer_size < 0:
            raise ConfigError(f"buffer_size must be >= 0, got {self.buffer_size}")
        if self.max_staleness < 0:
            raise ConfigError(f"max_staleness must be >= 0, got {self.max_staleness}")
        if self.normalize not in NORMALIZATIONS:
            raise ConfigError(f"normalize must be one of {NORMALIZATIONS}, got {self.normalize!r}")
        if not self.task_timeout > 0:
            raise ConfigError(f"task_timeout must be > 0, got {self.task_timeout}")
        check_ranges(("backoff", self.backoff, ">= 0", self.backoff >= 0),
                     ("max_blob_bytes", self.max_blob_bytes, ">= 0", self.max_blob_bytes >= 0))
        norm = self.max_update_norm
        if isinstance(norm, bool) or not isinstance(norm, (int, float)) or not (norm >= 0 and math.isfinite(norm)):
            raise ConfigError(f"max_update_norm must be finite and >= 0, got {self.max_update_norm}")
        try:
            device = torch.device(self.aggregate_device)
        except (RuntimeError, TypeError) as exc:
            raise ConfigError(f"aggregate_device must be 'cpu' or 'cuda[:N]', got {self.aggregate_device!r}") from exc
        if device.type not in ("cpu", "cuda"):
            raise ConfigError(f"aggregate_device must be 'cpu' or 'cuda[:N]', got {self.aggregate_device!r}")
        if device.type == "cuda" and not torch.cuda.is_available():
            raise ConfigError(f"aggregate_device={self.aggregate_device!r} but torch sees no CUDA device here")

    @classmethod
    def of_mode(cls, mode: str, **options: Any) -> ProtocolConfig:
        """The rules of a run in ``mode``: async takes ``options`` as given; sync rounds fix ``SYNC_RULES`` over
        them (the server steps when a round closes, on the example-weighted mean of the round's replies).

        >>> ProtocolConfig.of_mode("sync", buffer_size=4, task_timeout=30.0).buffer_size
        0
        """
        return cls(**{**options, **SYNC_RULES} if mode == "sync" else options)


#: What sync rounds fix, whatever the async options say: no buffer (the loop steps at a round's close), no stale
#: reply, every reply weighed by its examples and the sum divided by theirs (FedAvg's mean), no queued task, no
#: balancing.
SYNC_RULES: dict[str, Any] = {"buffer_size": 0, "max_staleness": 0, "weight_by_examples": True, "normalize": "weights",
                              "prefetch": 0, "balance": 1.0}

#: How a sum of weighted updates is normalised: by the sum of weights, not at all, or by their count.
NORMALIZATIONS = ("weights", "sum", "count")

#: Largest ``weight x ||update||`` accepted (float32 headroom for the buffer and the optimizer step).
WEIGHTED_NORM_LIMIT = 1e30

#: Largest aggregation weight a reply may carry (an example count): exact in float64, so a sum of weights stays
#: finite and a weight times a float32 value stays within float32 (with ``WEIGHTED_NORM_LIMIT``).
MAX_WEIGHT = 2.0**53

#: Task ids of the n-th restart start at ``n << TASK_ID_BITS``.
TASK_ID_BITS = 40

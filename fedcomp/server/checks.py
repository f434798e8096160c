"""Judging one reply: a list of small named checks, each returning a ``Decision`` when the reply fails it.

``ServerProtocol.admit`` runs three steps, in order, until one fails:

1. ``GATES``: is this reply one to judge at all? A failure is **ignored** (counted, nothing sent back): unknown
   client, no open task (``late``, or ``duplicate`` of a seq seen), a seq already seen (a node's replies may come
   out of order: a seq below the highest seen is judged if it is new).
2. ``decode_reply``: the blob must decode (``fedcomp.decode`` validates every byte, once); a failure is
   **nacked** as ``wire/<category>`` (the client restores the update).
3. ``CHECKS`` on the decoded update, failures **nacked** too: its header must match the reply and the task, its
   norm must be finite and within bounds, its staleness within ``max_staleness``, its weight positive and finite.

Checks fill in the ``Reply`` as they go (the decoded update, its norm, staleness and weight), so each later
check reads what an earlier one found; nothing is decoded or dequantized twice.

>>> [c.__name__ for c in CHECKS][:3]
['header_seq', 'header_client', 'header_base']
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from fedcomp.payload import Update, ValueCoding, Values
from fedcomp.protocol import MAX_WEIGHT, WEIGHTED_NORM_LIMIT, Decision, Outcome, ProtocolConfig, ReplyMeta, Task
from fedcomp.server.balance import balance_factor
from fedcomp.server.ledger import ClientLedger, NodeIdentities
from fedcomp.spec import ModelSpec
from fedcomp.wire import WireError, decode


class Judge(Protocol):
    """What the checks read of the server: the model spec, the version, the options, the staleness weights and
    the ledger (how many updates of each node were applied)."""

    spec: ModelSpec
    version: int
    config: ProtocolConfig
    staleness: Callable[[int], float]
    book: NodeIdentities


@dataclass
class Reply:
    """One reply under judgement, and what the checks found out about it so far."""

    client: int
    blob: bytes
    meta: ReplyMeta
    ledger: ClientLedger | None = None
    task: Task | None = None
    update: Update | None = None
    norm: float = 0.0
    tau: int = 0
    weight: float = 0.0
    given_weight: float | None = None  # the caller's own aggregation weight (``Compressed``: the example count)

    def fail(self, outcome: Outcome, reason: str) -> Decision:
        return Decision(outcome, reason, seq=self.meta.seq)


Check = Callable[[Judge, Reply], "Decision | None"]


def judge(server: Judge, reply: Reply, checks: Sequence[Check]) -> Decision | None:
    """The first failing check's decision, or None when the reply passes them all."""
    for check in checks:
        decision = check(server, reply)
        if decision is not None:
            return decision
    return None


# ---- gates: failures are ignored ------------------------------------------------------------------------------
def known_client(server: Judge, r: Reply) -> Decision | None:
    if r.ledger is None:
        return r.fail(Outcome.REJECTED, "unknown client: no task was ever sent to it")
    return None


def open_task(server: Judge, r: Reply) -> Decision | None:
    if r.task is not None:
        return None
    led, meta = r.ledger, r.meta
    assert led is not None
    if meta.seq and led.seen_before(meta.seq) and meta.incarnation == led.incarnation:
        return r.fail(Outcome.DUPLICATE, f"seq {meta.seq} already seen")
    return r.fail(Outcome.LATE, f"task {meta.task_id} is not open for this client")


def new_seq(server: Judge, r: Reply) -> Decision | None:
    """A seq is judged once: one seen before (or too old to tell, ``ClientLedger.seen_before``) is a duplicate.
    A seq below the highest seen but new is judged: a node's replies may arrive out of order."""
    assert r.ledger is not None
    if r.meta.seq <= 0 or r.ledger.seen_before(r.meta.seq):
        return r.fail(Outcome.DUPLICATE, f"seq {r.meta.seq} already seen (highest {r.ledger.last_seq})")
    return None


GATES: tuple[Check, ...] = (known_client, open_task, new_seq)


# ---- the decode, then the checks: failures are nacked --------------------------------------------------------
def decode_reply(server: Judge, r: Reply) -> Decision | None:
    """Decode the blob into ``r.update`` (every length, index, value and the CRC validated once); the failure's
    ``Decision`` (``wire/<category>``) if it does not decode."""
    try:
        r.update = decode(r.blob, server.spec, max_bytes=server.config.max_blob_bytes or None)
    except WireError as exc:
        return r.fail(Outcome.REJECTED, wire_reason(exc))
    return None


def header_seq(server: Judge, r: Reply) -> Decision | None:
    assert r.update is not None
    if r.update.seq != r.meta.seq:
        return r.fail(Outcome.REJECTED, f"seq: blob says {r.update.seq}, meta {r.meta.seq}")
    return None


def header_client(server: Judge, r: Reply) -> Decision | None:
    assert r.update is not None
    if r.update.client_id != r.client % (1 << 64):
        return r.fail(Outcome.REJECTED, f"client id: blob says {r.update.client_id}")
    return None


def header_base(server: Judge, r: Reply) -> Decision | None:
    assert r.update is not None and r.task is not None
    if r.update.base_version != r.task.base_version:
        return r.fail(
            Outcome.REJECTED, f"base version: blob {r.update.base_version}, task {r.task.base_version}"
        )
    return None


def finite(server: Judge, r: Reply) -> Decision | None:
    assert r.update is not None
    r.norm = update_norm(r.update)
    if not math.isfinite(r.norm):
        return r.fail(Outcome.REJECTED, "non-finite: NaN or Inf in the (dequantized) values")
    return None


def norm_bound(server: Judge, r: Reply) -> Decision | None:
    bound = server.config.max_update_norm
    if bound and r.norm > bound:
        return r.fail(Outcome.REJECTED, f"norm: {r.norm:.4g} > bound {bound:.4g}")
    return None


def fresh(server: Judge, r: Reply) -> Decision | None:
    assert r.task is not None
    r.tau = server.version - r.task.base_version
    if r.tau > server.config.max_staleness:
        return r.fail(Outcome.STALE, f"staleness {r.tau} > {server.config.max_staleness}")
    return None


def weighted(server: Judge, r: Reply) -> Decision | None:
    if r.given_weight is not None:  # the caller aggregates with its own weight (>= 0): bound that one
        r.weight = float(r.given_weight)
        if not (math.isfinite(r.weight) and 0 <= r.weight <= MAX_WEIGHT):
            return r.fail(Outcome.REJECTED, f"weight: {r.weight:.4g}")
    else:
        r.weight = float(server.staleness(r.tau))
        if server.config.weight_by_examples:
            r.weight *= max(int(r.meta.num_examples), 0)
        if server.config.balance > 1.0 and r.ledger is not None:
            r.weight *= balance_factor(r.ledger.applied, server.book.mean_applied(), server.config.balance)
        if not (math.isfinite(r.weight) and 0 < r.weight <= MAX_WEIGHT):
            return r.fail(Outcome.REJECTED, f"weight: {r.weight:.4g} (examples {r.meta.num_examples})")
    if r.weight * r.norm > WEIGHTED_NORM_LIMIT:
        return r.fail(Outcome.REJECTED, f"norm: weighted norm {r.weight * r.norm:.4g} overflows")
    return None


CHECKS: tuple[Check, ...] = (header_seq, header_client, header_base, finite, norm_bound, fresh, weighted)


# ---- helpers --------------------------------------------------------------------------------------------------
def wire_reason(exc: WireError) -> str:
    """``"wire/<category>: <message>"`` for a decode failure (``WireError.category``)."""
    return f"wire/{exc.category.value}: {exc}"


def update_norm(update: Update) -> float:
    """L2 norm of the update's values in float64, read from the codes and scales without dequantizing (the
    accumulator dequantizes once, when it adds); ``nan`` when a value or scale is not finite."""
    total = sum(_squared_norm(p.values) for p in update.tensors.values())
    return math.sqrt(total) if math.isfinite(total) else math.nan


def _squared_norm(v: Values) -> float:
    if v.coding.is_float:
        return float(v.data.double().square().sum())
    if v.coding is ValueCoding.LOWRANK:  # ||P diag(s) Q^T||^2 from the factors' Gram matrices, exact in float64
        p, s, q = (t.double() for t in v.factors())
        return float(((p.T @ p) * (q.T @ q) * torch.outer(s, s)).sum())
    n = v.data.numel()
    if n == 0:
        return 0.0
    scales = v.scales.double() if v.scales is not None else torch.ones(1, dtype=torch.float64)
    codes2 = v.data.double().square()
    if scales.numel() == 1:
        return float(codes2.sum() * scales[0].square())
    # per block: the sum of its squared codes (values past the last scale count in the last block)
    block, blocks = max(v.block, 1), scales.numel()
    whole = min(n // block, blocks)
    per_block = torch.zeros(blocks, dtype=torch.float64)
    per_block[:whole] = codes2[: whole * block].view(whole, block).sum(1)
    per_block[min(whole, blocks - 1)] += codes2[whole * block :].sum()
    return float((per_block * scales.square()).sum())

"""Index codings: which flat positions of a tensor a record carries.

* ``DENSE``: every position, no index stream (the payload had ``indices=None``).
* ``BITMAP``: ``numel`` bits, bit ``i`` set iff position ``i`` is kept.
* ``RICE``: Golomb-Rice coded gaps ``g_0 = i_0``, ``g_k = i_k - i_{k-1} - 1`` with parameter ``b``: quotient
  ``g >> b`` in unary (that many 0 bits, then a 1) in one stream and the low ``b`` bits in a second,
  fixed-width stream, so both directions are whole-array numpy operations.

``plan`` picks, for a sparse payload, the coding with the smallest exact encoded size (parameters included).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from enum import IntEnum

import numpy as np

from fedcomp.wire.bits import MAX_WIDTH, Reader, pack_uint, packed_len, unpack_uint, varint, varint_len
from fedcomp.wire.errors import WireCategory, WireError

MAX_RICE_B = MAX_WIDTH
_SHORTCUT_NNZ = 4096  # below this, sizing RICE exactly is cheaper than bounding it


class IndexCoding(IntEnum):
    """On-wire id of an index coding (high nibble of a record's kind byte)."""

    DENSE = 0
    BITMAP = 1
    RICE = 2


@dataclass(frozen=True)
class IndexPlan:
    """A chosen index coding with its parameters and exact size in bytes (parameters + streams)."""

    coding: IndexCoding
    size: int
    b: int = 0
    qsum: int = 0


def gaps(idx: np.ndarray) -> np.ndarray:
    """Gaps between sorted unique positions (``idx[0]`` for the first)."""
    g = np.empty_like(idx)
    g[:1] = idx[:1]
    np.subtract(idx[1:], idx[:-1] + 1, out=g[1:])
    return g


def rice_size(nnz: int, qsum: int, b: int) -> int:
    """Bytes of a RICE index section: ``b`` (1), ``qsum`` (varint), unary stream, remainder stream."""
    return 1 + varint_len(qsum) + packed_len(nnz + qsum, 1) + packed_len(nnz, b)


def rice_candidates(nnz: int, gap_sum: int) -> range:
    """The ``b`` that ``rice_plan`` sizes exactly for ``nnz > 0`` gaps summing to ``gap_sum``: ``b0 - 1 .. b0 + 2``
    around the Golomb optimum ``b0 = floor(log2(ln 2 * mean gap))`` (0 below 1), clamped to ``0 .. MAX_RICE_B``.

    >>> list(rice_candidates(10, 10_000))
    [8, 9, 10, 11]
    """
    m = gap_sum / nnz * math.log(2)  # == float(g.mean()) * ln 2: the sum of int64 gaps is exact in float64
    b0 = int(math.floor(math.log2(m))) if m >= 1 else 0
    return range(max(0, b0 - 1), min(MAX_RICE_B, b0 + 2) + 1)


def rice_plan_sums(nnz: int, gap_sum: int, qsum_of: Callable[[int], int]) -> IndexPlan:
    """``rice_plan`` from counts: ``nnz`` gaps summing to ``gap_sum`` and ``qsum_of(b)`` = the sum of ``g >> b``
    (asked only for ``b`` in ``rice_candidates``). A device encoder computes those sums where the gaps live."""
    if nnz == 0:
        return IndexPlan(IndexCoding.RICE, rice_size(0, 0, 0), 0, 0)
    best = None
    for b in rice_candidates(nnz, gap_sum):
        qsum = qsum_of(b)
        plan = IndexPlan(IndexCoding.RICE, rice_size(nnz, qsum, b), b, qsum)
        if best is None or plan.size < best.size:
            best = plan
    return best


def rice_plan(g: np.ndarray) -> IndexPlan:
    """Best ``b`` near the Golomb optimum for the mean gap, chosen by exact size among neighbours."""
    return rice_plan_sums(g.size, int(g.sum()), lambda b: int((g >> b).sum()))


def bitmap_plan(numel: int) -> IndexPlan:
    return IndexPlan(IndexCoding.BITMAP, packed_len(numel, 1))


def plan(idx: np.ndarray, numel: int, force: IndexCoding | None = None) -> IndexPlan:
    """Smallest index coding for sorted unique ``idx`` (ties go to the lower id), or ``force``d one."""
    gap_sum = int(idx[-1]) + 1 - idx.size if idx.size else 0  # sum of the gaps of strictly increasing positions
    cache: list[np.ndarray] = []

    def qsum_of(b: int) -> int:
        if not cache:
            cache.append(gaps(idx))
        return int((cache[0] >> b).sum())

    return plan_sums(idx.size, numel, gap_sum, qsum_of, force)


def plan_sums(
    nnz: int, numel: int, gap_sum: int, qsum_of: Callable[[int], int], force: IndexCoding | None = None
) -> IndexPlan:
    """``plan`` from counts (``rice_plan_sums``): what a device encoder calls with sums it computed on the device,
    so both encoders choose by the one rule."""
    if force is IndexCoding.DENSE:
        raise WireError("index coding DENSE is only for payloads without indices")
    if force is IndexCoding.BITMAP:
        return bitmap_plan(numel)
    if force is IndexCoding.RICE:
        return rice_plan_sums(nnz, gap_sum, qsum_of)
    bitmap = bitmap_plan(numel)
    if nnz > _SHORTCUT_NNZ and bitmap.size <= rice_lower_bound(nnz, gap_sum):
        return bitmap  # RICE cannot beat it: skip the O(nnz) sizing passes
    return min(bitmap, rice_plan_sums(nnz, gap_sum, qsum_of), key=lambda p: (p.size, p.coding))


def rice_lower_bound(nnz: int, gap_sum: int) -> int:
    """A lower bound on ``rice_size`` over every ``b`` for ``nnz`` gaps summing to ``gap_sum``.

    Each quotient is at least ``(g - 2**b + 1) / 2**b``, so the unary stream holds at least that many 0 bits.
    """
    best = None
    for b in range(MAX_RICE_B + 1):
        qsum = max(0, -(-(gap_sum - nnz * ((1 << b) - 1)) >> b))
        size = 2 + packed_len(nnz * (1 + b) + qsum, 1)
        best = size if best is None else min(best, size)
    return best


def encode_index(p: IndexPlan, idx: np.ndarray, numel: int) -> tuple[bytes, bytes]:
    """``(parameter bytes, stream bytes)`` of the index section described by ``p``."""
    if p.coding is IndexCoding.BITMAP:
        bits = np.zeros(numel, dtype=np.uint8)
        bits[idx] = 1
        return b"", np.packbits(bits, bitorder="little").tobytes()
    if p.coding is IndexCoding.RICE:
        g = gaps(idx)
        q = g >> p.b
        unary = np.zeros(idx.size + p.qsum, dtype=np.uint8)
        unary[np.cumsum(q + 1) - 1] = 1
        stream = np.packbits(unary, bitorder="little").tobytes() + pack_uint(g & ((1 << p.b) - 1), p.b)
        return bytes([p.b]) + varint(p.qsum), stream
    return b"", b""


def read_index(r: Reader, coding: IndexCoding, nnz: int, numel: int, what: str) -> np.ndarray:
    """Sorted unique int64 positions in ``[0, numel)``; validates parameters and lengths before allocating."""
    if coding is IndexCoding.BITMAP:
        return _read_bitmap(r, nnz, numel, what)
    return _read_rice(r, nnz, numel, what)


def _read_bitmap(r: Reader, nnz: int, numel: int, what: str) -> np.ndarray:
    bits = unpack_uint(r, numel, 1, f"{what} bitmap", "index")
    pos = np.flatnonzero(bits).astype(np.int64, copy=False)
    if pos.size != nnz:
        raise WireError(f"{what}: bitmap has {pos.size} set bits, nnz says {nnz}")
    return pos


def _read_rice(r: Reader, nnz: int, numel: int, what: str) -> np.ndarray:
    b = r.u8(f"{what} rice b")
    if b > MAX_RICE_B:
        raise WireError(f"{what}: rice parameter b={b} exceeds {MAX_RICE_B}")
    qsum = r.varint(f"{what} rice quotient sum")
    if (qsum << b) + nnz > numel:
        raise WireError(f"{what}: rice quotient sum {qsum} (b={b}) reaches past numel {numel}", WireCategory.SHAPE)
    nbits = nnz + qsum
    r.need(packed_len(nbits, 1) + packed_len(nnz, b), f"{what} rice streams")
    unary = unpack_uint(r, nbits, 1, f"{what} rice unary stream", "index")
    ends = np.flatnonzero(unary)
    if ends.size != nnz or (nnz and ends[-1] != nbits - 1):
        raise WireError(f"{what}: rice unary stream does not hold exactly {nnz} quotients summing to {qsum}")
    rem = unpack_uint(r, nnz, b, f"{what} rice remainder stream", "index")
    if nnz == 0:
        return np.zeros(0, dtype=np.int64)
    # Each remainder < numel, so the uint64 sum is exact for numel < 2**32 (see docs/wire-format.md, Limits).
    if int(rem.max()) >= numel or (qsum << b) + int(rem.sum(dtype=np.uint64)) + nnz > numel:
        raise WireError(f"{what}: rice-coded index beyond numel {numel}", WireCategory.SHAPE)
    q = np.diff(ends, prepend=-1) - 1
    return np.cumsum((q << b) + rem + 1) - 1

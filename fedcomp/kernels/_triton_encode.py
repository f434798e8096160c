"""Triton kernels of the device wire encode (imported lazily by fedcomp.kernels.crc and fedcomp.kernels.encode).

* ``index_stats_kernel`` and ``index_streams_kernel``: the sparse records' indices read in place, ``CHUNK`` kept
  indices of one record per program. The first writes a row per chunk (violations, the record's last index and
  ``lo`` in its first chunk, the quotient sums ``sum(g >> b)`` for ``WINDOW`` values of ``b``); the
  second ORs every RICE unary and remainder field and every bitmap bit into one stream buffer.
  The programs find their record in a table (int64, column-major): ``RECORD_COLUMNS`` per record
  (``tab[col * R + r]``), then ``CHUNK_COLUMNS`` per chunk (``tab[RECORD_COLUMNS * R + col * C + c]``).
  The stream buffer is little-endian bit streams held as int32 words (docs/wire-format.md: stream bit ``j`` is bit
  ``j % 8`` of byte ``j // 8``, which is bit ``j % 32`` of little-endian word ``j // 32``). A field of at most 32
  bits at bit position ``p`` touches words ``p // 32`` and ``p // 32 + 1``: two atomic ORs. Fields never overlap,
  so the order of the atomics does not matter: the result is deterministic.
* ``crc32_chunks_kernel``: the CRC-32 register (reflected polynomial 0xEDB88320, table driven, start 0, no final
  xor) of every ``C``-byte chunk of a byte buffer, one chunk per lane; the buffer is read as if ``pad`` zero bytes
  preceded it (leading zeros leave a zero register unchanged).

The chunk registers are folded into one by fedcomp.kernels.crc (a GF(2) matrix product per level, in torch).
"""

from __future__ import annotations

import triton
import triton.language as tl

#: Kept indices per program of the index kernels, and their warps.
CHUNK = 2048
CHUNK_WARPS = 8
# The table's columns per record: the indices' address (int64), their count, the tensor's numel; the index coding
# (RICE 1, bitmap 0), its b, the stream's byte offset and its unary bytes (0 before the plan). Per chunk: its record,
# its first kept index, and the unary bits of the record's chunks before it (0 before the plan).
PTR, COUNT, NUMEL, RICE, B, OFFSET, UNARY = (tl.constexpr(i) for i in range(7))
REC, FIRST, BEFORE = (tl.constexpr(i) for i in range(3))
RECORD_COLUMNS, CHUNK_COLUMNS = tl.constexpr(7), tl.constexpr(3)
#: Bytes per chunk and chunks (lanes) per program of ``crc32_chunks_kernel``.
CRC_CHUNK = 64
CRC_LANES = 1024
_LN2 = tl.constexpr(0.6931471805599453)
_MANTISSA, _EXPONENT_ONE = tl.constexpr((1 << 52) - 1), tl.constexpr(1023 << 52)  # of a float64


@triton.jit
def _chunk(tab, R, C, CHUNK: tl.constexpr):
    """Program's chunk c: its record r, its first kept index's place in the record, the places ``k``, ``ok``, the
    indices and the gaps (``idx[0]``, then ``idx[k] - idx[k-1] - 1``)."""
    c = tl.program_id(0)
    head = tab + RECORD_COLUMNS * R
    r = tl.load(head + REC * C + c)
    k0 = tl.load(head + FIRST * C + c)
    k = k0 + tl.arange(0, CHUNK)
    ok = k < tl.load(tab + COUNT * R + r)
    ptr = tl.load(tab + PTR * R + r).to(tl.pointer_type(tl.int64))
    idx = tl.load(ptr + k, mask=ok, other=0)
    prev = tl.load(ptr + k - 1, mask=ok & (k > 0), other=0)
    return c, r, k0, k, ok, idx, tl.where(k == 0, idx, idx - prev - 1)


@triton.jit
def index_stats_kernel(tab, R, C, out_ptr, CHUNK: tl.constexpr, WINDOW: tl.constexpr):
    """``out[c]`` = chunk c's row of ``3 + WINDOW``: ``[violations, last, lo, sum(g >> lo + w) for w < WINDOW]``
    over its kept indices; violations count gaps < 0 and indices outside ``[0, numel)``; ``last`` and ``lo``
    (``b0' - 2`` clamped to [0, 32], ``b0'`` the Golomb optimum from the record's last index and count) only in the
    record's first chunk, 0 in the others (so the record's row is the sum of its chunks' rows)."""
    c, r, k0, k, ok, idx, g = _chunk(tab, R, C, CHUNK)
    n = tl.load(tab + COUNT * R + r)
    bad = tl.sum((ok & ((g < 0) | (idx < 0) | (idx >= tl.load(tab + NUMEL * R + r)))).to(tl.int64), axis=0)
    last = tl.load(tl.load(tab + PTR * R + r).to(tl.pointer_type(tl.int64)) + n - 1)
    lo = tl.minimum(tl.maximum(_golomb_b0(last + 1 - n, n) - 2, 0), 32)
    first = k0 == 0
    row = out_ptr + c.to(tl.int64) * (3 + WINDOW)
    tl.store(row, bad)
    tl.store(row + 1, tl.where(first, last, 0))
    tl.store(row + 2, tl.where(first, lo, 0))
    for w in tl.static_range(WINDOW):
        tl.store(row + 3 + w, tl.sum(tl.where(ok, g >> (lo + w), 0), axis=0))


@triton.jit
def _golomb_b0(gsum, n):
    """``floor(log2(ln 2 * gsum / n))`` (0 below 1) for ``n >= 1`` from the float64 exponents and mantissas of
    ``gsum`` and ``n``: no division and no log (their approximations flush subnormals), within one of the host's."""
    a = gsum.to(tl.float64).to(tl.int64, bitcast=True)
    d = n.to(tl.float64).to(tl.int64, bitcast=True)
    ma = ((a & _MANTISSA) | _EXPONENT_ONE).to(tl.float64, bitcast=True) * _LN2  # in [ln 2, 2 ln 2)
    md = ((d & _MANTISSA) | _EXPONENT_ONE).to(tl.float64, bitcast=True)  # in [1, 2)
    b0 = (a >> 52) - (d >> 52) - (ma < md).to(tl.int64) - (2.0 * ma < md).to(tl.int64)
    return tl.where(gsum > 0, tl.maximum(b0, 0), 0)


@triton.jit
def index_streams_kernel(tab, R, C, words_ptr, CHUNK: tl.constexpr):
    """The chunk's fields in the record's stream at byte ``OFFSET``: RICE, a 1 bit after each quotient's zeros in
    the unary stream (``BEFORE`` bits of the record's chunks before this one) and ``g mod 2**b`` in ``b`` bits at
    ``k * b`` of the remainders (after ``UNARY`` bytes); bitmap, bit ``idx``."""
    c, r, _, k, ok, idx, g = _chunk(tab, R, C, CHUNK)
    base = 8 * tl.load(tab + OFFSET * R + r)
    if tl.load(tab + RICE * R + r) != 0:
        b = tl.load(tab + B * R + r)
        ones = tl.cumsum(tl.where(ok, (g >> b) + 1, 0), axis=0) - 1
        _or_fields(words_ptr, base + tl.load(tab + RECORD_COLUMNS * R + BEFORE * C + c) + ones, ok.to(tl.int64), ok)
        rem = g & ((1 << b) - 1)
        _or_fields(words_ptr, base + 8 * tl.load(tab + UNARY * R + r) + k * b, rem, ok & (rem != 0))
    else:
        _or_fields(words_ptr, base + idx, ok.to(tl.int64), ok)


@triton.jit
def _or_fields(words_ptr, pos, val, ok):
    """``words |= val << pos`` for each field: ``pos`` int64 stream bit positions, ``val`` int64 in [0, 2**32)."""
    wide = val << (pos & 31)  # < 2**63
    lo = (wide & 0xFFFFFFFF).to(tl.int32)
    hi = (wide >> 32).to(tl.int32)
    word = pos >> 5
    tl.atomic_or(words_ptr + word, lo, mask=ok & (lo != 0))
    tl.atomic_or(words_ptr + word + 1, hi, mask=ok & (hi != 0))


@triton.jit
def crc32_chunks_kernel(buf_ptr, table_ptr, out_ptr, n, pad, nchunks, C: tl.constexpr, LANES: tl.constexpr):
    """``out[c]`` = CRC register (start 0) of bytes ``[c C - pad, (c + 1) C - pad)`` (outside ``[0, n)``: 0)."""
    chunk = tl.program_id(0).to(tl.int64) * LANES + tl.arange(0, LANES)
    ok = chunk < nchunks
    start = chunk * C - pad
    r = tl.zeros([LANES], dtype=tl.int64)
    for i in range(C):
        p = start + i
        b = tl.load(buf_ptr + p, mask=ok & (p >= 0) & (p < n), other=0).to(tl.int64)
        r = tl.load(table_ptr + ((r ^ b) & 0xFF)) ^ (r >> 8)
    tl.store(out_ptr + chunk, r, mask=ok)

"""Triton kernels of the device wire encode (imported lazily by fedcomp.kernels.crc and fedcomp.kernels.encode).

* ``or_fields_kernel``: OR bit fields into a little-endian bit stream held as int32 words (docs/wire-format.md:
  stream bit ``j`` is bit ``j % 8`` of byte ``j // 8``, which is bit ``j % 32`` of little-endian word ``j // 32``).
  A field of at most 32 bits at bit position ``p`` touches words ``p // 32`` and ``p // 32 + 1``: two atomic ORs.
  Fields never overlap, so the order of the atomics does not matter: the result is deterministic.
* ``crc32_chunks_kernel``: the CRC-32 register (reflected polynomial 0xEDB88320, table driven, start 0, no final
  xor) of every ``C``-byte chunk of a byte buffer, one chunk per lane; the buffer is read as if ``pad`` zero bytes
  preceded it (leading zeros leave a zero register unchanged).

The chunk registers are folded into one by fedcomp.kernels.crc (a GF(2) matrix product per level, in torch).
"""

from __future__ import annotations

import triton
import triton.language as tl

#: Fields per program of ``or_fields_kernel``.
FIELDS_BLOCK = 1024
#: Bytes per chunk and chunks (lanes) per program of ``crc32_chunks_kernel``.
CRC_CHUNK = 64
CRC_LANES = 1024


@triton.jit
def or_fields_kernel(words_ptr, pos_ptr, val_ptr, n, BLOCK: tl.constexpr):
    """``words |= val << pos`` for each field: ``pos`` int64 stream bit positions, ``val`` int64 in [0, 2**32)."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < n
    pos = tl.load(pos_ptr + offs, mask=ok, other=0)
    val = tl.load(val_ptr + offs, mask=ok, other=0)
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

"""Triton kernels of quantize-and-pack with error feedback (imported lazily by fedcomp.kernels.quant).

Scale rules (``MODE``): 0 absmax / qmax (int8, int4), 1 L2 norm / qmax (QSGD), 2 mean |c| (sign), each computed
as the reference computes it (fedcomp/compressors). Codes are
``round(c / scale)`` clamped to ``[-qmax, qmax]`` (round half to even, or stochastic rounding
``floor(r) + (rand < r - floor(r))`` from ``tl.rand(seed, index)``), or ``sign(c)`` (0 -> +1) for MODE 2.
Divisions use ``div_rn`` (IEEE, like torch); launch with ``enable_fp_fusion=False`` so ``c - code * scale``
rounds twice, as the reference's dequantize-then-subtract does. Packing follows docs/wire-format.md: int4 as
4-bit two's complement fields, sign as one bit (1 = +1), least significant bits first.
"""

from __future__ import annotations

import triton
import triton.language as tl

#: Largest quantization block handled in one tile (one program computes the block's scale and codes).
MAX_TILE = 4096
#: Elements per program of the 1-D (scales given) kernel.
BLOCK_1D = 4096
NUM_WARPS = 8


@triton.jit
def _floor(r):
    """IEEE floor for |r| < 2**31. Not ``tl.floor``: libdevice's floorf is built flush-to-zero on CUDA
    (``cvt.rmi.ftz``), which takes floor(-1e-40) to 0, not -1 as the reference does."""
    t = r.to(tl.int32).to(tl.float32)  # truncation toward zero, exact
    return tl.where(t > r, t - 1.0, t)


@triton.jit
def _round_half_even(r):
    f = _floor(r)
    d = r - f  # exact for |r| < 2**23
    odd = (f - 2.0 * _floor(f * 0.5)) != 0.0
    return tl.where((d > 0.5) | ((d == 0.5) & odd), f + 1.0, f)


@triton.jit
def _codes(c, scale, offs, qmax, seed, MODE: tl.constexpr, STOCHASTIC: tl.constexpr):
    """Float codes of ``c`` for ``scale`` (broadcastable); ``offs``: global element indices (RNG counters)."""
    if MODE == 2:
        q = tl.where(c >= 0.0, 1.0, -1.0)
    else:
        r = tl.math.div_rn(c, tl.where(scale > 0.0, scale, 1.0))  # positive_or_one: a 0 scale means c ~ 0
        r = tl.minimum(tl.maximum(r, -qmax), qmax)
        if STOCHASTIC:
            low = _floor(r)
            q = low + (tl.rand(seed, offs.to(tl.int32)) < r - low).to(tl.float32)
        else:
            q = _round_half_even(r)
        q = tl.minimum(tl.maximum(q, -qmax), qmax)
    return q


@triton.jit
def _pack(q, valid, BITS: tl.constexpr, R: tl.constexpr, N: tl.constexpr):
    """Pack codes ``q`` ``[R, N]`` (N a multiple of 8 // BITS) along the last axis: bytes ``[R, N * BITS // 8]``."""
    PER: tl.constexpr = 8 // BITS
    if BITS == 1:
        fld = ((q > 0.0) & valid).to(tl.int32)
    else:
        fld = q.to(tl.int32) & ((1 << BITS) - 1)
    fld = tl.reshape(fld, [R, N // PER, PER])
    shifts = tl.arange(0, PER) * BITS
    return tl.sum(fld << shifts[None, None, :], axis=2)


@triton.jit
def _quant_rows(
    x_ptr, e_ptr, codes_ptr, scales_ptr, packed_ptr, rows, offs, inb, n, nblocks, block, nbytes, qmax, seed, base,
    READ_E: tl.constexpr, WRITE_E: tl.constexpr, MODE: tl.constexpr, STOCHASTIC: tl.constexpr,
    PACK_BITS: tl.constexpr, ROWS: tl.constexpr, BP: tl.constexpr,
):
    """Quantization blocks ``rows`` (``[ROWS]``) of one tensor, elements ``offs`` (``[ROWS, BP]``, ``inb`` in
    range): c = x (+ e with READ_E); per-block scale; codes; with WRITE_E, e <- c - code * scale; with PACK_BITS
    (block a multiple of 8 // PACK_BITS), the packed bytes too. ``base + offs``: the rounding's RNG counters."""
    c = tl.load(x_ptr + offs, mask=inb, other=0.0)
    if READ_E:
        c = c + tl.load(e_ptr + offs, mask=inb, other=0.0)
    a = tl.abs(c)
    if MODE == 0:
        scale = tl.math.div_rn(tl.max(a, axis=1), qmax)
    elif MODE == 1:
        amax = tl.max(a, axis=1)
        safe = tl.where(amax > 0.0, amax, 1.0)
        unit = tl.where(amax[:, None] > 0.0, tl.math.div_rn(c, safe[:, None]), 0.0)
        # l2_norms: absmax * (||c / absmax|| / qmax), saturating at the largest finite fp32
        scale = tl.minimum(amax * tl.math.div_rn(tl.sqrt_rn(tl.sum(unit * unit, axis=1)), qmax), 3.4028234663852886e38)
    else:
        cnt = tl.maximum(tl.minimum(n - rows * block, block), 1).to(tl.float32)  # rows past the end: 1
        scale = tl.sum(tl.math.div_rn(a, cnt[:, None]), axis=1)  # divide before summing, as the reference
    q = _codes(c, scale[:, None], base + offs, qmax, seed, MODE, STOCHASTIC)
    tl.store(codes_ptr + offs, q.to(tl.int8), mask=inb)
    tl.store(scales_ptr + rows, scale, mask=rows < nblocks)
    if WRITE_E:
        tl.store(e_ptr + offs, c - q * scale[:, None], mask=inb)
    if PACK_BITS > 0:
        PER: tl.constexpr = 8 // PACK_BITS
        byte = _pack(q, inb, PACK_BITS, ROWS, BP)
        bcols = tl.arange(0, BP // PER)
        boffs = rows[:, None] * (block // PER) + bcols[None, :]
        ok = (bcols[None, :] < block // PER) & (boffs < nbytes) & (rows[:, None] < nblocks)
        tl.store(packed_ptr + boffs, byte.to(tl.uint8), mask=ok)


@triton.jit
def quant_tile_kernel(
    x_ptr, e_ptr, codes_ptr, scales_ptr, packed_ptr, n, nblocks, block, nbytes, qmax, seed,
    HAS_E: tl.constexpr, MODE: tl.constexpr, STOCHASTIC: tl.constexpr, PACK_BITS: tl.constexpr,
    ROWS: tl.constexpr, BP: tl.constexpr,
):
    """One pass over ROWS quantization blocks of ``block`` (<= BP) elements (``_quant_rows``); with HAS_E the
    residual e is added to x and then holds the coding error."""
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BP)
    offs = rows[:, None] * block + cols[None, :]
    inb = (cols[None, :] < block) & (offs < n)
    _quant_rows(x_ptr, e_ptr, codes_ptr, scales_ptr, packed_ptr, rows, offs, inb, n, nblocks, block, nbytes, qmax,
                seed, 0, HAS_E, HAS_E, MODE, STOCHASTIC, PACK_BITS, ROWS, BP)


# quant_many_kernel's table (int64, column-major): per tensor (tab[col * T + t]) the fp32 x's and e's addresses, its
# size and its first code and first scale in the launch's flat outputs; then per program (tab[5 * T + col * C + c])
# its tensor and its first block (fedcomp.kernels._chunks).
X, E, N, CODE, SCALE = (tl.constexpr(i) for i in range(5))
OWNER, FIRST = (tl.constexpr(i) for i in range(2))


@triton.jit
def quant_many_kernel(
    tab, T, C, codes_ptr, scales_ptr, block, qmax, seed,
    READ_E: tl.constexpr, MODE: tl.constexpr, STOCHASTIC: tl.constexpr, ALIGNED: tl.constexpr,
    ROWS: tl.constexpr, BP: tl.constexpr,
):
    """``quant_tile_kernel`` (HAS_E, no packing) of every tensor t of the table at once, one program for ROWS
    blocks of one tensor: c = x_t (+ e_t with READ_E), codes and scales into the flat outputs at the tensor's
    first code and scale, e_t <- c - code * scale. ALIGNED (every x and e 16-byte aligned, the host checks): a
    program's full tiles read and write with 16-byte accesses. RNG counters: the tensor's first code + offset."""
    c = tl.program_id(0)
    t = tl.load(tab + 5 * T + OWNER * C + c)
    first = tl.load(tab + 5 * T + FIRST * C + c)
    rows = first + tl.arange(0, ROWS)
    x_ptr = tl.load(tab + X * T + t).to(tl.pointer_type(tl.float32))
    e_ptr = tl.load(tab + E * T + t).to(tl.pointer_type(tl.float32))
    if ALIGNED:
        x_ptr = tl.multiple_of(x_ptr, 16)
        e_ptr = tl.multiple_of(e_ptr, 16)
    n = tl.load(tab + N * T + t)
    code = tl.load(tab + CODE * T + t)
    nblocks = (n + block - 1) // block
    codes_t = codes_ptr + code
    scales_t = scales_ptr + tl.load(tab + SCALE * T + t)
    if ALIGNED:
        codes_t = tl.multiple_of(codes_t, 16)
    cols = tl.arange(0, BP)
    if (BP == block) & ((first + ROWS) * block <= n):  # every block of the tile full: no mask to honour
        offs = rows[:, None] * block + cols[None, :]
        _quant_rows(x_ptr, e_ptr, codes_t, scales_t, codes_t, rows, offs, tl.full((ROWS, BP), True, tl.int1), n,
                    nblocks, block, 0, qmax, seed, code, READ_E, True, MODE, STOCHASTIC, 0, ROWS, BP)
    else:  # the tensor's last tile: its blocks one by one (few registers: they set the whole kernel's count)
        for r in range(ROWS):
            row = first + r + tl.arange(0, 1)
            offs = row[:, None] * block + cols[None, :]
            _quant_rows(x_ptr, e_ptr, codes_t, scales_t, codes_t, row, offs, (cols[None, :] < block) & (offs < n), n,
                        nblocks, block, 0, qmax, seed, code, READ_E, True, MODE, STOCHASTIC, 0, 1, BP)


@triton.jit
def quant_1d_kernel(
    c_ptr, e_ptr, codes_ptr, scales_ptr, packed_ptr, n, block, nbytes, qmax, seed,
    WRITE_E: tl.constexpr, MODE: tl.constexpr, STOCHASTIC: tl.constexpr, PACK_BITS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """Codes of ``c`` with per-block scales already in ``scales`` (any block size); with WRITE_E,
    e <- c - code * scale (``e_ptr`` may alias ``c_ptr``); with PACK_BITS, the packed bytes."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    inb = offs < n
    c = tl.load(c_ptr + offs, mask=inb, other=0.0)
    scale = tl.load(scales_ptr + offs // block, mask=inb, other=0.0)
    q = _codes(c, scale, offs, qmax, seed, MODE, STOCHASTIC)
    tl.store(codes_ptr + offs, q.to(tl.int8), mask=inb)
    if WRITE_E:
        tl.store(e_ptr + offs, c - q * scale, mask=inb)
    if PACK_BITS > 0:
        PER: tl.constexpr = 8 // PACK_BITS
        byte = _pack(tl.reshape(q, [1, BLOCK]), tl.reshape(inb, [1, BLOCK]), PACK_BITS, 1, BLOCK)
        boffs = tl.program_id(0).to(tl.int64) * (BLOCK // PER) + tl.arange(0, BLOCK // PER)
        tl.store(packed_ptr + boffs, tl.reshape(byte, [BLOCK // PER]).to(tl.uint8), mask=boffs < nbytes)

"""Triton kernels of the server-side decode + weighted scatter-add and of a client's ``index_copy_`` into many tensors
at once (imported lazily by fedcomp.kernels.scatter)."""

from __future__ import annotations

import triton
import triton.language as tl

BLOCK = 2048
NUM_WARPS = 4


@triton.jit
def scatter_add_kernel(
    t_ptr, idx_ptr, data_ptr, scales_ptr, nnz, block, weight,
    SPARSE: tl.constexpr, QUANT: tl.constexpr, BLOCK: tl.constexpr,
):
    """``t[idx[i]] += weight * value[i]`` (sparse, atomic: duplicates add twice) or ``t[i] = fma(value[i], weight,
    t[i])`` (dense), where ``value[i] = data[i]`` (fp32) or ``data[i] * scales[i // block]`` (int8 codes)."""
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = i < nnz
    val = tl.load(data_ptr + i, mask=ok, other=0).to(tl.float32)
    if QUANT:
        val = val * tl.load(scales_ptr + i // block, mask=ok, other=0.0)
    if SPARSE:
        pos = tl.load(idx_ptr + i, mask=ok, other=0)
        tl.atomic_add(t_ptr + pos, val * weight, mask=ok, sem="relaxed")
    else:
        t = tl.load(t_ptr + i, mask=ok, other=0.0)
        tl.store(t_ptr + i, tl.fma(val, weight, t), mask=ok)


# put_many_kernel's table (int64, column-major): per tensor (tab[col * T + t]) the fp32 target's address, the int64
# positions' address, the fp32 values' address and their count; then per program (tab[4 * T + col * C + c]) its
# tensor and its first position (fedcomp.kernels._chunks).
DST, POS, SRC, COUNT = (tl.constexpr(i) for i in range(4))
OWNER, FIRST = (tl.constexpr(i) for i in range(2))


@triton.jit
def put_many_kernel(tab, T, C, BLOCK: tl.constexpr):
    """``dst_t[pos_t[j]] = src_t[j]`` for ``j < count_t`` of every tensor t (``index_copy_``; positions unique), one
    program for BLOCK positions of one tensor."""
    c = tl.program_id(0)
    t = tl.load(tab + 4 * T + OWNER * C + c)
    j = tl.load(tab + 4 * T + FIRST * C + c) + tl.arange(0, BLOCK)
    ok = j < tl.load(tab + COUNT * T + t)
    pos = tl.load(tl.load(tab + POS * T + t).to(tl.pointer_type(tl.int64)) + j, mask=ok, other=0)
    val = tl.load(tl.load(tab + SRC * T + t).to(tl.pointer_type(tl.float32)) + j, mask=ok, other=0.0)
    tl.store(tl.load(tab + DST * T + t).to(tl.pointer_type(tl.float32)) + pos, val, mask=ok)

"""Triton kernel of the server-side decode + weighted scatter-add (imported lazily by fedcomp.kernels.scatter)."""

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

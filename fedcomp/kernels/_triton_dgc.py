"""Triton kernels of the DGC step (imported lazily by fedcomp.kernels.dgc; see docs/kernels.md).

The arithmetic mirrors ``fedcomp.memory.dgc_math`` (what ``DGCMemory.compensate`` runs) operation by operation,
including where torch fuses a multiply-add (``torch.add(a, b, alpha=m)`` is one fma on CPU and GPU): the same
inputs give bitwise the same ``u`` and ``v``, so a threshold taken from the reference selects the same indices
here. Launch with ``enable_fp_fusion=False`` so the compiler adds no fma of its own.
"""

from __future__ import annotations

import triton
import triton.language as tl

#: Elements per program of the streaming kernels (one counter atomic per program that selects anything) and its
#: warps: the fastest of benchmarks/bench_kernels.py --sweep on an H200 at 100M elements (docs/results.md).
BLOCK = 1024
NUM_WARPS = 4


@triton.jit
def _momentum_velocity(g, u, v, s, momentum, NESTEROV: tl.constexpr, HAS_SCALE: tl.constexpr, HAS_U: tl.constexpr):
    """New (u, v) from gradient g, momentum u, velocity v and clip scale s (dgc_math.accumulate_); without
    HAS_U, plain error feedback: v + g (ResidualMemory.compensate), u is returned as g (unused)."""
    if HAS_U:
        if HAS_SCALE:
            # scale == 1 takes the reference's unclipped branch: u = g + m*u (one fma); else u = m*u + s*g.
            u_new = tl.where(s == 1.0, tl.fma(u, momentum, g), tl.fma(g, s, u * momentum))
        else:
            u_new = tl.fma(u, momentum, g)
        if NESTEROV:
            if HAS_SCALE:
                v_new = tl.fma(g, s, v)
            else:
                v_new = v + g
            v_new = tl.fma(u_new, momentum, v_new)
        else:
            v_new = v + u_new
    else:
        u_new = g
        v_new = v + g
    return u_new, v_new


@triton.jit
def _updated_state(g_ptr, u_ptr, v_ptr, scale_ptr, offs, ok, momentum, NESTEROV: tl.constexpr,
                   HAS_SCALE: tl.constexpr, HAS_U: tl.constexpr):
    """Load g, u, v at ``offs`` (where ``ok``) and the clip scale; return the new (u, v) (nothing stored)."""
    g = tl.load(g_ptr + offs, mask=ok, other=0.0)
    if HAS_U:
        u = tl.load(u_ptr + offs, mask=ok, other=0.0)
    else:
        u = g
    v = tl.load(v_ptr + offs, mask=ok, other=0.0)
    s = 1.0
    if HAS_SCALE:
        s = tl.load(scale_ptr)
    return _momentum_velocity(g, u, v, s, momentum, NESTEROV, HAS_SCALE, HAS_U)


@triton.jit
def dgc_sample_kernel(
    g_ptr, u_ptr, v_ptr, scale_ptr, out_ptr, start, stride, m, momentum,
    NESTEROV: tl.constexpr, HAS_SCALE: tl.constexpr, HAS_U: tl.constexpr, BLOCK: tl.constexpr,
):
    """``out[j] = |v_new[start + j * stride]|`` for ``j < m``: the threshold sample of the updated velocity,
    computed from g, u, v without writing any state."""
    j = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = j < m
    offs = start + j * stride
    _, v_new = _updated_state(g_ptr, u_ptr, v_ptr, scale_ptr, offs, ok, momentum, NESTEROV, HAS_SCALE, HAS_U)
    tl.store(out_ptr + j, tl.abs(v_new), mask=ok)


@triton.jit
def _compact(offs, val, mom, sel, count_ptr, idx_ptr, val_ptr, mom_ptr, capacity, SAVE_MOM: tl.constexpr):
    """Append the selected (offs, val[, mom]) to the bounded buffers; returns the mask of what was stored.

    One atomic per program reserves a contiguous run of slots; an in-block prefix sum places each element.
    Elements whose slot is past ``capacity`` are counted but not stored (the caller falls back to exact top-k).
    """
    sel_i = sel.to(tl.int32)
    total = tl.sum(sel_i, axis=0)
    keep = sel  # a block that selects nothing (a third of them at 1024 and density 0.001): no atomic, scan or store
    if total > 0:
        base = tl.atomic_add(count_ptr, total)
        slot = base + tl.cumsum(sel_i, axis=0) - 1
        keep = sel & (slot < capacity)
        tl.store(idx_ptr + slot, offs, mask=keep)
        tl.store(val_ptr + slot, val, mask=keep)
        if SAVE_MOM:
            tl.store(mom_ptr + slot, mom, mask=keep)
    return keep


@triton.jit
def dgc_fused_kernel(
    g_ptr, u_ptr, v_ptr, scale_ptr, thr_ptr, count_ptr, idx_ptr, val_ptr, mom_ptr, n, capacity, momentum,
    NESTEROV: tl.constexpr, HAS_SCALE: tl.constexpr, HAS_U: tl.constexpr, MASKING: tl.constexpr,
    DENSE: tl.constexpr, BLOCK: tl.constexpr,
):
    """One pass: u, v <- momentum correction + accumulation (with clip scale) of g; select
    ``|v| >= thr and v != 0``; append (index, v, u) of the selected to the buffers; zero v (and u when
    MASKING) where stored. DENSE: every element is sent, ``val[i] = v[i]``, v <- 0, u kept (no masking).
    Without HAS_U (plain error feedback, no momentum state): v <- v + g, u is neither read nor written."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    inb = offs < n
    u, v = _updated_state(g_ptr, u_ptr, v_ptr, scale_ptr, offs, inb, momentum, NESTEROV, HAS_SCALE, HAS_U)
    if DENSE:
        tl.store(val_ptr + offs, v, mask=inb)
        v = tl.zeros_like(v)
    else:
        thr = tl.load(thr_ptr)
        a = tl.abs(v)
        sel = inb & (a >= thr) & (a > 0.0)
        keep = _compact(offs, v, u, sel, count_ptr, idx_ptr, val_ptr, mom_ptr, capacity, MASKING)
        v = tl.where(keep, 0.0, v)
        if MASKING:
            u = tl.where(keep, 0.0, u)
    if HAS_U:
        tl.store(u_ptr + offs, u, mask=inb)
    tl.store(v_ptr + offs, v, mask=inb)


@triton.jit
def dgc_select_kernel(
    u_ptr, v_ptr, thr_ptr, count_ptr, idx_ptr, val_ptr, mom_ptr, n, capacity,
    MASKING: tl.constexpr, BLOCK: tl.constexpr,
):
    """Selection retry without a state update: select ``|v| >= thr and v != 0`` of the current v (already
    stored candidates are 0 there, so they are not taken twice), append, and zero v (and u) where stored.
    Reads v; touches u only at the selected positions."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    inb = offs < n
    v = tl.load(v_ptr + offs, mask=inb, other=0.0)
    thr = tl.load(thr_ptr)
    a = tl.abs(v)
    sel = inb & (a >= thr) & (a > 0.0)
    u = tl.load(u_ptr + offs, mask=sel, other=0.0)
    keep = _compact(offs, v, u, sel, count_ptr, idx_ptr, val_ptr, mom_ptr, capacity, MASKING)
    tl.store(v_ptr + offs, tl.zeros_like(v), mask=keep)
    if MASKING:
        tl.store(u_ptr + offs, tl.zeros_like(u), mask=keep)

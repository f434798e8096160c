"""Triton kernels of the DGC step (imported lazily by fedcomp.kernels.dgc; see docs/kernels.md).

The arithmetic mirrors ``fedcomp.memory.dgc_math`` (what ``DGCMemory.compensate`` runs) operation by operation,
including where torch fuses a multiply-add (``torch.add(a, b, alpha=m)`` is one fma on CPU and GPU): the same
inputs give bitwise the same ``u`` and ``v``, so a threshold taken from the reference selects the same indices
here. Launch with ``enable_fp_fusion=False`` so the compiler adds no fma of its own.

The selected positions come out sorted without a sort: the streaming pass marks each block's selection (its bits
and count), one ``torch.cumsum`` of the counts gives every block its first slot, and ``dgc_place_kernel`` writes each
block's positions in ascending order from there. No atomics: the same input gives the same buffer, in any launch
order.
"""

from __future__ import annotations

import triton
import triton.language as tl

#: Elements per program of the streaming kernels (a multiple of 32: a block's selection is marked as BLOCK // 32
#: int32 words) and its warps: the fastest of benchmarks/bench_kernels.py --sweep on an H200 at 100M elements
#: (docs/results.md).
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
def _mark(sel, bits_ptr, counts_ptr, BLOCK: tl.constexpr):
    """Store this program's selection ``sel`` (BLOCK bools) as BLOCK // 32 int32 words (bit j of word w: element
    32 w + j of the block) and its count: what ``dgc_place_kernel`` places."""
    pid = tl.program_id(0)
    words: tl.constexpr = BLOCK // 32
    sel_i = sel.to(tl.int32)
    packed = tl.sum(tl.reshape(sel_i, (words, 32)) << tl.arange(0, 32)[None, :], axis=1)
    tl.store(bits_ptr + pid.to(tl.int64) * words + tl.arange(0, words), packed)
    tl.store(counts_ptr + pid, tl.sum(sel_i, axis=0))


@triton.jit
def dgc_fused_kernel(
    g_ptr, u_ptr, v_ptr, scale_ptr, thr_ptr, bits_ptr, counts_ptr, val_ptr, n, momentum,
    NESTEROV: tl.constexpr, HAS_SCALE: tl.constexpr, HAS_U: tl.constexpr, DENSE: tl.constexpr,
    MARK: tl.constexpr, BLOCK: tl.constexpr,
):
    """One pass: u, v <- momentum correction + accumulation (with clip scale) of g, stored. MARK: the selection
    ``|v| >= thr and v != 0`` of each program's block marked (``_mark``: its bits and count; ``dgc_place_kernel``
    sends them). DENSE: every element is sent, ``val[i] = v[i]``, v <- 0, u kept (no masking). Neither: the state
    update alone. Without HAS_U (plain error feedback, no momentum state): v <- v + g, u is neither read nor
    written."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    _update_block(g_ptr, u_ptr, v_ptr, scale_ptr, thr_ptr, offs, offs < n, bits_ptr, counts_ptr, val_ptr, momentum,
                  NESTEROV, HAS_SCALE, HAS_U, DENSE, MARK, BLOCK)


@triton.jit
def _update_block(g_ptr, u_ptr, v_ptr, scale_ptr, thr_ptr, offs, inb, bits_ptr, counts_ptr, val_ptr, momentum,
                  NESTEROV: tl.constexpr, HAS_SCALE: tl.constexpr, HAS_U: tl.constexpr, DENSE: tl.constexpr,
                  MARK: tl.constexpr, BLOCK: tl.constexpr):
    """One block of the fused pass (``dgc_fused_kernel``'s contract) at ``offs``, where ``inb``; the batched pass
    (``_triton_dgc_multi``) runs it with its tensor's pointers."""
    u, v = _updated_state(g_ptr, u_ptr, v_ptr, scale_ptr, offs, inb, momentum, NESTEROV, HAS_SCALE, HAS_U)
    if DENSE:
        tl.store(val_ptr + offs, v, mask=inb)
        v = tl.zeros_like(v)
    elif MARK:
        thr = tl.load(thr_ptr)
        a = tl.abs(v)
        _mark(inb & (a >= thr) & (a > 0.0), bits_ptr, counts_ptr, BLOCK)
    if HAS_U:
        tl.store(u_ptr + offs, u, mask=inb)
    tl.store(v_ptr + offs, v, mask=inb)


@triton.jit
def dgc_mark_kernel(x_ptr, thr_ptr, bits_ptr, counts_ptr, n, BLOCK: tl.constexpr):
    """Mark ``|x| >= thr and x != 0`` per block (``_mark``), reading x only: a selection pass without a state
    update (a retry at a lower threshold, the small tensors' joint selection)."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    inb = offs < n
    a = tl.abs(tl.load(x_ptr + offs, mask=inb, other=0.0))
    thr = tl.load(thr_ptr)
    _mark(inb & (a >= thr) & (a > 0.0), bits_ptr, counts_ptr, BLOCK)


@triton.jit
def dgc_place_kernel(
    bits_ptr, counts_ptr, ends_ptr, thr_ptr, readout_ptr, u_ptr, v_ptr, idx_ptr, val_ptr, mom_ptr, blocks, capacity,
    MASKING: tl.constexpr, TAKE: tl.constexpr, BLOCK: tl.constexpr,
):
    """Place the marked positions in index order, without a sort: program b writes its block's marked positions,
    ascending, from slot ``ends[b] - counts[b]`` (``ends``: the inclusive cumsum of the counts), with v there (and
    u when MASKING); slots past ``capacity`` are not stored. TAKE: v is zeroed where stored (and u when MASKING).
    Program 0 writes ``readout = [total, thr == 0]`` (int32), the one thing the host reads."""
    pid = tl.program_id(0)
    if pid == 0:
        tl.store(readout_ptr, tl.load(ends_ptr + blocks - 1))
        tl.store(readout_ptr + 1, (tl.load(thr_ptr) == 0.0).to(tl.int32))
    c = tl.load(counts_ptr + pid)
    if c > 0:  # a block that marked nothing reads nothing more
        words: tl.constexpr = BLOCK // 32
        packed = tl.load(bits_ptr + pid.to(tl.int64) * words + tl.arange(0, words))
        sel = tl.reshape((packed[:, None] >> tl.arange(0, 32)[None, :]) & 1, (BLOCK,)) != 0
        slot = tl.load(ends_ptr + pid) - c + tl.cumsum(sel.to(tl.int32), axis=0) - 1
        keep = sel & (slot < capacity)
        offs = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        v = tl.load(v_ptr + offs, mask=keep, other=0.0)
        tl.store(idx_ptr + slot, offs, mask=keep)
        tl.store(val_ptr + slot, v, mask=keep)
        if TAKE:
            tl.store(v_ptr + offs, tl.zeros_like(v), mask=keep)
        if MASKING:
            u = tl.load(u_ptr + offs, mask=keep, other=0.0)
            tl.store(mom_ptr + slot, u, mask=keep)
            if TAKE:
                tl.store(u_ptr + offs, tl.zeros_like(u), mask=keep)

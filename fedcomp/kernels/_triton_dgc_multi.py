"""Triton kernels of many tensors' DGC steps, one launch per pass for all of them (imported lazily by
fedcomp.kernels.dgc_batch; see docs/kernels.md).

Each program works on one BLOCK of one tensor, exactly as a program of the one-tensor kernels of ``_triton_dgc``
does (they share its jit helpers, so a tensor's state, marks and placement are bitwise those of its own launches).
A program finds its tensor in the batch's table: int64, column-major, ``tab[col * T + t]`` for tensor ``t`` of
``T``, the columns below. The state pointers come from the table (each 16-byte aligned: the host checks), the
programs of a tensor are consecutive (``FIRST``: its first block program, ``SFIRST``: its first sample program) and
a program's tensor is the number of tensors after the first whose range starts at or before it (a vector compare
over at most ``TP`` entries, ``TP`` a power of two >= T).
"""

from __future__ import annotations

import triton
import triton.language as tl

from fedcomp.kernels._triton_dgc import _update_block, _updated_state

# The table's columns: pointers to g, u, v; n; first block program; last block program; first sample program; the
# sample's start, stride and count; the tensor's first slot in the candidate buffer and its capacity.
G, U, V, N, FIRST, LAST, SFIRST, START, STRIDE, M, SLOT, CAP = (tl.constexpr(i) for i in range(12))
COLUMNS = 12


@triton.jit
def _tensor_of(pid, tab, T, COL: tl.constexpr, TP: tl.constexpr):
    """The tensor whose programs (column COL: each tensor's first) hold program ``pid``."""
    i = tl.arange(0, TP)
    firsts = tl.load(tab + COL * T + 1 + i, mask=i < T - 1, other=2**62)
    return tl.sum((firsts <= pid).to(tl.int32), axis=0)


@triton.jit
def _col(tab, T, COL: tl.constexpr, t):
    return tl.load(tab + COL * T + t)


@triton.jit
def _state(tab, T, t):
    """Tensor t's g, u, v (fp32 pointers, 16-byte aligned)."""
    g = tl.multiple_of(_col(tab, T, G, t).to(tl.pointer_type(tl.float32)), 16)
    u = tl.multiple_of(_col(tab, T, U, t).to(tl.pointer_type(tl.float32)), 16)
    v = tl.multiple_of(_col(tab, T, V, t).to(tl.pointer_type(tl.float32)), 16)
    return g, u, v


@triton.jit
def dgc_multi_sample_kernel(
    tab, T, scale_ptr, out_ptr, row, momentum,
    NESTEROV: tl.constexpr, HAS_SCALE: tl.constexpr, HAS_U: tl.constexpr, TP: tl.constexpr, BLOCK: tl.constexpr,
):
    """``out[t * row + j] = |v_new[start + j * stride]|`` for ``j < m`` of each tensor t (``dgc_sample_kernel``'s
    sample, one row per tensor); state untouched."""
    pid = tl.program_id(0)
    t = _tensor_of(pid, tab, T, SFIRST, TP)
    j = (pid - _col(tab, T, SFIRST, t)).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = j < _col(tab, T, M, t)
    offs = _col(tab, T, START, t) + j * _col(tab, T, STRIDE, t)
    g, u, v = _state(tab, T, t)
    _, v_new = _updated_state(g, u, v, scale_ptr + t, offs, ok, momentum, NESTEROV, HAS_SCALE, HAS_U)
    tl.store(out_ptr + t * row + j, tl.abs(v_new), mask=ok)


@triton.jit
def dgc_multi_fused_kernel(
    tab, T, scale_ptr, thr_ptr, bits_ptr, counts_ptr, momentum,
    NESTEROV: tl.constexpr, HAS_SCALE: tl.constexpr, HAS_U: tl.constexpr, TP: tl.constexpr, BLOCK: tl.constexpr,
):
    """``dgc_fused_kernel`` with MARK for every tensor: u, v updated and stored, the block's ``|v| >= thr[t]`` and
    ``v != 0`` marked at the program's (global) block. A tensor's full blocks run unmasked (a mask known to be all
    true: 16-byte loads), its last partial block masked by its size."""
    pid = tl.program_id(0)
    t = _tensor_of(pid, tab, T, FIRST, TP)
    start = (pid - _col(tab, T, FIRST, t)).to(tl.int64) * BLOCK
    offs = start + tl.arange(0, BLOCK)
    n = _col(tab, T, N, t)
    g_ptr, u_ptr, v_ptr = _state(tab, T, t)
    if start + BLOCK <= n:
        _update_block(g_ptr, u_ptr, v_ptr, scale_ptr + t, thr_ptr + t, offs, tl.full((BLOCK,), True, tl.int1),
                      bits_ptr, counts_ptr, thr_ptr, momentum, NESTEROV, HAS_SCALE, HAS_U, False, True, BLOCK)
    else:
        _update_block(g_ptr, u_ptr, v_ptr, scale_ptr + t, thr_ptr + t, offs, offs < n, bits_ptr, counts_ptr,
                      thr_ptr, momentum, NESTEROV, HAS_SCALE, HAS_U, False, True, BLOCK)


@triton.jit
def dgc_multi_place_kernel(
    tab, T, bits_ptr, counts_ptr, ends_ptr, thr_ptr, readout_ptr, idx_ptr, val_ptr, mom_ptr,
    MASKING: tl.constexpr, TP: tl.constexpr, BLOCK: tl.constexpr,
):
    """``dgc_place_kernel`` (TAKE) for every tensor over one global cumsum ``ends`` of the block counts: tensor t's
    marked positions (its own indices) go, ascending, to its slots ``SLOT[t] ..`` (at most ``CAP[t]``); its first
    program writes ``readout[2t: 2t + 2] = [count, thr[t] == 0]``."""
    pid = tl.program_id(0)
    t = _tensor_of(pid, tab, T, FIRST, TP)
    first = _col(tab, T, FIRST, t).to(tl.int32)
    base = 0
    if first > 0:
        base = tl.load(ends_ptr + first - 1)
    if pid == first:
        tl.store(readout_ptr + 2 * t, tl.load(ends_ptr + _col(tab, T, LAST, t)) - base)
        tl.store(readout_ptr + 2 * t + 1, (tl.load(thr_ptr + t) == 0.0).to(tl.int32))
    c = tl.load(counts_ptr + pid)
    if c > 0:  # a block that marked nothing reads nothing more
        words: tl.constexpr = BLOCK // 32
        packed = tl.load(bits_ptr + pid.to(tl.int64) * words + tl.arange(0, words))
        sel = tl.reshape((packed[:, None] >> tl.arange(0, 32)[None, :]) & 1, (BLOCK,)) != 0
        slot = tl.load(ends_ptr + pid) - base - c + tl.cumsum(sel.to(tl.int32), axis=0) - 1
        keep = sel & (slot < _col(tab, T, CAP, t))
        at = _col(tab, T, SLOT, t) + slot
        offs = (pid - first).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        _, u_ptr, v_ptr = _state(tab, T, t)
        v = tl.load(v_ptr + offs, mask=keep, other=0.0)
        tl.store(idx_ptr + at, offs, mask=keep)
        tl.store(val_ptr + at, v, mask=keep)
        tl.store(v_ptr + offs, tl.zeros_like(v), mask=keep)
        if MASKING:
            u = tl.load(u_ptr + offs, mask=keep, other=0.0)
            tl.store(mom_ptr + at, u, mask=keep)
            tl.store(u_ptr + offs, tl.zeros_like(u), mask=keep)

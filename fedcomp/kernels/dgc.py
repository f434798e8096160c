"""The DGC client step on one tensor, fused: momentum correction, accumulation, clipping, sampled-threshold
selection, compaction and momentum factor masking.

``fused_dgc_step(g, u, v, k=...)`` has the contract of one ``DGCMemory`` send step (compensate, sampled-threshold
select from ``fedcomp.selection``, update with an fp32 sparse payload), on explicit state tensors ``u``
(momentum) and ``v`` (velocity) updated in place. CUDA tensors take the Triton path, CPU tensors the torch
reference (``backend`` overrides; see ``fedcomp.kernels._backend.resolve``). Passes of the Triton path:

1. clip scale (only with ``clip_norm``): ``torch.linalg.vector_norm(g)`` -> device scalar, no host sync;
2. sample kernel: ``|v_new|`` at a strided sample (``sample_rate`` of n) computed from g, u, v; the threshold is
   the ``k_s``-th largest sample value (``torch.topk`` on the sample, on the device);
3. fused kernel, the one full pass: read g, u, v; write u, v (20 B/element in fp32); selected (index, v, u)
   go to a bounded buffer through one atomic per block and are zeroed (masked) in v and u in the same pass;
4. one host sync (the selected count), then a sort of the few selected indices. Over-selection (> 1.3 k):
   exact top-k among the stored candidates and the rest restored into u and v (O(k)); a buffer overflow: all
   stored candidates restored, exact ``torch.topk`` over v. Under-selection (< 0.8 k): a lower threshold from the
   same sample and a select-only retry pass over v, exactly as ``fedcomp.selection.select``.

Same results as the reference: identical ``u``/``v`` (bitwise: the kernels mirror the reference's fma use),
identical indices for the same threshold and random sample start, identical state after masking.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from fedcomp import selection
from fedcomp.kernels._backend import resolve
from fedcomp.payload import TensorPayload, Values


@dataclass(frozen=True)
class DGCStep:
    """What one step sends. ``indices``: sorted unique int64 (``None`` = dense: every position, in order);
    ``values``: fp32 velocity at those positions (before it was zeroed); ``threshold``: 0-dim tensor, the last
    threshold tried (``inf`` when nothing was selected by threshold); ``passes``: full thresholding passes;
    ``exact``: the result came from an exact top-k."""

    indices: torch.Tensor | None
    values: torch.Tensor
    threshold: torch.Tensor
    passes: int = 0
    exact: bool = False

    def payload(self, shape: tuple[int, ...]) -> TensorPayload:
        """The fp32 ``TensorPayload`` of this step for a tensor of ``shape``."""
        return TensorPayload(tuple(shape), Values.f32(self.values), self.indices)


def clip_threshold(clip_norm: float | None, clip_workers: int | None) -> float | None:
    """The per-tensor L2 clip threshold of ``DGCMemoryConfig``: ``clip_norm * clip_workers ** -0.5``."""
    if clip_norm is None:
        return None
    return clip_norm * (clip_workers**-0.5 if clip_workers else 1.0)


def clip_scale(g: torch.Tensor, thr: float) -> torch.Tensor:
    """Device scalar (shape ``(1,)``, fp32): ``thr / ||g||`` if ``||g|| > thr`` and finite, else 1. No host sync.

    Computed in fp64 and rounded once, like the reference's Python-float scale handed to torch as ``alpha``.
    """
    norm = torch.linalg.vector_norm(g).double()
    ok = (norm > thr) & torch.isfinite(norm)
    return torch.where(ok, thr / norm, torch.ones_like(norm)).float().reshape(1)


def compensate_(g: torch.Tensor, u: torch.Tensor, v: torch.Tensor, *, momentum: float, nesterov: bool,
                scale: float = 1.0) -> None:
    """Torch reference of the state update (``DGCMemory.compensate`` on existing state), in place."""
    if scale == 1.0:
        torch.add(g, u, alpha=momentum, out=u)
    else:
        u.mul_(momentum).add_(g, alpha=scale)
    if nesterov:
        v.add_(g, alpha=scale).add_(u, alpha=momentum)
    else:
        v.add_(u)


def _check(g: torch.Tensor, u: torch.Tensor | None, v: torch.Tensor) -> None:
    for name, t in (("g", g), ("u", u if u is not None else g), ("v", v)):
        if t.dtype != torch.float32 or not t.is_contiguous():
            raise ValueError(f"{name} must be a contiguous float32 tensor")
        if t.shape != g.shape or t.device != g.device:
            raise ValueError(f"{name} must have the shape and device of g")
    if g.numel() >= 2**31 - 1:
        raise ValueError("tensors of 2**31 elements or more are not supported")


def fused_dgc_step(
    g: torch.Tensor,
    u: torch.Tensor | None,
    v: torch.Tensor,
    *,
    k: int,
    momentum: float = 0.9,
    nesterov: bool = False,
    masking: bool = True,
    clip_norm: float | None = None,
    clip_workers: int | None = None,
    dense: bool = False,
    generator: torch.Generator | None = None,
    sample_rate: float = 0.01,
    min_samples: int = 4096,
    max_iters: int = 3,
    threshold: float | torch.Tensor | None = None,
    capacity_factor: float = 4.0,
    backend: str | None = None,
) -> DGCStep:
    """One DGC send step for one tensor: fold gradient ``g`` into momentum ``u`` and velocity ``v`` (in place,
    contiguous fp32, same shape and device; zeros for a tensor's first step), select about ``k`` positions of
    the largest ``|v|`` as ``fedcomp.selection.select`` does (``generator`` draws the sample start on the host),
    zero ``v`` there and, with ``masking``, ``u``. ``dense``: send every position and zero ``v``, no masking
    (the sparsifier's dense rule). ``g`` is not modified. Returns the sent ``DGCStep``.

    ``u=None``: plain error feedback (``ResidualMemory`` with the DGC sparsifier): ``v <- v + g``, no momentum,
    masking, Nesterov or clipping (those options must be left at their defaults; ``masking`` is ignored).

    ``threshold`` (a float or a device scalar) skips the estimate: one pass sends every position with
    ``|v| >= threshold`` and ``v != 0``, unless more than ``capacity(k, capacity_factor)`` pass, in which case
    it sends the exact top-k (the bounded-buffer fallback). ``capacity_factor``: the candidate buffer holds
    ``capacity_factor * k`` entries (at least 1.3 k + 1024)."""
    _check(g, u, v)
    if u is None:
        if nesterov or clip_norm is not None:
            raise ValueError("u=None (plain error feedback) takes no nesterov or clip_norm")
        masking = False
    opts = dict(momentum=momentum, nesterov=nesterov, masking=masking, dense=dense,
                clip=clip_threshold(clip_norm, clip_workers), threshold=threshold,
                capacity=capacity(k, capacity_factor))
    sel = dict(generator=generator, sample_rate=sample_rate, min_samples=min_samples, max_iters=max_iters)
    if resolve(g, backend) == "triton":
        return _triton_step(g, u, v, k, **opts, **sel)
    return _torch_step(g, u, v, k, **opts, **sel)


def capacity(k: int, capacity_factor: float = 4.0) -> int:
    """Entries of the candidate buffer for ``k``: ``capacity_factor * k``, at least ``1.3 k + 1024``."""
    return max(1, math.ceil(capacity_factor * k), math.floor(selection.HIGH * k) + 1024)


def _torch_step(g, u, v, k, *, momentum, nesterov, masking, dense, clip, threshold, capacity, **sel) -> DGCStep:
    scale = 1.0
    if clip is not None:
        norm = float(torch.linalg.vector_norm(g))
        scale = clip / norm if norm > clip and math.isfinite(norm) else 1.0
    if u is None:
        v.add_(g)  # ResidualMemory.compensate: x + e
    else:
        compensate_(g, u, v, momentum=momentum, nesterov=nesterov, scale=scale)
    flat = v.view(-1)
    if dense:
        values = flat.clone()
        flat.zero_()
        return DGCStep(None, values, torch.tensor(0.0, device=g.device))
    if threshold is not None:
        thr = torch.as_tensor(threshold, dtype=torch.float32, device=g.device).reshape(())
        a = flat.abs()
        idx = torch.nonzero((a >= thr) & (a > 0)).view(-1)
        exact = idx.numel() > capacity
        if exact:
            idx = torch.topk(a, k, sorted=False).indices.sort().values
        s = selection.Selection(idx, float(thr), 1, exact)
    else:
        s = selection.select(flat, k, **sel)
    idx = s.indices.to(g.device)
    values = flat[idx]
    flat.index_fill_(0, idx, 0.0)
    if masking:
        u.view(-1).index_fill_(0, idx, 0.0)
    return DGCStep(idx, values, torch.tensor(s.threshold, device=g.device), s.passes, s.exact)


def sample_plan(
    n: int, generator: torch.Generator | None, sample_rate: float, min_samples: int
) -> tuple[int, int, int]:
    """``(start, stride, count)`` of the strided sample, drawn exactly as ``fedcomp.selection.select`` does
    (``fedcomp.selection.sample_plan``: a stride that shares no factor with ``n``)."""
    return selection.sample_plan(n, generator, sample_rate, min_samples)


def velocity_sample(g, u, v, *, start: int, stride: int, momentum: float, nesterov: bool,
                    scale: torch.Tensor | None = None) -> torch.Tensor:
    """Triton: ``|v_new|[start::stride]`` (the updated velocity at the sample positions; state untouched).
    ``u=None``: ``v_new = v + g``."""
    from fedcomp.kernels import _triton_dgc as K

    n = g.numel()
    m = len(range(start, n, stride))
    out = torch.empty(m, dtype=torch.float32, device=g.device)
    if m:
        K.dgc_sample_kernel[(math.ceil(m / K.BLOCK),)](
            g, v if u is None else u, v, g if scale is None else scale, out, start, stride, m, momentum,
            NESTEROV=nesterov, HAS_SCALE=scale is not None, HAS_U=u is not None, BLOCK=K.BLOCK,
            num_warps=K.NUM_WARPS,
            enable_fp_fusion=False,
        )
    return out


class _Buffers:
    """The bounded candidate buffer of the Triton path and its O(k) bookkeeping."""

    def __init__(self, capacity: int, device: torch.device) -> None:
        self.capacity = capacity
        self.count = torch.zeros(1, dtype=torch.int32, device=device)
        self.idx = torch.empty(capacity, dtype=torch.int64, device=device)
        self.val = torch.empty(capacity, dtype=torch.float32, device=device)
        self.mom = torch.empty(capacity, dtype=torch.float32, device=device)

    def sorted(self, c: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The ``c`` stored candidates ordered by index (the atomics store blocks in any order)."""
        idx, order = torch.sort(self.idx[:c])
        return idx, self.val[:c][order], self.mom[:c][order]

    def restore(self, u: torch.Tensor, v: torch.Tensor, c: int, masking: bool) -> None:
        """Undo the in-pass masking of every stored candidate (``c`` = the counter, may exceed capacity)."""
        c = min(c, self.capacity)
        v.index_copy_(0, self.idx[:c], self.val[:c])
        if masking:
            u.index_copy_(0, self.idx[:c], self.mom[:c])


def _triton_step(g, u, v, k, *, momentum, nesterov, masking, dense, clip, threshold, capacity, generator,
                 sample_rate, min_samples, max_iters) -> DGCStep:
    from fedcomp.kernels import _triton_dgc as K

    dev, n = g.device, g.numel()
    gf, vf = g.view(-1), v.view(-1)
    uf = vf if u is None else u.view(-1)  # without u the kernels neither read nor write it (HAS_U=False)
    scale = None if clip is None else clip_scale(g, clip)
    inf = torch.full((1,), math.inf, device=dev)
    hi_count, lo_count = math.floor(selection.HIGH * k), math.ceil(selection.LOW * k)
    buf = _Buffers(1 if dense else capacity, dev)
    values = torch.empty(n if dense else 0, dtype=torch.float32, device=dev)

    def fused(thr: torch.Tensor) -> None:
        K.dgc_fused_kernel[(math.ceil(n / K.BLOCK),)](
            gf, uf, vf, gf if scale is None else scale, thr, buf.count, buf.idx, values if dense else buf.val,
            buf.mom, n, buf.capacity, momentum, NESTEROV=nesterov, HAS_SCALE=scale is not None,
            HAS_U=u is not None, MASKING=masking, DENSE=dense, BLOCK=K.BLOCK, num_warps=K.NUM_WARPS,
            enable_fp_fusion=False,
        )

    def take(idx: torch.Tensor) -> torch.Tensor:
        """Send ``idx`` of the (unmasked) state: read v there, zero v and (masking) u. O(len(idx))."""
        vals = vf[idx]
        vf.index_fill_(0, idx, 0.0)
        if masking:
            uf.index_fill_(0, idx, 0.0)
        return vals

    if dense:
        fused(inf)
        return DGCStep(None, values, torch.zeros((), device=dev))
    if k >= n or k <= 0:
        fused(inf)  # state update only: nothing passes an infinite threshold
        if k <= 0:
            return DGCStep(torch.zeros(0, dtype=torch.int64, device=dev), values, inf[0])
        idx = torch.arange(n, device=dev)
        return DGCStep(idx, take(idx), torch.zeros((), device=dev), 0, True)

    if threshold is not None:
        thr = torch.as_tensor(threshold, dtype=torch.float32, device=dev).reshape(1)
        fused(thr)
        c = int(buf.count.item())
        if c <= buf.capacity:
            idx, vals, _ = buf.sorted(c)
            return DGCStep(idx, vals, thr[0], 1, False)
        buf.restore(uf, vf, c, masking)  # over-selected past the buffer: exact top-k instead
        idx = torch.topk(vf.abs(), k, sorted=False).indices.sort().values
        return DGCStep(idx, take(idx), thr[0], 1, True)

    start, stride, m = sample_plan(n, generator, sample_rate, min_samples)
    sample = velocity_sample(gf, None if u is None else uf, vf, start=start, stride=stride, momentum=momentum,
                             nesterov=nesterov, scale=scale)
    rank = min(m, math.ceil(m * k / n))
    depth = min(m, max(4 * rank, rank + 64))
    top = torch.topk(sample, depth, sorted=True).values
    passes, thr = 0, inf[0]
    while passes < max(1, max_iters):
        if rank > depth:
            top = torch.topk(sample, m, sorted=True).values
            depth = m
        thr = top[rank - 1 : rank]
        if passes == 0:
            fused(thr)
        else:
            K.dgc_select_kernel[(math.ceil(n / K.BLOCK),)](
                uf, vf, thr, buf.count, buf.idx, buf.val, buf.mom, n, buf.capacity,
                MASKING=masking, BLOCK=K.BLOCK, num_warps=K.NUM_WARPS,
            )
        passes += 1
        c = int(buf.count.item())  # the one host sync of a pass: the payload size
        if c > hi_count:
            if c <= buf.capacity:  # exact top-k among the candidates, as the reference does
                among, vals, moms = buf.sorted(c)
                pick = torch.topk(vals.abs(), k, sorted=False).indices.sort().values
                rest = torch.ones(c, dtype=torch.bool, device=dev)
                rest[pick] = False  # masked in the pass but not sent: put back
                vf.index_copy_(0, among[rest], vals[rest])
                if masking:
                    uf.index_copy_(0, among[rest], moms[rest])
                return DGCStep(among[pick], vals[pick], thr[0], passes, True)
            buf.restore(uf, vf, c, masking)  # overflow: the candidates are {|v| >= thr}, their top-k is v's
            idx = torch.topk(vf.abs(), k, sorted=False).indices.sort().values
            return DGCStep(idx, take(idx), thr[0], passes, True)
        if c >= lo_count or float(thr) == 0.0:
            idx, vals, _ = buf.sorted(c)
            return DGCStep(idx, vals, thr[0], passes, False)
        new_rank = min(m, math.ceil(rank * selection._RETRY_TARGET * k / max(c, 1)))
        if new_rank == rank:
            break
        rank = new_rank
    buf.restore(uf, vf, int(buf.count.item()), masking)
    idx = torch.topk(vf.abs(), k, sorted=False).indices.sort().values
    idx = idx[vf[idx] != 0]
    return DGCStep(idx, take(idx), thr[0], passes, True)

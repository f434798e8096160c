"""The DGC client step on one tensor, fused: momentum correction, accumulation, clipping, sampled-threshold
selection, placement of the selected in index order and momentum factor masking.

``fused_dgc_step(g, u, v, k=...)`` has the contract of one ``DGCMemory`` send step (compensate, sampled-threshold
select from ``fedcomp.compressors.selection``, update with an fp32 sparse payload), on explicit state tensors ``u``
(momentum) and ``v`` (velocity) updated in place. CUDA tensors take the Triton path, CPU tensors the torch
reference (``backend`` overrides; see ``fedcomp.kernels._backend.resolve``). Passes of the Triton path:

1. clip scale (only with ``clip_norm``): ``torch.linalg.vector_norm(g)`` -> device scalar, no host sync;
2. sample kernel: ``|v_new|`` at a strided sample (``sample_rate`` of n) computed from g, u, v; the threshold is
   the ``k_s``-th largest sample value (``torch.topk`` on the sample, on the device);
3. fused kernel, the one full pass: read g, u, v; write u, v (20 B/element in fp32); each block's selection
   marked (BLOCK / 32 words of bits and a count per block: 1/8 B/element);
4. placement, without a sort: one ``torch.cumsum`` of the block counts, then the place kernel writes each block's
   selected (index, v, u) in ascending order from its block's slot into a bounded buffer (sorted by
   construction) and zeroes (masks) them in v and u; it also writes the readout ``[count, threshold == 0]``;
5. one host read (the readout: ``start_dgc_step`` + ``fedcomp.kernels.pending.resolve_all`` read those of many
   tensors at once). Then over-selection (> 1.3 k): exact top-k among the stored candidates and the rest restored
   into u and v (O(k)); a buffer overflow: all stored candidates restored, exact ``torch.topk`` over v.
   Under-selection (< 0.8 k): the candidates restored, a lower threshold from the same sample and a select-only
   retry (mark kernel over v, placement, one host read of its readout), exactly as
   ``fedcomp.compressors.selection.select``.

Same results as the reference: identical ``u``/``v`` (bitwise: the kernels mirror the fma use of
``fedcomp.memory.dgc_math``, the arithmetic ``DGCMemory`` and the torch path share), identical indices for the same
threshold and random sample start, identical state after masking. In code, this module holds the step's entry
points and its drivers; the Triton step is ``TritonPass`` (the state, the fused pass, the sample) on ``Selection``
(marks, placement, readout, the O(k) bookkeeping) with ``select_rules`` (all in ``_dgc_select``) over the bounded
buffer of ``_dgc_buffers``, driven by one of three small functions: ``_none_or_all`` (``k <= 0`` or ``k >= n``),
``_fixed_threshold`` and ``_sampled_threshold`` (which launch, and return a ``fedcomp.kernels.pending.PendingStep``
whose ``finish`` applies the selection rules to the readout once it is on the host). ``start_select`` is the
selection alone (``Selection`` over any ``x``, read only): ``selection.select`` on the device, which the small
tensors' group step uses (``fedcomp.kernels.group``). ``plan_dgc_step`` is a step's checks and draw without a
launch: ``fedcomp.kernels.dgc_batch`` launches the planned steps of many tensors together (one launch per pass),
each finishing on segments of one buffer (``Buffers.carve``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from fedcomp.compressors import selection
from fedcomp.kernels._backend import resolve
from fedcomp.kernels._dgc_buffers import capacity
from fedcomp.kernels._dgc_select import DGCStep, SampleRanks, Selection, TritonPass, read_pair, select_rules
from fedcomp.kernels.pending import PendingStep
from fedcomp.memory.dgc_math import accumulate_, clip_scale, clip_threshold, mask_


def _check(g: torch.Tensor, u: torch.Tensor | None, v: torch.Tensor) -> None:
    for name, t in (("g", g), ("u", u if u is not None else g), ("v", v)):
        if t.dtype != torch.float32 or not t.is_contiguous():
            raise ValueError(f"{name} must be a contiguous float32 tensor")
        if t.shape != g.shape or t.device != g.device:
            raise ValueError(f"{name} must have the shape and device of g")
    if g.numel() >= 2**31 - 1:
        raise ValueError("tensors of 2**31 elements or more are not supported")


def fused_dgc_step(g: torch.Tensor, u: torch.Tensor | None, v: torch.Tensor, **options: Any) -> DGCStep:
    """One DGC send step for one tensor, resolved at once: ``start_dgc_step(g, u, v, **options).resolve()`` (the
    arguments and their contract are ``start_dgc_step``'s)."""
    return start_dgc_step(g, u, v, **options).resolve()


def start_dgc_step(g: torch.Tensor, u: torch.Tensor | None, v: torch.Tensor, **options: Any) -> PendingStep:
    """One DGC send step for one tensor (``options``: ``plan_dgc_step``'s keywords): fold gradient ``g`` into
    momentum ``u`` and velocity ``v`` (in place, contiguous fp32, same shape and device; zeros for a tensor's first
    step), select about ``k`` positions of the largest ``|v|`` as ``fedcomp.compressors.selection.select`` does
    (``generator`` draws the sample start on the host), zero ``v`` there and, with ``masking``, ``u``. ``dense``:
    send every position and zero ``v``, no masking (the sparsifier's dense rule). ``g`` is not modified. The
    returned ``PendingStep``'s ``resolve()`` is the sent ``DGCStep``.

    ``u=None``: plain error feedback (``ResidualMemory`` with the DGC sparsifier): ``v <- v + g``, no momentum,
    masking, Nesterov or clipping (those options must be left at their defaults; ``masking`` is ignored).

    ``threshold`` (a float or a device scalar) skips the estimate: one pass sends every position with
    ``|v| >= threshold`` and ``v != 0``, unless more than ``capacity(k, capacity_factor)`` pass, in which case
    it sends the exact top-k (the bounded-buffer fallback). ``capacity_factor``: the candidate buffer holds
    ``capacity_factor * k`` entries (at least 1.3 k + 1024).

    Without a host read: the state update, the first selection pass and its placement are launched (the sample
    start drawn from ``generator`` now), and the returned ``PendingStep`` holds the selected count and the
    threshold's zero test on the device (its readout). Many steps started one after another and resolved by
    ``resolve_all`` cost one host read in all (more only for a tensor whose first pass selected too few: one per
    retry pass). The torch backend runs the whole step here. ``fused_dgc_step`` is start + resolve::

        steps = [start_dgc_step(g[n], u[n], v[n], k=k[n]) for n in names]
        sent = resolve_all(steps)           # [DGCStep, ...], what fused_dgc_step would have returned
    """
    return start_planned(plan_dgc_step(g, u, v, **options))


@dataclass(frozen=True)
class DGCPlan:
    """One tensor's DGC step checked, its options resolved and its sample start drawn, nothing launched yet
    (``plan_dgc_step``). ``sample``: ``(start, stride, count)`` of a sampled-threshold step on the Triton path (the
    steps ``fedcomp.kernels.dgc_batch`` launches together), else ``None``."""

    g: torch.Tensor
    u: torch.Tensor | None
    v: torch.Tensor
    k: int
    opts: dict[str, Any]
    sel: dict[str, Any]
    triton: bool
    sample: tuple[int, int, int] | None


def plan_dgc_step(
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
) -> DGCPlan:
    """``start_dgc_step``'s checks and options, and its draw from ``generator`` (now, in call order), without a
    launch: ``start_planned`` (one tensor) or ``fedcomp.kernels.dgc_batch.start_dgc_steps`` (many) starts it."""
    _check(g, u, v)
    if u is None:
        if nesterov or clip_norm is not None:
            raise ValueError("u=None (plain error feedback) takes no nesterov or clip_norm")
        masking = False
    opts = dict(momentum=momentum, nesterov=nesterov, masking=masking, dense=dense,
                clip=clip_threshold(clip_norm, clip_workers), threshold=threshold,
                capacity=capacity(k, capacity_factor))
    sel = dict(generator=generator, sample_rate=sample_rate, min_samples=min_samples, max_iters=max_iters)
    triton = resolve(g, backend) == "triton"
    sampled = triton and not dense and 0 < k < g.numel() and threshold is None
    sample = sample_plan(g.numel(), generator, sample_rate, min_samples) if sampled else None
    return DGCPlan(g, u, v, k, opts, sel, triton, sample)


def start_planned(plan: DGCPlan) -> PendingStep:
    """Launch one planned step (the torch backend runs it whole here)."""
    if plan.triton:
        return _triton_start(plan, **plan.opts)
    return PendingStep.done(_torch_step(plan.g, plan.u, plan.v, plan.k, **plan.opts, **plan.sel))


def start_select(
    x: torch.Tensor,
    k: int,
    *,
    generator: torch.Generator | None = None,
    sample_rate: float = 0.01,
    min_samples: int = 4096,
    max_iters: int = 3,
    cuts: torch.Tensor | None = None,
    capacity_factor: float = 4.0,
) -> PendingStep[tuple[DGCStep, list[int] | None]]:
    """``fedcomp.compressors.selection.select(x, k, ...)`` on the Triton path, started without a host read (the
    sample start drawn from ``generator`` now): ``x`` (1-D contiguous fp32) is only read. Finished, ``(step,
    below)``: ``step.indices`` are select's indices, ``step.values`` x there, ``step.passes``/``step.exact``
    select's. ``cuts`` (sorted int64 positions ``<= numel`` on x's device) adds to the readout, per cut, how many
    first-pass candidates lie below it; ``below`` is that list when the first pass's candidates are what is sent,
    else ``None`` (the caller counts). Example::

        idx = start_select(x, 100, generator=gen).resolve()[0].indices   # == select(x, 100, generator=gen).indices
    """
    _check(x, None, x)
    n = x.numel()
    if k >= n or k <= 0:  # select's order: k >= n first (an empty x sends nothing either way)
        idx = torch.arange(n if k >= n else 0, device=x.device)
        return PendingStep.done((DGCStep(idx, x[idx], torch.zeros((), device=x.device), 0, k >= n), None))
    run = Selection(x, capacity(k, capacity_factor))
    if cuts is not None:
        run.buf.idx.fill_(n)  # past the count the buffer holds n: it stays sorted for the search below
    pending = _sampled_threshold(run, k, sample_plan(n, generator, sample_rate, min_samples), max_iters)
    if cuts is None:
        return PendingStep(pending.readout, lambda read: (pending.finish(read), None))
    below = torch.searchsorted(run.buf.idx, cuts).to(torch.int32)

    def finish(read: list[int]) -> tuple[DGCStep, list[int] | None]:
        step = pending.finish(read[:2])
        return step, (read[2:] if step.passes == 1 and not step.exact else None)

    return PendingStep(torch.cat([pending.readout, below]), finish)


def _torch_step(g, u, v, k, *, momentum, nesterov, masking, dense, clip, threshold, capacity, **sel) -> DGCStep:
    if u is None:
        v.add_(g)  # ResidualMemory.compensate: x + e
    else:
        accumulate_(g, u, v, momentum=momentum, nesterov=nesterov, scale=clip_scale(g, clip))
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
        s = selection.ThresholdSelection(idx, float(thr), 1, exact)
    else:
        s = selection.select(flat, k, **sel)
    idx = s.indices.to(g.device)
    values = flat[idx]
    flat.index_fill_(0, idx, 0.0)
    if masking:
        mask_(u, idx)
    return DGCStep(idx, values, torch.tensor(s.threshold, device=g.device), s.passes, s.exact)


def sample_plan(
    n: int, generator: torch.Generator | None, sample_rate: float, min_samples: int
) -> tuple[int, int, int]:
    """``(start, stride, count)`` of the strided sample, drawn exactly as ``fedcomp.compressors.selection.select`` does
    (``fedcomp.compressors.selection.sample_plan``: a stride that shares no factor with ``n``)."""
    return selection.sample_plan(n, generator, sample_rate, min_samples)


def _triton_start(plan: DGCPlan, *, threshold, **pass_opts) -> PendingStep:
    run, k = TritonPass(plan.g, plan.u, plan.v, **pass_opts), plan.k
    if run.dense:
        run.fused(run.inf, select=False)
        return PendingStep.done(DGCStep(None, run.values, torch.zeros((), device=run.dev)))
    if k <= 0 or k >= run.n:
        return PendingStep.done(_none_or_all(run, k))
    if threshold is not None:
        return _fixed_threshold(run, k, threshold)
    return _sampled_threshold(run, k, plan.sample, plan.sel["max_iters"])


def _none_or_all(run: TritonPass, k: int) -> DGCStep:
    """``k <= 0`` sends nothing, ``k >= n`` everything; the state update is a pass that selects nothing."""
    run.fused(run.inf, select=False)
    if k <= 0:
        empty = torch.zeros(0, dtype=torch.int64, device=run.dev)
        return DGCStep(empty, torch.zeros(0, dtype=torch.float32, device=run.dev), run.inf[0])
    idx = torch.arange(run.n, device=run.dev)
    return DGCStep(idx, run.take(idx), torch.zeros((), device=run.dev), 0, True)


def _fixed_threshold(run: TritonPass, k: int, threshold: float | torch.Tensor) -> PendingStep:
    """One pass at ``threshold``; over-selected past the buffer: the exact top-k instead."""
    thr = torch.as_tensor(threshold, dtype=torch.float32, device=run.dev).reshape(1)
    run.fused(thr)

    def finish(read: list[int]) -> DGCStep:
        c = read[0]
        return run.candidates(c, thr, 1) if c <= run.buf.capacity else run.top_of_v(c, k, thr, 1)

    return PendingStep(run.buf.readout, finish)


def _sampled_threshold(run: Selection, k: int, plan: tuple[int, int, int], max_iters: int) -> PendingStep:
    """Thresholds estimated from a strided sample of the updated ``|v|``, lowered while too few pass, the exact
    top-k when too many pass or the passes run out: ``fedcomp.compressors.selection.select``'s rules. The first
    pass is launched here; the rules run on its readout (``PendingStep.finish``)."""
    start, stride, m = plan
    ranks = SampleRanks(run.sample(start, stride), m, math.ceil(m * k / run.n))
    thr = ranks.threshold()
    run.first(thr)
    return PendingStep(run.buf.readout, lambda read: select_rules(run, k, ranks, thr, read_pair(read),
                                                                  max(1, max_iters)))

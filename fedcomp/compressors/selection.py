"""Sampled-threshold top-k selection (DGC, Lin et al. 2018, Sec. 3.1 and App. "implementation").

Exact top-k over millions of elements is a partial sort and far slower than the memory passes around it.
DGC estimates the threshold from a small sample instead:

1. sample ``|x|`` at a fixed stride from a random start (``sample_rate`` of the elements, at least
   ``min_samples``; the paper samples 0.1%-1%). The stride shares no factor with ``numel`` (``coprime_stride``):
   every row length, channel count or kernel period of the tensor's shape divides ``numel``, so the sample
   visits every residue modulo each of them evenly. (``numel // size`` aliased with them: stride 8 on a
   (512, 64) tensor sampled 8 of its 64 columns, and column-scaled tensors fell back to exact top-k most of the
   time; docs/results.md has the measurements.)
2. ``thr`` = the ``k_s``-th largest sample value, ``k_s = ceil(sample_size * k / numel)``;
3. select ``|x| >= thr`` in one pass;
4. more than ``1.3 k`` selected: exact top-k among those candidates (cheap: they are few). Fewer than ``0.8 k``:
   lower the threshold and select again (retry rule below), at most ``max_iters`` passes in all; still fewer:
   exact top-k over the whole tensor.

Retry rule: every selected set is ``{|x| >= thr}`` with ``thr`` a sample value, so it holds at least the
``r`` sample values ranked above ``thr``. When ``c < 0.8 k`` elements pass at sample rank ``r``, the next
threshold is the sample value at rank ``ceil(r * 1.05 k / c)`` (the count scales with the rank; 1.05 k is
the middle of the accepted band), capped at the sample size.

Result contract: sorted, unique int64 flat indices; ``0.8 k <= count <= 1.3 k``, or exactly ``k`` after an
exact top-k. Exceptions, both documented choices: a tensor with fewer than ``0.8 k`` nonzero elements gives
all of its nonzero positions (padding with zeros would send bytes that carry nothing), so an all-zero tensor
gives an empty selection; never empty for a tensor with a nonzero element.

Cost: ``|x| >= thr`` is found without materialising ``|x|`` or a full boolean mask. The tensor is viewed as
blocks of ``BLOCK`` elements; one ``amax`` and one ``amin`` pass (read-only, vectorised) give each block's
largest magnitude, and only blocks that reach ``thr`` are gathered and compared element-wise. No full sort.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

#: Elements per block in the two-level threshold scan; 64 floats = 4 cache lines.
BLOCK = 64
#: Below this many elements a direct ``|x| >= thr`` scan is as fast as the blocked one.
_DIRECT_BELOW = 1 << 16
#: Accepted band around ``k``.
LOW, HIGH = 0.8, 1.3
_RETRY_TARGET = 1.05


@dataclass(frozen=True)
class ThresholdSelection:
    """What ``select`` found: the positions plus how it got there (for tests and diagnostics)."""

    indices: torch.Tensor
    threshold: float  # last threshold tried (0.0: every nonzero element was a candidate)
    passes: int  # full passes over the tensor for thresholding (exact fallback not counted)
    exact: bool  # the result came from an exact top-k (over candidates or the whole tensor)


def _above(x: torch.Tensor, thr: float) -> torch.Tensor:
    """Sorted int64 positions with ``|x| >= thr`` (``thr > 0``), or ``x != 0`` when ``thr == 0``."""
    n = x.numel()
    if n < _DIRECT_BELOW:
        a = x.abs()
        return torch.nonzero(a >= thr if thr > 0 else a > 0).view(-1)
    main = n - n % BLOCK
    blocks = x[:main].view(-1, BLOCK)
    hi, lo = blocks.amax(1), blocks.amin(1)
    if thr > 0:
        hit = torch.nonzero((hi >= thr) | (lo <= -thr)).view(-1)
    else:
        hit = torch.nonzero((hi != 0) | (lo != 0)).view(-1)
    sub = blocks.index_select(0, hit).abs_().view(-1)  # the hit blocks, back to back
    j = torch.nonzero(sub >= thr if thr > 0 else sub > 0).view(-1)
    idx = hit[j // BLOCK].mul_(BLOCK).add_(j % BLOCK)
    if main < n:
        tail = x[main:].abs()
        t = torch.nonzero(tail >= thr if thr > 0 else tail > 0).view(-1).add_(main)
        idx = torch.cat([idx, t])
    return idx


def _exact(x: torch.Tensor, k: int, among: torch.Tensor | None = None) -> torch.Tensor:
    """Exact top-k positions by magnitude (optionally only among ``among``), sorted."""
    if among is None:
        return torch.topk(x.abs(), k, sorted=False).indices.sort().values
    pick = torch.topk(x[among].abs(), k, sorted=False).indices
    return among[pick.sort().values]


def coprime_stride(n: int, size: int) -> int:
    """The largest stride ``<= n // size`` that shares no factor with ``n`` (1 when ``size >= n``).

    With ``gcd(stride, n) == 1`` the positions ``start + j * stride`` run through all residues modulo any divisor
    ``L`` of ``n`` (a row length) before repeating one, so ``L`` consecutive samples hit ``L`` distinct columns.
    """
    stride = max(1, n // max(size, 1))
    while math.gcd(stride, n) != 1:
        stride -= 1
    return stride


def sample_plan(
    n: int,
    generator: torch.Generator | None,
    sample_rate: float,
    min_samples: int,
    *,
    stride_rule: Callable[[int, int], int] | None = None,
) -> tuple[int, int, int]:
    """``(start, stride, count)`` of the threshold sample ``x[start::stride]`` of an ``n``-element tensor.

    At least ``max(min_samples, ceil(n * sample_rate))`` positions (all of them when that reaches ``n``); the stride
    is ``stride_rule(n, size)``, by default ``coprime_stride``; the start is one ``randint(stride)`` from
    ``generator`` when ``stride > 1``.
    """
    size = min(n, max(min_samples, math.ceil(n * sample_rate)))
    stride = (stride_rule or coprime_stride)(n, size)
    start = int(torch.randint(stride, (1,), generator=generator)) if stride > 1 else 0
    return start, stride, len(range(start, n, stride))


def select(
    x: torch.Tensor,
    k: int,
    *,
    generator: torch.Generator | None = None,
    sample_rate: float = 0.01,
    min_samples: int = 4096,
    max_iters: int = 3,
    stride_rule: Callable[[int, int], int] | None = None,
) -> ThresholdSelection:
    """About ``k`` positions of the largest ``|x|`` of 1-D, finite, float ``x`` (see the module docstring).

    ``generator`` draws the sample's start (one ``randint`` per call when the stride is > 1), so a seeded generator
    makes the selection deterministic. ``k >= numel`` selects everything; ``k <= 0`` nothing. ``x`` is not modified.
    ``stride_rule(numel, sample size) -> stride`` replaces ``coprime_stride`` (benchmarks pass the old
    ``numel // size`` rule to measure the aliasing it caused; see ``sample_plan``).
    """
    if x.dim() != 1:
        raise ValueError("select expects a 1-D tensor")
    n = x.numel()
    if k >= n:
        return ThresholdSelection(torch.arange(n, device=x.device), 0.0, 0, True)
    if k <= 0:
        return ThresholdSelection(torch.zeros(0, dtype=torch.int64, device=x.device), math.inf, 0, False)
    start, stride, _ = sample_plan(n, generator, sample_rate, min_samples, stride_rule=stride_rule)
    sample = x[start::stride].abs()
    m = sample.numel()
    rank = min(m, math.ceil(m * k / n))
    lo_count, hi_count = math.ceil(LOW * k), math.floor(HIGH * k)
    passes, thr, depth = 0, 0.0, 0
    while passes < max(1, max_iters):
        if rank > depth:  # the sorted top of the sample: just deep enough first, with room for retries after
            depth = rank if not depth else min(m, max(2 * rank, rank + 64))
            top = torch.topk(sample, depth, sorted=True).values
        thr = float(top[rank - 1])
        idx = _above(x, thr)
        passes += 1
        c = idx.numel()
        if c > hi_count:
            return ThresholdSelection(_exact(x, k, idx), thr, passes, True)
        if c >= lo_count or thr == 0.0:
            # In band, or every nonzero element is already in: fewer than 0.8 k nonzeros (maybe none).
            return ThresholdSelection(idx, thr, passes, False)
        new_rank = min(m, math.ceil(rank * _RETRY_TARGET * k / max(c, 1)))
        if new_rank == rank:
            break  # the sample cannot go lower
        rank = new_rank
    # Still fewer than 0.8 k: exact top-k over everything, minus zeros (they carry nothing).
    exact = _exact(x, k)
    nz = exact[x[exact] != 0]
    return ThresholdSelection(nz, thr, passes, True)


def sampled_topk(x: torch.Tensor, k: int, **options) -> torch.Tensor:
    """Only the indices of ``select(x, k, **options)``."""
    return select(x, k, **options).indices

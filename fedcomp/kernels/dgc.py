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
5. one host read (the readout: ``start_dgc_step`` + ``resolve_all`` read those of many tensors at once). Then
   over-selection (> 1.3 k): exact top-k among the stored candidates and the rest restored into u and v (O(k)); a
   buffer overflow: all stored candidates restored, exact ``torch.topk`` over v. Under-selection (< 0.8 k): the
   candidates restored, a lower threshold from the same sample and a select-only retry (mark kernel over v,
   placement, one host read of its readout), exactly as ``fedcomp.compressors.selection.select``.

Same results as the reference: identical ``u``/``v`` (bitwise: the kernels mirror the fma use of
``fedcomp.memory.dgc_math``, the arithmetic ``DGCMemory`` and the torch path share), identical indices for the same
threshold and random sample start, identical state after masking. In code, the Triton step is ``_TritonPass`` (the
state, the fused pass, the sample) on ``_Selection`` (marks, placement, readout, the O(k) bookkeeping), driven by
one of three small functions: ``_none_or_all`` (``k <= 0`` or ``k >= n``), ``_fixed_threshold`` and
``_sampled_threshold`` (which launch, and return a ``PendingStep`` whose ``finish`` applies the selection rules to
the readout once it is on the host). ``start_select`` is the selection alone (``_Selection`` over any ``x``, read
only): ``selection.select`` on the device, which the small tensors' group step uses (``fedcomp.kernels.group``).
``plan_dgc_step`` is a step's checks and draw without a launch: ``fedcomp.kernels.dgc_batch`` launches the planned
steps of many tensors together (one launch per pass), each finishing here on segments of one buffer
(``_Buffers.carve``).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Generic, NamedTuple, TypeVar

import torch

from fedcomp.compressors import selection
from fedcomp.kernels._backend import resolve
from fedcomp.memory.dgc_math import accumulate_, clip_scale, clip_scale_tensor, clip_threshold, mask_
from fedcomp.payload import TensorPayload, Values

T = TypeVar("T")


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
    run = _Selection(x, capacity(k, capacity_factor))
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


@dataclass(frozen=True)
class PendingStep(Generic[T]):
    """A started step: ``readout`` (1-D int32 on the device, what the host must read to finish: for a DGC step
    the selected count and whether the threshold is 0; ``None`` when nothing is left to read) and
    ``finish(readout as a list of ints) -> T`` (a ``DGCStep`` for the steps here), the O(k) rest once the readout
    is on the host."""

    readout: torch.Tensor | None
    finish: Callable[[list[int]], T]

    @staticmethod
    def done(result: T) -> PendingStep[T]:
        return PendingStep(None, lambda _: result)

    def resolve(self) -> T:
        """The result, reading its own readout (one host read)."""
        return self.finish([] if self.readout is None else self.readout.tolist())


def resolve_all(steps: Sequence[PendingStep[T]]) -> list[T]:
    """Every started step finished, in order, after **one** host read of all their readouts."""
    return [s.finish(read) for s, read in zip(steps, read_all(steps), strict=True)]


def read_all(steps: Sequence[PendingStep]) -> list[list[int]]:
    """The readouts of ``steps`` on the host, by **one** host read (``[]`` for a step with none): each step's
    ``finish`` argument, for a caller that finishes them in an order of its own."""
    readouts = [s.readout for s in steps if s.readout is not None]
    host = torch.cat(readouts).tolist() if readouts else []
    out, at = [], 0
    for s in steps:
        width = 0 if s.readout is None else s.readout.numel()
        out.append(host[at: at + width])
        at += width
    return out


def _starts(sizes: Sequence[int]) -> list[int]:
    """Exclusive prefix sums: where each of back-to-back parts of ``sizes`` starts."""
    return list(itertools.accumulate(sizes, initial=0))[:-1]


class _Carving(NamedTuple):
    """Where each tensor's part of a carved ``_Buffers`` starts: its slots and its blocks' marks."""

    capacities: tuple[int, ...]
    blocks: tuple[int, ...]
    words: int
    slots: list[int]
    firsts: list[int]


def in_band(k: int, c: int, zero: bool) -> bool:
    """Whether a pass's ``c`` candidates are what is sent (``selection.select``'s rule): at most 1.3 k, and at
    least 0.8 k or the threshold 0."""
    return c <= math.floor(selection.HIGH * k) and (c >= math.ceil(selection.LOW * k) or zero)


def _read(readout: list[int]) -> tuple[int, bool]:
    """``(count, zero_threshold)`` of a readout read to the host."""
    return readout[0], bool(readout[1])


def capacity(k: int, capacity_factor: float = 4.0) -> int:
    """Entries of the candidate buffer for ``k``: ``capacity_factor * k``, at least ``1.3 k + 1024``."""
    return max(1, math.ceil(capacity_factor * k), math.floor(selection.HIGH * k) + 1024)


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


_INFS: dict[torch.device, torch.Tensor] = {}


def _inf(device: torch.device) -> torch.Tensor:
    """``[inf]`` on ``device``, made once per device (a threshold nothing passes; the kernels only read it)."""
    inf = _INFS.get(device)
    if inf is None:
        inf = _INFS[device] = torch.full((1,), math.inf, device=device)
    return inf


class _Buffers:
    """The bounded candidate buffer of the Triton path (index, v, u of up to ``capacity`` selected positions, in
    index order), the marks of a selection pass over ``blocks`` blocks (``counts``, their inclusive cumsum
    ``ends``, ``bits``), the ``readout`` and the O(k) bookkeeping. ``carve`` makes those of many tensors as
    segments of one allocation (``fedcomp.kernels.dgc_batch``)."""

    def __init__(self, capacity: int, blocks: int, parts: Sequence[torch.Tensor],
                 layout: _Carving | None = None) -> None:
        self.capacity, self.blocks, self.layout = capacity, blocks, layout
        self.idx, self.val, self.mom, self.bits, self.counts, self.ends, self.readout = parts

    @staticmethod
    def carve(capacities: Sequence[int], blocks: Sequence[int], words: int, device: torch.device) -> _Buffers:
        """One allocation (one op) for tensors of these capacities and block counts, the whole of it returned (its
        capacity: the padded sum; for one tensor, its own buffer); tensor t's slots start at the sum of the padded
        capacities before it (a multiple of 4: 16-byte aligned), its marks at its first block, its readout at
        ``2t``: ``segment(t)`` is its part."""
        c4 = [-(-c // 4) * 4 for c in capacities]
        cap, nb, width = sum(c4), sum(blocks), 2 * len(blocks)
        raw = torch.empty(16 * cap + 4 * (nb * (2 + words) + width), dtype=torch.uint8, device=device)
        idx = raw[: 8 * cap].view(torch.int64)
        val, mom = raw[8 * cap : 16 * cap].view(torch.float32).split([cap, cap])
        bits, counts, ends, readout = raw[16 * cap :].view(torch.int32).split([nb * words, nb, nb, width])
        if len(capacities) == 1:  # one tensor: the whole is its part
            cap = capacities[0]
            idx, val, mom = idx[:cap], val[:cap], mom[:cap]
        return _Buffers(cap, nb, (idx, val, mom, bits, counts, ends, readout),
                        _Carving(tuple(capacities), tuple(blocks), words, _starts(c4), _starts(blocks)))

    def segment(self, t: int) -> _Buffers:
        """Tensor t's part of a carved buffer (views)."""
        lay, words = self.layout, self.layout.words
        c, b, slot, first = lay.capacities[t], lay.blocks[t], lay.slots[t], lay.firsts[t]
        at, marks = slice(slot, slot + c), slice(first, first + b)
        return _Buffers(c, b, (self.idx[at], self.val[at], self.mom[at], self.bits[first * words: (first + b) * words],
                               self.counts[marks], self.ends[marks], self.readout[2 * t: 2 * t + 2]))

    def slot(self, t: int) -> int:
        """Tensor t's first slot in a carved buffer."""
        return self.layout.slots[t]

    def stored(self, c: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The ``c`` stored candidates (``c <= capacity``), in index order: indices and values."""
        return self.idx[:c], self.val[:c]

    def restore(self, u: torch.Tensor, v: torch.Tensor, c: int, masking: bool) -> None:
        """Undo the zeroing (and masking) of every stored candidate (``c``: the count, may exceed capacity)."""
        c = min(c, self.capacity)
        v.index_copy_(0, self.idx[:c], self.val[:c])
        if masking:
            u.index_copy_(0, self.idx[:c], self.mom[:c])


class _Selection:
    """A thresholded selection over the flat ``v`` on the Triton path: each pass marks ``|v| >= thr and v != 0`` per
    block and places the marked positions, in index order, into the bounded buffer with their values (no sort);
    the readout; the O(k) steps of the selection rules. Select-only here (``TAKE = False``): ``v`` is only read.
    ``_TritonPass`` (``TAKE = True``) also updates the state in its first pass and takes what it sends (zeroes v
    and, masking, u), putting back what it does not send."""

    TAKE = False

    def __init__(self, v: torch.Tensor, capacity: int, *, marks: bool = True, buf: _Buffers | None = None) -> None:
        from fedcomp.kernels import _triton_dgc

        self.K, self.n, self.dev = _triton_dgc, v.numel(), v.device
        self.v = self.u = v.view(-1)
        self.masking = False
        self.inf = _inf(self.dev)
        self.blocks = math.ceil(self.n / self.K.BLOCK)
        if buf is None:
            buf = _Buffers.carve([capacity], [self.blocks if marks else 0], self.K.BLOCK // 32, self.dev)
        self.buf = buf

    def sample(self, start: int, stride: int) -> torch.Tensor:
        """``|v|[start::stride]``, the threshold sample."""
        return self.v[start::stride].abs()

    def first(self, thr: torch.Tensor) -> None:
        """The first selection pass at ``thr``."""
        self.mark(thr)

    def mark(self, thr: torch.Tensor) -> None:
        """Mark every ``|v| >= thr`` (a read of v) and place them."""
        K, buf = self.K, self.buf
        K.dgc_mark_kernel[(self.blocks,)](self.v, thr, buf.bits, buf.counts, self.n, BLOCK=K.BLOCK,
                                          num_warps=K.NUM_WARPS)
        self.place(thr)

    def reselect(self, thr: torch.Tensor, c: int) -> None:
        """A retry at a lower threshold: the ``c`` stored candidates put back (``TAKE``), then every ``|v| >= thr``
        marked and placed (they include the ones put back)."""
        self.put_back(c)
        self.mark(thr)

    def place(self, thr: torch.Tensor) -> None:
        """The marked positions into the buffer in index order (cumsum of the block counts, the place kernel;
        ``TAKE``: zeroed in v, and in u when masking); the readout written."""
        K, buf = self.K, self.buf
        torch.cumsum(buf.counts, 0, dtype=torch.int32, out=buf.ends)
        K.dgc_place_kernel[(self.blocks,)](
            buf.bits, buf.counts, buf.ends, thr, buf.readout, self.u, self.v, buf.idx, buf.val, buf.mom,
            self.blocks, buf.capacity, MASKING=self.masking, TAKE=self.TAKE, BLOCK=K.BLOCK, num_warps=K.NUM_WARPS,
        )

    def readout(self) -> tuple[int, bool]:
        """``(count, zero_threshold)`` of the last selection (the count may exceed the buffer): one host read."""
        return _read(self.buf.readout.tolist())

    def put_back(self, c: int) -> None:
        """``TAKE``: undo the placement's zeroing of the stored candidates (``c``: the count)."""
        if self.TAKE:
            self.buf.restore(self.u, self.v, c, self.masking)

    def take(self, idx: torch.Tensor) -> torch.Tensor:
        """Send ``idx``: v there (``TAKE``: then zeroed in v and, masking, u). O(len(idx))."""
        vals = self.v[idx]
        if self.TAKE:
            self.v.index_fill_(0, idx, 0.0)
            if self.masking:
                mask_(self.u, idx)
        return vals

    def candidates(self, c: int, thr: torch.Tensor, passes: int) -> DGCStep:
        """Send the ``c`` stored candidates (already taken by the placement)."""
        idx, vals = self.buf.stored(c)
        return DGCStep(idx, vals, thr[0], passes, False)

    def top_of_candidates(self, c: int, k: int, thr: torch.Tensor, passes: int) -> DGCStep:
        """Over-selection within the buffer: send the exact top-k among the candidates, put the others back."""
        among, vals = self.buf.stored(c)
        pick = torch.topk(vals.abs(), k, sorted=False).indices.sort().values
        if self.TAKE:
            rest = torch.ones(c, dtype=torch.bool, device=self.dev)
            rest[pick] = False  # taken by the placement but not sent
            self.v.index_copy_(0, among[rest], vals[rest])
            if self.masking:
                self.u.index_copy_(0, among[rest], self.buf.mom[:c][rest])
        return DGCStep(among[pick], vals[pick], thr[0], passes, True)

    def top_of_v(self, c: int, k: int, thr: torch.Tensor, passes: int, *, nonzero: bool = False) -> DGCStep:
        """Put every stored candidate back (``c``: the count) and send the exact top-k of v (``nonzero``: only
        its nonzero entries)."""
        self.put_back(c)
        idx = torch.topk(self.v.abs(), k, sorted=False).indices.sort().values
        if nonzero:
            idx = idx[self.v[idx] != 0]
        return DGCStep(idx, self.take(idx), thr[0], passes, True)


class _TritonPass(_Selection):
    """One tensor's Triton DGC step: flat views of the state, the fused pass (state update and first selection) and
    the sample of the updated velocity. Without ``u`` the kernels neither read nor write it (``HAS_U=False``;
    ``self.u`` is ``v``)."""

    TAKE = True

    def __init__(self, g, u, v, *, momentum, nesterov, masking, dense, clip, capacity, buf=None, scale=None) -> None:
        super().__init__(v, 1 if dense else capacity, marks=not dense, buf=buf)
        self.g, self.has_u = g.view(-1), u is not None
        self.u = self.v if u is None else u.view(-1)
        self.momentum, self.nesterov, self.masking, self.dense = momentum, nesterov, masking, dense
        #: the clip scale, shape (1,) on the device (``scale``: already computed by a batch), None without clipping
        self.scale = scale if scale is not None or clip is None else clip_scale_tensor(g, clip)
        #: the dense step's sent values (every v); a sparse step sends from the candidate buffer
        self.values = torch.empty(self.n, dtype=torch.float32, device=self.dev) if dense else None

    def first(self, thr: torch.Tensor) -> None:
        self.fused(thr)

    def fused(self, thr: torch.Tensor, *, select: bool = True) -> None:
        """The one full pass: update u and v (DENSE: send every v and zero it); ``select``: then send
        ``|v| >= thr`` (``place``)."""
        K, buf, select = self.K, self.buf, select and not self.dense
        K.dgc_fused_kernel[(self.blocks,)](
            self.g, self.u, self.v, self.g if self.scale is None else self.scale, thr, buf.bits, buf.counts,
            self.values if self.dense else buf.val, self.n, self.momentum,
            NESTEROV=self.nesterov, HAS_SCALE=self.scale is not None, HAS_U=self.has_u, DENSE=self.dense,
            MARK=select, BLOCK=K.BLOCK, num_warps=K.NUM_WARPS, enable_fp_fusion=False,
        )
        if select:
            self.place(thr)

    def sample(self, start: int, stride: int) -> torch.Tensor:
        return velocity_sample(self.g, self.u if self.has_u else None, self.v, start=start, stride=stride,
                               momentum=self.momentum, nesterov=self.nesterov, scale=self.scale)


class _SampleRanks:
    """Thresholds from the sample: its ``rank``-th largest value, the rank raised after an under-selection as
    ``fedcomp.compressors.selection.select`` does. Sorts the top ``depth`` sample values; all ``m`` once a rank needs
    them."""

    def __init__(self, sample: torch.Tensor, m: int, rank: int, top: torch.Tensor | None = None) -> None:
        self.sample, self.m, self.rank = sample, m, min(m, rank)
        self.depth = sample_depth(m, rank)
        #: the top ``depth`` sample values, descending (``top``: at least that many, already sorted by a batch)
        self.top = torch.topk(sample, self.depth, sorted=True).values if top is None else top[: self.depth]

    def threshold(self) -> torch.Tensor:
        """The current threshold, shape ``(1,)``, on the device."""
        if self.rank > self.depth:
            self.top, self.depth = torch.topk(self.sample, self.m, sorted=True).values, self.m
        return self.top[self.rank - 1 : self.rank]

    def lower_threshold(self, k: int, selected: int) -> bool:
        """Aim the next threshold at ``_RETRY_TARGET * k`` after ``selected``; False if the rank cannot move."""
        rank = min(self.m, math.ceil(self.rank * selection._RETRY_TARGET * k / max(selected, 1)))
        moved, self.rank = rank != self.rank, rank
        return moved


def sample_depth(m: int, rank: int) -> int:
    """How many of the ``m`` sample values a threshold search at ``rank`` sorts first (``_SampleRanks``)."""
    rank = min(m, rank)
    return min(m, max(4 * rank, rank + 64))


def _triton_start(plan: DGCPlan, *, threshold, **pass_opts) -> PendingStep:
    run, k = _TritonPass(plan.g, plan.u, plan.v, **pass_opts), plan.k
    if run.dense:
        run.fused(run.inf, select=False)
        return PendingStep.done(DGCStep(None, run.values, torch.zeros((), device=run.dev)))
    if k <= 0 or k >= run.n:
        return PendingStep.done(_none_or_all(run, k))
    if threshold is not None:
        return _fixed_threshold(run, k, threshold)
    return _sampled_threshold(run, k, plan.sample, plan.sel["max_iters"])


def _none_or_all(run: _TritonPass, k: int) -> DGCStep:
    """``k <= 0`` sends nothing, ``k >= n`` everything; the state update is a pass that selects nothing."""
    run.fused(run.inf, select=False)
    if k <= 0:
        empty = torch.zeros(0, dtype=torch.int64, device=run.dev)
        return DGCStep(empty, torch.zeros(0, dtype=torch.float32, device=run.dev), run.inf[0])
    idx = torch.arange(run.n, device=run.dev)
    return DGCStep(idx, run.take(idx), torch.zeros((), device=run.dev), 0, True)


def _fixed_threshold(run: _TritonPass, k: int, threshold: float | torch.Tensor) -> PendingStep:
    """One pass at ``threshold``; over-selected past the buffer: the exact top-k instead."""
    thr = torch.as_tensor(threshold, dtype=torch.float32, device=run.dev).reshape(1)
    run.fused(thr)

    def finish(read: list[int]) -> DGCStep:
        c = read[0]
        return run.candidates(c, thr, 1) if c <= run.buf.capacity else run.top_of_v(c, k, thr, 1)

    return PendingStep(run.buf.readout, finish)


def _sampled_threshold(run: _Selection, k: int, plan: tuple[int, int, int], max_iters: int) -> PendingStep:
    """Thresholds estimated from a strided sample of the updated ``|v|``, lowered while too few pass, the exact
    top-k when too many pass or the passes run out: ``fedcomp.compressors.selection.select``'s rules. The first
    pass is launched here; the rules run on its readout (``PendingStep.finish``)."""
    start, stride, m = plan
    ranks = _SampleRanks(run.sample(start, stride), m, math.ceil(m * k / run.n))
    thr = ranks.threshold()
    run.first(thr)
    return PendingStep(run.buf.readout, lambda read: _select_rules(run, k, ranks, thr, _read(read),
                                                                   max(1, max_iters)))


def _select_rules(run: _Selection, k: int, ranks: _SampleRanks, thr: torch.Tensor, read: tuple[int, bool],
                  max_iters: int) -> DGCStep:
    """After pass 1 selected ``c`` at threshold ``thr`` (``read``: c and whether thr is 0): the candidates, their
    top-k, v's top-k, or retry passes at lower thresholds (one host read of the readout each)."""
    c, zero = read
    passes = 1
    while True:
        if in_band(k, c, zero):
            return run.candidates(c, thr, passes)
        if c > math.floor(selection.HIGH * k):  # the candidates are {|v| >= thr}: their top-k, or v's (overflow)
            if c <= run.buf.capacity:
                return run.top_of_candidates(c, k, thr, passes)
            return run.top_of_v(c, k, thr, passes)
        if passes >= max_iters or not ranks.lower_threshold(k, c):
            return run.top_of_v(c, k, thr, passes, nonzero=True)
        passes += 1
        thr = ranks.threshold()
        run.reselect(thr, c)
        c, zero = run.readout()

"""Selection on the Triton DGC path for one tensor's flat state: what a step sends (``DGCStep``), the passes that
find it and the rules that decide it.

* ``Selection`` (select-only: ``v`` is read) marks ``|v| >= thr and v != 0`` per block and places the marked
  positions, in index order, into the bounded ``Buffers`` (no sort), with the readout ``[count, thr == 0]``; it
  holds the O(k) steps of the rules (send the candidates, their top-k or v's top-k; put them back for a retry).
* ``TritonPass`` is one tensor's DGC step on it: its fused pass updates u and v and makes the first selection, and
  it takes what it sends (zeroes v and, masking, u).
* ``SampleRanks``: thresholds from the strided sample of the updated ``|v|`` (``velocity_sample``), the rank raised
  after an under-selection as ``fedcomp.compressors.selection.select`` raises it.
* ``select_rules``: ``select``'s rules applied to a first pass's readout.

``fedcomp.kernels.dgc`` drives these for one tensor, ``fedcomp.kernels.dgc_batch`` for many launched together. On
a GPU, or on the CPU under ``TRITON_INTERPRET=1``::

    run = Selection(x, capacity(k))
    ranks = SampleRanks(run.sample(start, stride), m, rank)
    thr = ranks.threshold()
    run.first(thr)
    step = select_rules(run, k, ranks, thr, run.readout(), 3)   # a DGCStep: select(x, k)'s indices
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from fedcomp.compressors import selection
from fedcomp.kernels._dgc_buffers import Buffers
from fedcomp.memory.dgc_math import clip_scale_tensor, mask_
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


def in_band(k: int, c: int, zero: bool) -> bool:
    """Whether a pass's ``c`` candidates are what is sent (``selection.select``'s rule): at most 1.3 k, and at
    least 0.8 k or the threshold 0."""
    return c <= math.floor(selection.HIGH * k) and (c >= math.ceil(selection.LOW * k) or zero)


def read_pair(readout: list[int]) -> tuple[int, bool]:
    """``(count, zero_threshold)`` of a readout read to the host."""
    return readout[0], bool(readout[1])


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


class Selection:
    """A thresholded selection over the flat ``v`` on the Triton path: each pass marks ``|v| >= thr and v != 0`` per
    block and places the marked positions, in index order, into the bounded buffer with their values (no sort);
    the readout; the O(k) steps of the selection rules. Select-only here (``TAKE = False``): ``v`` is only read.
    ``TritonPass`` (``TAKE = True``) also updates the state in its first pass and takes what it sends (zeroes v
    and, masking, u), putting back what it does not send."""

    TAKE = False

    def __init__(self, v: torch.Tensor, capacity: int, *, marks: bool = True, buf: Buffers | None = None) -> None:
        from fedcomp.kernels import _triton_dgc

        self.K, self.n, self.dev = _triton_dgc, v.numel(), v.device
        self.v = self.u = v.view(-1)
        self.masking = False
        self.inf = _inf(self.dev)
        self.blocks = math.ceil(self.n / self.K.BLOCK)
        if buf is None:
            buf = Buffers.carve([capacity], [self.blocks if marks else 0], self.K.BLOCK // 32, self.dev)
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
        return read_pair(self.buf.readout.tolist())

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


class TritonPass(Selection):
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


class SampleRanks:
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
    """How many of the ``m`` sample values a threshold search at ``rank`` sorts first (``SampleRanks``)."""
    rank = min(m, rank)
    return min(m, max(4 * rank, rank + 64))


def select_rules(run: Selection, k: int, ranks: SampleRanks, thr: torch.Tensor, read: tuple[int, bool],
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

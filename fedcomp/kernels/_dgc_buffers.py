"""The candidate buffer of the Triton DGC path and the marks of its selection passes. ``Buffers`` holds up to
``capacity`` selected positions (index, v, u) in index order, each block's mark bits, count and inclusive cumsum,
and the readout; ``Buffers.carve`` makes those of many tensors as segments of one allocation
(``fedcomp.kernels.dgc_batch``), ``segment(t)`` being tensor t's part. ``capacity(k)`` sizes a buffer:

    >>> capacity(100), capacity(100_000)
    (1154, 400000)
    >>> whole = Buffers.carve([5, 9], [2, 3], 32, torch.device("cpu"))
    >>> whole.capacity, whole.slot(1), whole.segment(1).capacity, whole.segment(1).counts.numel()
    (20, 8, 9, 3)
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from typing import NamedTuple

import torch

from fedcomp.compressors import selection


def starts(sizes: Sequence[int]) -> list[int]:
    """Exclusive prefix sums: where each of back-to-back parts of ``sizes`` starts."""
    return list(itertools.accumulate(sizes, initial=0))[:-1]


def capacity(k: int, capacity_factor: float = 4.0) -> int:
    """Entries of the candidate buffer for ``k``: ``capacity_factor * k``, at least ``1.3 k + 1024``."""
    return max(1, math.ceil(capacity_factor * k), math.floor(selection.HIGH * k) + 1024)


class Carving(NamedTuple):
    """Where each tensor's part of a carved ``Buffers`` starts: its slots and its blocks' marks."""

    capacities: tuple[int, ...]
    blocks: tuple[int, ...]
    words: int
    slots: list[int]
    firsts: list[int]


class Buffers:
    """The bounded candidate buffer of the Triton path (index, v, u of up to ``capacity`` selected positions, in
    index order), the marks of a selection pass over ``blocks`` blocks (``counts``, their inclusive cumsum
    ``ends``, ``bits``), the ``readout`` and the O(k) bookkeeping. ``carve`` makes those of many tensors as
    segments of one allocation (``fedcomp.kernels.dgc_batch``)."""

    def __init__(self, capacity: int, blocks: int, parts: Sequence[torch.Tensor],
                 layout: Carving | None = None) -> None:
        self.capacity, self.blocks, self.layout = capacity, blocks, layout
        self.idx, self.val, self.mom, self.bits, self.counts, self.ends, self.readout = parts

    @staticmethod
    def carve(capacities: Sequence[int], blocks: Sequence[int], words: int, device: torch.device) -> Buffers:
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
        return Buffers(cap, nb, (idx, val, mom, bits, counts, ends, readout),
                        Carving(tuple(capacities), tuple(blocks), words, starts(c4), starts(blocks)))

    def segment(self, t: int) -> Buffers:
        """Tensor t's part of a carved buffer (views)."""
        lay, words = self.layout, self.layout.words
        c, b, slot, first = lay.capacities[t], lay.blocks[t], lay.slots[t], lay.firsts[t]
        at, marks = slice(slot, slot + c), slice(first, first + b)
        return Buffers(c, b, (self.idx[at], self.val[at], self.mom[at], self.bits[first * words: (first + b) * words],
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

"""Device-side parts of the wire encode (fedcomp.kernels.encode): torch ops over all tensors of an update at once,
plus the Triton bit-field kernel. Nothing here synchronises with the host; sizes come from the host, which knows
every count from tensor shapes.

* ``IndexSegments``: the sparse records' indices concatenated (one int64 vector, a segment per record), their
  gaps, the checks ``encode`` makes on them and the sums the index-coding plan needs (``stats``);
* ``value_flags``: the checks ``encode`` makes on values, codes and scales, as one count of violations;
* ``IndexSegments.streams``: every RICE unary and remainder stream and every bitmap, written at their byte offsets
  in one scratch buffer by one launch of ``or_fields_kernel``;
* ``pack_fields``: sub-byte codes (INT4, SIGN, TERNARY) of all records of one coding packed at once, each record
  starting on a byte.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from fedcomp.payload import ValueCoding, flat

#: Columns of the quotient-sum window per segment: enough for ``rice_candidates`` around a ``b0`` that the
#: device's float64 log2 may have rounded one off (docs/kernels.md, "Device encode").
WINDOW = 6
_LN2 = math.log(2)
_BF16_EXP = 0x7F80
#: Bits per code of the sub-byte codings (docs/wire-format.md).
CODE_BITS = {ValueCoding.INT4: 4, ValueCoding.SIGN: 1, ValueCoding.TERNARY: 2}


def _segment_ids(counts: torch.Tensor, total: int) -> torch.Tensor:
    """Segment number of each of ``total`` concatenated elements (``counts`` per segment, on the device)."""
    ids = torch.arange(counts.numel(), device=counts.device)
    return torch.repeat_interleave(ids, counts, output_size=total)


class IndexSegments:
    """The sparse records' indices as one vector: ``seg`` (segment of each element), ``k`` (its place in the
    segment), gaps ``g`` (``idx[0]``, then ``idx[k] - idx[k-1] - 1``)."""

    def __init__(self, indices: Sequence[torch.Tensor], counts: torch.Tensor, starts: torch.Tensor) -> None:
        self.idx = torch.cat([flat(i).to(torch.int64) for i in indices])
        self.counts, self.starts, self.n = counts, starts, self.idx.numel()
        self.seg = _segment_ids(counts, self.n)
        self.k = torch.arange(self.n, device=self.idx.device) - starts[self.seg]
        prev = torch.cat([self.idx[:1], self.idx[:-1]])
        self.g = torch.where(self.k == 0, self.idx, self.idx - prev - 1)

    def stats(self, numels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(violations, per-segment [last, lo, qsum(lo) .. qsum(lo + WINDOW - 1)])``: violations counts indices
        outside ``[0, numel)`` and gaps < 0 (not strictly increasing; with every index in range no gap overflows
        int64); ``qsum(b)`` is the sum of ``g >> b`` over the segment, for the ``WINDOW`` values of ``b`` from
        ``lo = b0' - 2``, ``b0'`` the Golomb optimum computed in float64 on the device. Rows of empty segments are
        meaningless."""
        last = self.idx[(self.starts + self.counts - 1).clamp(min=0)]
        bad = (self.g < 0).sum() + ((self.idx < 0) | (self.idx >= numels[self.seg])).sum()
        m = (last + 1 - self.counts).double() / self.counts.clamp(min=1).double() * _LN2
        b0 = torch.where(m >= 1, torch.floor(torch.log2(m.clamp(min=1))), torch.zeros_like(m)).long()
        lo = (b0 - 2).clamp(0, 32)
        shifts = lo[self.seg][:, None] + torch.arange(WINDOW, device=lo.device)
        win = torch.zeros(self.counts.numel(), WINDOW, dtype=torch.int64, device=lo.device)
        win.index_add_(0, self.seg, self.g[:, None] >> shifts)
        return bad, torch.cat([last[:, None], lo[:, None], win], dim=1)

    def streams(self, plan: torch.Tensor, nbytes: int) -> torch.Tensor:
        """The index streams of every segment at once (uint8, ``nbytes``). ``plan`` rows per segment:
        ``[rice (0/1), b, stream offset, unary bytes]``; a bitmap segment sets bit ``idx`` of its stream, a RICE
        segment ``q_k`` zeros and a one in its unary stream and ``g_k mod 2**b`` in ``b`` bits after it."""
        from fedcomp.kernels import _triton_encode as K

        words = torch.zeros(math.ceil(nbytes / 4) + 2, dtype=torch.int32, device=self.idx.device)
        if self.n:
            rice, b, offset, unary = (plan[:, c][self.seg] for c in range(4))
            q = self.g >> b
            cum = torch.cumsum(q + 1, 0)
            first = (cum - q - 1)[self.starts[self.seg]]  # the exclusive sum at the segment's first element
            one = torch.where(rice != 0, cum - first - 1, self.idx)
            rem = torch.where(rice != 0, self.g & ((torch.ones_like(b) << b) - 1), torch.zeros_like(b))
            pos = torch.cat([8 * offset + one, 8 * (offset + unary) + self.k * b])
            val = torch.cat([torch.ones_like(one), rem])
            K.or_fields_kernel[(math.ceil(pos.numel() / K.FIELDS_BLOCK),)](
                words, pos, val, pos.numel(), BLOCK=K.FIELDS_BLOCK
            )
        return words.view(torch.uint8)[:nbytes]


def value_flags(coding: ValueCoding, data: torch.Tensor, scales: torch.Tensor | None) -> torch.Tensor:
    """Violations of what ``encode`` requires of ``data`` (the values of every record of ``coding``, concatenated)
    and their ``scales``: finite floats; codes in range (SIGN: not 0); scales finite and >= 0; and ``|scale|`` times
    the largest code finite (a bound: past it, the host's exact per-block check decides)."""
    if coding is ValueCoding.BF16:
        return ((data.view(torch.int16) & _BF16_EXP) == _BF16_EXP).sum()
    if coding.is_float:
        return (~torch.isfinite(data)).sum()
    lo, hi = coding.code_range
    bad = ((data < lo) | (data > hi)).sum()
    if coding is ValueCoding.SIGN:
        bad = bad + (data == 0).sum()
    assert scales is not None
    bound = scales.abs() * max(abs(lo), abs(hi))
    return bad + (~torch.isfinite(scales)).sum() + (scales < 0).sum() + (~torch.isfinite(bound)).sum()


def pack_fields(coding: ValueCoding, codes: torch.Tensor, layout: torch.Tensor, padded: int) -> torch.Tensor:
    """The sub-byte wire fields of ``codes`` (every record of ``coding``, concatenated) packed per record: each
    record's fields start on a byte, its padding bits are zero. ``layout`` rows per record: ``[count, first
    element, first field slot]`` (slots: the records' counts rounded up to whole bytes); ``padded`` slots in all."""
    bits = CODE_BITS[coding]
    per = 8 // bits
    seg = _segment_ids(layout[:, 0], codes.numel())
    slot = torch.arange(codes.numel(), device=codes.device) - layout[seg, 1] + layout[seg, 2]
    fields = (codes > 0) if coding is ValueCoding.SIGN else (codes.to(torch.int32) & ((1 << bits) - 1))
    buf = torch.zeros(padded, dtype=torch.int32, device=codes.device)
    buf[slot] = fields.to(torch.int32)
    shifts = torch.arange(per, device=codes.device, dtype=torch.int32) * bits
    return (buf.view(-1, per) << shifts).sum(dim=1).to(torch.uint8)

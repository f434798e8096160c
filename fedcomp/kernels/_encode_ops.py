"""Device-side parts of the wire encode (fedcomp.kernels.encode): Triton kernels and torch ops over all tensors of
an update at once. Nothing here synchronises with the host; sizes come from the host, which knows every count from
tensor shapes.

* ``IndexSegments``: the sparse records' indices read in place, a table of them copied to the device once per
  kernel: one launch for their gaps, the checks ``encode`` makes on them and the sums the index-coding plan needs
  (``stats``), one for every RICE unary and remainder stream and every bitmap, written at their byte offsets in
  one scratch buffer (``streams``);
* ``value_flags``: the checks ``encode`` makes on values, codes and scales, as one count of violations;
* ``pack_fields``: sub-byte codes (INT4, SIGN, TERNARY) of all records of one coding packed at once, each record
  starting on a byte.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import numpy as np
import torch

from fedcomp.kernels._chunks import chunks
from fedcomp.payload import ValueCoding

#: Columns of the quotient-sum window per segment: enough for ``rice_candidates`` around a ``b0`` that the
#: device's float64 log2 may have rounded one off (docs/kernels.md, "Device encode").
WINDOW = 6
_BF16_EXP = 0x7F80
#: Bits per code of the sub-byte codings (docs/wire-format.md).
CODE_BITS = {ValueCoding.INT4: 4, ValueCoding.SIGN: 1, ValueCoding.TERNARY: 2}


def _segment_ids(counts: torch.Tensor, total: int) -> torch.Tensor:
    """Segment number of each of ``total`` concatenated elements (``counts`` per segment, on the device)."""
    ids = torch.arange(counts.numel(), device=counts.device)
    return torch.repeat_interleave(ids, counts, output_size=total)


class IndexSegments:
    """The sparse records' indices, read in place by the index kernels of ``_triton_encode`` (``CHUNK`` kept
    indices of one record per program): ``stats`` (one row per chunk, read by the host with the encode's one
    synchronisation), ``read`` (the rows per record), then with the host's plan ``streams``. Indices that are not
    int64 with unit stride are read from an int64 copy. ``h2d`` puts a host int64 array on the device."""

    def __init__(self, indices: Sequence[torch.Tensor], numels: Sequence[int],
                 h2d: Callable[[np.ndarray], torch.Tensor]) -> None:
        from fedcomp.kernels import _triton_encode as K

        self.K, self.h2d = K, h2d
        self.idx = [i if i.dtype == torch.int64 and (i.numel() < 2 or i.stride(0) == 1)
                    else i.to(torch.int64).contiguous() for i in indices]
        self.counts = np.array([i.numel() for i in self.idx], dtype=np.int64)
        self.first, self.rec, self.start = chunks(self.counts, K.CHUNK)  # records' first chunks; chunks' records
        self.records = np.zeros((K.RECORD_COLUMNS.value, len(self.idx)), dtype=np.int64)
        self.records[K.PTR.value] = [i.data_ptr() for i in self.idx]
        self.records[K.COUNT.value], self.records[K.NUMEL.value] = self.counts, numels
        self.chunk_rows: np.ndarray | None = None

    def _launch(self, kernel, out: torch.Tensor, before: np.ndarray, **extra) -> None:
        tab = np.concatenate([self.records.ravel(), self.rec, self.start, before])
        R, C = len(self.idx), self.rec.size
        kernel[(C,)](self.h2d(tab), R, C, out, CHUNK=self.K.CHUNK, num_warps=self.K.CHUNK_WARPS, **extra)

    def stats(self, device: torch.device) -> torch.Tensor:
        """Every chunk's row ``[violations, last, lo, qsum(lo) .. qsum(lo + WINDOW - 1)]`` (``index_stats_kernel``;
        ``qsum(b)``: the sum of ``g >> b``; ``lo = b0' - 2``, ``b0'`` the Golomb optimum computed in float64 on
        the device), int64 ``(chunks, STAT_COLUMNS)`` on ``device``."""
        out = torch.empty(self.rec.size, 3 + WINDOW, dtype=torch.int64, device=device)
        self._launch(self.K.index_stats_kernel, out, np.zeros_like(self.rec), WINDOW=WINDOW)
        return out

    def read(self, chunk_rows: np.ndarray) -> tuple[int, np.ndarray]:
        """From the host copy of ``stats``: the violations (indices outside ``[0, numel)``, gaps < 0: not strictly
        increasing) and per record ``[last, lo, qsum(lo) ..]`` (rows of empty records are zeros)."""
        self.chunk_rows = chunk_rows.reshape(self.rec.size, 3 + WINDOW)
        rows = np.zeros((len(self.idx), self.chunk_rows.shape[1] - 1), dtype=np.int64)
        kept = self.counts > 0
        if kept.any():
            rows[kept] = np.add.reduceat(self.chunk_rows[:, 1:], self.first[kept], axis=0)
        return int(self.chunk_rows[:, 0].sum()), rows

    def streams(self, plan: np.ndarray, nbytes: int, device: torch.device) -> torch.Tensor | None:
        """The index streams of every record at once (uint8, ``nbytes``; ``index_streams_kernel``), or ``None``
        when a RICE record's ``b`` lies outside its chunks' quotient sums. ``plan`` rows per record: ``[rice (0/1),
        b, stream offset, unary bytes]``; a bitmap record sets bit ``idx`` of its stream, a RICE record ``q_k``
        zeros and a one in its unary stream and ``g_k mod 2**b`` in ``b`` bits after it."""
        K, rows = self.K, self.chunk_rows
        words = torch.zeros(math.ceil(nbytes / 4) + 2, dtype=torch.int32, device=device)
        if self.rec.size:
            rice, b = plan[self.rec, 0] != 0, plan[self.rec, 1]
            col = b - rows[self.first[self.rec], 2]  # b - lo: the quotient sum at b of each chunk
            if (rice & ((col < 0) | (col >= WINDOW))).any():
                return None
            length = np.minimum(K.CHUNK, self.counts[self.rec] - self.start)
            bits = np.where(rice, rows[np.arange(self.rec.size), 3 + np.clip(col, 0, WINDOW - 1)] + length, 0)
            upto = np.cumsum(bits) - bits  # unary bits before each chunk, over all records
            self.records[[K.RICE.value, K.B.value, K.OFFSET.value, K.UNARY.value]] = plan.T
            self._launch(K.index_streams_kernel, words, upto - upto[self.first[self.rec]])
        return words.view(torch.uint8)[:nbytes]


def value_flags(coding: ValueCoding, data: torch.Tensor, scales: torch.Tensor | None) -> torch.Tensor:
    """Violations of what ``encode`` requires of ``data`` (the values of every record of ``coding``, concatenated)
    and their ``scales``, as a count that is 0 exactly when there is none: finite floats; codes in range (SIGN:
    not 0); scales >= 0; and scale times the largest code finite (so the scale is finite too; past that bound the
    host's exact per-block check decides)."""
    if coding is ValueCoding.BF16:
        return ((data.view(torch.int16) & _BF16_EXP) == _BF16_EXP).sum()
    if coding.is_float:
        return (~torch.isfinite(data)).sum()
    lo, hi = coding.code_range
    bad = (data < lo) | (data > hi)
    if coding is ValueCoding.SIGN:
        bad |= data == 0
    assert scales is not None
    bound = scales * max(abs(lo), abs(hi))  # NaN or ±inf when the scale is
    return bad.sum() + ((scales < 0) | ~torch.isfinite(bound)).sum()


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

"""Per-name float64 sums kept as views of one flat buffer, so that adding a whole update (``Totals.after_step``) is
a few ops in all instead of a few per tensor.

``FlatSums.of(sums, likes)`` makes ``sums[name]`` (for every name of ``likes``) a view of one buffer, copying
what was there (``None`` when the tensors are not all on one device); ``add(payloads)`` adds every sparse
payload's dequantized values at once, with the same per-element arithmetic as one ``index_add_`` per tensor
(each position gets one float64 add of the same float32 value), and the dense ones by one ``add_`` per run of
neighbouring tensors. Example::

    flat = FlatSums.of(outstanding, {"w": w, "b": b})
    flat.add({"w": p_w, "b": p_b})     # == outstanding["w"].view(-1).index_add_(0, p_w.indices, ...) ...
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import torch

from fedcomp.kernels._backend import to_device
from fedcomp.payload import TensorPayload, ValueCoding, Values


class FlatSums:
    """Names, their offsets in ``buf`` (float64, 1-D) and the views handed out."""

    def __init__(self, buf: torch.Tensor, offsets: dict[str, int], views: dict[str, torch.Tensor]) -> None:
        self.buf, self.offsets, self.views = buf, offsets, views

    @staticmethod
    def of(sums: dict[str, torch.Tensor], likes: Mapping[str, torch.Tensor],
           cached: FlatSums | None = None) -> FlatSums | None:
        """``cached`` when ``sums`` still holds its views for exactly ``likes``' names, else a new buffer with
        ``sums`` rebound to views of it (missing sums start at zero); ``None`` if ``likes`` span devices."""
        if cached is not None and cached.views.keys() == likes.keys() and all(
                sums.get(n) is v for n, v in cached.views.items()):
            return cached
        devices = {t.device for t in likes.values()}
        if len(devices) != 1:
            return None
        offsets, at = {}, 0
        for name, t in likes.items():
            offsets[name], at = at, at + t.numel()
        buf = torch.zeros(at, dtype=torch.float64, device=devices.pop())
        views = {}
        for name, t in likes.items():
            view = buf[offsets[name]: offsets[name] + t.numel()].view(t.shape)
            old = sums.get(name)
            if old is not None:
                view.copy_(old)
            sums[name] = views[name] = view
        return FlatSums(buf, offsets, views)

    def holds(self, sums: Mapping[str, torch.Tensor]) -> bool:
        """Whether ``sums`` still holds this buffer's views (nothing replaced them since ``of``)."""
        return all(sums.get(n) is v for n, v in self.views.items())

    def add(self, payloads: Mapping[str, TensorPayload], weight: float = 1.0) -> dict[str, TensorPayload]:
        """Add ``weight`` times every payload of a name in ``offsets`` whose values ``dequantize_all`` takes, a few
        ops per coding: sparse ones by one ``index_add_``, dense ones by one ``add_`` per run of neighbouring names
        (``alpha=weight``, as one ``index_add_``/``add_`` per tensor would). Returns the others (LOWRANK, unknown
        names, tensors on another device), for the caller to add one by one."""
        rest: dict[str, TensorPayload] = {}
        sparse: dict[ValueCoding, list] = {}
        dense: dict[ValueCoding, list] = {}
        for name, p in payloads.items():
            if name not in self.offsets or not _batchable(p.values) or not self._here(p):
                rest[name] = p
            elif p.nnz:
                (dense if p.indices is None else sparse).setdefault(p.values.coding, []).append((name, p))
        idx, vals = [], []
        for group in sparse.values():
            counts = [p.nnz for _, p in group]
            offs = torch.tensor(np.repeat([self.offsets[n] for n, _ in group], counts), dtype=torch.int64)
            idx.append(torch.cat([p.indices.to(torch.int64) for _, p in group]) + to_device(offs, self.buf.device))
            vals.append(dequantize_all([p.values for _, p in group], self.buf.device))
        if idx:
            self.buf.index_add_(0, torch.cat(idx), torch.cat(vals).to(torch.float64), alpha=weight)
        for group in dense.values():
            values = dequantize_all([p.values for _, p in group], self.buf.device).to(torch.float64)
            self._add_runs(group, values, weight)
        return rest

    def _here(self, p: TensorPayload) -> bool:
        """Whether ``p``'s tensors are on the buffer's device (others are moved one by one by the caller)."""
        tensors = [p.values.data, p.values.scales, p.indices]
        return all(t is None or t.device == self.buf.device for t in tensors)

    def _add_runs(self, group: list[tuple[str, TensorPayload]], values: torch.Tensor, weight: float) -> None:
        """``weight`` times ``values`` (the group's payloads' values, concatenated) added at their names' ranges, one
        ``add_`` per run of ranges that follow each other in the buffer and in ``group``."""
        at, runs = 0, []  # [buffer start, buffer end, values start]
        for name, p in group:
            start = self.offsets[name]
            if runs and runs[-1][1] == start:
                runs[-1][1] += p.nnz
            else:
                runs.append([start, start + p.nnz, at])
            at += p.nnz
        for start, end, first in runs:
            self.buf[start:end].add_(values[first: first + end - start], alpha=weight)


def dequantize_all(values: list[Values], device: torch.device) -> torch.Tensor:
    """``torch.cat([v.dequantize() for v in values])`` for non-empty ``values`` of one non-LOWRANK coding, in a
    few ops: the same products ``code * scale``, elementwise."""
    data = torch.cat([v.data for v in values])
    if values[0].coding.is_float:
        return data.to(torch.float32)
    repeats = []
    for v in values:
        n, nb = v.data.numel(), v.scales.numel()
        repeats += [v.block] * (nb - 1) + [n - (nb - 1) * v.block] if nb > 1 else [n]
    scales = torch.cat([v.scales for v in values])
    counts = to_device(torch.tensor(repeats, dtype=torch.int64), device)
    per = scales.repeat_interleave(counts, output_size=data.numel())
    return data.to(torch.float32) * per


def _batchable(v: Values) -> bool:
    """Values ``dequantize_all`` takes: a float coding, or codes with one scale or one per ``block``."""
    if v.coding.is_float:
        return True
    if v.coding is ValueCoding.LOWRANK or v.scales is None or v.block <= 0:
        return False
    nb = v.scales.numel()
    return nb == 1 or nb == -(-v.data.numel() // v.block)

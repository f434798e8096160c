"""The host half of the device encode's checks: an update's records when everything ``fedcomp.wire.encode`` checks
without reading data holds (names, shapes, codings, dtypes, lengths, block, scale counts, one device), else
``None`` (the caller then hands the update to ``encode``, which raises the error it finds)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from fedcomp.payload import FLOAT_DTYPES, TensorPayload, Update, ValueCoding, Values, flat
from fedcomp.spec import ModelSpec
from fedcomp.wire.values import MAX_BLOCK


@dataclass(frozen=True)
class Record:
    """One spec tensor's payload as the device encoder reads it. ``indices``: ``None`` for a dense record."""

    numel: int
    coding: ValueCoding
    data: torch.Tensor
    scales: torch.Tensor | None
    block: int
    indices: torch.Tensor | None

    @property
    def nnz(self) -> int:
        return self.numel if self.indices is None else self.indices.numel()


def records_of(update: Update, spec: ModelSpec) -> list[Record] | None:
    """The records of ``update`` in spec order, or ``None`` when the device path does not take it."""
    if set(update.tensors) != set(spec.names):
        return None
    records, device = [], None
    for name, shape in spec.entries:
        record = _record(update.tensors[name], tuple(shape))
        if record is None:
            return None
        tensors = [t for t in (record.data, record.scales, record.indices) if t is not None]
        device = device or record.data.device
        if any(t.device != device for t in tensors):
            return None
        records.append(record)
    return records


def _record(p: object, shape: tuple[int, ...]) -> Record | None:
    if not isinstance(p, TensorPayload) or tuple(p.shape) != shape or not isinstance(p.values, Values):
        return None
    v, numel = p.values, math.prod(shape)
    try:
        coding = ValueCoding(v.coding)
    except ValueError:
        return None
    if coding is ValueCoding.LOWRANK or not isinstance(v.data, torch.Tensor) or v.data.dim() != 1:
        return None
    idx = p.indices
    if idx is not None and not _index_tensor(idx):
        return None
    count = numel if idx is None else idx.numel()
    if v.data.numel() != count:
        return None
    data = flat(v.data)  # 1-D already (checked above): no view op
    if coding.is_float:
        ok = data.dtype == FLOAT_DTYPES[coding] and v.scales is None and not v.block
        return Record(numel, coding, data, None, 0, idx) if ok else None
    s = v.scales
    if data.dtype != torch.int8 or type(v.block) is not int or not 0 < v.block <= MAX_BLOCK:
        return None
    if not isinstance(s, torch.Tensor) or s.dtype != torch.float32 or s.dim() != 1:
        return None
    if s.numel() != Values.num_blocks(count, v.block):
        return None
    return Record(numel, coding, data, flat(s), v.block, idx)


def _index_tensor(idx: object) -> bool:
    if not isinstance(idx, torch.Tensor) or idx.dim() != 1:
        return False
    return not (idx.dtype.is_floating_point or idx.dtype.is_complex or idx.dtype == torch.bool)

"""The wire encode of an update on the device its payloads live on: the bytes of ``fedcomp.wire.encode``, bit for
bit, with one host synchronisation before the final copy.

``encode_update(update, spec, backend=None)`` is what ``Pipeline.send`` calls: payloads on a CUDA device (or any
device with ``backend="triton"``: CPU tensors under ``TRITON_INTERPRET=1``) take ``device_encode``; everything
else takes ``fedcomp.wire.encode``, the reference::

    blob = encode_update(update, spec)  # == fedcomp.wire.encode(update, spec), byte for byte

``device_encode`` works over all tensors of the update at once, never tensor by tensor:

1. checks on the host what needs no data (names, shapes, dtypes, lengths, block and scale counts, one device);
2. on the device: the sparse records' indices read in place by one Triton launch (``_encode_ops.IndexSegments``),
   their gaps, the violations ``encode`` refuses (order, range, NaN/Inf, code ranges, scales), and per chunk of
   kept indices the record's last index and the quotient sums the index-coding rule sizes RICE with; **one** copy
   of those few numbers to the host;
3. on the host: the index coding of every record by the rule ``fedcomp.wire.index.plan_sums`` (the CPU encoder's
   own rule, from the same sums), and the byte layout;
4. on the device: every index stream by one Triton launch, sub-byte codes packed per coding, then one
   ``torch.cat`` of all pieces (host-made headers copied in once, index streams, scales, values, codes) into one
   flat buffer, its CRC-32 by ``fedcomp.kernels.crc``, and **one** copy of the finished bytes to the host.

An update the device path does not take (a LOWRANK record, mixed devices, anything ``encode`` would refuse,
a quantized block whose ``scale x largest code`` overflows float32) is handed to ``fedcomp.wire.encode``, which
encodes it or raises its ``WireError``: the two paths accept exactly the same updates and give the same bytes.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from fedcomp.kernels._backend import resolve, to_device
from fedcomp.kernels._encode_ops import CODE_BITS, WINDOW, IndexSegments, pack_fields, value_flags
from fedcomp.kernels._encode_records import Record, records_of
from fedcomp.payload import Update, ValueCoding, flat
from fedcomp.spec import ModelSpec
from fedcomp.wire import encode
from fedcomp.wire.bits import packed_len, varint
from fedcomp.wire.codec import VERSION, head_bytes, identity_bytes
from fedcomp.wire.index import IndexCoding, IndexPlan, plan_sums


class _Fallback(Exception):
    """The device path does not take this update: ``fedcomp.wire.encode`` decides."""


def encode_update(update: Update, spec: ModelSpec, *, backend: str | None = None) -> bytes:
    """``fedcomp.wire.encode(update, spec)``: by ``device_encode`` when ``backend`` resolves to Triton for the
    payloads' tensors (``None``: CUDA tensors do, when triton is installed), else by the reference encoder."""
    first = next((p.values.data for p in update.tensors.values() if hasattr(p, "values")), None)
    if not isinstance(first, torch.Tensor) or resolve(first, backend) != "triton":
        return encode(update, spec)
    return device_encode(update, spec)


def device_encode(update: Update, spec: ModelSpec) -> bytes:
    """The bytes of ``fedcomp.wire.encode(update, spec)``, computed on the payloads' device (module docstring);
    raises what ``encode`` raises."""
    records = records_of(update, spec)
    if records is None:
        return encode(update, spec)
    ident = identity_bytes(update, spec)  # raises encode's WireError for a bad identity field or meta entry
    try:
        return _Encoder(records, head_bytes(spec, VERSION, ident)).run()
    except _Fallback:
        return encode(update, spec)


class _Encoder:
    """One ``device_encode``: the records, the device they live on, and the pieces of the blob in order."""

    def __init__(self, records: list[Record], head: bytes) -> None:
        self.records, self.head = records, head
        self.device = records[0].data.device if records else torch.device("cpu")
        self.sparse = [r for r in records if r.indices is not None]
        self.segments: IndexSegments | None = None

    def _h2d(self, rows: list[list[int]] | np.ndarray | bytes) -> torch.Tensor:
        """Host numbers (int64) or bytes (uint8) on the device; from pinned memory, without waiting on the device
        (a pageable copy would synchronise)."""
        if isinstance(rows, bytes):
            t = torch.frombuffer(bytearray(rows), dtype=torch.uint8) if rows else torch.zeros(0, dtype=torch.uint8)
        else:
            t = torch.as_tensor(np.asarray(rows, dtype=np.int64))
        return to_device(t, self.device)

    def run(self) -> bytes:
        plans = self._plans(self._stats())
        pieces = self._pieces(plans)
        return self._finish(pieces)

    def _stats(self) -> np.ndarray | None:
        """The one synchronisation before the final copy: violations, and per sparse record [last, lo, window]
        (``None`` without a kept index)."""
        flags = [torch.zeros((), dtype=torch.int64, device=self.device)]
        for coding in {r.coding for r in self.records}:
            group = [r for r in self.records if r.coding is coding]
            data = torch.cat([r.data for r in group])
            scales = None if coding.is_float else torch.cat([r.scales for r in group])
            flags.append(value_flags(coding, data, scales))
        out = torch.stack(flags).sum().view(1)
        if sum(r.nnz for r in self.sparse):
            self.segments = IndexSegments([r.indices for r in self.sparse], [r.numel for r in self.sparse], self._h2d)
            out = torch.cat([out, self.segments.stats(self.device).view(-1)])
        host = out.cpu().numpy()
        if host[0]:
            raise _Fallback
        if self.segments is None:
            return None
        bad, rows = self.segments.read(host[1:])
        if bad:
            raise _Fallback
        return rows

    def _plans(self, rows: np.ndarray | None) -> list[IndexPlan]:
        """The index coding of every sparse record, by the CPU encoder's rule (``plan_sums``)."""
        plans = []
        for i, r in enumerate(self.sparse):
            last, lo = (int(rows[i, 0]), int(rows[i, 1])) if r.nnz else (0, 0)

            def qsum_of(b: int, i: int = i, lo: int = lo) -> int:
                if not 0 <= b - lo < WINDOW:
                    raise _Fallback  # the device's b0 was off by more than its window allows (not seen)
                return int(rows[i, 2 + b - lo])

            plans.append(plan_sums(r.nnz, r.numel, last + 1 - r.nnz if r.nnz else 0, qsum_of))
        return plans

    def _index_streams(self, plans: list[IndexPlan]) -> list[torch.Tensor]:
        """Every sparse record's index stream (uint8 views of one buffer), in ``self.sparse`` order."""
        sizes, table = [], []  # per record: [rice (0/1), b, stream offset, unary bytes]
        for r, p in zip(self.sparse, plans, strict=True):
            if p.coding is IndexCoding.RICE:
                unary = packed_len(r.nnz + p.qsum, 1)
                sizes.append(unary + packed_len(r.nnz, p.b))
                table.append([1, p.b, 0, unary])
            else:
                sizes.append(packed_len(r.numel, 1))
                table.append([0, 0, 0, 0])
        offsets = np.cumsum([0, *sizes])
        if self.segments is None:  # no kept index anywhere: every stream is zero bits
            buf = torch.zeros(int(offsets[-1]), dtype=torch.uint8, device=self.device)
        else:
            for row, off in zip(table, offsets, strict=False):
                row[2] = int(off)
            buf = self.segments.streams(np.array(table, dtype=np.int64), int(offsets[-1]), self.device)
            if buf is None:
                raise _Fallback  # the chosen b outside the device's quotient window (not seen)
        return [buf[offsets[i] : offsets[i + 1]] for i in range(len(sizes))]

    def _packed_codes(self) -> dict[int, torch.Tensor]:
        """Sub-byte codes packed, per record (by position in ``self.records``), for every coding at once."""
        out = {}
        for coding, bits in CODE_BITS.items():
            group = [(i, r) for i, r in enumerate(self.records) if r.coding is coding]
            if not group:
                continue
            per = 8 // bits
            counts = [r.data.numel() for _, r in group]
            slots = [per * math.ceil(c / per) for c in counts]
            layout = np.stack([counts, np.cumsum([0, *counts[:-1]]), np.cumsum([0, *slots[:-1]])], axis=1)
            packed = pack_fields(coding, torch.cat([r.data for _, r in group]), self._h2d(layout), sum(slots))
            for (i, _), c, slot in zip(group, counts, layout[:, 2], strict=True):
                out[i] = packed[slot // per : slot // per + packed_len(c, bits)]
        return out

    def _pieces(self, plans: list[IndexPlan]) -> list[bytes | torch.Tensor]:
        """The blob before its CRC, as host bytes and device byte tensors in order."""
        streams = iter(self._index_streams(plans))
        plan_of = iter(plans)
        packed = self._packed_codes()
        pieces: list[bytes | torch.Tensor] = [self.head]
        for i, r in enumerate(self.records):
            if r.indices is None:
                pieces.append(bytes([IndexCoding.DENSE << 4 | r.coding]))
            else:
                p = next(plan_of)
                params = bytes([p.b]) + varint(p.qsum) if p.coding is IndexCoding.RICE else b""
                pieces += [bytes([p.coding << 4 | r.coding]) + varint(r.nnz) + params, next(streams)]
            if r.coding.is_float:
                pieces.append(_bytes_of(r.data))
                continue
            pieces += [varint(r.block) + varint(r.scales.numel()), _bytes_of(r.scales)]
            pieces.append(packed[i] if r.coding is not ValueCoding.INT8 else _bytes_of(r.data))
        return [p for p in pieces if p is not None]

    def _finish(self, pieces: list[bytes | torch.Tensor]) -> bytes:
        """Host pieces copied to the device at once, everything joined into one buffer, the CRC appended on the
        device, one copy to the host."""
        from fedcomp.kernels.crc import crc32

        small = b"".join(p for p in pieces if isinstance(p, bytes))
        small_dev = self._h2d(small)
        parts, at = [], 0
        for p in pieces:
            if isinstance(p, bytes):
                parts.append(small_dev[at : at + len(p)])
                at += len(p)
            else:
                parts.append(p)
        parts = [p for p in parts if p.numel()]
        total = sum(p.numel() for p in parts)
        out = torch.empty(total + 4, dtype=torch.uint8, device=self.device)
        torch.cat(parts, out=out[:total])
        out[total:] = crc32(out[:total])
        if out.is_cuda:
            host = torch.empty(out.numel(), dtype=torch.uint8, pin_memory=True)
            host.copy_(out)
            return host.numpy().tobytes()
        return out.numpy().tobytes()


def _bytes_of(t: torch.Tensor) -> torch.Tensor | None:
    """The little-endian bytes of a 1-D tensor (a view when contiguous); ``None`` for an empty one (no bytes to
    join; an empty tensor may have any stride, which a dtype view refuses)."""
    if t.numel() == 0:
        return None
    return flat(t).contiguous().view(torch.uint8)

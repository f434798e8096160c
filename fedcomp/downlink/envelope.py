"""The downlink envelope (``FCD``): fedcomp wire blobs plus the version chain and the digest of ``P_version``.

Format (little-endian; the ``dense`` mode sends the plain ``FCW`` update blob instead)::

    "FCD" | format u8 (1) | kind u8 (0 full, 1 deltas) | version varint | base varint | digest[16]
          | n_parts varint | n_parts x (length varint, one fedcomp wire blob) | crc32 u32 over all before it

``full``: one part, the public model ``P_v`` as dense records (fp32, fp16 or int8 values, ``FULL_CODINGS``: what
the server's full copies hold; wire header ``base_version = v``), ``base = version``. ``deltas``: the encoded
deltas in order, part ``i`` with wire header ``base_version = from``, ``seq = to``, forming a chain ``base -> ...
-> version`` (0 parts when ``base == version``). ``digest`` is ``model_digest(P_v)``.

>>> spec = ModelSpec((("w", (3,)),))
>>> part = encode_dense({"w": torch.zeros(3)}, spec, 2)
>>> blob = encode_envelope(Kind.FULL, 2, 2, bytes(16), [part])
>>> env = decode_envelope(blob, spec)                   # validates everything, else DownlinkError
>>> (env.kind, env.version, len(env.parts))
(0, 2, 1)
"""

from __future__ import annotations

import zlib
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from fedcomp.downlink.model import DIGEST_BYTES, encode_dense
from fedcomp.payload import Update, ValueCoding
from fedcomp.spec import ModelSpec
from fedcomp.wire import WireError, decode
from fedcomp.wire.bits import Reader, varint
from fedcomp.wire.codec import default_max_bytes

MAGIC = b"FCD"
FORMAT = 1
CRC_BYTES = 4
#: Present in every ``DownlinkError`` message: a client error reply carrying it asks the server for a full copy.
RESYNC = "downlink-resync"
_HEADER_MIN = len(MAGIC) + 2 + 2 + DIGEST_BYTES + 1 + CRC_BYTES
#: The value codings of a full copy's records: the ``Broadcaster`` modes' full copies (``dense`` and ``delta``:
#: fp32, ``fp16``, ``int8``; an empty tensor is fp32). Each decodes to at most 4 bytes per byte it came in, so a
#: full copy is bounded by its size before its digest is checked; anything else (LOWRANK factors: ``m x n``
#: values from ``4 (m + n + 1)`` bytes) is refused before it is materialized.
FULL_CODINGS = frozenset({ValueCoding.F32, ValueCoding.F16, ValueCoding.INT8})


class DownlinkError(WireError):
    """A downlink message cannot give this client the public model (corrupt, or it does not fit the replica)."""

    def __init__(self, message: str) -> None:
        super().__init__(f"{RESYNC}: {message}")


class Kind:
    """Envelope kinds (the ``kind`` byte)."""

    FULL = 0
    DELTAS = 1


@dataclass(frozen=True)
class Envelope:
    """A decoded ``FCD`` envelope: validated parts (wire ``Update``s) and the digest of ``P_version``."""

    kind: int
    version: int
    base: int
    digest: bytes
    parts: list[Update]


def encode_envelope(kind: int, version: int, base: int, digest: bytes, parts: list[bytes]) -> bytes:
    """The ``FCD`` bytes around already-encoded wire blobs (see the module docstring)."""
    if len(digest) != DIGEST_BYTES:
        raise ValueError(f"digest must be {DIGEST_BYTES} bytes")
    out = [MAGIC, bytes([FORMAT, kind]), varint(version), varint(base), digest, varint(len(parts))]
    for p in parts:
        out += [varint(len(p)), p]
    body = b"".join(out)
    return body + zlib.crc32(body).to_bytes(CRC_BYTES, "little")


def encode_full(tensors: Mapping[str, torch.Tensor], spec: ModelSpec, version: int, digest: bytes) -> bytes:
    """The fp32 full copy of ``P_version`` (``digest`` = its ``model_digest``) as one ``FCD`` envelope."""
    return encode_envelope(Kind.FULL, version, version, digest, [encode_dense(tensors, spec, version)])


def decode_envelope(blob: object, spec: ModelSpec, *, max_bytes: int | None = None) -> Envelope:
    """Validate an ``FCD`` blob (size cap, magic, format, CRC, kind, lengths, every part through
    ``fedcomp.wire.decode``, the version chain); any defect raises ``DownlinkError``."""
    if not isinstance(blob, (bytes, bytearray, memoryview)):
        raise DownlinkError(f"expected bytes, got {type(blob).__name__}")
    blob = bytes(blob)
    cap = default_max_bytes(spec) if max_bytes is None else max_bytes
    if len(blob) > cap:
        raise DownlinkError(f"message of {len(blob)} bytes exceeds max_bytes={cap}")
    if len(blob) < _HEADER_MIN:
        raise DownlinkError(f"message of {len(blob)} bytes is shorter than the minimum {_HEADER_MIN}")
    if blob[:3] != MAGIC:
        raise DownlinkError(f"bad magic {blob[:3]!r} (not a fedcomp downlink message)")
    if blob[3] != FORMAT:
        raise DownlinkError(f"unknown downlink format {blob[3]} (this decoder reads {FORMAT})")
    if zlib.crc32(memoryview(blob)[:-CRC_BYTES]) != int.from_bytes(blob[-CRC_BYTES:], "little"):
        raise DownlinkError("CRC mismatch (corrupted or truncated message)")
    kind = blob[4]
    if kind not in (Kind.FULL, Kind.DELTAS):
        raise DownlinkError(f"unknown message kind {kind}")
    try:
        r = Reader(blob, 5, len(blob) - CRC_BYTES)
        version, base = r.varint("version"), r.varint("base version")
        off = r.take(DIGEST_BYTES, "digest", "header")
        digest = blob[off : off + DIGEST_BYTES]
        n = r.varint("part count", max_value=r.remaining)
        parts = []
        for i in range(n):
            length = r.varint(f"part {i} length", max_value=r.remaining)
            start = r.take(length, f"part {i}", "values")
            try:
                parts.append(decode(blob[start : start + length], spec))
            except WireError as exc:
                raise DownlinkError(f"part {i}: {exc}") from None
        if r.remaining:
            raise DownlinkError(f"{r.remaining} trailing bytes after the last part")
    except DownlinkError:
        raise
    except WireError as exc:
        raise DownlinkError(str(exc)) from None
    except Exception as exc:  # defensive: the reads above validate every length first
        raise DownlinkError(f"malformed message ({type(exc).__name__}: {exc})") from exc
    _check_chain(kind, version, base, parts)
    return Envelope(kind, version, base, digest, parts)


def _check_chain(kind: int, version: int, base: int, parts: list[Update]) -> None:
    if kind == Kind.FULL:
        if len(parts) != 1 or base != version or parts[0].base_version != version:
            raise DownlinkError("full copy must be one part of base version == version")
        check_full(parts[0], FULL_CODINGS, "full copy")
        return
    at = base
    for i, p in enumerate(parts):
        if p.base_version != at or p.seq <= at:
            raise DownlinkError(f"delta {i} goes {p.base_version} -> {p.seq}, expected from {at} upwards")
        at = p.seq
    if at != version:
        raise DownlinkError(f"deltas end at version {at}, message says {version}")


def check_full(update: Update, codings: frozenset[ValueCoding], what: str) -> None:
    """``DownlinkError`` unless every record of ``update`` is dense and of one of ``codings`` (call before
    materializing: ``what`` names the message in the error)."""
    for name, p in update.tensors.items():
        if not p.is_dense:
            raise DownlinkError(f"{what} has a sparse record")
        if p.values.coding not in codings:
            raise DownlinkError(f"{what}: record {name!r} is {p.values.coding.name}, not one of "
                                f"{', '.join(sorted(c.name for c in codings))}")

"""Encode an ``Update`` to one self-describing, versioned, CRC-checked byte string and back (docs/wire-format.md).

Layout: ``"FCW" | version u8 | fingerprint[8] | client_id seq base_version n_tensors (varints) | meta |
one record per spec tensor, in spec order | crc32 u32le`` (CRC over everything before it).

``encode`` refuses payloads that do not match the spec or hold NaN/Inf, and raises ``WireError`` too. ``decode``
validates everything before trusting it and raises only ``WireError``: size cap, magic, version, CRC,
fingerprint, tensor count, every length and count (checked before allocating), coding ids, nnz <= numel, index
range, strictly increasing indices, code ranges (SIGN codes non-zero), block > 0, scale count ==
ceil(nnz / block), scales >= 0, finiteness of values, scales and meta, finiteness after dequantization (every
code x scale finite in float32), zero padding bits, minimal varints and no trailing bytes. So "finite" holds for
``Values.dequantize()`` of everything ``decode`` returns, and both ends accept exactly the same payloads.

Version 2 is version 1 plus the LOWRANK value coding (low-rank factors in a dense record, fedcomp.wire.values):
``encode`` writes version 2 exactly when an update holds a LOWRANK record, so every other update keeps its
version-1 bytes; ``decode`` reads both and rejects LOWRANK in a version-1 blob and a version-2 blob without one.
"""

from __future__ import annotations

import math
import zlib
from dataclasses import dataclass

import numpy as np
import torch

from fedcomp.payload import TensorPayload, Update, ValueCoding
from fedcomp.spec import ModelSpec
from fedcomp.wire.bits import U64_MAX, Reader, varint
from fedcomp.wire.errors import WireCategory, WireError
from fedcomp.wire.index import IndexCoding, encode_index, plan, read_index
from fedcomp.wire.values import coding_of, encode_lowrank, encode_values, read_lowrank, read_values

MAGIC = b"FCW"
VERSION = 1
#: The version of an update holding a LOWRANK record (version 1 + that coding); decoders read ``VERSIONS``.
LOWRANK_VERSION = 2
VERSIONS = (VERSION, LOWRANK_VERSION)
FINGERPRINT_BYTES = 8
CRC_BYTES = 4
#: Bytes a decoder accepts beyond twice the dense fp32 model size (headers, meta) when no max_bytes is given.
SLACK_BYTES = 64 * 1024
MAX_META_KEY = 255
_FIXED = len(MAGIC) + 1 + FINGERPRINT_BYTES
_MIN_LEN = _FIXED + 5 + CRC_BYTES  # four one-byte varints and the meta count
SECTIONS = ("header", "index", "scales", "values", "crc")


def default_max_bytes(spec: ModelSpec) -> int:
    """Decode size cap when none is given: 2 x the dense fp32 model plus ``SLACK_BYTES``."""
    return 2 * spec.dense_bytes + SLACK_BYTES


# ----------------------------------------------------------------------------------------------- encode


def encode(update: Update, spec: ModelSpec) -> bytes:
    """The wire bytes of ``update``; each sparse tensor gets its smallest index coding.

    Raises ``WireError`` if the update does not match ``spec`` (names, shapes, lengths, index order/range,
    dtypes, code ranges, scale counts), holds a NaN/Inf value, scale or meta entry, a negative scale, or a
    ``code x scale`` that overflows float32 (message: "... NaN or Inf"), i.e. exactly what ``decode`` rejects.
    """
    return encode_with(update, spec)


def check(update: Update, spec: ModelSpec) -> None:
    """Raise ``WireError`` wherever ``encode`` would, without writing the indices' coding, the head or the CRC:
    how a client checks the updates of a state it reads (about half of ``encode``'s time on a sparse update).

    >>> check(update, spec)  # None, or the WireError encode(update, spec) would raise  # doctest: +SKIP
    """
    _records(update, spec, None, code_indices=False)


def encode_with(update: Update, spec: ModelSpec, *, index_coding: IndexCoding | None = None) -> bytes:
    """``encode`` with every sparse tensor forced to ``index_coding`` (tests and benchmarks)."""
    ident, parts = _records(update, spec, index_coding)
    lowrank = any(update.tensors[name].values.coding is ValueCoding.LOWRANK for name in spec.names)
    parts.insert(0, head_bytes(spec, LOWRANK_VERSION if lowrank else VERSION, ident))
    crc = 0
    for part in parts:  # per part, not per element: avoids copying the body once more just to checksum it
        crc = zlib.crc32(part, crc)
    parts.append(crc.to_bytes(CRC_BYTES, "little"))
    return b"".join(parts)


def _records(
    update: Update, spec: ModelSpec, index_coding: IndexCoding | None, code_indices: bool = True
) -> tuple[bytes, list[bytes]]:
    """The identity bytes and every record's parts, in the spec's order (``WireError`` naming the tensor)."""
    names = set(spec.names)
    if set(update.tensors) != names:
        missing, extra = sorted(names - set(update.tensors)), sorted(set(update.tensors) - names)
        raise WireError(f"update tensors do not match the spec: missing {missing}, unexpected {extra}")
    ident = identity_bytes(update, spec)
    parts = []
    for name, shape in spec.entries:
        try:
            parts.extend(_encode_record(update.tensors[name], shape, index_coding, code_indices))
        except WireError as e:
            raise WireError(f"tensor {name!r}: {e}", e.category) from None
    return ident, parts


def identity_bytes(update: Update, spec: ModelSpec) -> bytes:
    """The header after the fingerprint: client_id, seq, base_version, the tensor count and the meta section;
    ``WireError`` for an identity field outside ``[0, 2**64)`` or a bad meta entry (what ``encode`` refuses)."""
    parts = [_uint_field(getattr(update, field), field) for field in ("client_id", "seq", "base_version")]
    return b"".join([*parts, varint(len(spec)), _encode_meta(update.meta)])


def head_bytes(spec: ModelSpec, version: int, ident: bytes) -> bytes:
    """Magic, ``version``, the spec's fingerprint and ``ident`` (``identity_bytes``): every byte before the first
    record (the device encoder writes the same head)."""
    return MAGIC + bytes([version]) + spec.fingerprint + ident


def _uint_field(value: object, field: str) -> bytes:
    if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or not 0 <= value <= U64_MAX:
        raise WireError(f"{field} must be an int in [0, 2**64), got {value!r}")
    return varint(int(value))


def _encode_meta(meta: dict[str, float]) -> bytes:
    parts = [varint(len(meta))]
    for key, value in meta.items():
        raw = key.encode() if isinstance(key, str) else None
        if raw is None or len(raw) > MAX_META_KEY:
            raise WireError(f"meta key must be a str of <= {MAX_META_KEY} UTF-8 bytes, got {key!r}")
        try:
            number = float(value)
        except (TypeError, ValueError):
            raise WireError(f"meta {key!r}: not a number: {value!r}") from None
        if not math.isfinite(number):
            raise WireError(f"meta {key!r}: not finite: {number}")
        parts += [varint(len(raw)), raw, np.float64(number).astype("<f8").tobytes()]
    return b"".join(parts)


def _encode_record(
    p: TensorPayload, shape: tuple[int, ...], force: IndexCoding | None, code_indices: bool = True
) -> list[bytes]:
    if not isinstance(p, TensorPayload):
        raise WireError(f"expected a TensorPayload, got {type(p).__name__}")
    if tuple(p.shape) != tuple(shape):
        raise WireError(f"payload shape {tuple(p.shape)} != spec shape {tuple(shape)}", WireCategory.SHAPE)
    numel = math.prod(shape)
    coding = coding_of(p.values.coding, "values")
    if coding is ValueCoding.LOWRANK and p.indices is None:
        return [bytes([IndexCoding.DENSE << 4 | coding]), *encode_lowrank(p.values, shape)]
    if p.indices is None:
        vparams, scales, data = encode_values(p.values, numel)
        return [bytes([IndexCoding.DENSE << 4 | coding]), vparams, scales, data]
    idx = _checked_indices(p.indices, numel)
    vparams, scales, data = encode_values(p.values, idx.size)
    if not code_indices:  # every check is behind: the coding of valid indices cannot fail
        return [vparams, scales, data]
    ip = plan(idx, numel, force)
    iparams, stream = encode_index(ip, idx, numel)
    return [bytes([ip.coding << 4 | coding]), varint(idx.size), iparams, stream, vparams, scales, data]


def _checked_indices(indices: object, numel: int) -> np.ndarray:
    if not isinstance(indices, torch.Tensor) or indices.dim() != 1:
        raise WireError("indices must be a 1-D tensor")
    if indices.dtype.is_floating_point or indices.dtype.is_complex or indices.dtype == torch.bool:
        raise WireError(f"indices must be integers, got {indices.dtype}")
    idx = indices.detach().cpu().to(torch.int64).contiguous().numpy()
    if idx.size > 1 and not np.all(idx[1:] > idx[:-1]):
        raise WireError("indices are not strictly increasing")
    if idx.size and (idx[0] < 0 or idx[-1] >= numel):
        raise WireError(f"indices outside [0, {numel})")
    return idx


# ----------------------------------------------------------------------------------------------- decode


@dataclass(frozen=True)
class RecordInfo:
    """What one record of a blob holds (see ``inspect``)."""

    name: str
    index_coding: IndexCoding
    value_coding: ValueCoding
    nnz: int
    numel: int
    nbytes: int


def decode(blob: bytes, spec: ModelSpec, *, max_bytes: int | None = None) -> Update:
    """Validate ``blob`` against ``spec`` and return its ``Update``; any defect raises ``WireError``.

    ``max_bytes`` caps the accepted size (default ``default_max_bytes(spec)``). Decoded indices are int64,
    float values keep their coding's dtype, quantized codes are int8 with float32 scales.
    """
    return _parse(blob, spec, max_bytes)[0]


def encoded_size_breakdown(blob: bytes, spec: ModelSpec) -> dict[str, int]:
    """Bytes of ``blob`` per section: header (fixed header, meta, record headers and coding parameters),
    index (index streams), scales, values (values and codes), crc. The counts sum to ``len(blob)``."""
    return _parse(blob, spec, None)[1]


def inspect(blob: bytes, spec: ModelSpec) -> list[RecordInfo]:
    """Per-record summary of a (validated) blob: chosen codings, nnz and bytes."""
    return _parse(blob, spec, None)[2]


def _parse(blob: object, spec: ModelSpec, max_bytes: int | None) -> tuple[Update, dict[str, int], list[RecordInfo]]:
    try:
        return _parse_checked(blob, spec, max_bytes)
    except WireError:
        raise
    except Exception as e:  # defensive: validation above should make this unreachable
        raise WireError(f"malformed payload ({type(e).__name__}: {e})") from e


def _parse_checked(blob: object, spec: ModelSpec, max_bytes: int | None):
    blob = _as_bytes(blob)
    cap = default_max_bytes(spec) if max_bytes is None else max_bytes
    if len(blob) > cap:
        raise WireError(f"payload of {len(blob)} bytes exceeds max_bytes={cap}", WireCategory.OVERSIZED)
    if len(blob) < _MIN_LEN:
        raise WireError(
            f"payload of {len(blob)} bytes is shorter than the minimum {_MIN_LEN} (truncated)", WireCategory.TRUNCATED
        )
    if blob[: len(MAGIC)] != MAGIC:
        raise WireError(f"bad magic {blob[: len(MAGIC)]!r} (not a fedcomp update)", WireCategory.MAGIC)
    version = blob[len(MAGIC)]
    if version not in VERSIONS:
        raise WireError(
            f"unknown codec version {version} (this decoder reads versions {', '.join(map(str, VERSIONS))})",
            WireCategory.CODEC_VERSION,
        )
    body = memoryview(blob)[:-CRC_BYTES]
    if zlib.crc32(body) != int.from_bytes(blob[-CRC_BYTES:], "little"):
        raise WireError("CRC mismatch (corrupted or truncated payload)", WireCategory.CRC)
    if blob[len(MAGIC) + 1 : _FIXED] != spec.fingerprint:
        raise WireError("model fingerprint mismatch (payload built for another model spec)", WireCategory.FINGERPRINT)
    r = Reader(blob, _FIXED, len(blob) - CRC_BYTES)
    r.sections = {"header": _FIXED}
    client_id, seq, base_version = (r.varint(f) for f in ("client_id", "seq", "base_version"))
    try:
        count = r.varint("tensor count")
    except WireError as exc:  # an unreadable tensor count is a shape error (unless the payload is cut short)
        category = WireCategory.TRUNCATED if exc.category is WireCategory.TRUNCATED else WireCategory.SHAPE
        raise WireError(str(exc), category) from None
    if count != len(spec):
        raise WireError(f"tensor count {count} != {len(spec)} tensors in the spec", WireCategory.SHAPE)
    meta = _read_meta(r)
    tensors, infos = {}, []
    for i, (name, shape) in enumerate(spec.entries):
        start = r.pos
        tensors[name], info = _read_record(r, f"record {i} ({name!r})", shape, version)
        infos.append(RecordInfo(name, *info, r.pos - start))
    if r.remaining:
        raise WireError(f"{r.remaining} trailing bytes after the last record")
    if version == LOWRANK_VERSION and all(i.value_coding is not ValueCoding.LOWRANK for i in infos):
        raise WireError(f"codec version {version} without a LOWRANK record (such an update is written as version 1)")
    sections = {s: r.sections.get(s, 0) for s in SECTIONS}
    sections["crc"] = CRC_BYTES
    return Update(tensors, base_version=base_version, seq=seq, client_id=client_id, meta=meta), sections, infos


def _as_bytes(blob: object) -> bytes:
    if isinstance(blob, bytes):
        return blob
    if isinstance(blob, (bytearray, memoryview)):
        return bytes(blob)
    raise WireError(f"expected bytes, got {type(blob).__name__}")


def _read_meta(r: Reader) -> dict[str, float]:
    n = r.varint("meta count", max_value=r.remaining // 9)  # an entry takes >= 9 bytes
    meta: dict[str, float] = {}
    for j in range(n):
        klen = r.varint(f"meta {j} key length", MAX_META_KEY)
        off = r.take(klen, f"meta {j} key", "header")
        try:
            key = r.blob[off : off + klen].decode()
        except UnicodeDecodeError:
            raise WireError(f"meta {j}: key is not UTF-8") from None
        if key in meta:
            raise WireError(f"meta {j}: duplicate key {key!r}")
        value = float(r.array("<f8", 1, f"meta {key!r} value", "header")[0])
        if not math.isfinite(value):
            raise WireError(f"meta {key!r}: not finite")
        meta[key] = value
    return meta


def _read_record(r: Reader, what: str, shape: tuple[int, ...], version: int):
    kind = r.u8(f"{what} kind")
    try:
        icoding = IndexCoding(kind >> 4)
    except ValueError:
        raise WireError(f"{what}: unknown index coding id {kind >> 4}") from None
    vcoding = coding_of(kind & 0xF, what)
    numel = math.prod(shape)
    if vcoding is ValueCoding.LOWRANK:
        if version < LOWRANK_VERSION:
            raise WireError(f"{what}: unknown value coding id {int(vcoding)} in a version-{version} blob")
        if icoding is not IndexCoding.DENSE:
            raise WireError(f"{what}: LOWRANK values need index coding DENSE, not {icoding.name}")
        return TensorPayload(tuple(shape), read_lowrank(r, shape, what)), (icoding, vcoding, numel, numel)
    idx = None
    if icoding is IndexCoding.DENSE:
        count = numel
    else:
        count = r.varint(f"{what} nnz")
        if count > numel:
            raise WireError(f"{what}: nnz {count} > numel {numel}", WireCategory.SHAPE)
        idx = torch.from_numpy(read_index(r, icoding, count, numel, what))
    values = read_values(r, vcoding, count, what)
    return TensorPayload(tuple(shape), values, idx), (icoding, vcoding, count, numel)

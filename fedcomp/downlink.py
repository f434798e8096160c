"""Downlink compression: what the server sends clients as "the model", and the replica a client keeps.

Two models live on the server. ``W_v`` is the **true** model the optimizer updates. ``P_v`` is the **public**
model: what a client that applied the downlink messages holds, bitwise, and trains from (its update's base
version names ``P_v``). A ``Broadcaster`` (registry ``DOWNLINKS``) turns ``W_v`` into ``P_v`` and into bytes:

* ``dense``: ``P_v = W_v``; the message is today's blob (dense fp32 records of the wire format, seq 0, base
  version = v), byte for byte.
* ``fp16`` / ``int8``: ``P_v = dequantize(quantize(W_v))`` (round to nearest; int8 blockwise absmax, ``block``
  values per fp32 scale). Each version is quantized afresh from ``W_v``, so the error never accumulates.
* ``delta``: ``P_0 = W_0``, then at each new version the server compresses the gap ``W_v - P_{v-1}`` (any
  ``fedcomp`` compressor, default ``topk+int8``), encodes it, decodes it again and sets ``P_v = P_{v-1} +
  decoded``. Server-side error feedback is implicit and exact: the residual ``e_v = W_v - P_v`` is everything
  not broadcast yet, and the next gap ``W_{v+1} - P_v = (W_{v+1} - W_v) + e_v`` carries it, so the public model
  tracks the true one (no extra residual buffer, nothing counted twice). The last ``history`` encoded deltas
  are kept; a client known to hold ``P_c`` gets the chain of deltas ``c -> v`` when that is smaller than the
  dense fp32 copy of ``P_v``, and that dense copy otherwise (new clients, clients too far behind or unknown).

Message format (``FCD``, little-endian; the ``dense`` mode keeps the plain ``FCW`` update blob)::

    "FCD" | format u8 (1) | kind u8 (0 full, 1 deltas) | version varint | base varint | digest[16]
          | n_parts varint | n_parts x (length varint, one fedcomp wire blob) | crc32 u32 over all before it

``full``: one part, the public model ``P_v`` as dense records (fp32, fp16 or int8 values; wire header
``base_version = v``), ``base = version``. ``deltas``: the encoded deltas in order, part ``i`` with wire header
``base_version = from``, ``seq = to``, forming a chain ``base -> ... -> version`` (0 parts when ``base ==
version``). We send the concatenated deltas, not a merged sum: ``P`` is built by applying each decoded delta in
order with the same float32 ops, and a merged sum rounds differently. ``digest`` is
``model_digest(P_v)``, a 128-bit BLAKE2b of the tensors' float32 bytes in spec order.

The replica contract (``receive``): the returned ``Replica`` is bitwise equal to the server's ``P_v`` (up to a
128-bit hash collision), or ``receive`` raises ``DownlinkError``, never returning a wrong model. Both ends
build ``P`` with the same functions (``materialize`` and ``apply_part``: CPU float32, index_add in index
order), which is why the result is bitwise equal. A client that cannot apply a message (no replica, a version
outside the chain, a digest mismatch, a corrupt blob) raises; the server then forgets what it believed that
client holds (``Broadcaster.on_failure``) and its next task carries a full copy.
"""

from __future__ import annotations

import hashlib
import zlib
from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any, ClassVar

import torch

from fedcomp.compressors.base import COMPRESSORS, Compressor
from fedcomp.payload import TensorPayload, Update, Values
from fedcomp.pipeline import build_compressor
from fedcomp.registry import Registry
from fedcomp.spec import ModelSpec
from fedcomp.wire import WireError, decode, encode
from fedcomp.wire.bits import Reader, varint
from fedcomp.wire.codec import MAGIC as WIRE_MAGIC
from fedcomp.wire.codec import default_max_bytes

MAGIC = b"FCD"
FORMAT = 1
DIGEST_BYTES = 16
CRC_BYTES = 4
#: Present in every ``DownlinkError`` message: a client error reply carrying it asks the server for a full copy.
RESYNC = "downlink-resync"
_HEADER_MIN = len(MAGIC) + 2 + 2 + DIGEST_BYTES + 1 + CRC_BYTES


class DownlinkError(WireError):
    """A downlink message cannot give this client the public model (corrupt, or it does not fit the replica)."""

    def __init__(self, message: str) -> None:
        super().__init__(f"{RESYNC}: {message}")


class Kind:
    """Message kinds (the ``kind`` byte)."""

    FULL = 0
    DELTAS = 1


# ---------------------------------------------------------------------------------------------- the model math


def model_digest(tensors: Mapping[str, torch.Tensor], spec: ModelSpec) -> bytes:
    """128-bit BLAKE2b of the tensors' float32 bytes (CPU, contiguous) in spec order: the replica check."""
    h = hashlib.blake2b(digest_size=DIGEST_BYTES)
    for name in spec.names:
        h.update(tensors[name].detach().to("cpu", torch.float32).contiguous().numpy().tobytes())
    return h.digest()


def materialize(update: Update, spec: ModelSpec) -> dict[str, torch.Tensor]:
    """The float32 CPU tensors of a full-copy part (dequantized). Server and client both call this."""
    return {name: update.tensors[name].to_dense() for name in spec.names}


def apply_part(tensors: dict[str, torch.Tensor], update: Update, spec: ModelSpec) -> None:
    """``P += decoded delta`` in place, tensor by tensor in spec order. Server and client both call this."""
    for name in spec.names:
        update.tensors[name].add_to(tensors[name], 1.0)


def _dense_update(tensors: Mapping[str, torch.Tensor], spec: ModelSpec, version: int, coding: Any) -> Update:
    return Update({n: coding(tensors[n].detach().reshape(-1).float(), spec.shape(n)) for n in spec.names}, version)


def _f32(flat: torch.Tensor, shape: tuple[int, ...]) -> TensorPayload:
    return TensorPayload(shape, Values.f32(flat))


def encode_dense(tensors: Mapping[str, torch.Tensor], spec: ModelSpec, version: int) -> bytes:
    """Today's downlink blob: dense fp32 records, seq 0, base version = ``version`` (the ``dense`` mode)."""
    return encode(_dense_update(tensors, spec, version, _f32), spec)


# ---------------------------------------------------------------------------------------------- the envelope


@dataclass(frozen=True)
class Message:
    """A decoded ``FCD`` message: validated parts (wire ``Update``s) and the digest of ``P_version``."""

    kind: int
    version: int
    base: int
    digest: bytes
    parts: list[Update]


def encode_message(kind: int, version: int, base: int, digest: bytes, parts: list[bytes]) -> bytes:
    """The ``FCD`` bytes around already-encoded wire blobs (see the module docstring)."""
    if len(digest) != DIGEST_BYTES:
        raise ValueError(f"digest must be {DIGEST_BYTES} bytes")
    out = [MAGIC, bytes([FORMAT, kind]), varint(version), varint(base), digest, varint(len(parts))]
    for p in parts:
        out += [varint(len(p)), p]
    body = b"".join(out)
    return body + zlib.crc32(body).to_bytes(CRC_BYTES, "little")


def decode_message(blob: object, spec: ModelSpec, *, max_bytes: int | None = None) -> Message:
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
    return Message(kind, version, base, digest, parts)


def _check_chain(kind: int, version: int, base: int, parts: list[Update]) -> None:
    if kind == Kind.FULL:
        if len(parts) != 1 or base != version or parts[0].base_version != version:
            raise DownlinkError("full copy must be one part of base version == version")
        if any(not p.is_dense for p in parts[0].tensors.values()):
            raise DownlinkError("full copy has a sparse record")
        return
    at = base
    for i, p in enumerate(parts):
        if p.base_version != at or p.seq <= at:
            raise DownlinkError(f"delta {i} goes {p.base_version} -> {p.seq}, expected from {at} upwards")
        at = p.seq
    if at != version:
        raise DownlinkError(f"deltas end at version {at}, message says {version}")


# ---------------------------------------------------------------------------------------------- the client side


@dataclass
class Replica:
    """A client's copy of the public model: ``version`` and float32 CPU tensors (spec names)."""

    version: int
    tensors: dict[str, torch.Tensor]

    def digest(self, spec: ModelSpec) -> bytes:
        return model_digest(self.tensors, spec)

    def to_bytes(self, spec: ModelSpec) -> bytes:
        """A full fp32 ``FCD`` message of this replica (bit-exact; what a client keeps in ``context.state``)."""
        part = encode(_dense_update(self.tensors, spec, self.version, _f32), spec)
        return encode_message(Kind.FULL, self.version, self.version, self.digest(spec), [part])

    @staticmethod
    def from_bytes(data: bytes, spec: ModelSpec) -> Replica | None:
        """The replica saved by ``to_bytes``; ``None`` if it is missing or does not verify (asks for a resync)."""
        try:
            return receive(data, spec, None)
        except WireError:
            return None


def receive(blob: bytes, spec: ModelSpec, replica: Replica | None) -> Replica:
    """The public model a downlink blob gives this client, verified against the server's digest.

    ``replica`` is not modified. Raises ``DownlinkError`` (message contains ``RESYNC``) when the blob is corrupt,
    deltas arrive without a replica or for a version outside their chain, or the result's digest differs.
    A plain ``FCW`` blob (the ``dense`` mode) is a full fp32 copy (integrity: its CRC).
    """
    if not isinstance(blob, (bytes, bytearray, memoryview)):
        raise DownlinkError(f"expected bytes, got {type(blob).__name__}")
    if bytes(blob[: len(WIRE_MAGIC)]) == WIRE_MAGIC:
        try:
            update = decode(blob, spec)
        except WireError as exc:
            raise DownlinkError(f"dense model: {exc}") from None
        if any(not p.is_dense for p in update.tensors.values()):
            raise DownlinkError("dense model has a sparse record")
        return Replica(update.base_version, materialize(update, spec))
    msg = decode_message(blob, spec)
    if msg.kind == Kind.FULL:
        tensors = materialize(msg.parts[0], spec)
    else:
        if replica is None:
            raise DownlinkError(f"deltas {msg.base} -> {msg.version} but this client holds no replica")
        nodes = [msg.base] + [p.seq for p in msg.parts]
        if replica.version not in nodes:
            raise DownlinkError(f"deltas {msg.base} -> {msg.version} do not start at the replica's {replica.version}")
        tensors = {n: replica.tensors[n].detach().to("cpu", torch.float32).clone() for n in spec.names}
        for p in msg.parts:
            if p.base_version >= replica.version:
                apply_part(tensors, p, spec)
    out = Replica(msg.version, tensors)
    if out.digest(spec) != msg.digest:
        raise DownlinkError(f"model fingerprint mismatch after applying version {msg.version}")
    return out


# ---------------------------------------------------------------------------------------------- the server side


@dataclass
class DownlinkStats:
    """Downlink messages by kind and their payload bytes (``full_*``: full copies; ``delta_*``: delta chains);
    ``resyncs``: clients forgotten after a failed task (their next message is a full copy)."""

    full: int = 0
    delta: int = 0
    full_bytes: int = 0
    delta_bytes: int = 0
    resyncs: int = 0

    def to_dict(self, prefix: str = "downlink_") -> dict[str, int]:
        return {prefix + k: v for k, v in asdict(self).items()}

    def merge(self, other: DownlinkStats) -> None:
        for k, v in asdict(other).items():
            setattr(self, k, getattr(self, k) + v)


DOWNLINKS: Registry[Broadcaster] = Registry("downlink mode")


class Broadcaster(ABC):
    """Server side of one downlink mode: publishes ``P_v`` from ``W_v`` and picks each client's message.

    The loop calls ``message(client, task_id, params, version)`` for every task (it publishes ``version``
    first if it is new), ``on_reply(client, task_id)`` for every reply that came back (any outcome: the client
    applied that task's model, so it holds at least that version) and ``on_failure(client)`` for every failed
    task (error reply, node lost: it may have restarted or rejected the model, so its next message is full).
    Not thread-safe.
    """

    Config: ClassVar[type | None] = None
    #: Versions of encoded deltas kept (0: only clients that already hold ``P_v`` get an empty delta message).
    history: int = 0

    def __init__(self, spec: ModelSpec, config: Any = None) -> None:
        self.spec = spec
        self.config = config if config is not None else (self.Config() if self.Config else None)
        self.version = -1
        self.public: dict[str, torch.Tensor] = {}
        self.digest = b""
        self.synced: dict[int, int] = {}  # client -> newest version it is known to hold
        self.in_flight: dict[int, tuple[int, int]] = {}  # task id -> (client, version sent)
        self.stats = DownlinkStats()  # since roll_stats
        self.totals = DownlinkStats()
        self._full: bytes | None = None
        self._cache: dict[int, bytes | None] = {}
        self.chain: list[tuple[int, int, bytes]] = []  # (from, to, encoded delta), oldest first

    # ---- publishing ---------------------------------------------------------------------------------------
    def publish(self, params: Mapping[str, torch.Tensor], version: int) -> None:
        """Make ``P_version`` from ``W_version`` (no-op if already published)."""
        if version == self.version:
            return
        if version < self.version:
            raise ValueError(f"version {version} < published {self.version}")
        if self.version < 0 or not self._advance(params, version):
            self.public, self._full = self._full_copy(params, version)
            self.chain = []
        self.version = version
        self.digest = model_digest(self.public, self.spec)
        self._cache = {}
        oldest = self.chain[0][0] if self.chain else version
        self.in_flight = {t: cv for t, cv in self.in_flight.items() if cv[1] >= oldest}

    @abstractmethod
    def _full_copy(
        self, params: Mapping[str, torch.Tensor], version: int
    ) -> tuple[dict[str, torch.Tensor], bytes | None]:
        """``(P_version, its full message)``; ``None`` = the fp32 full message, encoded when first needed."""

    def _advance(self, params: Mapping[str, torch.Tensor], version: int) -> bool:
        """Advance ``public`` by one encoded delta (delta modes); False = take a full copy instead."""
        del params, version
        return False

    def full_message(self) -> bytes:
        if self._full is None:
            self._full = self._encode_full()
        return self._full

    def _encode_full(self) -> bytes:
        part = encode(_dense_update(self.public, self.spec, self.version, _f32), self.spec)
        return encode_message(Kind.FULL, self.version, self.version, self.digest, [part])

    # ---- per client ---------------------------------------------------------------------------------------
    def message(self, client: int, task_id: int, params: Mapping[str, torch.Tensor], version: int) -> bytes:
        """The bytes of ``client``'s next task at ``version``: its missing deltas if smaller, else a full copy."""
        self.publish(params, version)
        blob = self._deltas_for(self.synced.get(int(client)))
        if blob is None:
            blob = self.full_message()
            self.stats.full += 1
            self.stats.full_bytes += len(blob)
        else:
            self.stats.delta += 1
            self.stats.delta_bytes += len(blob)
        self.in_flight[int(task_id)] = (int(client), self.version)
        return blob

    def _deltas_for(self, held: int | None) -> bytes | None:
        if held is None:
            return None
        if held in self._cache:
            return self._cache[held]
        nodes = [f for f, _, _ in self.chain] + [self.version]
        if held not in nodes:
            return None
        parts = [b for f, _, b in self.chain if f >= held]
        blob = encode_message(Kind.DELTAS, self.version, held, self.digest, parts)
        out = blob if len(blob) < len(self.full_message()) else None
        self._cache[held] = out
        return out

    def on_reply(self, client: int, task_id: int) -> None:
        sent = self.in_flight.pop(int(task_id), None)
        if sent is not None and sent[0] == int(client):
            self.synced[sent[0]] = max(self.synced.get(sent[0], -1), sent[1])

    def on_failure(self, client: int, task_id: int) -> None:
        self.in_flight.pop(int(task_id), None)
        if self.synced.pop(int(client), None) is not None:
            self.stats.resyncs += 1

    def summary(self) -> dict[str, int]:
        """Whole-run counters (``totals`` plus what was not rolled yet), unprefixed."""
        total = DownlinkStats(**asdict(self.totals))
        total.merge(self.stats)
        return total.to_dict(prefix="")

    def roll_stats(self) -> dict[str, int]:
        """Counters since the last call (merged into ``totals``), as ``downlink_*`` keys of a metrics row."""
        row = self.stats.to_dict()
        self.totals.merge(self.stats)
        self.stats = DownlinkStats()
        return row


@DOWNLINKS.register("dense")
class DenseBroadcaster(Broadcaster):
    """Today's downlink: the dense fp32 model, as a plain wire blob. ``P_v = W_v``."""

    def _full_copy(self, params, version):
        public = {n: params[n].detach().to("cpu", torch.float32).clone() for n in self.spec.names}
        return public, encode_dense(public, self.spec, version)

    def _deltas_for(self, held: int | None) -> bytes | None:
        del held
        return None


class QuantizedBroadcaster(Broadcaster):
    """A full quantized copy every version: ``P_v = dequantize(quantize(W_v))``; a client already holding
    ``P_v`` gets a 0-part delta message."""

    def quantizer(self) -> Compressor:
        raise NotImplementedError

    def _full_copy(self, params, version):
        q = self.quantizer()
        tensors = {n: q.compress(params[n].detach().to("cpu", torch.float32), n) for n in self.spec.names}
        part = encode(Update(tensors, base_version=version), self.spec)
        update = decode(part, self.spec)
        public = materialize(update, self.spec)
        return public, encode_message(Kind.FULL, version, version, model_digest(public, self.spec), [part])


@DOWNLINKS.register("fp16")
class FP16Broadcaster(QuantizedBroadcaster):
    """Half-precision copy of ``W_v`` (2 bytes per value, round to nearest, saturating)."""

    def quantizer(self) -> Compressor:
        return COMPRESSORS.build("fp16")


@dataclass(frozen=True)
class Int8Config:
    """``block``: values per fp32 scale (overhead ``4 / block`` bytes per value)."""

    block: int = 64

    def __post_init__(self) -> None:
        if not isinstance(self.block, int) or self.block < 1:
            raise ValueError(f"block must be an int >= 1, got {self.block!r}")


@DOWNLINKS.register("int8")
class Int8Broadcaster(QuantizedBroadcaster):
    """Blockwise absmax int8 copy of ``W_v``, round to nearest (``|error| <= scale / 2``)."""

    Config: ClassVar[type] = Int8Config

    def quantizer(self) -> Compressor:
        return COMPRESSORS.build("int8", block=self.config.block, stochastic=False)


@dataclass(frozen=True)
class DeltaConfig:
    """``compressor``: a ``fedcomp`` compressor name for the deltas (``"a+b"`` composes); ``density``,
    ``dense_below``, ``block``, ``stochastic``, ``seed``: its options (each goes to the part that has it);
    ``history``: encoded deltas kept (a client further behind gets a full copy).

    Tuning: the message to a client ``k`` versions behind is about ``k x density x numel x (1 + index bits/8)``
    bytes plus the small tensors sent dense in every delta; keep ``history x density`` well below 1.
    """

    compressor: str = "topk+int8"
    density: float = 0.01
    dense_below: int = 1024
    block: int = 256
    stochastic: bool = False
    seed: int = 0
    history: int = 16

    def __post_init__(self) -> None:
        if not isinstance(self.history, int) or self.history < 1:
            raise ValueError(f"history must be an int >= 1, got {self.history!r}")


@DOWNLINKS.register("delta")
class DeltaBroadcaster(Broadcaster):
    """Compressed deltas of the public model with server-side error feedback (see the module docstring).

    Contract: after every ``publish``, ``W_v - P_v`` is exactly the mass not yet broadcast, and the next delta
    compresses it together with the new change; ``P_v`` is the result of applying the decoded deltas in order.
    """

    Config: ClassVar[type] = DeltaConfig

    def __init__(self, spec: ModelSpec, config: Any = None) -> None:
        super().__init__(spec, config)
        c = self.config
        opts = {"density": c.density, "dense_below": c.dense_below, "block": c.block, "stochastic": c.stochastic,
                "seed": c.seed}
        parts = c.compressor.split("+")
        known = set().union(*(COMPRESSORS.config_fields(p) for p in parts))
        self.compressor = build_compressor(c.compressor, **{k: v for k, v in opts.items() if k in known})
        self.history = c.history

    def _full_copy(self, params, version):
        public = {n: params[n].detach().to("cpu", torch.float32).clone() for n in self.spec.names}
        return public, None

    def _advance(self, params, version) -> bool:
        gap = {n: params[n].detach().to("cpu", torch.float32) - self.public[n] for n in self.spec.names}
        if not all(bool(torch.isfinite(g).all()) for g in gap.values()):
            return False
        payloads = {n: self.compressor.compress(gap[n], n) for n in self.spec.names}
        blob = encode(Update(payloads, base_version=self.version, seq=version), self.spec)
        apply_part(self.public, decode(blob, self.spec), self.spec)  # exactly what a client will apply
        self._full = None
        self.chain = (self.chain + [(self.version, version, blob)])[-self.history :]
        return True

    def residual(self, params: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """``W_v - P_v``: what the next delta will carry on top of the new change."""
        return {n: params[n].detach().to("cpu", torch.float32) - self.public[n] for n in self.spec.names}


def build_broadcaster(name: str, spec: ModelSpec, **options: Any) -> Broadcaster:
    """A downlink mode by name (``dense``, ``fp16``, ``int8``, ``delta``) with its typed options."""
    cls = DOWNLINKS.get(name)
    return cls(spec, DOWNLINKS.make_config(name, **options))


def dense_fp32_bytes(spec: ModelSpec) -> int:
    """Payload bytes of the ``dense`` mode's message for ``spec`` (the baseline of downlink ratios)."""
    return len(encode_dense({n: torch.zeros(s) for n, s in spec.entries}, spec, 0))


__all__ = [
    "DOWNLINKS",
    "RESYNC",
    "Broadcaster",
    "DeltaBroadcaster",
    "DownlinkError",
    "DownlinkStats",
    "Message",
    "Replica",
    "apply_part",
    "build_broadcaster",
    "decode_message",
    "dense_fp32_bytes",
    "encode_dense",
    "encode_message",
    "materialize",
    "model_digest",
    "receive",
]

"""The client side of the downlink: the replica of the public model a client keeps, and ``receive``.

Contract: the ``Replica`` that ``receive`` returns is bitwise equal to the server's ``P_v`` (up to a 128-bit hash
collision), or ``receive`` raises ``DownlinkError``, never returning a wrong model. A client that cannot apply a
message (no replica, a version outside the chain, a digest mismatch, a corrupt blob) raises; the server then
forgets what it believed that client holds (``Broadcaster.on_failure``) and its next task carries a full copy.

A replica is a value: nothing modifies its tensors in place (``receive`` builds a new one when the model
changes). So it keeps the bytes it was saved as, and ``to_bytes`` encodes only a replica that changed:

>>> spec = ModelSpec((("w", (3,)),))
>>> r = receive(encode_dense({"w": torch.ones(3)}, spec, 4), spec, None)      # a full copy of P_4
>>> saved = r.to_bytes(spec)                                # encoded once (what the client keeps)
>>> back = Replica.from_bytes(saved, spec)
>>> back.version, back.to_bytes(spec) is saved             # unchanged: the saved bytes again, no encoding
(4, True)
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from fedcomp.downlink.envelope import MAGIC, DownlinkError, Kind, check_full, decode_envelope, encode_full
from fedcomp.downlink.model import apply_part, cpu_f32, materialize, model_digest
from fedcomp.payload import ValueCoding
from fedcomp.spec import ModelSpec
from fedcomp.wire import WireError, decode
from fedcomp.wire.codec import MAGIC as WIRE_MAGIC

#: The value coding of the ``dense`` mode's plain ``FCW`` message (``encode_dense``).
DENSE_CODINGS = frozenset({ValueCoding.F32})


@dataclass
class Replica:
    """A client's copy of the public model: ``version`` and float32 CPU tensors (spec names).

    ``saved``: the full fp32 ``FCD`` bytes of this replica once known (loaded from them, or encoded once by
    ``to_bytes``); ``verified``: the digest its tensors had when ``receive`` checked them or ``to_bytes`` encoded
    them. ``to_bytes`` trusts ``saved``: do not modify ``tensors`` in place.
    """

    version: int
    tensors: dict[str, torch.Tensor]
    saved: bytes | None = field(default=None, repr=False, compare=False)
    verified: bytes | None = field(default=None, repr=False, compare=False)

    def fits(self, spec: ModelSpec) -> bool:
        """Whether the tensors are ``spec``'s: its names, with its shapes."""
        return set(self.tensors) == set(spec.names) and all(
            tuple(self.tensors[n].shape) == tuple(s) for n, s in spec.entries)

    def digest(self, spec: ModelSpec) -> bytes:
        return model_digest(self.tensors, spec)

    def to_bytes(self, spec: ModelSpec) -> bytes:
        """A full fp32 ``FCD`` message of this replica (bit-exact; what a client keeps in ``context.state``),
        encoded the first time only."""
        if self.saved is None:
            if self.verified is None:
                self.verified = self.digest(spec)
            self.saved = encode_full(self.tensors, spec, self.version, self.verified)
        return self.saved

    @staticmethod
    def from_bytes(data: bytes, spec: ModelSpec) -> Replica | None:
        """The replica saved by ``to_bytes``; ``None`` if it is missing or does not verify (asks for a resync)."""
        try:
            replica = receive(data, spec, None)
        except WireError:
            return None
        if bytes(data[: len(MAGIC)]) == MAGIC:  # an envelope: what to_bytes writes (a bare FCW blob is not)
            replica.saved = bytes(data)
        return replica


def receive(blob: bytes, spec: ModelSpec, replica: Replica | None) -> Replica:
    """The public model a downlink blob gives this client, verified against the server's digest.

    ``replica`` is not modified; when the blob brings nothing new (its chain ends at the replica's version) the
    result shares the replica's tensors, and its saved bytes if the tensors still have the digest they were saved
    with. Raises ``DownlinkError`` (message contains ``RESYNC``) when the blob is corrupt, deltas arrive without a
    replica or for a version outside their chain, or the result's digest differs. A plain ``FCW`` blob (the
    ``dense`` mode) is a full fp32 copy (integrity: its CRC). Nothing is materialized beyond a small factor of the
    blob's size before the digest check: a full copy holds only ``FULL_CODINGS`` (a plain blob only fp32), and
    deltas apply only to a replica of ``spec``'s shapes.
    """
    if not isinstance(blob, (bytes, bytearray, memoryview)):
        raise DownlinkError(f"expected bytes, got {type(blob).__name__}")
    if bytes(blob[: len(WIRE_MAGIC)]) == WIRE_MAGIC:
        try:
            update = decode(blob, spec)
        except WireError as exc:
            raise DownlinkError(f"dense model: {exc}") from None
        check_full(update, DENSE_CODINGS, "dense model")
        return Replica(update.base_version, materialize(update, spec))
    env = decode_envelope(blob, spec)  # a full copy's codings are checked there (FULL_CODINGS)
    if env.kind == Kind.FULL:
        out = Replica(env.version, materialize(env.parts[0], spec))
    else:
        if replica is None:
            raise DownlinkError(f"deltas {env.base} -> {env.version} but this client holds no replica")
        if not replica.fits(spec):  # deltas add into the replica's tensors: never grow past what it holds
            raise DownlinkError(f"deltas {env.base} -> {env.version} for another model than the replica's")
        nodes = [env.base] + [p.seq for p in env.parts]
        if replica.version not in nodes:
            raise DownlinkError(f"deltas {env.base} -> {env.version} do not start at the replica's {replica.version}")
        if replica.version == env.version:  # nothing to apply: the same tensors
            out = Replica(replica.version, replica.tensors, replica.saved, replica.verified)
        else:
            out = Replica(env.version, cpu_f32(replica.tensors, spec))
            for p in env.parts:
                if p.base_version >= replica.version:
                    apply_part(out.tensors, p, spec)
    digest = out.digest(spec)
    if digest != env.digest:
        raise DownlinkError(f"model fingerprint mismatch after applying version {env.version}")
    if digest != out.verified:
        out.saved = None  # changed in place since it was saved: encode again
    out.verified = digest
    return out

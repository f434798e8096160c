"""The server side of the downlink: ``Broadcaster`` turns the true model ``W_v`` into the public ``P_v`` and
each client's message. Registry ``DOWNLINKS``; typed configs per mode.

Two models live on the server. ``W_v`` is the **true** model the optimizer updates. ``P_v`` is the **public**
model: what a client that applied the downlink messages holds, bitwise, and trains from (its update's base
version names ``P_v``). The modes:

* ``dense``: ``P_v = W_v``; the message is the dense fp32 wire blob (seq 0, base version = v), byte for byte.
* ``fp16`` / ``int8``: ``P_v = dequantize(quantize(W_v))`` (round to nearest; int8 blockwise absmax, ``block``
  values per fp32 scale). Each version is quantized afresh from ``W_v``, so the error never accumulates.
* ``delta``: ``P_0 = W_0``, then at each new version the server compresses the gap ``W_v - P_{v-1}`` (any
  ``fedcomp`` compressor, default ``topk+int8``), encodes it, decodes it again and sets ``P_v = P_{v-1} +
  decoded``. Server-side error feedback is implicit and exact: the residual ``e_v = W_v - P_v`` is everything
  not broadcast yet, and the next gap ``W_{v+1} - P_v = (W_{v+1} - W_v) + e_v`` carries it, so the public model
  tracks the true one (no extra residual buffer, nothing counted twice). The last ``history`` encoded deltas
  are kept; a client known to hold ``P_c`` gets the chain of deltas ``c -> v`` (an ``envelope``) when that is
  smaller than the dense fp32 copy of ``P_v``, and that dense copy otherwise (new clients, clients too far
  behind or unknown). We send the concatenated deltas, not a merged sum: ``P`` is built by applying each
  decoded delta in order with the same float32 ops (``model.apply_part``), and a merged sum rounds differently.

>>> spec = ModelSpec((("w", (64, 64)),))
>>> b = build_broadcaster("delta", spec, density=0.01)
>>> full = b.message(client=1, task_id=1, params={"w": torch.zeros(64, 64)}, version=0)  # new client: full copy
>>> b.on_reply(1, 1)                                                    # it holds P_0 now
>>> delta = b.message(1, 2, {"w": torch.ones(64, 64)}, 1)               # then the delta 0 -> 1 (41 values)
>>> len(full), len(delta)
(16437, 108)
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from fedcomp.client.pipeline import build_compressor, known_options
from fedcomp.compressors.base import COMPRESSORS, Compressor
from fedcomp.downlink.envelope import Kind, encode_envelope, encode_full
from fedcomp.downlink.model import apply_part, cpu_f32, encode_dense, materialize, model_digest
from fedcomp.downlink.stats import DownlinkStats
from fedcomp.payload import Update
from fedcomp.registry import Registry
from fedcomp.spec import ModelSpec
from fedcomp.wire import decode, encode

DOWNLINKS: Registry[Broadcaster] = Registry("downlink mode")


class Broadcaster(ABC):
    """Server side of one downlink mode: publishes ``P_v`` from ``W_v`` and picks each client's message.

    The loop calls ``message(client, task_id, params, version)`` for every task (it publishes ``version``
    first if it is new), ``on_reply(client, task_id)`` for every reply that came back (any outcome: the client
    applied that task's model, so it holds at least that version), ``on_failure(client)`` for every failed
    task (error reply, node lost: it may have restarted or rejected the model, so its next message is full) and
    ``forget(task_id)`` for a task resolved without a reply (expired, round closed).
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
        return encode_full(self.public, self.spec, self.version, self.digest)

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
        blob = encode_envelope(Kind.DELTAS, self.version, held, self.digest, parts)
        out = blob if len(blob) < len(self.full_message()) else None
        self._cache[held] = out
        return out

    def on_reply(self, client: int, task_id: int) -> None:
        """``client`` replied to ``task_id``: it holds the model that task carried. A reply naming another node's
        task changes nothing (that task stays in flight for its own node)."""
        sent = self.in_flight.get(int(task_id))
        if sent is not None and sent[0] == int(client):
            del self.in_flight[int(task_id)]
            self.synced[sent[0]] = max(self.synced.get(sent[0], -1), sent[1])

    def forget(self, task_id: int) -> None:
        """``task_id`` was resolved without a reply (its deadline passed, its round closed): it leaves the in-flight
        tracker; what its client is known to hold is unchanged (a client that lost its replica fails its next
        task, and ``on_failure`` then sends a full copy). A reply that still comes teaches nothing."""
        self.in_flight.pop(int(task_id), None)

    def on_failure(self, client: int, task_id: int) -> None:
        self.in_flight.pop(int(task_id), None)
        if self.synced.pop(int(client), None) is not None:
            self.stats.resyncs += 1

    def summary(self) -> dict[str, int]:
        """Whole-run counters (``totals`` plus what was not rolled yet), unprefixed."""
        total = DownlinkStats()
        total.merge(self.totals)
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
        public = cpu_f32(params, self.spec)
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
        return public, encode_envelope(Kind.FULL, version, version, model_digest(public, self.spec), [part])


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
        self.build()  # a bad compressor or option fails with the config, before any run starts

    def build(self) -> Compressor:
        """The delta compressor, its options taken from this config (each to the part that has it)."""
        opts = {"density": self.density, "dense_below": self.dense_below, "block": self.block,
                "stochastic": self.stochastic, "seed": self.seed}
        return build_compressor(self.compressor, **known_options(self.compressor, opts))


@DOWNLINKS.register("delta")
class DeltaBroadcaster(Broadcaster):
    """Compressed deltas of the public model with server-side error feedback (see the module docstring).

    Contract: after every ``publish``, ``W_v - P_v`` is exactly the mass not yet broadcast, and the next delta
    compresses it together with the new change; ``P_v`` is the result of applying the decoded deltas in order.
    """

    Config: ClassVar[type] = DeltaConfig

    def __init__(self, spec: ModelSpec, config: Any = None) -> None:
        super().__init__(spec, config)
        self.compressor = self.config.build()
        self.history = self.config.history

    def _full_copy(self, params, version):
        return cpu_f32(params, self.spec), None

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

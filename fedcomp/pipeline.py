"""The send step: compensate → compress → update → encode, plus the ack/nack ledger.

``build("dgc+int8", spec, density=0.001)`` returns a ``Pipeline``; ``pipeline.send(grads, ...)`` returns the
bytes to put in one Flower message, and ``pipeline.nack(seq)`` adds an update the server did not apply
back into the error-feedback memory, so ``Σ applied + Σ residuals == Σ computed`` holds across losses.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from fedcomp.compressors.base import COMPRESSORS, Composed, Compressor, Quantizer, Sparsifier
from fedcomp.kernels import fused_send
from fedcomp.kernels._backend import BACKENDS  # the kernel backends a pipeline accepts (None: by device)
from fedcomp.memory.base import MEMORIES, Memory
from fedcomp.payload import TensorPayload, Update
from fedcomp.registry import ConfigError
from fedcomp.spec import ModelSpec
from fedcomp.wire import decode, encode


def build_compressor(name: str, **options: Any) -> Compressor:
    """A compressor by registry name; ``"a+b"`` composes sparsifier ``a`` with quantizer ``b``.

    For a composition each option goes to the part(s) whose config has a field of that name.
    """
    parts = name.split("+")
    if len(parts) == 1:
        return COMPRESSORS.build(name, **options)
    if len(parts) != 2:
        raise ConfigError(f"compressor {name!r}: compose at most two (sparsifier+quantizer)")
    fields = [COMPRESSORS.config_fields(p) for p in parts]
    unknown = set(options) - fields[0] - fields[1]
    if unknown:
        raise ConfigError(f"compressor {name!r}: unknown option(s) {sorted(unknown)}")
    built = [
        COMPRESSORS.build(p, **{k: v for k, v in options.items() if k in f})
        for p, f in zip(parts, fields, strict=True)
    ]
    sparsifier, quantizer = built
    if not isinstance(sparsifier, Sparsifier) or not isinstance(quantizer, Quantizer):
        raise ConfigError(f"compressor {name!r}: expected sparsifier+quantizer, e.g. 'dgc+int8'")
    return Composed(sparsifier, quantizer)


class Pipeline:
    """A compressor with its error-feedback memory over one model spec, and the unacked-update ledger.

    ``backend`` picks the send step's kernels (``fedcomp.kernels.fused_send``): ``None`` = by device (CUDA tensors
    take the fused Triton kernels, CPU tensors the torch reference), ``"torch"`` = always the reference,
    ``"triton"`` = the kernels wherever the memory/compressor pair has one (CPU tensors only under
    ``TRITON_INTERPRET=1``). It is a runtime choice, not state: ``state_dict`` does not hold it.

    The tensors given to ``send`` stay on their device through compression (the memory's state must be there
    too: ``to(device)``); encoding copies each payload tensor to the CPU once. Not thread-safe. ``state_dict()``
    holds everything needed to resume (memory, compressor RNG and schedule, next sequence number, encoded
    unacked updates).
    """

    def __init__(self, spec: ModelSpec, compressor: Compressor, memory: Memory, *, backend: str | None = None) -> None:
        if backend is not None and backend not in BACKENDS:
            raise ConfigError(f"backend must be one of {', '.join(BACKENDS)} or None (by device), got {backend!r}")
        self.spec, self.compressor, self.memory, self.backend = spec, compressor, memory, backend
        self.next_seq = 1
        self.pending: dict[int, bytes] = {}
        #: Tensors compressed jointly (``Compressor.group``: the small tensors under the ``"group"`` policy); they
        #: take the reference steps on every device, the others ``fused_send`` first.
        self.grouped: tuple[str, ...] = tuple(compressor.group(spec))

    def to(self, device: torch.device | str) -> Pipeline:
        """Move the error-feedback state to ``device`` (the device of the tensors ``send`` will get); returns self."""
        self.memory.to(device)
        return self

    def compress(self, tensors: Mapping[str, torch.Tensor]) -> dict[str, TensorPayload]:
        """One error-feedback step over every tensor of the spec (missing names are an error).

        Tensors outside ``grouped``: compensate → compress → update one by one (or ``fused_send``). The group:
        compensate each, one ``compress_group`` over all of them, update each with its own payload, so the
        memory contract (``Σ inputs == Σ sent + residual``) holds per tensor as before."""
        grouped = set(self.grouped)
        out = {}
        for name in self.spec.names:
            if name in grouped:
                continue
            # the fused kernels when the backend (by default: the tensor's device) picks them, else the reference
            p = fused_send(self.memory, self.compressor, tensors[name], name, backend=self.backend)
            if p is None:
                v = self.memory.compensate(tensors[name], name)
                p = self.compressor.compress(v, name)
                self.memory.update(v, name, p)
            out[name] = p
        if self.grouped:
            vs = {name: self.memory.compensate(tensors[name], name) for name in self.grouped}
            payloads = self.compressor.compress_group(vs)
            for name in self.grouped:
                self.memory.update(vs[name], name, payloads[name])
            out.update(payloads)
        return {name: out[name] for name in self.spec.names}

    def send(
        self, tensors: Mapping[str, torch.Tensor], *, base_version: int = 0, client_id: int = 0
    ) -> bytes:
        """Compress and encode; the update stays pending until ``ack`` or ``nack`` of its ``seq``."""
        seq = self.next_seq
        self.next_seq += 1
        blob = encode(Update(self.compress(tensors), base_version, seq, client_id), self.spec)
        self.pending[seq] = blob
        return blob

    @property
    def last_seq(self) -> int:
        return self.next_seq - 1

    def ack(self, seq: int) -> bool:
        """The server applied ``seq``: forget it. Returns False if it was not pending."""
        return self.pending.pop(seq, None) is not None

    def nack(self, seq: int) -> bool:
        """The server did not apply ``seq``: restore it into the memory. Returns False if it was not pending."""
        blob = self.pending.pop(seq, None)
        if blob is None:
            return False
        for name, payload in decode(blob, self.spec).tensors.items():
            self.memory.restore(name, payload)
        return True

    def set_epoch(self, epoch: float) -> None:
        self.compressor.set_epoch(epoch)

    def state_dict(self) -> dict[str, Any]:
        return {
            "compressor": self.compressor.state_dict(),
            "memory": self.memory.state_dict(),
            "next_seq": self.next_seq,
            "pending": dict(self.pending),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.compressor.load_state_dict(state["compressor"])
        self.memory.load_state_dict(state["memory"])
        self.next_seq = int(state["next_seq"])
        self.pending = dict(state["pending"])


def build(
    name: str, spec: ModelSpec, *, memory: str | None = None, backend: str | None = None, **options: Any
) -> Pipeline:
    """Compressor ``name`` with its options, wrapped in ``memory`` (default: the compressor's own choice), sending
    with kernel ``backend`` (see ``Pipeline``; ``None`` = by device).

    Options the memory's config knows (e.g. ``momentum`` for DGC) go to the memory; the rest to the
    compressor.
    """
    mem_name = memory
    if mem_name is None:
        sparsifier = name.split("+")[0]
        mem_name = COMPRESSORS.get(sparsifier).default_memory
    mem_fields = MEMORIES.config_fields(mem_name)
    mem_opts = {k: v for k, v in options.items() if k in mem_fields}
    comp_opts = {k: v for k, v in options.items() if k not in mem_fields}
    return Pipeline(spec, build_compressor(name, **comp_opts), MEMORIES.build(mem_name, **mem_opts), backend=backend)

"""The send step: compensate → compress → update → encode, plus the ack/nack ledger.

``build("dgc+int8", spec, density=0.001)`` returns a ``Pipeline``; ``pipeline.send(grads, ...)`` returns the
bytes to put in one Flower message, and ``pipeline.nack(seq)`` adds an update the server did not apply
back into the error-feedback memory, so ``Σ applied + Σ residuals == Σ computed`` holds across losses.
``pipeline.totals`` keeps the running sums that let a saved state prove it (``fedcomp check``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch

from fedcomp.client.admit import MAX_MAGNITUDE, NonFiniteUpdate, UpdateMismatch, admit  # noqa: F401 (the refusals)
from fedcomp.client.saved import check_memory, check_table, update_from_state, update_state
from fedcomp.client.totals import Totals
from fedcomp.compressors.base import COMPRESSORS, Composed, Compressor, Quantizer, Sparsifier
from fedcomp.kernels._backend import KERNEL_BACKENDS  # the kernel backends a pipeline accepts (None: by device)
from fedcomp.kernels.encode import encode_update
from fedcomp.kernels.group import start_group_send
from fedcomp.kernels.hooks import FusedBatch, fused_compress_group
from fedcomp.memory.base import MEMORIES, Memory
from fedcomp.payload import TensorPayload, Update, Values
from fedcomp.registry import ConfigError
from fedcomp.spec import ModelSpec


def part_fields(name: str) -> list[set[str]]:
    """The config fields of each part of compressor ``name`` (``"a"``, or ``"a+b"`` = sparsifier + quantizer)."""
    parts = name.split("+")
    if len(parts) > 2:
        raise ConfigError(f"compressor {name!r}: compose at most two (sparsifier+quantizer)")
    return [COMPRESSORS.config_fields(p) for p in parts]


def known_options(name: str, options: Mapping[str, Any]) -> dict[str, Any]:
    """The options some part of compressor ``name`` has a field for (a caller with a fixed set of options, like
    the downlink's ``DeltaConfig``, passes them all and lets the compressor take its own).

    >>> known_options("topk+int8", {"density": 0.1, "block": 64, "momentum": 0.9})
    {'density': 0.1, 'block': 64}
    """
    known = set().union(*part_fields(name))
    return {k: v for k, v in options.items() if k in known}


def build_compressor(name: str, **options: Any) -> Compressor:
    """A compressor by registry name; ``"a+b"`` composes sparsifier ``a`` with quantizer ``b``.

    For a composition each option goes to the part(s) whose config has a field of that name; an option no part
    has raises ``ConfigError``.
    """
    fields = part_fields(name)
    if len(fields) == 1:
        return COMPRESSORS.build(name, **options)
    unknown = set(options) - set(known_options(name, options))
    if unknown:
        raise ConfigError(f"compressor {name!r}: unknown option(s) {sorted(unknown)}")
    built = [
        COMPRESSORS.build(p, **{k: v for k, v in options.items() if k in f})
        for p, f in zip(name.split("+"), fields, strict=True)
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
    too: ``to(device)``); with the Triton backend the wire encode runs there too (``fedcomp.kernels.encode``: one
    copy of the finished bytes to the host), else encoding copies each payload tensor to the CPU once. Not
    thread-safe. ``state_dict()`` holds everything needed to resume (memory, compressor RNG and schedule, next
    sequence number, the unacked updates' payloads; a state that holds them as encoded blobs, as saved before,
    still loads) and the running ``totals`` (``None`` when the memory keeps no residual, e.g. ``"none"``, or when
    the state was saved before totals existed: conservation is then not recorded).
    """

    def __init__(
        self,
        spec: ModelSpec,
        compressor: Compressor,
        memory: Memory,
        *,
        backend: str | None = None,
        totals: bool = True,
    ) -> None:
        if backend is not None and backend not in KERNEL_BACKENDS:
            names = ", ".join(KERNEL_BACKENDS)
            raise ConfigError(f"backend must be one of {names} or None (by device), got {backend!r}")
        self.spec, self.compressor, self.memory, self.backend = spec, compressor, memory, backend
        self.next_seq = 1
        #: Updates sent and not resolved yet, by ``seq``: the payloads as compressed (on the send device), so a
        #: nack restores them and an ack counts them without decoding the blob again.
        self.pending: dict[int, Update] = {}
        self.totals: Totals | None = Totals() if totals else None  # off where no state is ever checked (dp)
        #: Tensors compressed jointly (``Compressor.group``: the small tensors under the ``"group"`` policy); they
        #: take the reference steps on every device, the others the fused steps first (``kernels.hooks.FusedBatch``).
        self.grouped: tuple[str, ...] = tuple(compressor.group(spec))

    def to(self, device: torch.device | str) -> Pipeline:
        """Move the error-feedback state to ``device`` (the device of the tensors ``send`` will get); returns self."""
        self.memory.to(device)
        if self.totals is not None:
            self.totals.to(device)
        return self

    def residual_of(self, name: str) -> torch.Tensor | None:
        try:
            return self.memory.residual(name)
        except KeyError:  # an unseen name, or a memory that keeps none
            return None

    def compress(self, tensors: Mapping[str, torch.Tensor]) -> dict[str, TensorPayload]:
        """One error-feedback step over every tensor of the spec (missing names are an error).

        Tensors outside ``grouped``: compensate → compress → update one by one (or the fused steps, all started
        before any is finished: ``FusedBatch``). The group:
        compensate each, one ``compress_group`` over all of them, update each with its own payload, so the
        memory contract (``Σ inputs == Σ sent + residual``) holds per tensor as before; on the kernel path the
        same steps over the memory's flat group state, a few ops for the whole group (``kernels.group``)."""
        grouped = set(self.grouped)
        out = {}
        fused = FusedBatch(self.memory, self.compressor, backend=self.backend)
        for name in self.spec.names:
            # the fused kernels when the backend (by default: the tensor's device) picks them, else the reference
            if name in grouped or fused.add(name, tensors[name]):
                continue
            v = self.memory.compensate(tensors[name], name)
            p = self.compressor.compress(v, name)
            self.memory.update(v, name, p)
            out[name] = p
        group = {name: tensors[name] for name in self.grouped}
        started = start_group_send(self.memory, self.compressor, group, backend=self.backend) if group else None
        if started is not None:
            fused.include(started)  # the group's step on its flat state, read with the others
        out.update(fused.finish())  # one host read for every fused tensor's selection (and the group's)
        if group and started is None:
            out.update(self._reference_group(group))
        return {name: out[name] for name in self.spec.names}

    def _reference_group(self, group: Mapping[str, torch.Tensor]) -> dict[str, TensorPayload]:
        """The group's reference steps: compensate each, one ``compress_group`` (its quantizer by the kernel where
        the backend picks it), update each with its own payload."""
        vs = {name: self.memory.compensate(t, name) for name, t in group.items()}
        payloads = fused_compress_group(self.compressor, vs, backend=self.backend, inputs=group)  # quantizer kernel
        if payloads is None:
            payloads = self.compressor.compress_group(vs, inputs=group)
        for name, v in vs.items():
            self.memory.update(v, name, payloads[name])
        return payloads

    def bound(self, payloads: dict[str, TensorPayload], max_norm: float) -> dict[str, TensorPayload]:
        """``payloads`` scaled down to L2 norm ``max_norm`` if they are longer (client-side DP clipping: what
        error feedback adds to a clipped update must not lift it over the norm); the part cut off goes back into
        the memory, so ``Σ inputs == Σ sent + residual`` still holds."""
        norm = math.sqrt(sum(float(p.values.dequantize().double().square().sum()) for p in payloads.values()))
        if norm <= max_norm:
            return payloads
        factor = max_norm / norm * (1 - 1e-6)  # the margin covers fp16/bf16 rounding of scaled values
        out = {}
        for name, p in payloads.items():
            kept = p.scaled(factor)
            cut = p.values.dequantize() - kept.values.dequantize()
            self.memory.restore(name, TensorPayload(p.shape, Values.f32(cut), p.indices))
            out[name] = kept
        return out

    def send(
        self,
        tensors: Mapping[str, torch.Tensor],
        *,
        base_version: int = 0,
        client_id: int = 0,
        max_norm: float = 0.0,
    ) -> bytes:
        """Compress and encode; the update stays pending until ``ack`` or ``nack`` of its ``seq``. ``max_norm`` > 0
        bounds the L2 norm of what is sent (``bound``). ``UpdateMismatch`` for a tensor of the spec missing or of
        another shape, ``NonFiniteUpdate`` for NaN, Inf or a magnitude of ``MAX_MAGNITUDE`` or more, both before
        anything changes (the next update is sent as if this one never came; error feedback would keep a NaN for
        good, and DGC's threshold never selects it); an encode that fails restores the update into the memory, as
        a nack does. Names outside the spec are not sent; tensors of any memory layout are (channels-last ones,
        transposed views)."""
        tensors = admit(self.spec, tensors)
        seq = self.next_seq
        self.next_seq += 1
        if self.totals is not None:  # the running totals observe the step from outside (fedcomp.client.totals)
            self.totals.before_step(self)
        payloads = self.compress(tensors)  # 1. compensate, 2. compress, 3. update the memory (per tensor)
        if max_norm > 0:
            payloads = self.bound(payloads, max_norm)
        if self.totals is not None and not self.totals.after_step(self, payloads):
            self.totals = None  # the memory keeps no residual: conservation cannot be recorded
        update = Update(payloads, base_version, seq, client_id)
        self.pending[seq] = update
        # 4. encode (on the payloads' device when the backend is Triton: the same bytes); pending until ack/nack
        try:
            return encode_update(update, self.spec, backend=self.backend)
        except Exception:
            self.nack(seq)  # its mass goes back into the memory: nothing lost
            raise

    @property
    def last_seq(self) -> int:
        return self.next_seq - 1

    def ack(self, seq: int) -> bool:
        """The server applied ``seq``: forget it (its mass leaves ``totals.outstanding``). False if it was not
        pending."""
        update = self.pending.pop(seq, None)
        if update is None:
            return False
        if self.totals is not None:
            self.totals.on_ack(update.tensors)
        return True

    def nack(self, seq: int) -> bool:
        """The server did not apply ``seq``: restore it into the memory. Returns False if it was not pending."""
        update = self.pending.pop(seq, None)
        if update is None:
            return False
        for name, payload in update.tensors.items():
            self.memory.restore(name, payload)
        if self.totals is not None:
            self.totals.nacked += 1
        return True

    def set_epoch(self, epoch: float) -> None:
        self.compressor.set_epoch(epoch)

    def take_state(self, other: Pipeline) -> None:
        """Continue ``other``'s state in this (fresh) pipeline of the same compression and spec without copying
        it: its memory, pending updates, totals and next ``seq`` as they are, and its compressor's ``state_dict``
        (small: RNG, epoch) loaded into this one's compressor, so settings ``other`` was given that are not state
        (``set_density``) are this pipeline's own, as after ``load_state_dict(other.state_dict())``. ``other``
        is not to be used after."""
        self.compressor.load_state_dict(other.compressor.state_dict())
        self.memory, self.pending, self.totals = other.memory, other.pending, other.totals
        self.next_seq = other.next_seq

    def state_dict(self) -> dict[str, Any]:
        return {
            "compressor": self.compressor.state_dict(),
            "memory": self.memory.state_dict(),
            "next_seq": self.next_seq,
            "pending": {seq: update_state(u) for seq, u in self.pending.items()},
            "totals": None if self.totals is None else self.totals.state_dict(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """A saved state, checked against the model before any of it is used (``fedcomp.client.saved``)."""
        check_memory(state["memory"], self.spec)
        self.compressor.load_state_dict(state["compressor"])
        self.memory.load_state_dict(state["memory"])
        self.next_seq = int(state["next_seq"])
        self.pending = {int(seq): update_from_state(u, int(seq), self.spec) for seq, u in state["pending"].items()}
        saved = state.get("totals")  # absent in states saved before totals existed: not recorded from here on
        self.totals = None if saved is None else Totals.from_state(saved)
        if self.totals is not None:
            check_table(self.totals.outstanding, self.spec, "saved running sum")
            self.totals.to(self.memory.device)


def build(
    name: str,
    spec: ModelSpec,
    *,
    memory: str | None = None,
    backend: str | None = None,
    totals: bool = True,
    **options: Any,
) -> Pipeline:
    """Compressor ``name`` with its options, wrapped in ``memory`` (default: the compressor's own choice), sending
    with kernel ``backend`` (see ``Pipeline``; ``None`` = by device).

    Options the memory's config knows (e.g. ``momentum`` for DGC) go to the memory; the rest to the
    compressor. ``totals=False`` skips the running sums ``fedcomp check`` reads (two dense passes per ``send``).
    """
    mem_name = memory
    if mem_name is None:
        sparsifier = name.split("+")[0]
        mem_name = COMPRESSORS.get(sparsifier).default_memory
    mem_fields = MEMORIES.config_fields(mem_name)
    mem_opts = {k: v for k, v in options.items() if k in mem_fields}
    comp_opts = {k: v for k, v in options.items() if k not in mem_fields}
    unknown = sorted(set(comp_opts) - set(known_options(name, comp_opts)))
    if unknown:
        owners = [repr(m) for m in MEMORIES.names() if set(unknown) <= MEMORIES.config_fields(m)]
        hint = f"; {', '.join(unknown)}: of memory {' or '.join(owners)}, this one's is {mem_name!r}" if owners else ""
        known = sorted(set().union(*part_fields(name), mem_fields))
        raise ConfigError(f"compressor {name!r}: unknown option(s) {unknown}; known: {known}{hint}")
    compressor, mem = build_compressor(name, **comp_opts), MEMORIES.build(mem_name, **mem_opts)
    return Pipeline(spec, compressor, mem, backend=backend, totals=totals)

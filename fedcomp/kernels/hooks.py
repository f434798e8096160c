"""Drop-in fused send step for a pipeline: one call in place of ``compensate -> compress -> update``.

``fused_send(memory, compressor, tensor, name)`` returns the payload the three reference calls would return and
leaves the memory in the state they would leave it, using the fused kernels, or ``None`` when no fused path
applies (CPU tensors, or a memory/compressor pair without a kernel): the caller then runs the reference calls.

``FUSED_STEPS`` says which pairs have one. Its keys are a memory class and the classes of the compressor's
``stages`` (``dgc+int8``: ``DGC``, ``Int8Quantizer``); a lookup takes the entry of the nearest registered classes
(``Int8Quantizer`` is an ``AbsmaxQuantizer``). Registered: ``DGCMemory`` or ``ResidualMemory`` + ``DGC``
(optionally followed by a quantizer with a kernel: ``dgc+int8``), and ``ResidualMemory`` + a quantizer with a
kernel (``int8``, ``int4``, ``qsgd``, ``sign``: ``fedcomp.kernels.quant.QUANT_SPECS``). A step gets the memory's
live state (``Memory.step_state``) and the stages, and updates the state in place::

    FUSED_STEPS[(ResidualMemory, SignQuantizer)](state, x, name, backend, quantizer) -> TensorPayload | Queued

A step may return a ``Deferred`` (the DGC steps do): a planned step (its sample start drawn) that the batch
launches with the others' (``fedcomp.kernels.dgc_batch.start_dgc_steps``: one launch per pass for all of them) and
finishes once the counts are on the host; or a ``Queued`` tensor (the quantizer steps): the batch codes all of them
with one launch (``fedcomp.kernels.quant.quantize_all``). ``FusedBatch`` sends many tensors and reads all their
counts at once, one host read per send (an included step of several tensors, the small tensors' group, is read in
the same copy)::

    batch = FusedBatch(memory, compressor)
    for name in names:
        batch.add(name, tensors[name])  # False: no fused path for it (the caller runs the reference steps)
    batch.include(start_group_send(memory, compressor, group))  # where it applies (not None)
    payloads = batch.finish()           # {name: TensorPayload}

``fused_compress_group`` is the small tensors' joint step (``Compressor.compress_group``) of a composition with
its quantizer's kernel.

The compressor's generator draws the sample start exactly as the reference does, so sparse indices match the
reference pipeline. Stochastic rounding takes a seed from the quantizer's generator (same distribution, other
stream). A DGC tensor's first step starts from zero state (``u = m * 0 + g``), which equals the reference's
``u = g`` (tests/test_kernels.py checks the whole step sequence).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Mapping
from dataclasses import asdict, dataclass
from itertools import product

import torch

from fedcomp.compressors.base import Compressor, Quantizer
from fedcomp.compressors.dgc import DGC
from fedcomp.kernels._backend import resolve
from fedcomp.kernels._dgc_select import DGCStep
from fedcomp.kernels.dgc import DGCPlan, plan_dgc_step
from fedcomp.kernels.dgc_batch import start_dgc_steps
from fedcomp.kernels.pending import PendingStep, read_all
from fedcomp.kernels.quant import QUANT_SPECS, has_kernel, quantize_all
from fedcomp.kernels.scatter import put_many
from fedcomp.memory.base import Memory, StepState
from fedcomp.memory.dgc import DGCMemory
from fedcomp.memory.residual import ResidualMemory
from fedcomp.payload import TensorPayload


@dataclass(frozen=True)
class Deferred:
    """A fused step planned, not launched: ``plan`` (its draws made) is started with the batch's others
    (``start_dgc_steps``), ``finish(dgc_step)`` makes the payload once the step is resolved; with a ``quantizer``
    the batch then codes that payload's values (one launch for the batch) and writes their coding error into
    ``velocity`` at the sent positions."""

    plan: DGCPlan
    finish: Callable[[DGCStep], TensorPayload]
    quantizer: Quantizer | None = None
    velocity: torch.Tensor | None = None


@dataclass(frozen=True)
class Queued:
    """A tensor the batch codes with the others of its ``quantizer`` by one launch (``quantize_all``): ``x +
    residual`` coded, the coding error left in ``residual``."""

    x: torch.Tensor
    residual: torch.Tensor
    quantizer: Quantizer


#: ``step(state, tensor, name, backend, *stages) -> TensorPayload | Deferred | Queued``; ``tensor`` is contiguous
#: fp32.
FusedStep = Callable[..., "TensorPayload | Deferred | Queued"]
#: (memory class, stage class, ...) -> the fused step of that pair.
FUSED_STEPS: dict[tuple[type, ...], FusedStep] = {}


def find_fused_step(memory: Memory, compressor: Compressor) -> FusedStep | None:
    """The fused step of the nearest registered (memory class, stage classes) key, or ``None``."""
    classes = [type(memory).__mro__, *(type(stage).__mro__ for stage in compressor.stages)]
    return next((FUSED_STEPS[key] for key in product(*classes) if key in FUSED_STEPS), None)


def fused_send(memory, compressor, tensor: torch.Tensor, name: str, *,
               backend: str | None = None) -> TensorPayload | None:
    """Fused ``v = memory.compensate(tensor, name); p = compressor.compress(v, name); memory.update(v, name, p)``;
    returns ``p``, or ``None`` if the pair has no fused path or ``tensor`` takes the torch backend."""
    batch = FusedBatch(memory, compressor, backend=backend)
    return batch.finish()[name] if batch.add(name, tensor) else None


def fused_compress_group(compressor: Compressor, tensors: Mapping[str, torch.Tensor], *,
                         backend: str | None = None,
                         inputs: Mapping[str, torch.Tensor] | None = None) -> dict[str, TensorPayload] | None:
    """``compressor.compress_group(tensors, inputs)`` of a ``sparsifier+quantizer`` composition with the quantizer run
    by its kernel (``quantize_all``: one launch for every non-empty payload, no host synchronisation): the sparsifier's
    own joint selection, and for round-to-nearest the reference's codes and scales; stochastic rounding takes a seed
    from the quantizer's generator (same distribution, other stream). ``None`` (nothing done) when the tensors take the
    torch backend or the compressor is not such a composition (the caller runs ``compress_group``)."""
    stages = compressor.stages
    first = next(iter(tensors.values()), None)
    if len(stages) != 2 or first is None or resolve(first, backend) != "triton" or not has_kernel(stages[1]):
        return None
    sparsifier, quantizer = stages
    out = sparsifier.compress_group(tensors, inputs)
    kept = [name for name, p in out.items() if not p.is_dense and p.nnz]
    coded, _ = quantize_all(quantizer, [out[n].values.data.contiguous() for n in kept], backend=backend)
    for name, values in zip(kept, coded, strict=True):
        out[name] = TensorPayload(out[name].shape, values, out[name].indices)
    return out


class FusedBatch:
    """Fused send steps of many tensors with one host read in all: ``add`` launches each tensor's step (in call
    order: the samplers' draws are the reference's), ``finish`` reads every pending count at once and returns
    the payloads by name. Each tensor's payload and state are what ``fused_send`` gives it alone."""

    def __init__(self, memory, compressor, *, backend: str | None = None) -> None:
        self.memory, self.compressor, self.backend = memory, compressor, backend
        self.step = find_fused_step(memory, compressor)
        self.sent: dict[str, TensorPayload | Deferred | Queued] = {}
        self.included: list[PendingStep[Mapping[str, TensorPayload]]] = []

    def include(self, step: PendingStep[Mapping[str, TensorPayload]]) -> None:
        """Finish ``step`` (a started step of several tensors: ``fedcomp.kernels.group.start_group_send``) with the
        batch's one host read; the payloads it gives by name join ``finish``'s."""
        self.included.append(step)

    def add(self, name: str, tensor: torch.Tensor) -> bool:
        """Start the fused step of ``tensor``; False (nothing done) when it has none (see ``fused_send``)."""
        if self.step is None or resolve(tensor, self.backend) != "triton":
            return False
        x = tensor.detach() if tensor.requires_grad else tensor  # a view op only where autograd needs one
        if x.dtype != torch.float32 or not x.is_contiguous():
            x = x.float().contiguous()
        state = self.memory.step_state(name, x)
        if state is None:
            return False
        self.sent[name] = self.step(state, x, name, self.backend, *self.compressor.stages)
        return True

    def finish(self) -> dict[str, TensorPayload]:
        """The payloads of every added tensor and included step (one host read of the pending readouts); the batch
        is emptied."""
        deferred = [(n, d) for n, d in self.sent.items() if isinstance(d, Deferred)]
        started = start_dgc_steps([d.plan for _, d in deferred])
        reads = read_all(started + self.included)
        steps = [s.finish(read) for s, read in zip(started, reads, strict=False)]
        out = dict(self.sent)
        for (name, d), step in zip(deferred, steps, strict=True):
            out[name] = d.finish(step)
        for group in _by_quantizer((n, d) for n, d in deferred if d.quantizer is not None):
            self._code(out, group)
        for group in _by_quantizer((n, q) for n, q in out.items() if isinstance(q, Queued)):
            self._code_queued(out, group)
        for step, read in zip(self.included, reads[len(deferred):], strict=True):  # after the coding above: the
            out.update(step.finish(read))  # quantizer's draws in the order of the steps one by one
        self.sent, self.included = {}, []
        return out  # type: ignore[return-value]

    def _code(self, out: dict, group: list[tuple[str, Deferred]]) -> None:
        """Code the sent values of ``group`` (one quantizer) at once; each velocity keeps its values' error."""
        payloads = [out[name] for name, _ in group]
        values, errors = quantize_all(group[0][1].quantizer, [p.values.data for p in payloads], backend=self.backend)
        # each v keeps the quantization error of its sent values
        put_many([d.velocity for _, d in group], [p.indices for p in payloads], errors, backend=self.backend)
        for (name, _), p, v in zip(group, payloads, values, strict=True):
            out[name] = TensorPayload(p.shape, v, p.indices)

    def _code_queued(self, out: dict, group: list[tuple[str, Queued]]) -> None:
        """Code the queued tensors of ``group`` (one quantizer) at once; each residual keeps its coding error."""
        values, _ = quantize_all(group[0][1].quantizer, [q.x for _, q in group], [q.residual for _, q in group],
                                 backend=self.backend)
        for (name, q), v in zip(group, values, strict=True):
            out[name] = TensorPayload(tuple(q.x.shape), v)


def _by_quantizer(items: Iterable[tuple[str, Deferred | Queued]]) -> list[list[tuple[str, Deferred | Queued]]]:
    """``items`` grouped by their quantizer (the same object), in first-seen order."""
    groups: dict[int, list] = {}
    for name, item in items:
        groups.setdefault(id(item.quantizer), []).append((name, item))
    return list(groups.values())


def _rule_options(rule) -> dict:
    """``asdict(rule)`` (``{}`` for ``None``), made once per hashable rule (a memory's frozen config; ``asdict``
    costs microseconds a tensor). The dict may be shared: read it, do not change it."""
    if rule is None:
        return {}
    try:
        return _hashable_rule_options(rule)
    except TypeError:  # a rule that is not hashable
        return asdict(rule)


@functools.lru_cache(maxsize=64)
def _hashable_rule_options(rule) -> dict:
    return asdict(rule)


def _dgc_send(state: StepState, g: torch.Tensor, name: str, backend: str | None, sparsifier: DGC,
              quantizer: Quantizer | None = None) -> Deferred:
    """DGC sparsifier with DGCMemory (momentum state and rule) or ResidualMemory (plain error feedback, no
    momentum), then optionally a quantizer of the sent values (their error stays in the velocity)."""
    cfg = sparsifier.config
    dense = sparsifier.sends_dense(g)
    planned = plan_dgc_step(
        g, state.momentum, state.velocity, k=max(1, round(sparsifier.density_for(name) * g.numel())), dense=dense,
        generator=sparsifier.generator, sample_rate=cfg.sample_rate, min_samples=cfg.min_samples,
        max_iters=cfg.max_iters, backend=backend, **_rule_options(state.rule),
    )

    def finish(step: DGCStep) -> TensorPayload:
        return step.payload(tuple(g.shape))

    # the batch codes the sent values (FusedBatch._code); dense tensors stay fp32, as Composed sends them
    return Deferred(planned, finish, None if dense else quantizer, state.velocity)


def _quantize_send(state: StepState, x: torch.Tensor, name: str, backend: str | None,
                   quantizer: Quantizer) -> Queued:
    """Plain error feedback + a quantizer: code ``x + e``, keep the coding error in ``e`` (with the batch's
    other tensors: ``FusedBatch``)."""
    del name, backend
    return Queued(x, state.velocity, quantizer)


for _memory in (DGCMemory, ResidualMemory):
    FUSED_STEPS[(_memory, DGC)] = _dgc_send
    for _quantizer in QUANT_SPECS:
        FUSED_STEPS[(_memory, DGC, _quantizer)] = _dgc_send
for _quantizer in QUANT_SPECS:
    FUSED_STEPS[(ResidualMemory, _quantizer)] = _quantize_send

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

    FUSED_STEPS[(ResidualMemory, SignQuantizer)](state, x, name, backend, quantizer) -> TensorPayload

The compressor's generator draws the sample start exactly as the reference does, so sparse indices match the
reference pipeline. Stochastic rounding takes a seed from the quantizer's generator (same distribution, other
stream). A DGC tensor's first step starts from zero state (``u = m * 0 + g``), which equals the reference's
``u = g`` (tests/test_kernels.py checks the whole step sequence).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict
from itertools import product

import torch

from fedcomp.compressors.base import Compressor, Quantizer
from fedcomp.compressors.dgc import DGC
from fedcomp.kernels._backend import resolve
from fedcomp.kernels.dgc import fused_dgc_step
from fedcomp.kernels.quant import QUANT_SPECS, ef_quantize
from fedcomp.memory.base import Memory, StepState
from fedcomp.memory.dgc import DGCMemory
from fedcomp.memory.residual import ResidualMemory
from fedcomp.payload import TensorPayload

#: ``step(state, tensor, name, backend, *stages) -> TensorPayload``; ``tensor`` is contiguous fp32.
FusedStep = Callable[..., TensorPayload]
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
    if resolve(tensor, backend) != "triton":
        return None
    step = find_fused_step(memory, compressor)
    if step is None:
        return None
    x = tensor.detach()
    if x.dtype != torch.float32 or not x.is_contiguous():
        x = x.float().contiguous()
    state = memory.step_state(name, x)
    if state is None:
        return None
    return step(state, x, name, backend, *compressor.stages)


def _dgc_send(state: StepState, g: torch.Tensor, name: str, backend: str | None, sparsifier: DGC,
              quantizer: Quantizer | None = None) -> TensorPayload:
    """DGC sparsifier with DGCMemory (momentum state and rule) or ResidualMemory (plain error feedback, no
    momentum), then optionally a quantizer of the sent values (their error stays in the velocity)."""
    cfg = sparsifier.config
    dense = sparsifier.sends_dense(g)
    step = fused_dgc_step(
        g, state.momentum, state.velocity, k=max(1, round(sparsifier.density_for(name) * g.numel())), dense=dense,
        generator=sparsifier.generator, sample_rate=cfg.sample_rate, min_samples=cfg.min_samples,
        max_iters=cfg.max_iters, backend=backend, **(asdict(state.rule) if state.rule is not None else {}),
    )
    payload = step.payload(tuple(g.shape))
    if quantizer is None or dense:
        return payload
    err = torch.zeros_like(step.values)
    q = ef_quantize(quantizer, step.values, err, name=name, backend=backend)
    state.velocity.view(-1).index_copy_(0, step.indices, err)  # v keeps the quantization error of the sent values
    return TensorPayload(payload.shape, q.values, step.indices)


def _quantize_send(state: StepState, x: torch.Tensor, name: str, backend: str | None,
                   quantizer: Quantizer) -> TensorPayload:
    """Plain error feedback + a quantizer: code ``x + e``, keep the coding error in ``e``."""
    q = ef_quantize(quantizer, x, state.velocity, name=name, backend=backend)
    return TensorPayload(tuple(x.shape), q.values)


for _memory in (DGCMemory, ResidualMemory):
    FUSED_STEPS[(_memory, DGC)] = _dgc_send
    for _quantizer in QUANT_SPECS:
        FUSED_STEPS[(_memory, DGC, _quantizer)] = _dgc_send
for _quantizer in QUANT_SPECS:
    FUSED_STEPS[(ResidualMemory, _quantizer)] = _quantize_send

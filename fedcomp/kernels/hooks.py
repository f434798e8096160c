"""Drop-in fused send step for a pipeline: one call in place of ``compensate -> compress -> update``.

``fused_send(memory, compressor, tensor, name)`` returns the payload the three reference calls would return and
leaves the memory in the state they would leave it, using the fused kernels, or ``None`` when no fused path
applies (CPU tensors, or a memory/compressor pair without a kernel): the caller then runs the reference calls.
Supported pairs: ``DGCMemory`` or ``ResidualMemory`` + ``DGC`` (optionally composed with a quantizer:
``dgc+int8``), and ``ResidualMemory`` + a quantizer with a kernel (``int8``, ``int4``, ``qsgd``, ``sign``).

The memory's state tensors are used in place (created on the tensor's device at a name's first step), and the
compressor's generator draws the sample start exactly as the reference does, so sparse indices match the
reference pipeline. Stochastic rounding takes a seed from the quantizer's generator (same distribution, other
stream). A DGC tensor's first step starts from zero state (``u = m * 0 + g``), which equals the reference's
``u = g`` (tests/test_kernels.py checks the whole step sequence).
"""

from __future__ import annotations

import torch

from fedcomp.kernels._backend import resolve
from fedcomp.kernels.dgc import fused_dgc_step
from fedcomp.kernels.quant import ef_quantize, quant_spec
from fedcomp.payload import TensorPayload, Values


def _quantizer_kernel_ok(quantizer) -> bool:
    try:
        quant_spec(quantizer)
    except TypeError:
        return False
    return True


def fused_send(memory, compressor, tensor: torch.Tensor, name: str, *,
               backend: str | None = None) -> TensorPayload | None:
    """Fused ``v = memory.compensate(tensor, name); p = compressor.compress(v, name); memory.update(v, name, p)``;
    returns ``p``, or ``None`` if the pair has no fused path or ``tensor`` takes the torch backend."""
    from fedcomp.compressors.base import Composed, Quantizer
    from fedcomp.compressors.dgc import DGC
    from fedcomp.memory.dgc import DGCMemory
    from fedcomp.memory.residual import ResidualMemory

    if resolve(tensor, backend) != "triton":
        return None
    sparsifier, quantizer = compressor, None
    if isinstance(compressor, Composed):
        sparsifier, quantizer = compressor.sparsifier, compressor.quantizer
        if not _quantizer_kernel_ok(quantizer):
            return None
    if isinstance(memory, (DGCMemory, ResidualMemory)) and isinstance(sparsifier, DGC):
        return _dgc_send(memory, sparsifier, quantizer, tensor, name, backend)
    if isinstance(memory, ResidualMemory) and isinstance(compressor, Quantizer) and _quantizer_kernel_ok(compressor):
        return _residual_send(memory, compressor, tensor, name, backend)
    return None


def _dgc_send(memory, sparsifier, quantizer, tensor, name, backend) -> TensorPayload:
    """DGC sparsifier with DGCMemory (momentum state) or ResidualMemory (plain error feedback, ``u=None``)."""
    from fedcomp.memory.dgc import DGCMemory

    g = tensor.detach()
    if g.dtype != torch.float32 or not g.is_contiguous():
        g = g.float().contiguous()
    if isinstance(memory, DGCMemory):
        if name not in memory.momentums:
            memory.momentums[name] = torch.zeros_like(g)
            memory.velocities[name] = torch.zeros_like(g)
        u, v = memory.momentums[name], memory.velocities[name]
        cfg = memory.config
        mem_opts = dict(momentum=cfg.momentum, nesterov=cfg.nesterov, masking=cfg.masking,
                        clip_norm=cfg.clip_norm, clip_workers=cfg.clip_workers)
    else:
        u, mem_opts = None, {}
        v = memory.errors.get(name)
        if v is None:
            v = memory.errors[name] = torch.zeros_like(g)
    scfg = sparsifier.config
    dense = sparsifier.sends_dense(g)
    k = max(1, round(sparsifier.density_for(name) * g.numel()))
    step = fused_dgc_step(
        g, u, v, k=k, dense=dense, generator=sparsifier.generator, sample_rate=scfg.sample_rate,
        min_samples=scfg.min_samples, max_iters=scfg.max_iters, backend=backend, **mem_opts,
    )
    payload = step.payload(tuple(g.shape))
    if quantizer is None or dense:
        return payload
    err = torch.zeros_like(step.values)
    q = ef_quantize(quantizer, step.values, err, name=name, backend=backend)
    v.view(-1).index_copy_(0, step.indices, err)  # v keeps the quantization error of the sent values
    return TensorPayload(payload.shape, q.values, step.indices)


def _residual_send(memory, quantizer, tensor, name, backend) -> TensorPayload:
    x = tensor.detach()
    if x.dtype != torch.float32 or not x.is_contiguous():
        x = x.float().contiguous()
    e = memory.errors.get(name)
    if e is None:
        e = memory.errors[name] = torch.zeros_like(x)
    q = ef_quantize(quantizer, x, e, name=name, backend=backend)
    values: Values = q.values
    return TensorPayload(tuple(x.shape), values)

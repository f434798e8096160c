"""Server-side decode + weighted scatter-add of one payload into a dense float32 buffer.

``scatter_add(target, payload, weight)`` has the contract of ``TensorPayload.add_to``: ``target += weight *
decompressed`` in O(nnz) for sparse payloads, any value coding (fp32/fp16/bf16 values or int8 codes with
per-block scales: dequantized in the kernel, never materialised). CUDA targets take the Triton kernel (one
pass over the payload: reads 8 B index + 1-4 B value per kept element, one fp32 atomic add each; duplicate
indices add twice, like ``index_add_``), CPU targets ``add_to`` itself. Same rounding as the reference:
sparse ``t + (w * v)``, dense ``fma(v, w, t)``.
"""

from __future__ import annotations

import math

import torch

from fedcomp.kernels._backend import resolve
from fedcomp.payload import TensorPayload


def scatter_add(target: torch.Tensor, payload: TensorPayload, weight: float = 1.0, *,
                backend: str | None = None) -> None:
    """``target += weight * payload.to_dense()`` (``target``: contiguous float32 with ``payload.numel``
    elements, on any device; a payload decoded on the CPU is moved to ``target``'s device). Indices are trusted:
    validate before (the wire decoder and ``SparseAccumulator`` do)."""
    if target.dtype != torch.float32 or not target.is_contiguous() or target.numel() != payload.numel:
        raise ValueError("target must be a contiguous float32 tensor with the payload's numel")
    if resolve(target, backend) == "torch":
        payload.add_to(target, weight)
        return
    from fedcomp.kernels import _triton_scatter as K

    v = payload.values
    nnz = len(v)
    if nnz == 0:
        return
    dev = target.device
    data = v.data.to(dev)
    indices = None if payload.indices is None else payload.indices.to(dev)
    if v.coding.is_float and data.dtype != torch.float32:
        data = data.float()  # fp16/bf16 -> fp32 is exact (and bf16 math is unreliable in the interpreter)
    quant = not v.coding.is_float
    flat = target.view(-1)
    K.scatter_add_kernel[(math.ceil(nnz / K.BLOCK),)](
        flat, flat if indices is None else indices, data.contiguous(),
        v.scales.to(dev) if quant else data, nnz, v.block if quant else 1, float(weight),
        SPARSE=indices is not None, QUANT=quant, BLOCK=K.BLOCK, num_warps=K.NUM_WARPS,
        enable_fp_fusion=False,
    )

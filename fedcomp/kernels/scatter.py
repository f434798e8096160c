"""Server-side decode + weighted scatter-add of one payload into a dense float32 buffer, and a client's
``index_copy_`` into many tensors at once (``put_many``).

``scatter_add(target, payload, weight)`` has the contract of ``TensorPayload.add_to``: ``target += weight *
decompressed`` in O(nnz) for sparse payloads, any value coding (fp32/fp16/bf16 values or int8 codes with
per-block scales: dequantized in the kernel, never materialised). CUDA targets take the Triton kernel (one
pass over the payload: reads 8 B index + 1-4 B value per kept element, one fp32 atomic add each; duplicate
indices add twice, like ``index_add_``), CPU targets ``add_to`` itself. Same rounding as the reference:
sparse ``t + (w * v)``, dense ``fma(v, w, t)``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from fedcomp.kernels._backend import resolve, to_device
from fedcomp.kernels._chunks import table
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


def put_many(targets: Sequence[torch.Tensor], positions: Sequence[torch.Tensor], values: Sequence[torch.Tensor], *,
             backend: str | None = None) -> None:
    """``targets[i].view(-1).index_copy_(0, positions[i], values[i])`` for every ``i`` (positions unique in each
    target). On the Triton path one launch for all (a table of the tensors' addresses copied to the device once):
    contiguous float32 targets and values, int64 positions with unit stride, one device; otherwise, or for fewer
    than two tensors, one ``index_copy_`` each. Positions are trusted (a DGC step's own).

    >>> t = [torch.zeros(4), torch.zeros(3)]
    >>> put_many(t, [torch.tensor([1, 3]), torch.tensor([0])], [torch.ones(2), torch.full((1,), 2.0)])
    >>> t[0].tolist(), t[1].tolist()
    ([0.0, 1.0, 0.0, 1.0], [2.0, 0.0, 0.0])
    """
    if len(targets) < 2 or not _put_many_takes(targets, positions, values, backend):
        for t, p, v in zip(targets, positions, values, strict=True):
            t.view(-1).index_copy_(0, p, v)
        return
    from fedcomp.kernels import _triton_scatter as K

    counts = [p.numel() for p in positions]
    tab, programs = table([[t.data_ptr() for t in targets], [p.data_ptr() for p in positions],
                           [v.data_ptr() for v in values], counts], counts, K.BLOCK)
    if programs:
        K.put_many_kernel[(programs,)](to_device(torch.from_numpy(tab), targets[0].device), len(targets), programs,
                                       BLOCK=K.BLOCK, num_warps=K.NUM_WARPS)


def _put_many_takes(targets, positions, values, backend: str | None) -> bool:
    """Whether ``put_many``'s kernel takes these tensors (see ``put_many``)."""
    dev = targets[0].device
    if resolve(targets[0], backend) != "triton":
        return False
    for t, p, v in zip(targets, positions, values, strict=True):
        if t.dtype != torch.float32 or v.dtype != torch.float32 or p.dtype != torch.int64:
            return False
        if not (t.is_contiguous() and v.is_contiguous() and (p.numel() < 2 or p.stride(0) == 1)):
            return False
        if t.device != dev or p.device != dev or v.device != dev or p.numel() != v.numel():
            return False
    return True

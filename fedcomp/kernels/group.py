"""The small tensors' send step over flat state: the group of a sparsifier's ``small="group"`` policy
(``Pipeline.grouped``) compensated, selected and updated by a few ops on the whole group instead of a few per tensor.

``group_send(memory, compressor, tensors)`` returns what the reference steps return (per name ``compensate``, one
``compress_group``, per name ``update``) and leaves the memory as they leave it, bitwise, or ``None`` when it does not
apply (the torch backend, a name's first step, clipping, a memory without group state, a compressor whose
group step is not the sparsifier's own or whose quantizer has no kernel): the caller then runs the reference steps.
The memory keeps the group's state as views of flat buffers (``Memory.group_state``), so one send is::

    g = cat(tensors)                             # 1 op
    u <- m u + g; v <- v + u                     # 2 ops on the flat buffers (plain error feedback: v <- v + g)
    idx = sparsifier.select_group(v, counts)     # the joint selection, global positions in v
    v[idx] -= sent (quantizer: v[idx] = coding error, by one launch for every tensor); u[idx] <- 0   # 2 ops

Every op is elementwise on what the per-tensor steps compute (the same fma use as ``fedcomp.memory.dgc_math``) or
the same selection on the same values, so payloads and state are bitwise the reference's (tests/test_group_send.py).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from fedcomp.compressors.base import Composed, Compressor, Quantizer, Sparsifier, split_group
from fedcomp.kernels._backend import resolve
from fedcomp.kernels.quant import has_kernel, quantize_all
from fedcomp.memory.base import Memory
from fedcomp.memory.dgc_math import accumulate_
from fedcomp.payload import TensorPayload


def group_stages(compressor: Compressor) -> tuple[Sparsifier, Quantizer | None] | None:
    """The sparsifier (and the quantizer with a kernel) of a compressor whose group step is ``Sparsifier``'s own
    (``Composed``: then each kept payload quantized), else ``None``."""
    stages = compressor.stages
    sparsifier = stages[0]
    if not isinstance(sparsifier, Sparsifier) or type(sparsifier).compress_group is not Sparsifier.compress_group:
        return None
    if len(stages) == 1:
        return sparsifier, None
    quantizer = stages[1]
    own = isinstance(compressor, Composed) and type(compressor).compress_group is Composed.compress_group
    if len(stages) != 2 or not own or not isinstance(quantizer, Quantizer) or not has_kernel(quantizer):
        return None
    return sparsifier, quantizer


def group_send(memory: Memory, compressor: Compressor, tensors: Mapping[str, torch.Tensor], *,
               backend: str | None = None) -> dict[str, TensorPayload] | None:
    """The reference ``compensate`` (each) -> ``compress_group`` -> ``update`` (each) of ``tensors`` (the group, in
    spec order) on the memory's flat group state; ``None`` (nothing done) where it does not apply (module doc)."""
    first = next(iter(tensors.values()), None)
    stages = group_stages(compressor)
    if first is None or stages is None or resolve(first, backend) != "triton":
        return None
    state = memory.group_state(tuple(tensors))
    rule = state.rule if state is not None else None
    if state is None or (rule is not None and rule.clip_norm is not None):
        return None
    v, u = state.velocity, state.momentum
    if {t.device for t in tensors.values()} != {v.device}:
        return None
    g = torch.cat([t.detach().reshape(-1).float() for t in tensors.values()])
    if g.numel() != v.numel():
        return None
    if u is None:
        v.add_(g)  # ResidualMemory.compensate: x + e
    else:
        accumulate_(g, u, v, momentum=rule.momentum, nesterov=rule.nesterov)
    sparsifier, quantizer = stages
    idx = sparsifier.select_group(v, [t.numel() for t in tensors.values()])
    sent = v[idx]
    out = split_group({n: tuple(t.shape) for n, t in tensors.items()}, idx, sent)
    kept = [n for n, p in out.items() if p.nnz] if quantizer is not None else []
    if kept:  # Composed.compress_group codes each non-empty payload; v keeps the coding error of what was sent
        coded, errors = quantize_all(quantizer, [out[n].values.data for n in kept], backend=backend)
        for name, values in zip(kept, coded, strict=True):
            out[name] = TensorPayload(out[name].shape, values, out[name].indices)
        v.index_copy_(0, idx, torch.cat(errors))
    else:
        v.index_add_(0, idx, sent, alpha=-1.0)  # TensorPayload.add_to(v, -1.0) of the fp32 payloads
    if u is not None and rule.masking:
        u.index_fill_(0, idx, 0.0)  # momentum factor masking (the group's payloads are all sparse)
    return out

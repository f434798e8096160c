"""The small tensors' send step over flat state: the group of a sparsifier's ``small="group"`` policy
(``Pipeline.grouped``) compensated, selected and updated by a few ops on the whole group instead of a few per tensor.

``group_send(memory, compressor, tensors)`` returns what the reference steps return (per name ``compensate``, one
``compress_group``, per name ``update``) and leaves the memory as they leave it, bitwise, or ``None`` when it does not
apply (the torch backend, a name's first step, clipping, a memory without group state, a compressor whose
group step is not the sparsifier's own or whose quantizer has no kernel): the caller then runs the reference steps.
The memory keeps the group's state as views of flat buffers (``Memory.group_state``), so one send is::

    g = cat(tensors)                             # 1 op
    u <- m u + g; v <- v + u                     # 2 ops on the flat buffers (plain error feedback: v <- v + g)
    idx = sparsifier.select_group(v, counts, g)  # the joint selection (keys: v over each tensor's RMS of g)
    v[idx] -= sent (quantizer: v[idx] = coding error, by one launch for every tensor); u[idx] <- 0   # 2 ops

Every op is elementwise on what the per-tensor steps compute (the same fma use as ``fedcomp.memory.dgc_math``) or
the same selection on the same values, so payloads and state are bitwise the reference's (tests/test_group_send.py).

The joint selection of a sparsifier in ``GROUP_SELECTS`` (DGC's sampled threshold) runs on the device
(``fedcomp.kernels.dgc.start_select``) and needs no host read of its own: ``start_group_send`` launches the step and
returns a ``PendingStep`` whose readout (the selected count, the threshold's zero test, each tensor's share) is read
with the other steps' (``FusedBatch.include``: one host read per send). Other sparsifiers select by
``select_group`` (its own host reads).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch

from fedcomp.compressors.base import (
    Composed,
    Compressor,
    Quantizer,
    Sparsifier,
    group_offsets,
    split_group,
)
from fedcomp.compressors.dgc import DGC
from fedcomp.kernels._backend import resolve
from fedcomp.kernels.dgc import start_select
from fedcomp.kernels.pending import PendingStep
from fedcomp.kernels.quant import has_kernel, quantize_all
from fedcomp.memory.base import Memory
from fedcomp.memory.dgc_math import accumulate_
from fedcomp.payload import TensorPayload, flat

#: The started joint selection of ``select_group``'s keys: ``(sparsifier, keys, k, cuts) -> PendingStep`` of
#: ``(indices, per-tensor cut points or None)``.
GroupSelect = Callable[[Sparsifier, torch.Tensor, int, torch.Tensor], PendingStep]
#: Sparsifier class -> its device joint selection (the nearest registered class whose ``select`` it keeps).
GROUP_SELECTS: dict[type, GroupSelect] = {}


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


def find_group_select(sparsifier: Sparsifier) -> GroupSelect | None:
    """The ``GROUP_SELECTS`` entry of the nearest registered class of ``sparsifier`` whose ``select`` it does not
    override (an override selects otherwise), else ``None``."""
    cls = next((c for c in type(sparsifier).__mro__ if c in GROUP_SELECTS), None)
    if cls is None or type(sparsifier).select is not cls.select:
        return None
    return GROUP_SELECTS[cls]


def group_send(memory: Memory, compressor: Compressor, tensors: Mapping[str, torch.Tensor], *,
               backend: str | None = None) -> dict[str, TensorPayload] | None:
    """The reference ``compensate`` (each) -> ``compress_group`` -> ``update`` (each) of ``tensors`` (the group, in
    spec order) on the memory's flat group state; ``None`` (nothing done) where it does not apply (module doc).
    ``start_group_send(...).resolve()``."""
    started = start_group_send(memory, compressor, tensors, backend=backend)
    return None if started is None else started.resolve()


def start_group_send(memory: Memory, compressor: Compressor, tensors: Mapping[str, torch.Tensor], *,
                     backend: str | None = None) -> PendingStep[dict[str, TensorPayload]] | None:
    """``group_send`` started: the compensation and the joint selection launched (the sample drawn now), the rest
    in the returned step's ``finish`` once its readout is on the host; ``None`` (nothing done) where it does not
    apply."""
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
    g = torch.cat([flat(t).float() for t in tensors.values()])
    if g.numel() != v.numel():
        return None
    if u is None:
        v.add_(g)  # ResidualMemory.compensate: x + e
    else:
        accumulate_(g, u, v, momentum=rule.momentum, nesterov=rule.nesterov)
    sparsifier, quantizer = stages
    shapes = {n: tuple(t.shape) for n, t in tensors.items()}
    selected = _start_selection(sparsifier, v, shapes, g)

    def finish(read: list[int]) -> dict[str, TensorPayload]:
        idx, cuts = selected.finish(read)
        sent = v[idx]
        out = split_group(shapes, idx, sent, cuts)
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

    return PendingStep(selected.readout, finish)


def _start_selection(sparsifier: Sparsifier, v: torch.Tensor, shapes: Mapping[str, tuple[int, ...]],
                     g: torch.Tensor) -> PendingStep:
    """``sparsifier.select_group`` of the flat velocity ``v`` scaled by the flat inputs ``g``, started: on the device
    where ``GROUP_SELECTS`` has the sparsifier (with each tensor's cut point in the readout), else at once by
    ``select_group``."""
    start = find_group_select(sparsifier)
    counts = _sizes(shapes)
    if start is None or v.numel() == 0:
        return PendingStep.done((sparsifier.select_group(v, counts, g), None))
    keys, k = sparsifier.group_keys(v, counts, g)
    cuts = torch.tensor(group_offsets(shapes.values()), dtype=torch.int64).to(v.device, non_blocking=True)
    return start(sparsifier, keys, k, cuts)


def _sizes(shapes: Mapping[str, tuple[int, ...]]) -> list[int]:
    """Elements of each tensor."""
    offsets = group_offsets(shapes.values())
    return [b - a for a, b in zip(offsets, offsets[1:], strict=False)]


def _dgc_select(sparsifier: DGC, keys: torch.Tensor, k: int, cuts: torch.Tensor) -> PendingStep:
    """``DGC.select`` (``fedcomp.compressors.selection.select``) of the group's keys, started on the device."""
    cfg = sparsifier.config
    started = start_select(keys, k, generator=sparsifier.generator, sample_rate=cfg.sample_rate,
                           min_samples=cfg.min_samples, max_iters=cfg.max_iters, cuts=cuts)

    def finish(read: list[int]) -> tuple[torch.Tensor, list[int] | None]:
        step, below = started.finish(read)
        return step.indices, below

    return PendingStep(started.readout, finish)


GROUP_SELECTS[DGC] = _dgc_select

"""Many tensors' DGC steps launched together: one launch per pass for every tensor of a send, not one per tensor.

``start_dgc_steps(plans)`` starts planned steps (``fedcomp.kernels.dgc.plan_dgc_step``: checked, sample start drawn).
The sampled-threshold steps of the Triton path that share a rule (momentum, Nesterov, masking, momentum state,
clipping) and a device, their state 16-byte aligned, start as one batch of ``T`` tensors:

1. with clipping, each tensor's clip scale (as its own step computes it), then one sample kernel: every tensor's
   strided sample of the updated ``|v|``, one row each of a ``T x m_max`` matrix padded with -1;
2. one ``torch.topk`` over the rows (as deep as the deepest tensor needs) and one ``torch.take`` of each tensor's
   threshold;
3. one fused kernel: every tensor's state update and first-pass marks;
4. one ``torch.cumsum`` of all block counts and one place kernel: each tensor's candidates, in index order, into its
   own segment of one buffer, its readout ``[count, thr == 0]`` beside the others'.

The kernels find each program's tensor in a small int64 table (``fedcomp.kernels._triton_dgc_multi``), copied to
the device once per batch. Each tensor then finishes alone (its ``PendingStep``: its readout, the selection rules
over views of its buffers); a retry or an exact top-k runs the one-tensor kernels. Every tensor's threshold, state,
indices and values are bitwise what its own ``start_planned`` gives: the same arithmetic (shared jit helpers), the
same sample values, the same rules. Other steps (dense, ``k`` of 0 or all, a fixed threshold, the torch backend,
a lone tensor, a sample so much larger than the batch's others that padding them to it would cost more than
``PADDING`` times the samples) start one by one; past ``MAX_TENSORS`` compatible steps, a further batch starts.
Example::

    plans = [plan_dgc_step(g[n], u[n], v[n], k=k[n], generator=gen) for n in names]   # draws in order
    sent = resolve_all(start_dgc_steps(plans))   # [DGCStep, ...]: what the steps one by one would send
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence

import torch

from fedcomp.kernels._dgc_buffers import Buffers, starts
from fedcomp.kernels._dgc_select import DGCStep, SampleRanks, TritonPass, in_band, read_pair, sample_depth, select_rules
from fedcomp.kernels.dgc import DGCPlan, start_planned
from fedcomp.kernels.pending import PendingStep
from fedcomp.memory.dgc_math import clip_scale_tensor


def start_dgc_steps(plans: Sequence[DGCPlan]) -> list[PendingStep]:
    """Every planned step started (module doc): the compatible sampled-threshold steps as batches, the others one by
    one; the returned steps in the order of ``plans``."""
    batches: dict[tuple, list[int]] = {}
    for i, plan in enumerate(plans):
        key = _batch_key(plan)
        if key is not None:
            batches.setdefault(key, []).append(i)
    out: dict[int, PendingStep] = {}
    for key_members in batches.values():
        for at in range(0, len(key_members), MAX_TENSORS):
            members = key_members[at: at + MAX_TENSORS]
            members = _fitting([plans[i].sample[2] for i in members], [plans[i].g.numel() for i in members], members)
            if len(members) > 1 and sum(plans[i].g.numel() for i in members) < 2**31 - 1:
                out.update(zip(members, _start_batch([plans[i] for i in members]), strict=True))
    return [out[i] if i in out else start_planned(plan) for i, plan in enumerate(plans)]


#: Tensors in one batch at most (more start as further batches): a kernel program finds its tensor by one vector
#: compare over a power of two at least the batch's tensors (``_triton_dgc_multi._tensor_of``), so this bounds its
#: registers and the kernels' variants (16 to 1,024 entries: seven).
MAX_TENSORS = 1024

#: The padded sample matrix of a batch may hold this many times its samples, and no more values than the batch's
#: tensors hold; any batch may pad to ``FLOOR`` values (16 MiB of float32), so small models batch whatever they sample.
PADDING = 8
FLOOR = 2**22


def _fitting(counts: Sequence[int], sizes: Sequence[int], members: Sequence[int]) -> list[int]:
    """The members (with sample ``counts`` of tensors of ``sizes``) a batch takes: those of the largest samples start
    alone while the batch's ``T x m_max`` sample matrix would hold more than ``PADDING`` times its samples or more
    than its tensors' elements (a run's ``sample_rate`` cannot make it outgrow the state), and more than ``FLOOR``."""
    order = sorted(range(len(members)), key=counts.__getitem__)
    total, elements = sum(counts), sum(sizes)
    while len(order) > 1 and len(order) * counts[order[-1]] > max(min(PADDING * total, elements), FLOOR):
        last = order.pop()
        total, elements = total - counts[last], elements - sizes[last]
    return sorted(members[j] for j in order)


def _batch_key(plan: DGCPlan) -> tuple | None:
    """What steps must share to run in one batch, or ``None`` for a step that starts alone."""
    if plan.sample is None or plan.sample[2] < 1:
        return None
    if any(t is not None and t.data_ptr() % 16 for t in (plan.g, plan.u, plan.v)):
        return None  # the kernels read the state with 16-byte loads
    o = plan.opts
    return plan.g.device, o["momentum"], o["nesterov"], o["masking"], plan.u is None, o["clip"]


def _start_batch(plans: Sequence[DGCPlan]) -> list[PendingStep]:
    """Launch the passes of ``plans`` (one rule, one device) together; each tensor's ``PendingStep``."""
    from fedcomp.kernels import _triton_dgc as K1
    from fedcomp.kernels import _triton_dgc_multi as K

    layout = _Layout(plans, K1.BLOCK)
    first, dev = plans[0], plans[0].g.device
    o = first.opts
    whole = Buffers.carve(layout.capacities, layout.blocks, K1.BLOCK // 32, dev)
    tab = torch.tensor(layout.table(whole.layout[3]), dtype=torch.int64).to(dev, non_blocking=True)
    T, tp = len(plans), max(16, 1 << (len(plans) - 1).bit_length())
    flags = dict(NESTEROV=o["nesterov"], HAS_SCALE=o["clip"] is not None, HAS_U=first.u is not None, TP=tp,
                 BLOCK=K1.BLOCK, num_warps=K1.NUM_WARPS)
    scale = None if o["clip"] is None else torch.cat([clip_scale_tensor(p.g, o["clip"]) for p in plans])
    scales = whole.val if scale is None else scale  # (read only with clipping)
    samples = torch.full((T, layout.row), -1.0, device=dev)
    K.dgc_multi_sample_kernel[(layout.sample_programs,)](tab, T, scales, samples, layout.row, o["momentum"], **flags,
                                                         enable_fp_fusion=False)
    top = torch.topk(samples, layout.depth, dim=1, sorted=True).values
    thr = torch.take(top, tab[K.COLUMNS * T:])
    K.dgc_multi_fused_kernel[(whole.blocks,)](tab, T, scales, thr, whole.bits, whole.counts, o["momentum"], **flags,
                                              enable_fp_fusion=False)
    torch.cumsum(whole.counts, 0, dtype=torch.int32, out=whole.ends)
    K.dgc_multi_place_kernel[(whole.blocks,)](
        tab, T, whole.bits, whole.counts, whole.ends, thr, whole.readout, whole.idx, whole.val, whole.mom,
        MASKING=o["masking"], TP=tp, BLOCK=K1.BLOCK, num_warps=K1.NUM_WARPS,
    )
    pass_opts = {key: o[key] for key in ("momentum", "nesterov", "masking", "dense", "clip")}
    shared = (whole, samples, top, thr, scale, pass_opts)
    return [PendingStep(whole.readout[2 * t: 2 * t + 2],
                        functools.partial(_finish, plan, t, layout.counts[t], layout.ranks[t], shared))
            for t, plan in enumerate(plans)]


def _finish(plan: DGCPlan, t: int, m: int, rank: int, shared: tuple, read: list[int]) -> DGCStep:
    """Batched tensor t's step on its readout: the candidates when in band (the common case, a slice of the shared
    buffer), else the selection rules on views of its segment (``fedcomp.kernels._dgc_select.select_rules``)."""
    whole, samples, top, thr, scale, pass_opts = shared
    c, zero = read_pair(read)
    if in_band(plan.k, c, zero):
        at = whole.slot(t)
        return DGCStep(whole.idx[at: at + c], whole.val[at: at + c], thr[t], 1, False)
    buf = whole.segment(t)
    run = TritonPass(plan.g, plan.u, plan.v, **pass_opts, capacity=buf.capacity, buf=buf,
                     scale=None if scale is None else scale[t: t + 1])
    ranks = SampleRanks(samples[t, :m], m, rank, top[t])
    return select_rules(run, plan.k, ranks, thr[t: t + 1], (c, zero), max(1, plan.sel["max_iters"]))


class _Layout:
    """Where each tensor of a batch sits: its block programs and sample programs (consecutive, in plan order), its
    capacity and buffer slots, its sample's threshold rank and depth; ``table()`` is the kernels' table."""

    def __init__(self, plans: Sequence[DGCPlan], block: int) -> None:
        self.plans = plans
        self.sizes = [p.g.numel() for p in plans]
        self.counts = [p.sample[2] for p in plans]
        self.blocks = [math.ceil(n / block) for n in self.sizes]
        self.sample_blocks = [math.ceil(m / block) for m in self.counts]
        self.sample_programs = sum(self.sample_blocks)
        self.capacities = [p.opts["capacity"] for p in plans]
        self.ranks = [min(m, math.ceil(m * p.k / n)) for p, m, n in zip(plans, self.counts, self.sizes, strict=True)]
        self.row = max(self.counts)
        self.depth = max(sample_depth(m, r) for m, r in zip(self.counts, self.ranks, strict=True))

    def table(self, slots: Sequence[int]) -> list[int]:
        """The kernels' columns (``_triton_dgc_multi``; ``slots``: each tensor's first slot in the carved buffer),
        column-major, then each tensor's threshold position in the ``T x depth`` top values."""
        plans = self.plans
        firsts, sfirsts = starts(self.blocks), starts(self.sample_blocks)
        cols = [
            [p.g.data_ptr() for p in plans],
            [(p.v if p.u is None else p.u).data_ptr() for p in plans],
            [p.v.data_ptr() for p in plans],
            self.sizes,
            firsts,
            [f + b - 1 for f, b in zip(firsts, self.blocks, strict=True)],
            sfirsts,
            [p.sample[0] for p in plans],
            [p.sample[1] for p in plans],
            self.counts,
            list(slots),
            self.capacities,
            [t * self.depth + r - 1 for t, r in enumerate(self.ranks)],
        ]
        return [x for col in cols for x in col]


"""Error-feedback conservation under any stream of gradients, with acks and nacks.

Plain error feedback ("residual" memory):   Σ inputs            == Σ applied + Σ in flight + residual
DGC memory (velocity identity):             Σ inflow into v     == Σ applied + Σ in flight + v
where the inflow of step t is ``u_t`` (Nesterov: ``g_t + m u_t``, ``g_t`` after clipping). "Applied" payloads were
acked; nacked ones went back into the memory with ``restore``. Sums are float64, tolerance 1e-5 of the mass.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import fedcomp
from fedcomp.memory.dgc import DGCMemory

SHAPES = st.lists(
    st.one_of(
        st.tuples(st.integers(1, 40)),  # 1-D: sent dense
        st.tuples(st.integers(1, 12), st.integers(1, 30)),
        st.tuples(st.integers(1, 4), st.integers(1, 5), st.integers(1, 6)),
    ),
    min_size=1,
    max_size=4,
)

RESIDUAL_CASES = ["topk", "randomk", "dgc", "dgc+int8", "topk+int4"]
DGC_CASES = ["dgc", "topk", "dgc+int8"]


def inflow(mem: DGCMemory, g: torch.Tensor, name: str) -> torch.Tensor:
    """What this step added to v, from the documented equations (call right after compensate)."""
    cfg = mem.config
    u = mem.momentum(name).double()
    if not cfg.nesterov:
        return u
    g = g.double()
    if cfg.clip_norm is not None:
        thr = cfg.clip_norm * (cfg.clip_workers**-0.5 if cfg.clip_workers else 1.0)
        norm = float(torch.linalg.vector_norm(g.float()))
        if norm > thr:
            g = g * (thr / norm)
    return g + cfg.momentum * u


def run_stream(compressor, memory, mem_opts, shapes, steps, seed, nack_rate, epochs):
    gen = torch.Generator().manual_seed(seed)
    names = [f"t{i}" for i in range(len(shapes))]
    spec = fedcomp.ModelSpec(tuple(zip(names, map(tuple, shapes), strict=True)))
    opts = {"density": 0.1, "dense_below": 8, **mem_opts}
    if compressor.startswith("dgc"):
        opts["warmup_epochs"] = epochs
    if compressor.startswith(("dgc", "randomk")):
        opts["seed"] = seed % 1000
    pipe = fedcomp.build(compressor, spec, memory=memory, **opts)
    mem, comp = pipe.memory, pipe.compressor
    total_in = {n: torch.zeros(s, dtype=torch.float64) for n, s in spec.entries}
    applied = {n: torch.zeros(s, dtype=torch.float64) for n, s in spec.entries}
    pending: list[dict[str, fedcomp.TensorPayload]] = []
    mass = 0.0
    for t in range(steps):
        comp.set_epoch(t / 2)
        grads = {n: torch.randn(s, generator=gen) * float(torch.rand(1, generator=gen) * 10) for n, s in spec.entries}
        # an all-zero gradient now and then (empty payloads)
        if float(torch.rand(1, generator=gen)) < 0.1:
            grads[names[0]].zero_()
        sent = {}
        for n in names:
            v = mem.compensate(grads[n], n)
            a = inflow(mem, grads[n], n) if isinstance(mem, DGCMemory) else grads[n].double()
            total_in[n] += a
            mass = max(mass, float(a.abs().max()))
            p = comp.compress(v, n)
            mem.update(v, n, p)
            sent[n] = p
        pending.append(sent)
        # settle a random subset of what is in flight: ack (applied) or nack (restored)
        keep = []
        for upd in pending:
            r = float(torch.rand(1, generator=gen))
            if r < nack_rate:
                for n, p in upd.items():
                    mem.restore(n, p)
            elif r < 0.7:
                for n, p in upd.items():
                    applied[n] += p.to_dense().double()
            else:
                keep.append(upd)
        pending = keep
    for n, s in spec.entries:
        in_flight = sum((u[n].to_dense().double() for u in pending), torch.zeros(s, dtype=torch.float64))
        rhs = applied[n] + in_flight + mem.residual(n).double()
        tol = 1e-5 * max(mass * steps, 1e-12)
        err = float((total_in[n] - rhs).abs().max())
        assert err <= tol, f"{n} {s}: conservation error {err:.3g} > {tol:.3g}"


COMMON = dict(
    shapes=SHAPES,
    steps=st.integers(1, 10),
    seed=st.integers(0, 2**31),
    nack_rate=st.sampled_from([0.0, 0.3, 1.0]),
    epochs=st.sampled_from([0, 2]),
)


@pytest.mark.parametrize("compressor", RESIDUAL_CASES)
@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(**COMMON)
def test_residual_memory_conserves(compressor, shapes, steps, seed, nack_rate, epochs):
    run_stream(compressor, "residual", {}, shapes, steps, seed, nack_rate, epochs)


@pytest.mark.parametrize("compressor", DGC_CASES)
@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    **COMMON,
    momentum=st.sampled_from([0.0, 0.5, 0.9]),
    nesterov=st.booleans(),
    masking=st.booleans(),
    clip=st.sampled_from([None, 0.5, 5.0]),
)
def test_dgc_memory_velocity_identity(
    compressor, shapes, steps, seed, nack_rate, epochs, momentum, nesterov, masking, clip
):
    mem_opts = dict(momentum=momentum, nesterov=nesterov, masking=masking, clip_norm=clip, clip_workers=4)
    run_stream(compressor, "dgc", mem_opts, shapes, steps, seed, nack_rate, epochs)


@pytest.mark.parametrize(("compressor", "memory"), [("dgc", None), ("dgc+int8", "residual"), ("randomk", None)])
def test_end_to_end_through_the_wire(compressor, memory):
    """fedcomp.build(...).send / ack / nack: the applied mass is what the server decodes from acked blobs."""
    gen = torch.Generator().manual_seed(11)
    shapes = {"conv": (16, 3, 5, 5), "fc": (50, 60), "b": (50,)}
    spec = fedcomp.ModelSpec(tuple(shapes.items()))
    pipe = fedcomp.build(compressor, spec, memory=memory, density=0.01)
    total_in = {n: torch.zeros(s, dtype=torch.float64) for n, s in spec.entries}
    applied = {n: torch.zeros(s, dtype=torch.float64) for n, s in spec.entries}
    blobs = {}
    for step in range(12):
        grads = {n: torch.randn(s, generator=gen) for n, s in spec.entries}
        if step == 3:
            grads["fc"].zero_()
        dgc = isinstance(pipe.memory, DGCMemory)
        # residual memory: the raw gradient; dgc memory: its inflow u_t = m * (masked u) + g
        before = {n: pipe.memory.momentum(n).double() for n in spec.names} if dgc and step else {}
        blob = pipe.send(grads, base_version=step)
        seq = pipe.last_seq
        blobs[seq] = blob
        for n in spec.names:
            total_in[n] += grads[n].double() + (0.9 * before[n] if n in before else 0.0)
        # the server answers every other update late; a third of the answers are nacks
        if step % 2:
            for s in (seq - 1, seq):
                if s % 3 == 0:
                    assert pipe.nack(s)
                else:
                    assert pipe.ack(s)
                    for n, t in fedcomp.decode(blobs[s], spec).to_dense().items():
                        applied[n] += t.double()
    assert not pipe.pending and not pipe.nack(1)
    for n in spec.names:
        err = (total_in[n] - applied[n] - pipe.memory.residual(n).double()).abs().max()
        scale = total_in[n].abs().max() + 12
        assert err <= 1e-5 * scale * math.sqrt(12), n

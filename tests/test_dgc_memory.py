"""DGC memory: momentum correction, Nesterov, masking, dense-sent tensors, clipping, restore, state."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import fedcomp
from fedcomp.memory.dgc import DGCMemory, DGCMemoryConfig
from fedcomp.payload import TensorPayload, ValueCoding, Values


def t(*xs):
    return torch.tensor(xs, dtype=torch.float32)


def send(v, idx):
    """A sparse fp32 payload of ``v`` at ``idx`` (what a sparsifier would produce)."""
    idx = torch.tensor(idx, dtype=torch.int64)
    return TensorPayload(tuple(v.shape), Values.f32(v.reshape(-1)[idx].clone()), idx)


def step(mem, g, idx, name="w"):
    v = mem.compensate(g, name)
    p = send(v, idx)
    mem.update(v, name, p)
    return p


G = [t(1, 2, 4), t(2, 0, -2), t(1, 1, 1)]
SENT = [[2], [0], [1]]


def test_momentum_correction_hand_computed():
    mem = DGCMemory(DGCMemoryConfig(momentum=0.5))
    v = mem.compensate(G[0], "w")
    assert torch.equal(v, t(1, 2, 4)) and torch.equal(mem.momentum("w"), t(1, 2, 4))
    assert v is mem.residual("w")  # compensate hands out the live velocity
    mem.update(v, "w", send(v, [2]))
    assert torch.equal(mem.residual("w"), t(1, 2, 0)) and torch.equal(mem.momentum("w"), t(1, 2, 0))
    # u = 0.5 * [1, 2, 0] + [2, 0, -2] = [2.5, 1, -2];  v = [1, 2, 0] + u = [3.5, 3, -2]
    v = mem.compensate(G[1], "w")
    assert torch.equal(mem.momentum("w"), t(2.5, 1, -2)) and torch.equal(v, t(3.5, 3, -2))
    p = send(v, [0])
    assert torch.equal(p.values.data, t(3.5))
    mem.update(v, "w", p)
    assert torch.equal(mem.residual("w"), t(0, 3, -2)) and torch.equal(mem.momentum("w"), t(0, 1, -2))
    # u = 0.5 * [0, 1, -2] + [1, 1, 1] = [1, 1.5, 0];  v = [0, 3, -2] + u = [1, 4.5, -2]
    v = mem.compensate(G[2], "w")
    assert torch.equal(mem.momentum("w"), t(1, 1.5, 0)) and torch.equal(v, t(1, 4.5, -2))
    mem.update(v, "w", send(v, [1]))
    assert torch.equal(mem.residual("w"), t(1, 0, -2)) and torch.equal(mem.momentum("w"), t(1, 0, 0))


def test_nesterov_hand_computed():
    mem = DGCMemory(DGCMemoryConfig(momentum=0.5, nesterov=True))
    expect_v = [t(1.5, 3, 6), t(4.75, 3.5, -3), t(1.5, 5.25, -2)]
    expect_u = [t(1, 2, 4), t(2.5, 1, -2), t(1, 1.5, 0)]
    after_v = [t(1.5, 3, 0), t(0, 3.5, -3), t(1.5, 0, -2)]
    after_u = [t(1, 2, 0), t(0, 1, -2), t(1, 0, 0)]
    for g, idx, ev, eu, av, au in zip(G, SENT, expect_v, expect_u, after_v, after_u, strict=True):
        v = mem.compensate(g, "w")
        assert torch.equal(v, ev) and torch.equal(mem.momentum("w"), eu)
        mem.update(v, "w", send(v, idx))
        assert torch.equal(mem.residual("w"), av) and torch.equal(mem.momentum("w"), au)


def test_without_masking_momentum_keeps_sent_positions():
    mem = DGCMemory(DGCMemoryConfig(momentum=0.5, masking=False))
    step(mem, G[0], [2])
    assert torch.equal(mem.momentum("w"), t(1, 2, 4)) and torch.equal(mem.residual("w"), t(1, 2, 0))
    v = mem.compensate(G[1], "w")  # u = [0.5, 1, 2] + [2, 0, -2]
    assert torch.equal(mem.momentum("w"), t(2.5, 1, 0)) and torch.equal(v, t(3.5, 3, 0))


def test_compensate_does_not_modify_input():
    mem = DGCMemory(DGCMemoryConfig(momentum=0.9, nesterov=True, clip_norm=0.1))
    g = torch.randn(50, generator=torch.Generator().manual_seed(1))
    keep = g.clone()
    for _ in range(3):
        v = mem.compensate(g, "w")
        mem.update(v, "w", send(v, [0, 7]))
    assert torch.equal(g, keep)


def test_masking_zeroes_exactly_the_sent_positions():
    gen = torch.Generator().manual_seed(0)
    mem = DGCMemory(DGCMemoryConfig(momentum=0.9))
    comp = fedcomp.build_compressor("dgc", density=0.01)
    for _ in range(4):
        g = torch.randn(64, 100, generator=gen)
        v = mem.compensate(g, "w")
        u_before, v_before = mem.momentum("w").clone(), v.clone()
        p = comp.compress(v, "w")
        assert not p.is_dense and p.nnz > 0
        assert torch.equal(v, v_before)  # compress did not touch the live state
        mem.update(v, "w", p)
        sent = torch.zeros(v.numel(), dtype=torch.bool)
        sent[p.indices] = True
        u, v = mem.momentum("w").view(-1), mem.residual("w").view(-1)
        assert torch.all(u[sent] == 0) and torch.all(v[sent] == 0)
        assert torch.equal(u[~sent], u_before.view(-1)[~sent])
        assert torch.equal(v[~sent], v_before.view(-1)[~sent])


def test_quantized_values_leave_their_error_in_v():
    mem = DGCMemory(DGCMemoryConfig(momentum=0.9))
    v = mem.compensate(t(0.3, -1.7, 2.2, 0.05), "w")
    before = v.clone()
    idx = torch.tensor([1, 2])
    p = TensorPayload((4,), Values(ValueCoding.INT8, torch.tensor([-98, 127], dtype=torch.int8), t(2.2 / 127), 64), idx)
    mem.update(v, "w", p)
    deq = p.values.dequantize()
    assert torch.equal(mem.residual("w")[idx], before[idx] - deq)
    assert torch.equal(mem.residual("w")[[0, 3]], before[[0, 3]])
    assert torch.equal(mem.momentum("w")[idx], t(0, 0))


def test_dense_sent_tensors_keep_their_momentum():
    """A bias is sent whole every step: v empties, u is not masked, so what is sent is heavy-ball momentum."""
    mem = DGCMemory(DGCMemoryConfig(momentum=0.9))
    comp = fedcomp.build_compressor("dgc", density=0.001)
    gen = torch.Generator().manual_seed(3)
    u_ref = torch.zeros(10)
    for _ in range(5):
        g = torch.randn(10, generator=gen)
        u_ref = 0.9 * u_ref + g
        v = mem.compensate(g, "b")
        p = comp.compress(v, "b")
        assert p.is_dense
        mem.update(v, "b", p)
        torch.testing.assert_close(p.to_dense(), u_ref)
        assert torch.all(mem.residual("b") == 0)
        torch.testing.assert_close(mem.momentum("b"), u_ref)


@pytest.mark.parametrize(("workers", "threshold"), [(None, 2.0), (4, 1.0), (16, 0.5)])
def test_clipping_per_tensor_norm_scaled_by_workers(workers, threshold):
    mem = DGCMemory(DGCMemoryConfig(momentum=0.5, clip_norm=2.0, clip_workers=workers))
    g = t(3, 4, 0, 0) * 2  # norm 10
    keep = g.clone()
    v = mem.compensate(g, "w")
    assert torch.equal(g, keep)
    assert torch.linalg.vector_norm(mem.momentum("w")).item() == pytest.approx(threshold, rel=1e-6)
    torch.testing.assert_close(v, g * (threshold / 10))
    mem.update(v, "w", send(v, [0]))
    # second step: u = 0.5 * u + clip(g2); a small gradient passes unchanged
    u_prev = mem.momentum("w").clone()
    small = t(0, 0, threshold / 4, 0)
    mem.compensate(small, "w")
    torch.testing.assert_close(mem.momentum("w"), 0.5 * u_prev + small)
    # third step: a large gradient is clipped after the first step too (the accumulating path, not the first's)
    u_prev, v_prev = mem.momentum("w").clone(), mem.residual("w").clone()
    big = t(0, 6, 0, 8)  # norm 10
    v = mem.compensate(big, "w")
    torch.testing.assert_close(mem.momentum("w"), 0.5 * u_prev + big * (threshold / 10))
    torch.testing.assert_close(v, v_prev + mem.momentum("w"))


def test_restore_adds_back_into_v_only():
    mem = DGCMemory(DGCMemoryConfig(momentum=0.5))
    p = step(mem, G[0], [2])
    u = mem.momentum("w").clone()
    mem.restore("w", p)
    assert torch.equal(mem.residual("w"), t(1, 2, 4))
    assert torch.equal(mem.momentum("w"), u)
    # restore of a name never seen starts from zeros
    mem.restore("new", send(t(5, 6, 7), [1]))
    assert torch.equal(mem.residual("new"), t(0, 6, 0))


def test_state_dict_round_trip_is_a_copy():
    mem = DGCMemory(DGCMemoryConfig(momentum=0.5))
    step(mem, G[0], [2])
    state = mem.state_dict()
    step(mem, G[1], [0])
    assert torch.equal(state["v"]["w"], t(1, 2, 0)) and torch.equal(state["u"]["w"], t(1, 2, 0))
    other = DGCMemory(DGCMemoryConfig(momentum=0.5))
    other.load_state_dict(state)
    step(other, G[1], [0])
    assert torch.equal(other.residual("w"), mem.residual("w"))
    assert torch.equal(other.momentum("w"), mem.momentum("w"))
    state["v"]["w"].fill_(9)
    assert not torch.equal(other.residual("w"), state["v"]["w"])


def test_build_routes_memory_options():
    spec = fedcomp.ModelSpec.from_tensors({"w": torch.zeros(40, 40)})
    pipe = fedcomp.build("dgc", spec, momentum=0.5, nesterov=True, clip_norm=1.0, clip_workers=4, density=0.01)
    assert isinstance(pipe.memory, DGCMemory)
    assert pipe.memory.config == DGCMemoryConfig(momentum=0.5, nesterov=True, clip_norm=1.0, clip_workers=4)
    assert pipe.compressor.config.density == 0.01
    with pytest.raises(fedcomp.ConfigError):
        fedcomp.build("dgc", spec, momentum=1.5)


def reference(grads_and_sends, m, nesterov, masking):
    """Readable dense float64 re-implementation of the paper's equations."""
    u = v = None
    for g, idx in grads_and_sends:
        g = g.double()
        u = g.clone() if u is None else m * u + g
        inflow = g + m * u if nesterov else u
        v = inflow.clone() if v is None else v + inflow
        v[idx] = 0
        if masking:
            u[idx] = 0
    return u, v


@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(0, 2**31),
    steps=st.integers(1, 8),
    n=st.integers(1, 40),
    m=st.sampled_from([0.0, 0.5, 0.9]),
    nesterov=st.booleans(),
    masking=st.booleans(),
)
def test_matches_dense_reference(seed, steps, n, m, nesterov, masking):
    gen = torch.Generator().manual_seed(seed)
    mem = DGCMemory(DGCMemoryConfig(momentum=m, nesterov=nesterov, masking=masking))
    log = []
    for _ in range(steps):
        g = torch.randn(n, generator=gen)
        idx = torch.randperm(n, generator=gen)[: int(torch.randint(0, n + 1, (1,), generator=gen))].sort().values
        step(mem, g, idx.tolist())
        log.append((g, idx))
    u, v = reference(log, m, nesterov, masking)
    torch.testing.assert_close(mem.momentum("w").double(), u, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(mem.residual("w").double(), v, rtol=1e-5, atol=1e-5)


def test_step_state_is_the_live_state():
    """What a fused send step gets: zeros at a name's first step, then the memory's own u and v, not copies."""
    mem = DGCMemory(DGCMemoryConfig(momentum=0.5))
    state = mem.step_state("w", torch.zeros(3))
    assert torch.equal(state.velocity, torch.zeros(3)) and torch.equal(state.momentum, torch.zeros(3))
    assert state.rule is mem.config
    state.velocity.add_(1.0)
    state.momentum.add_(2.0)
    assert torch.equal(mem.residual("w"), t(1, 1, 1)) and torch.equal(mem.momentum("w"), t(2, 2, 2))
    v = mem.compensate(G[0], "w")  # continues from what the fused step left: u = 0.5 * 2 + g, v = 1 + u
    assert torch.equal(v, t(3, 4, 6))
    again = mem.step_state("w", torch.zeros(3))
    assert again.velocity is mem.residual("w") and again.momentum is mem.momentum("w")

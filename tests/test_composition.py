"""Sparsifier + quantizer compositions ("topk+int8", STC = "topk+ternary", ...) with error feedback.

A tiny exact top-k sparsifier defined here keeps these tests independent of the project's sparsifiers; one group
of tests runs the registered "topk" through ``build_compressor`` as well.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

import fedcomp
from fedcomp import COMPRESSORS, MEMORIES, ConfigError, ModelSpec, TensorPayload, Update, ValueCoding, build_compressor
from fedcomp.compressors.base import Composed, Quantizer, Sparsifier, SparsifierConfig

# (registry name, options): every quantizer, small blocks so that a few kept values span several blocks
QUANTIZERS = {
    "identity": {},
    "fp16": {},
    "bf16": {},
    "qsgd": {"bucket": 8},
    "int8": {"block": 8},
    "int4": {"block": 8, "stochastic": False},
    "sign": {},
    "ternary": {},
}
DENSITY, DENSE_BELOW = 0.05, 64


class LargestK(Sparsifier):
    """Exact top-k by magnitude (test double for the project's sparsifiers)."""

    def select(self, flat: torch.Tensor, k: int, name: str) -> torch.Tensor:
        del name
        return torch.topk(flat.abs(), min(k, flat.numel())).indices.sort().values


def quantizer(name: str, seed: int = 0) -> Quantizer:
    options = dict(QUANTIZERS[name])
    if "seed" in COMPRESSORS.config_fields(name):
        options["seed"] = seed
    return build_compressor(name, **options)


def composed(name: str, seed: int = 0) -> Composed:
    return Composed(LargestK(SparsifierConfig(density=DENSITY, dense_below=DENSE_BELOW)), quantizer(name, seed))


def sample(shape: tuple[int, ...], seed: int) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


HYPO = settings(
    derandomize=True, database=None, deadline=None, max_examples=25, suppress_health_check=[HealthCheck.too_slow]
)


# ---------------------------------------------------------------- what a composed payload holds


@pytest.mark.parametrize("qname", QUANTIZERS)
def test_indices_from_sparsifier_values_from_quantizer(qname):
    x = sample((20, 30), seed=1)
    before = x.clone()
    p = composed(qname, seed=4).compress(x, "w")
    assert torch.equal(x, before), "composition modified its input"
    k = round(DENSITY * x.numel())
    flat = x.reshape(-1)
    expected_idx = torch.topk(flat.abs(), k).indices.sort().values
    assert p.shape == (20, 30) and torch.equal(p.indices, expected_idx) and p.nnz == k
    twin = quantizer(qname, seed=4).quantize(flat[expected_idx], "w")  # same seed: same rounding draws
    assert p.values.coding is twin.coding and p.values.block == twin.block
    assert torch.equal(p.values.data, twin.data)
    assert (p.values.scales is None) == (twin.scales is None)
    if twin.scales is not None:
        assert torch.equal(p.values.scales, twin.scales)
    if qname != "identity":
        assert not torch.equal(p.values.dequantize(), flat[expected_idx])  # the kept values were coded


@pytest.mark.parametrize("qname", QUANTIZERS)
@pytest.mark.parametrize("shape", [(50,), (4, 10), (1, 63)])  # 1-D, or fewer than dense_below elements
def test_tensors_the_sparsifier_sends_dense_stay_f32(qname, shape):
    x = sample(shape, seed=2)
    p = composed(qname).compress(x, "b")
    assert p.is_dense and p.values.coding is ValueCoding.F32 and torch.equal(p.to_dense(), x)


def test_stc_is_topk_then_plus_minus_mean_magnitude():
    x = sample((16, 16), seed=3)
    p = composed("ternary").compress(x, "w")
    kept = x.reshape(-1)[p.indices]
    mu = kept.abs().mean()
    torch.testing.assert_close(p.values.dequantize(), torch.sign(kept) * mu)


# ---------------------------------------------------------------- error feedback over compositions


@pytest.mark.parametrize("qname", QUANTIZERS)
def test_memory_keeps_unselected_values_and_quantization_error(qname):
    x = sample((10, 20), seed=5)
    mem = MEMORIES.build("residual")
    comp = composed(qname)
    v = mem.compensate(x, "w")
    p = comp.compress(v, "w")
    mem.update(v, "w", p)
    e = mem.residual("w").reshape(-1)
    flat = x.reshape(-1)
    unselected = torch.ones(flat.numel(), dtype=torch.bool)
    unselected[p.indices] = False
    assert torch.equal(e[unselected], flat[unselected])  # not sent: kept exactly
    torch.testing.assert_close(e[p.indices], flat[p.indices] - p.values.dequantize(), rtol=0, atol=1e-6)


@pytest.mark.parametrize("qname", QUANTIZERS)
@HYPO
@given(data=st.data())
def test_residual_memory_conserves_mass_with_nacks(qname, data):
    """Σ inputs == Σ dequantized sent (minus nacked) + residual, per tensor, after every step and restore."""
    shapes = {"w": data.draw(st.sampled_from([(8, 9), (3, 40), (70, 1)]), label="w"), "b": (5,)}
    comp = composed(qname, seed=data.draw(st.integers(0, 99), label="seed"))
    mem = MEMORIES.build("residual")
    bound = float(np.float32(data.draw(st.sampled_from([1.0, 1e4, 1e30]), label="bound")))
    totals = {
        n: [torch.zeros(s, dtype=torch.float64), torch.zeros(s, dtype=torch.float64), 0.0] for n, s in shapes.items()
    }  # Σ in, Σ sent, magnitude (for the relative tolerance)
    pending: list[tuple[str, TensorPayload]] = []
    for _ in range(data.draw(st.integers(1, 5), label="steps")):
        for name, shape in shapes.items():
            x = torch.from_numpy(
                data.draw(arrays(np.float32, shape, elements=st.floats(-bound, bound, width=32)), label=name)
            )
            v = mem.compensate(x, name)
            p = comp.compress(v, name)
            sent = p.to_dense()
            mem.update(v, name, p)
            t = totals[name]
            t[0] += x.double()
            t[1] += sent.double()
            t[2] += float(x.abs().max() + v.abs().max() + sent.abs().max())
            pending.append((name, p))
        if data.draw(st.booleans(), label="nack"):
            name, lost = pending.pop(data.draw(st.integers(0, len(pending) - 1), label="which"))
            mem.restore(name, lost)
            totals[name][1] -= lost.to_dense().double()
            totals[name][2] += float(lost.to_dense().abs().max() + mem.residual(name).abs().max())
        for name, (total_in, total_sent, magnitude) in totals.items():
            gap = (total_in - total_sent - mem.residual(name).double()).abs().max().item()
            assert gap <= 1e-5 * magnitude + 1e-38, (name, gap, magnitude)


# ---------------------------------------------------------------- through the registry and the wire


@pytest.fixture
def largestk_registered(monkeypatch):
    """Registers the test sparsifier as "largestk" for one test only."""
    monkeypatch.setitem(COMPRESSORS._entries, "largestk", LargestK)
    return "largestk"


@pytest.mark.parametrize("qname", QUANTIZERS)
def test_build_compressor_routes_options_to_each_part(largestk_registered, qname):
    options = {"density": 0.02, "dense_below": 10, **QUANTIZERS[qname]}
    comp = build_compressor(f"{largestk_registered}+{qname}", **options)
    assert isinstance(comp, Composed) and isinstance(comp.sparsifier, LargestK)
    assert (comp.sparsifier.config.density, comp.sparsifier.config.dense_below) == (0.02, 10)
    assert comp.quantizer.registry_name == qname
    for key, value in QUANTIZERS[qname].items():
        assert getattr(comp.quantizer.config, key) == value


def test_build_compressor_rejects_bad_compositions(largestk_registered):
    with pytest.raises(ConfigError):
        build_compressor("int8+largestk")  # quantizer first
    with pytest.raises(ConfigError):
        build_compressor("largestk+largestk")
    with pytest.raises(ConfigError):
        build_compressor("largestk+int8", levels=3)  # an option neither part knows
    with pytest.raises(ConfigError):
        build_compressor("largestk+qsgd", levels=200)  # the quantizer's own validation


@pytest.mark.parametrize("qname", QUANTIZERS)
def test_composed_and_dense_quantized_payloads_survive_the_wire(qname):
    tensors = {"w": sample((30, 40), seed=6), "b": sample((40,), seed=7), "v": sample((300,), seed=8)}
    spec = ModelSpec.from_tensors(tensors)
    comp, q = composed(qname), quantizer(qname)
    payloads = {
        "w": comp.compress(tensors["w"], "w"),
        "b": comp.compress(tensors["b"], "b"),
        "v": q.compress(tensors["v"], "v"),
    }  # sparse quantized, dense F32, dense quantized
    decoded = fedcomp.decode(fedcomp.encode(Update(payloads, 3, 4, 5), spec), spec)
    for name, p in payloads.items():
        d = decoded.tensors[name]
        assert d.values.coding is p.values.coding and d.values.block == p.values.block
        assert torch.equal(d.to_dense(), p.to_dense())
        assert (d.indices is None and p.indices is None) or torch.equal(d.indices, p.indices)


# ---------------------------------------------------------------- the project's own top-k


def require_topk() -> None:
    assert "topk" in COMPRESSORS, "fedcomp/compressors/topk.py must register 'topk'"


@pytest.mark.parametrize("qname", QUANTIZERS)
def test_registered_topk_composes_with_each_quantizer(qname):
    require_topk()
    x = sample((40, 25), seed=9)
    comp = build_compressor(f"topk+{qname}", density=0.01, dense_below=100, **QUANTIZERS[qname])
    assert isinstance(comp, Composed) and comp.sparsifier.registry_name == "topk"
    p = comp.compress(x, "w")
    flat = x.reshape(-1)
    assert torch.equal(p.indices, torch.topk(flat.abs(), 10).indices.sort().values)  # continuous data: no ties
    assert p.values.coding is quantizer(qname).quantize(flat[:1], "w").coding
    mem = MEMORIES.build("residual")
    v = mem.compensate(x, "w")
    p = comp.compress(v, "w")
    mem.update(v, "w", p)
    torch.testing.assert_close(p.to_dense() + mem.residual("w"), x, rtol=0, atol=1e-6)


def test_stc_pipeline_round_trip_with_nack():
    """``build("topk+ternary")``: send, nack, and the restored residual again holds everything computed."""
    require_topk()
    grads = {"w": sample((32, 32), seed=10), "b": sample((32,), seed=11)}
    pipe = fedcomp.build("topk+ternary", ModelSpec.from_tensors(grads), density=0.01)
    blob = pipe.send(grads)
    sent = fedcomp.decode(blob, pipe.spec)
    assert sent.tensors["w"].values.coding is ValueCoding.TERNARY
    # "b" is small: the group's one kept value (round(0.01 * 32) = 0 -> 1), ternary as well
    assert sent.tensors["b"].nnz == 1 and sent.tensors["b"].values.coding is ValueCoding.TERNARY
    assert pipe.nack(pipe.last_seq)
    for name, g in grads.items():
        torch.testing.assert_close(pipe.memory.residual(name), g, rtol=0, atol=1e-6)

"""Quantizers: coding invariants, error bounds, unbiasedness, determinism, state, error-feedback conservation."""

from __future__ import annotations

import io
import math

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from fedcomp import COMPRESSORS, MEMORIES, ConfigError, ValueCoding, Values, build_compressor
from fedcomp.compressors.base import Quantizer, Seeded

# id -> (registry name, options). Small blocks so that short hypothesis inputs span several blocks.
SPECS = {
    "identity": ("identity", {}),
    "fp16": ("fp16", {}),
    "bf16": ("bf16", {}),
    "qsgd": ("qsgd", {"bucket": 16}),
    "qsgd-s7": ("qsgd", {"bucket": 16, "levels": 7}),
    "qsgd-s1": ("qsgd", {"bucket": 5, "levels": 1}),
    "int8": ("int8", {"block": 16}),
    "int8-nearest": ("int8", {"block": 16, "stochastic": False}),
    "int4": ("int4", {"block": 7}),
    "int4-nearest": ("int4", {"block": 7, "stochastic": False}),
    "sign": ("sign", {}),
    "sign-block": ("sign", {"block": 8}),
    "ternary": ("ternary", {}),
    "ternary-block": ("ternary", {"block": 8}),
}
STOCHASTIC = ["qsgd", "qsgd-s7", "qsgd-s1", "int8", "int4"]
ROUNDING = STOCHASTIC + ["int8-nearest", "int4-nearest"]  # code = rounding of x / scale

HYPO = settings(
    derandomize=True, database=None, deadline=None, max_examples=40, suppress_health_check=[HealthCheck.too_slow]
)


def make(spec_id: str, **extra) -> Quantizer:
    name, options = SPECS[spec_id]
    q = build_compressor(name, **{**options, **extra})
    assert isinstance(q, Quantizer)
    return q


def vectors(max_size: int = 80, bound: float = 1e30):
    """float32 vectors mixing magnitudes, exact zeros and subnormals."""
    bound = float(np.float32(bound))  # hypothesis wants bounds exact in float32
    elements = st.one_of(
        st.floats(-bound, bound, width=32),
        st.floats(-10.0, 10.0, width=32),
        st.just(0.0),
    )
    return arrays(np.float32, st.integers(0, max_size), elements=elements).map(torch.from_numpy)


def per_element(v: Values) -> torch.Tensor:
    """Each value's scale, float64."""
    return v.scales.double().repeat_interleave(v.block)[: len(v)]


def blocks64(x: torch.Tensor, block: int) -> list[torch.Tensor]:
    return list(x.double().split(block)) if x.numel() else []


# ---------------------------------------------------------------- registry, defaults, config validation


def test_registered_with_documented_defaults():
    for name in ["identity", "fp16", "bf16", "qsgd", "int8", "int4", "sign", "ternary"]:
        assert name in COMPRESSORS and issubclass(COMPRESSORS.get(name), Quantizer)
    assert (build_compressor("qsgd").config.levels, build_compressor("qsgd").config.bucket) == (127, 512)
    for name in ["int8", "int4"]:
        cfg = build_compressor(name).config
        assert (cfg.block, cfg.stochastic, cfg.seed) == (256, True, 0)
    assert build_compressor("sign").config.block is None and build_compressor("ternary").config.block is None
    for name in ["qsgd", "int8", "int4"]:
        assert isinstance(build_compressor(name), Seeded)


@pytest.mark.parametrize(
    "name,options",
    [
        ("qsgd", {"levels": 128}),
        ("qsgd", {"levels": 0}),
        ("qsgd", {"bucket": 0}),
        ("qsgd", {"levels": 7.5}),
        ("qsgd", {"seed": -1}),
        ("int8", {"block": 0}),
        ("int8", {"block": None}),
        ("int4", {"stochastic": 1}),
        ("int8", {"seed": True}),
        ("sign", {"block": 0}),
        ("ternary", {"block": -3}),
        ("int8", {"levels": 3}),
        ("fp16", {"block": 4}),
    ],
)
def test_bad_options_are_rejected(name, options):
    with pytest.raises(ConfigError):
        build_compressor(name, **options)


def test_qsgd_code_width_follows_levels():
    assert make("qsgd", levels=7).quantize(torch.ones(3), "w").coding is ValueCoding.INT4
    assert make("qsgd", levels=8).quantize(torch.ones(3), "w").coding is ValueCoding.INT8


# ---------------------------------------------------------------- coding invariants (property)


@pytest.mark.parametrize("spec_id", SPECS)
@HYPO
@given(x=vectors())
def test_coding_invariants(spec_id, x):
    q = make(spec_id)
    before = x.clone()
    v = q.quantize(x, "w")
    assert torch.equal(x, before), "quantizer modified its input"
    n = x.numel()
    assert len(v) == n and v.data.dim() == 1
    deq = v.dequantize()
    assert deq.dtype == torch.float32 and deq.shape == (n,) and torch.isfinite(deq).all()
    if v.coding.is_float:
        assert v.scales is None
        return
    assert v.data.dtype == torch.int8 and v.block >= 1
    lo, hi = v.coding.code_range
    assert ((v.data >= lo) & (v.data <= hi)).all()
    if v.coding is ValueCoding.SIGN:
        assert (v.data != 0).all()
    assert v.scales.dtype == torch.float32 and v.scales.numel() == math.ceil(n / v.block)
    assert torch.isfinite(v.scales).all() and (v.scales >= 0).all()


@pytest.mark.parametrize("spec_id", ROUNDING)
@HYPO
@given(x=vectors())
def test_rounding_error_bound_and_scales(spec_id, x):
    q = make(spec_id)
    v = q.quantize(x, "w")
    x64, scale = x.double(), per_element(v)
    err = (x64 - v.dequantize().double()).abs()
    bound = scale if q.stochastic else scale / 2
    assert (err <= bound * (1 + 1e-5) + 1e-38).all()
    # reference scales, one per block, in float64
    ref = []
    for b in blocks64(x, v.block):
        if q.registry_name == "qsgd":
            ref.append(torch.linalg.vector_norm(b) / q.qmax)
        else:
            ref.append(b.abs().max() / q.qmax)
    if ref:
        torch.testing.assert_close(v.scales.double(), torch.stack(ref), rtol=1e-5, atol=1e-38)
    # codes are one of the two integers next to x / scale
    r = torch.where(scale > 0, x64 / scale.clamp_min(1e-300), 0.0)
    assert ((v.data.double() - r).abs() < 1 + 1e-4).all()


@pytest.mark.parametrize("spec_id", ["sign", "sign-block", "ternary", "ternary-block"])
@HYPO
@given(x=vectors())
def test_sign_and_ternary_codes_and_scales(spec_id, x):
    v = make(spec_id).quantize(x, "w")
    codes = v.data.double()
    if v.coding is ValueCoding.SIGN:
        assert torch.equal(codes, torch.where(x >= 0, 1.0, -1.0).double())
    else:
        assert torch.equal(codes, torch.sign(x).double())
    ref = []
    for b in blocks64(x, v.block):
        mags = b.abs() if v.coding is ValueCoding.SIGN else b.abs()[b != 0]
        ref.append(mags.mean() if mags.numel() else torch.tensor(0.0, dtype=torch.float64))
    if ref:
        torch.testing.assert_close(v.scales.double(), torch.stack(ref), rtol=1e-5, atol=1e-38)


@pytest.mark.parametrize("spec_id", ["sign", "ternary"])
def test_sign_and_ternary_default_block_is_whole_tensor(spec_id):
    x = torch.tensor([0.0, 3.0, -1.0, 0.0, 2.0])
    v = make(spec_id).quantize(x, "w")
    assert v.block == 5 and v.scales.numel() == 1
    expected = 6.0 / 5 if spec_id == "sign" else 2.0  # ||x||_1 / d, or mean over the three nonzeros
    assert v.scales.item() == pytest.approx(expected)


def test_partial_last_block():
    x = torch.arange(1.0, 11.0)  # 10 values, blocks of 4: [1..4], [5..8], [9, 10]
    for name in ["int8", "int4"]:
        v = build_compressor(name, block=4, stochastic=False).quantize(x, "w")
        torch.testing.assert_close(v.scales, torch.tensor([4.0, 8.0, 10.0]) / (127 if name == "int8" else 7))
    v = build_compressor("qsgd", bucket=4).quantize(x, "w")
    torch.testing.assert_close(v.scales, torch.tensor([30.0, 174.0, 181.0]).sqrt() / 127)
    v = build_compressor("sign", block=4).quantize(x, "w")
    torch.testing.assert_close(v.scales, torch.tensor([2.5, 6.5, 9.5]))  # the last block averages 2 values
    v = build_compressor("ternary", block=4).quantize(torch.tensor([1.0, 0, 0, 0, 0, 0, 0, 0, 0, 4.0]), "w")
    torch.testing.assert_close(v.scales, torch.tensor([1.0, 0.0, 4.0]))


# ---------------------------------------------------------------- edge inputs


@pytest.mark.parametrize("spec_id", SPECS)
@pytest.mark.parametrize("n", [0, 1, 5, 300])
def test_all_zero_input(spec_id, n):
    v = make(spec_id).quantize(torch.zeros(n), "w")
    assert torch.equal(v.dequantize(), torch.zeros(n))
    if not v.coding.is_float:
        assert torch.equal(v.scales, torch.zeros_like(v.scales))
        if v.coding is not ValueCoding.SIGN:
            assert not v.data.any()


@pytest.mark.parametrize("spec_id", SPECS)
@pytest.mark.parametrize("value", [2.5, -0.75, 1e-20])
def test_single_element_is_exact(spec_id, value):
    """One value is its own absmax / norm / mean: every coding sends it exactly, up to the cast's rounding."""
    v = make(spec_id).quantize(torch.tensor([value]), "w")
    rel = {ValueCoding.F16: 2**-11, ValueCoding.BF16: 2**-8}.get(v.coding, 1e-6)
    if v.coding is ValueCoding.F16 and abs(value) < 6e-8:
        assert v.dequantize().item() == 0.0  # below fp16's smallest subnormal; the residual keeps it
    else:
        assert v.dequantize().item() == pytest.approx(value, rel=rel)


@pytest.mark.parametrize("spec_id", SPECS)
def test_extreme_magnitudes_stay_finite(spec_id):
    big = torch.finfo(torch.float32).max
    x = torch.tensor([big, -big, big / 2, 1.0, 0.0, -1e-45] * 6)
    v = make(spec_id).quantize(x, "w")
    if v.scales is not None:
        assert torch.isfinite(v.scales).all()
    assert not torch.isnan(v.dequantize()).any()


# ---------------------------------------------------------------- casts and identity


@pytest.mark.parametrize("name,dtype", [("fp16", torch.float16), ("bf16", torch.bfloat16)])
@HYPO
@given(x=vectors(bound=6e4))
def test_casts_equal_torch_casts(name, dtype, x):
    v = build_compressor(name).quantize(x, "w")
    assert v.data.dtype == dtype and torch.equal(v.data, x.to(dtype))


def test_fp16_saturates_instead_of_overflowing():
    v = build_compressor("fp16").quantize(torch.tensor([1e6, -1e6, 65519.0, 70000.0]), "w")
    assert v.data.tolist() == [65504.0, -65504.0, 65504.0, 65504.0]


def test_identity_is_lossless_and_owns_its_data():
    x = torch.randn(50, generator=torch.Generator().manual_seed(1))
    v = build_compressor("identity").quantize(x, "w")
    assert v.coding is ValueCoding.F32 and torch.equal(v.data, x)
    x.add_(1.0)
    assert not torch.equal(v.data, x), "payload aliases the input"


# ---------------------------------------------------------------- statistics of stochastic rounding

Z = 5.0  # standard errors: two-sided normal tail 5.7e-7 per element, so with ~10^3 checked elements a
#           correct quantizer fails with probability < 1e-3 (and never for the fixed seeds used here)
DRAWS = 4000


def sample_x(d: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(d, generator=g) * torch.logspace(-3, 1, d)[torch.randperm(d, generator=g)]
    x[3] = 0.0
    return x


def draws(spec_id: str, x: torch.Tensor, **extra) -> tuple[torch.Tensor, torch.Tensor]:
    """DRAWS independent quantizations of ``x`` in one call: one copy per block. Returns (dequantized, scale)."""
    d = x.numel()
    key = "bucket" if SPECS[spec_id][0] == "qsgd" else "block"
    v = make(spec_id, **{key: d}, seed=123, **extra).quantize(x.repeat(DRAWS), "w")
    assert torch.equal(v.scales, v.scales[:1].expand_as(v.scales))  # same scale for every copy
    return v.dequantize().double().view(DRAWS, d), v.scales[0].double()


def unbiased_within_noise(x: torch.Tensor, deq: torch.Tensor, scale: torch.Tensor) -> bool:
    """|mean - x| <= Z standard errors, from the exact variance of stochastic rounding (scale^2 p (1 - p))."""
    x64 = x.double()
    r = x64 / scale
    p = r - torch.floor(r)
    se = scale * torch.sqrt(p * (1 - p) / deq.shape[0])
    return bool(((deq.mean(0) - x64).abs() <= Z * se + 1e-6 * scale).all())


@pytest.mark.parametrize("spec_id", STOCHASTIC)
def test_stochastic_rounding_is_unbiased(spec_id):
    x = sample_x(48, seed=7)
    deq, scale = draws(spec_id, x)
    assert unbiased_within_noise(x, deq, scale)


@pytest.mark.parametrize("spec_id", ["int8", "int4"])
def test_unbiasedness_check_detects_round_to_nearest(spec_id):
    """The statistical check has power: round-to-nearest (biased) fails it."""
    x = sample_x(48, seed=7)
    deq, scale = draws(spec_id, x, stochastic=False)
    assert not unbiased_within_noise(x, deq, scale)


@pytest.mark.parametrize("levels", [1, 3, 7, 127])
@pytest.mark.parametrize("d", [1, 10, 512])
def test_qsgd_variance_within_paper_bound(levels, d):
    """Exact variance sum(scale^2 p (1 - p)) <= min(d / s^2, sqrt(d) / s) ||x||^2 (QSGD Lemma 3.1)."""
    x = sample_x(max(d, 4), seed=d)[:d].double()
    norm = torch.linalg.vector_norm(x)
    v = build_compressor("qsgd", levels=levels, bucket=d).quantize(x.float(), "w")
    scale = v.scales.double()[0]
    torch.testing.assert_close(scale, norm / levels, rtol=1e-6, atol=0)
    p = torch.frac(x.abs() / scale)
    variance = (scale**2 * p * (1 - p)).sum()
    assert variance <= min(d / levels**2, math.sqrt(d) / levels) * norm**2 * (1 + 1e-9)


@pytest.mark.parametrize("spec_id", STOCHASTIC)
def test_seeded_draws(spec_id):
    x = sample_x(200, seed=3)
    a, b = make(spec_id, seed=1), make(spec_id, seed=1)
    first = a.quantize(x, "w").data
    assert torch.equal(first, b.quantize(x, "w").data)  # same seed, same draws
    assert not torch.equal(first, a.quantize(x, "w").data)  # the generator advances
    assert not torch.equal(first, make(spec_id, seed=2).quantize(x, "w").data)


@pytest.mark.parametrize("spec_id", ["int8-nearest", "int4-nearest"])
def test_deterministic_mode_is_round_to_nearest(spec_id):
    x = sample_x(200, seed=5)
    a, b = make(spec_id, seed=1), make(spec_id, seed=2)
    v = a.quantize(x, "w")
    for other in (a.quantize(x, "w"), b.quantize(x, "w")):
        assert torch.equal(v.data, other.data) and torch.equal(v.scales, other.scales)
    assert torch.equal(v.data.double(), torch.round(x.double() / per_element(v)))


# ---------------------------------------------------------------- state


@pytest.mark.parametrize("spec_id", SPECS)
def test_state_dict_round_trip(spec_id):
    x = sample_x(100, seed=11)
    q = make(spec_id, **({"seed": 5} if spec_id in STOCHASTIC else {}))
    q.quantize(x, "w")
    buf = io.BytesIO()
    torch.save(q.state_dict(), buf)  # a checkpoint holds only tensors and plain containers
    expected = q.quantize(x, "w")
    fresh = make(spec_id, **({"seed": 99} if spec_id in STOCHASTIC else {}))
    buf.seek(0)
    fresh.load_state_dict(torch.load(buf, weights_only=True))
    got = fresh.quantize(x, "w")
    assert torch.equal(got.data, expected.data)
    assert (got.scales is None) == (expected.scales is None)
    if got.scales is not None:
        assert torch.equal(got.scales, expected.scales)


# ---------------------------------------------------------------- error-feedback conservation


@pytest.mark.parametrize("spec_id", SPECS)
@HYPO
@given(data=st.data())
def test_residual_memory_conserves_mass_with_nacks(spec_id, data):
    """Σ inputs == Σ dequantized sent (minus nacked) + residual, after every step and restore."""
    q = make(spec_id)
    mem = MEMORIES.build("residual")
    shape = data.draw(st.sampled_from([(1,), (7,), (3, 5), (2, 33)]), label="shape")
    steps = data.draw(st.integers(1, 6), label="steps")
    bound = data.draw(st.sampled_from([1.0, 1e4, 1e30]), label="bound")
    elements = st.floats(-float(np.float32(bound)), float(np.float32(bound)), width=32)
    total_in = torch.zeros(shape, dtype=torch.float64)
    total_sent = torch.zeros(shape, dtype=torch.float64)
    magnitude = 0.0  # Σ of the largest |value| each fp32 operation saw; rounding error is relative to it
    pending = []
    for _ in range(steps):
        x = torch.from_numpy(data.draw(arrays(np.float32, shape, elements=elements), label="x"))
        v = mem.compensate(x, "w")
        p = q.compress(v, "w")
        sent = p.to_dense()
        magnitude += float(x.abs().max() + v.abs().max() + sent.abs().max())
        mem.update(v, "w", p)
        total_in += x.double()
        total_sent += sent.double()
        pending.append(p)
        if data.draw(st.booleans(), label="nack"):
            lost = pending.pop(data.draw(st.integers(0, len(pending) - 1), label="which"))
            mem.restore("w", lost)
            total_sent -= lost.to_dense().double()
            magnitude += float(lost.to_dense().abs().max() + mem.residual("w").abs().max())
        gap = (total_in - total_sent - mem.residual("w").double()).abs().max().item()
        assert gap <= 1e-5 * magnitude + 1e-38, (gap, magnitude)

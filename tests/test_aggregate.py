"""SparseAccumulator: equals a dense reference, normalisations, reset, validation, O(nnz) (never densifies)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import fedcomp
from fedcomp.payload import TensorPayload, Update, ValueCoding, Values
from fedcomp.server.aggregate import SparseAccumulator
from fedcomp.spec import ModelSpec

SPEC = ModelSpec((("conv.weight", (4, 3, 3, 3)), ("conv.bias", (4,)), ("fc.weight", (10, 16))))


def _sparse(shape, idx, vals):
    return TensorPayload(tuple(shape), Values.f32(torch.as_tensor(vals, dtype=torch.float32)),
                         torch.as_tensor(idx, dtype=torch.int64))


def _dense(t):
    return TensorPayload(tuple(t.shape), Values.f32(t))


def _int8(shape, idx, codes, scales, block):
    vals = Values(ValueCoding.INT8, torch.as_tensor(codes, dtype=torch.int8), torch.as_tensor(scales), block)
    return TensorPayload(tuple(shape), vals, None if idx is None else torch.as_tensor(idx, dtype=torch.int64))


@st.composite
def payloads(draw, shape):
    numel = math.prod(shape)
    kind = draw(st.sampled_from(["sparse", "dense", "int8-sparse", "f16-dense"]))
    seed = draw(st.integers(0, 2**31 - 1))
    g = torch.Generator().manual_seed(seed)
    if kind == "dense":
        return _dense(torch.randn(shape, generator=g))
    if kind == "f16-dense":
        return TensorPayload(shape, Values(ValueCoding.F16, torch.randn(numel, generator=g).half()))
    k = draw(st.integers(0, numel))
    idx = torch.randperm(numel, generator=g)[:k].sort().values
    if kind == "sparse":
        return _sparse(shape, idx, torch.randn(k, generator=g))
    block = draw(st.sampled_from([1, 4, 64]))
    codes = torch.randint(-127, 128, (k,), generator=g, dtype=torch.int8)
    scales = torch.rand(Values.num_blocks(k, block), generator=g)
    return _int8(shape, idx, codes, scales, block)


@st.composite
def updates(draw):
    return {name: draw(payloads(shape)) for name, shape in SPEC.entries}


@settings(max_examples=60, deadline=None)
@given(
    ups=st.lists(st.tuples(updates(), st.one_of(st.just(0.0), st.floats(1e-3, 1e3))), min_size=1, max_size=5),
    as_update=st.booleans(),
)
def test_matches_dense_reference(ups, as_update):
    acc = SparseAccumulator(SPEC)
    ref = {n: torch.zeros(s, dtype=torch.float64) for n, s in SPEC.entries}
    mag = {n: torch.zeros(s, dtype=torch.float64) for n, s in SPEC.entries}  # Σ|w u|: float32 rounding scale
    for i, (payload_map, w) in enumerate(ups):
        acc.add(Update(payload_map, seq=i) if as_update else payload_map, weight=w)
        for n, p in payload_map.items():
            ref[n] += w * p.to_dense().double()
            mag[n] += w * p.to_dense().double().abs()
    total = sum(w for _, w in ups)
    assert acc.count == len(ups) and acc.total_weight == pytest.approx(total)

    def close(got, want, scale):
        assert got.dtype == torch.float32 and got.shape == want.shape
        assert ((got.double() - want).abs() <= 1e-6 * scale + 1e-30).all()

    for n in SPEC.names:
        close(acc.result("sum")[n], ref[n], mag[n])
        close(acc.result("count")[n], ref[n] / len(ups), mag[n] / len(ups))
        if total > 0:
            close(acc.result("weights")[n], ref[n] / total, mag[n] / total)


def _two_updates():
    a = {
        "conv.weight": _sparse((4, 3, 3, 3), [0, 5, 107], [1.0, 2.0, 3.0]),
        "conv.bias": _dense(torch.tensor([1.0, 1.0, 1.0, 1.0])),
        "fc.weight": _sparse((10, 16), [], []),
    }
    b = {
        "conv.weight": _sparse((4, 3, 3, 3), [5, 6], [10.0, 20.0]),
        "conv.bias": _dense(torch.tensor([3.0, 0.0, 0.0, -1.0])),
        "fc.weight": _int8((10, 16), [159], [-127], [0.5], 4),
    }
    return a, b


def test_normalisations_by_hand():
    a, b = _two_updates()
    acc = SparseAccumulator(SPEC)
    acc.add(a, weight=1.0)
    acc.add(Update(b), weight=3.0)
    s = acc.result("sum")
    assert s["conv.weight"].view(-1)[[0, 5, 6, 107]].tolist() == [1.0, 32.0, 60.0, 3.0]
    assert s["conv.weight"].abs().sum().item() == 96.0
    assert s["conv.bias"].tolist() == [10.0, 1.0, 1.0, -2.0]
    assert s["fc.weight"].view(-1)[159].item() == -190.5
    w = acc.result("weights")
    assert w["conv.bias"].tolist() == [2.5, 0.25, 0.25, -0.5]
    c = acc.result()  # default: weights
    assert torch.equal(c["conv.bias"], w["conv.bias"])
    k = acc.result("count")
    assert k["conv.bias"].tolist() == [5.0, 0.5, 0.5, -1.0]
    with pytest.raises(ValueError, match="normalize"):
        acc.result("mean")


def test_result_is_a_copy_and_reset_zeroes_in_place():
    a, _ = _two_updates()
    acc = SparseAccumulator(SPEC)
    buffers = {n: t for n, t in acc.buffers.items()}
    ptrs = {n: t.data_ptr() for n, t in buffers.items()}
    acc.add(a, 2.0)
    out = acc.result("sum")
    acc.reset()
    assert out["conv.bias"].tolist() == [2.0] * 4  # unaffected by reset
    assert acc.count == 0 and acc.total_weight == 0.0 and len(acc) == 0
    for n, t in acc.buffers.items():
        assert t is buffers[n] and t.data_ptr() == ptrs[n] and not t.any()
    acc.add(a, 1.0)
    assert acc.result("sum")["conv.weight"].view(-1)[107].item() == 3.0


def test_empty_normalisation_errors():
    acc = SparseAccumulator(SPEC)
    assert all(not t.any() for t in acc.result("sum").values())
    with pytest.raises(ValueError, match="no update"):
        acc.result("count")
    with pytest.raises(ValueError, match="total weight is 0"):
        acc.result("weights")
    a, _ = _two_updates()
    acc.add(a, 1e-300)
    with pytest.raises(ValueError, match="underflows"):
        acc.result("weights")
    acc.reset()
    acc.add(a, 0.0)  # counted, contributes nothing
    assert acc.count == 1 and not acc.result("count")["conv.bias"].any()
    with pytest.raises(ValueError, match="total weight is 0"):
        acc.result("weights")


@pytest.mark.parametrize("weight", [-1.0, float("nan"), float("inf"), -0.001])
def test_bad_weight(weight):
    a, _ = _two_updates()
    acc = SparseAccumulator(SPEC)
    with pytest.raises(ValueError, match="weight"):
        acc.add(a, weight)
    assert acc.count == 0


def _mutations():
    yield "extra", lambda u: {**u, "other": _dense(torch.zeros(2))}, "'other'"
    yield "missing", lambda u: {k: v for k, v in u.items() if k != "conv.bias"}, "'conv.bias'"
    yield "shape", lambda u: {**u, "conv.bias": _dense(torch.zeros(5))}, "'conv.bias'.*shape"
    yield "transposed", lambda u: {**u, "fc.weight": _sparse((16, 10), [1], [1.0])}, "'fc.weight'.*shape"
    yield "range", lambda u: {**u, "fc.weight": _sparse((10, 16), [3, 160], [1.0, 1.0])}, "'fc.weight'.*range"
    yield "negative", lambda u: {**u, "fc.weight": _sparse((10, 16), [-1], [1.0])}, "'fc.weight'.*range"
    yield "count", lambda u: {**u, "fc.weight": _sparse((10, 16), [1, 2], [1.0])}, "'fc.weight'.*indices"
    yield (
        "dense-count",
        lambda u: {**u, "conv.bias": TensorPayload((4,), Values.f32(torch.zeros(3)))},
        "'conv.bias'.*3 values",
    )


@pytest.mark.parametrize("label, mutate, match", list(_mutations()), ids=[m[0] for m in _mutations()])
def test_validation_names_the_tensor_and_changes_nothing(label, mutate, match):
    a, b = _two_updates()
    acc = SparseAccumulator(SPEC)
    acc.add(a, 1.0)
    before = acc.result("sum")
    bad = mutate(b)
    with pytest.raises(ValueError, match=match):
        acc.add(bad, 1.0)
    # atomic: the earlier tensors of the bad update were not applied either
    assert acc.count == 1 and acc.total_weight == 1.0
    after = acc.result("sum")
    assert all(torch.equal(before[n], after[n]) for n in SPEC.names)


FLT_MAX = float(torch.finfo(torch.float32).max)


def _non_finite_payloads():
    """(label, fc.weight payload, weight): each would put ±inf or NaN into the buffer."""
    yield "int8 code x scale", _int8((10, 16), [3, 9], [1, 127], [3e38], 4), 1.0
    yield "int8 dense", _int8((10, 16), None, [127] * 160, [3e38] * 40, 4), 1.0
    yield "nan f32", _sparse((10, 16), [1, 2], [1.0, float("nan")]), 1.0
    yield "inf f16", TensorPayload((10, 16), Values(ValueCoding.F16, torch.full((160,), math.inf).half())), 1.0
    yield "nan scale", _int8((10, 16), [3], [1], [float("nan")], 4), 1.0
    yield "weight x value", _sparse((10, 16), [7], [2e38]), 2.0
    yield "weight x code x scale", _int8((10, 16), [7], [100], [3e36], 4), 2.0


@pytest.mark.parametrize("label, payload, weight", list(_non_finite_payloads()),
                         ids=[c[0] for c in _non_finite_payloads()])
def test_add_refuses_non_finite_values_and_changes_nothing(label, payload, weight):
    a, b = _two_updates()
    acc = SparseAccumulator(SPEC)
    acc.add(a, 1.0)
    before = acc.result("sum")
    with pytest.raises(ValueError, match="'fc.weight'.*NaN or Inf"):
        acc.add({**b, "fc.weight": payload}, weight)
    assert acc.count == 1 and acc.total_weight == 1.0
    after = acc.result("sum")
    assert all(torch.equal(before[n], after[n]) for n in SPEC.names)


@settings(max_examples=200, deadline=None)
@given(
    scale=st.one_of(st.floats(0.0, FLT_MAX, width=32), st.sampled_from([3e38, FLT_MAX / 127, FLT_MAX / 2, 1.0])),
    code=st.integers(-127, 127),
    weight=st.one_of(st.just(1.0), st.floats(0.0, 1e3)),
)
def test_add_accepts_exactly_what_stays_finite(scale, code, weight):
    """An int8 record is added iff ``weight * code * scale`` (float32, as the scatter-add computes it) is finite;
    the buffers stay finite either way."""
    a, _ = _two_updates()
    payload = _int8((10, 16), [5, 6], [code, 1], [scale], 4)
    with np.errstate(over="ignore", invalid="ignore"):
        product = np.float32(weight) * (np.float32(code) * np.float32(scale))
        finite = bool(np.isfinite(product) and np.isfinite(np.float32(weight) * np.float32(scale)))
    acc = SparseAccumulator(SPEC)
    if finite:
        acc.add({**a, "fc.weight": payload}, weight)
        assert acc.count == 1
    else:
        with pytest.raises(ValueError, match="NaN or Inf"):
            acc.add({**a, "fc.weight": payload}, weight)
        assert acc.count == 0
    assert all(bool(torch.isfinite(t).all()) for t in acc.buffers.values())


def test_never_densifies(monkeypatch):
    def boom(self):
        raise AssertionError("SparseAccumulator must not call to_dense")

    a, b = _two_updates()
    monkeypatch.setattr(TensorPayload, "to_dense", boom)
    monkeypatch.setattr(Update, "to_dense", boom)
    acc = SparseAccumulator(SPEC)
    acc.add(a, 1.0)
    acc.add(Update(b), 2.0)
    assert acc.result("sum")["conv.weight"].view(-1)[6].item() == 40.0


def test_sparse_cost_is_o_nnz(monkeypatch):
    """A sparse add reads only its kept values: instrument dequantize and index_add_ sizes on a big tensor."""
    big = ModelSpec((("w", (1000, 1000)),))
    acc = SparseAccumulator(big)
    sizes = []
    original = Values.dequantize

    def spy(self):
        out = original(self)
        sizes.append(out.numel())
        return out

    monkeypatch.setattr(Values, "dequantize", spy)
    idx = torch.arange(0, 1_000_000, 1000)
    acc.add({"w": _sparse((1000, 1000), idx, torch.ones(1000))}, 1.0)
    assert sizes == [1000]
    assert acc.buffers["w"].sum().item() == 1000.0


def test_package_exports_it():
    assert fedcomp.SparseAccumulator is SparseAccumulator


def test_end_to_end_with_the_pipeline():
    """Compress → encode → decode → accumulate equals the decoded update."""
    model = torch.nn.Sequential(torch.nn.Linear(40, 30), torch.nn.ReLU(), torch.nn.Linear(30, 2))
    spec = ModelSpec.from_module(model)
    grads = {n: torch.randn_like(p) for n, p in model.named_parameters()}
    pipe = fedcomp.build("topk", spec, density=0.1, dense_below=0)
    update = fedcomp.decode(pipe.send(grads, base_version=0), spec)
    acc = SparseAccumulator(spec)
    acc.add(update, 0.5)
    for n, t in update.to_dense().items():
        torch.testing.assert_close(acc.result("sum")[n], 0.5 * t)


# ------------------------------------------------------------------------------- staleness weights


def test_staleness_registry_and_values():
    from fedcomp.server.staleness import STALENESS, build_staleness

    assert {"constant", "polynomial", "hinge", "fedbuff"} <= set(STALENESS.names())
    taus = [0, 1, 3, 4, 5, 8, 99]
    expected = {
        ("constant", ()): [1.0] * 7,
        ("polynomial", ()): [1.0, 2**-0.5, 0.5, 5**-0.5, 6**-0.5, 1 / 3, 0.1],
        ("polynomial", (("a", 1.0),)): [1.0, 0.5, 0.25, 0.2, 1 / 6, 1 / 9, 0.01],
        ("hinge", ()): [1.0, 1.0, 1.0, 1.0, 1 / 11, 1 / 41, 1 / 951],
        ("hinge", (("a", 0.5), ("b", 0))): [1.0, 1 / 1.5, 1 / 2.5, 1 / 3, 1 / 3.5, 1 / 5, 1 / 50.5],
        ("fedbuff", ()): [1.0, 2**-0.5, 0.5, 5**-0.5, 6**-0.5, 1 / 3, 0.1],
    }
    for (name, opts), values in expected.items():
        fn = build_staleness(name, **dict(opts))
        got = [fn(t) for t in taus]
        assert got == pytest.approx(values, rel=1e-12), (name, opts)
        assert all(isinstance(v, float) for v in got)


@pytest.mark.parametrize("name", ["constant", "polynomial", "hinge", "fedbuff"])
def test_staleness_rejects_bad_tau_and_is_monotone(name):
    import numpy as np

    from fedcomp.server.staleness import build_staleness

    fn = build_staleness(name)
    with pytest.raises(ValueError, match="tau"):
        fn(-1)
    with pytest.raises(TypeError):
        fn(1.5)
    with pytest.raises(TypeError):
        fn(True)
    assert fn(np.int64(3)) == fn(3)
    values = [fn(t) for t in range(200)]
    assert values[0] == 1.0 and all(v > 0 for v in values)
    assert all(a >= b for a, b in zip(values, values[1:], strict=False))


def test_staleness_config_validation():
    from fedcomp.registry import ConfigError
    from fedcomp.server.staleness import build_staleness

    with pytest.raises(ConfigError):
        build_staleness("polynomial", a=-1.0)
    with pytest.raises(ConfigError):
        build_staleness("hinge", b=-2)
    with pytest.raises(ConfigError, match="takes no options"):
        build_staleness("fedbuff", a=1.0)
    with pytest.raises(ConfigError, match="unknown staleness"):
        build_staleness("exponential")

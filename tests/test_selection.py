"""Sampled-threshold top-k selection: count band, ordering, completeness above the threshold, never empty."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import fedcomp
from fedcomp.compressors.selection import (
    _DIRECT_BELOW,
    BLOCK,
    HIGH,
    LOW,
    coprime_stride,
    sample_plan,
    sampled_topk,
    select,
)


def data(kind, n, gen):
    if kind == "normal":
        return torch.randn(n, generator=gen)
    if kind == "uniform":
        return torch.rand(n, generator=gen) * 2 - 1
    if kind == "cauchy":  # heavy-tailed
        return torch.empty(n).cauchy_(generator=gen)
    if kind == "lognormal":
        return torch.empty(n).log_normal_(0.0, 2.0, generator=gen) * torch.randn(n, generator=gen).sign()
    if kind == "sparse":  # mostly zeros, a few nonzeros clustered at the front
        x = torch.zeros(n)
        m = max(1, n // 50)
        x[:m] = torch.randn(m, generator=gen)
        return x
    raise ValueError(kind)


def check(x, k, s):
    idx = s.indices
    assert idx.dtype == torch.int64 and idx.dim() == 1
    if idx.numel():
        assert int(idx.min()) >= 0 and int(idx.max()) < x.numel()
        assert torch.all(idx[1:] > idx[:-1]), "sorted and unique"
    nnz = int((x != 0).sum())
    c = idx.numel()
    if nnz < math.ceil(LOW * k):
        assert c == nnz and torch.all(x[idx] != 0), "fewer nonzeros than 0.8k: all of them"
    elif s.exact:
        assert c == min(k, nnz)  # exact top-k, zeros dropped
        # exactly the k largest magnitudes: nothing left out is larger than the smallest kept
        kept = x[idx].abs()
        rest = x.abs().clone()
        rest[idx] = -1
        assert float(rest.max()) <= float(kept.min())
    else:
        assert math.ceil(LOW * k) <= c <= math.floor(HIGH * k)
        # the selected set is exactly {|x| >= thr} (thr == 0: every nonzero)
        want = x.abs() >= s.threshold if s.threshold > 0 else x != 0
        assert torch.equal(idx, torch.nonzero(want).view(-1))
    if nnz:
        assert c > 0


@pytest.mark.parametrize("kind", ["normal", "uniform", "cauchy", "lognormal", "sparse"])
@pytest.mark.parametrize("n", [1000, 5003, 70_001, 1 << 20])
@pytest.mark.parametrize("density", [0.001, 0.01, 0.25])
def test_count_in_band_on_many_distributions(kind, n, density):
    gen = torch.Generator().manual_seed(n + int(density * 1000))
    x = data(kind, n, gen)
    k = max(1, round(density * n))
    for _ in range(3):
        check(x, k, select(x, k, generator=gen))


@settings(max_examples=60, deadline=None)
@given(
    seed=st.integers(0, 2**31),
    n=st.integers(2, 5000),
    density=st.floats(1e-3, 0.9),
    kind=st.sampled_from(["normal", "uniform", "cauchy", "sparse"]),
    zero_frac=st.sampled_from([0.0, 0.5, 0.99, 1.0]),
    sample_rate=st.sampled_from([0.001, 0.01, 0.2]),
    min_samples=st.sampled_from([1, 16, 4096]),
    max_iters=st.integers(1, 4),
)
def test_contract_property(seed, n, density, kind, zero_frac, sample_rate, min_samples, max_iters):
    gen = torch.Generator().manual_seed(seed)
    x = data(kind, n, gen)
    x[torch.rand(n, generator=gen) < zero_frac] = 0
    k = max(1, min(n - 1, round(density * n)))
    s = select(x, k, generator=gen, sample_rate=sample_rate, min_samples=min_samples, max_iters=max_iters)
    check(x, k, s)


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**31), n=st.integers(2, 3000), pos=st.integers(0, 2999), k=st.integers(1, 50))
def test_never_empty_for_a_single_nonzero(seed, n, pos, k):
    x = torch.zeros(n)
    x[pos % n] = -1e-30
    idx = sampled_topk(x, min(k, n - 1) or 1, generator=torch.Generator().manual_seed(seed), min_samples=1)
    assert idx.tolist() == [pos % n]


def test_all_zero_gives_empty_selection():
    for n in (100, 100_000):
        assert select(torch.zeros(n), 10, generator=torch.Generator()).indices.numel() == 0


def test_exact_when_the_sample_is_the_whole_tensor():
    """n <= min_samples: the threshold is the true k-th largest, so the selection is exact top-k (recall 1)."""
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(3000, generator=gen)
    for k in (1, 3, 30, 300):
        s = select(x, k, generator=gen, min_samples=4096)
        top = torch.topk(x.abs(), k).indices.sort().values
        assert torch.equal(s.indices, top) and s.passes == 1


def test_recall_against_exact_topk_with_sampled_threshold():
    """Sampled threshold: the selection is the exact top-c set for its own count c, so recall vs top-k is min(c,k)/k."""
    gen = torch.Generator().manual_seed(6)
    x = torch.empty(1 << 20).cauchy_(generator=gen)
    k = 1000
    s = select(x, k, generator=gen)
    top = set(torch.topk(x.abs(), k).indices.tolist())
    got = set(s.indices.tolist())
    assert len(top & got) == min(len(got), k)


def test_retries_lower_the_threshold_and_fallback_is_exact():
    """Large values exactly at the sample positions (drawn as ``select`` will draw them): the sample overrates the
    threshold, the first pass undershoots and one retry at a lower rank lands in the band; with no retry allowed,
    exact top-k over everything. Large values off the sample: overshoot, exact top-k among the candidates."""
    n, k = 200_000, 1000
    for seed in range(6):
        start, stride, m = sample_plan(n, torch.Generator().manual_seed(seed), 0.01, 1)
        on = torch.zeros(n, dtype=torch.bool)
        on[start::stride] = True
        base = torch.rand(n, generator=torch.Generator().manual_seed(100 + seed)) * 0.1
        x = torch.where(on, base + 10.0, base)
        for max_iters, passes, exact in ((3, 2, False), (1, 1, True)):
            s = select(x, k, generator=torch.Generator().manual_seed(seed), sample_rate=0.01, min_samples=1,
                       max_iters=max_iters)
            check(x, k, s)
            assert (s.passes, s.exact) == (passes, exact)
        off = torch.nonzero(~on).view(-1)[: 2 * k]
        y = base.clone()
        y[off] += 10.0
        s = select(y, k, generator=torch.Generator().manual_seed(seed), sample_rate=0.01, min_samples=1)
        check(y, k, s)
        assert (s.passes, s.exact) == (1, True) and m >= 2000


def test_exact_fallback_never_pads_with_zeros():
    """900 nonzeros (0.9 k) at even positions: undershoot then exact fallback, or thr = 0; either way all 900."""
    n, k = 200_000, 1000
    x = torch.zeros(n)
    x[:1800:2] = 10 + torch.rand(900, generator=torch.Generator().manual_seed(1))
    for seed in range(6):
        s = select(x, k, generator=torch.Generator().manual_seed(seed), sample_rate=0.5, min_samples=1, max_iters=1)
        assert torch.equal(s.indices, torch.arange(0, 1800, 2))


# --- the sample's stride: no aliasing with the tensor's rows ----------------------------------------------------


def floor_stride(n: int, size: int) -> int:
    """The stride rule before the fix: ``n // size``, which shares factors with row lengths (stride 8 on 64)."""
    return n // size


def scaled(shape, kind, seed):
    """Normal values with a log-normal scale per row or per column of the 2-D view ``(shape[0], -1)``."""
    gen = torch.Generator().manual_seed(seed)
    rows, cols = shape[0], math.prod(shape[1:])
    scale = torch.randn(rows if kind == "row" else cols, generator=gen).exp()
    x = torch.randn(rows, cols, generator=gen) * (scale[:, None] if kind == "row" else scale)
    return x.view(-1)


def fallback_rate(shape, kind, density, stride_rule=None, tensors=5, seeds=40):
    """Share of ``select`` calls that end in an exact top-k, over ``tensors`` draws x ``seeds`` sample starts."""
    exact = 0
    for t in range(tensors):
        x = scaled(shape, kind, t)
        k = round(density * x.numel())
        for seed in range(seeds):
            gen = torch.Generator().manual_seed(seed)
            exact += select(x, k, generator=gen, stride_rule=stride_rule).exact
    return exact / (tensors * seeds)


@pytest.mark.parametrize("kind", ["column", "row"])
def test_scaled_512x64_rarely_falls_back_to_exact_topk(kind):
    """(512, 64) at density 0.01: n // size = 8 divides the row length 64, so the old sample saw 8 of the 64
    columns; with per-column scales most calls fell back to exact top-k (72% measured). Counted, not timed."""
    assert fallback_rate((512, 64), kind, 0.01) <= 0.1
    if kind == "column":
        assert fallback_rate((512, 64), kind, 0.01, stride_rule=floor_stride) >= 0.4  # the test sees aliasing


@settings(max_examples=200, deadline=None)
@given(
    shape=st.lists(st.sampled_from([1, 2, 3, 5, 7, 8, 9, 12, 16, 27, 32, 64, 100, 128]), min_size=2, max_size=4),
    sample_rate=st.sampled_from([0.001, 0.01, 0.05, 0.3]),
    min_samples=st.sampled_from([1, 64, 4096]),
    seed=st.integers(0, 2**31),
)
def test_sample_visits_every_column_evenly(shape, sample_rate, min_samples, seed):
    """For every row length L of the shape (a product of trailing dimensions), the sample's positions modulo L are
    all distinct until every column has been hit: min(count, L) distinct columns, and no column twice ahead of
    another."""
    n = math.prod(shape)
    start, stride, m = sample_plan(n, torch.Generator().manual_seed(seed), sample_rate, min_samples)
    assert m >= min(n, max(min_samples, math.ceil(n * sample_rate))) and math.gcd(stride, n) == 1
    pos = torch.arange(start, n, stride)
    assert pos.numel() == m
    for i in range(1, len(shape)):
        cols = math.prod(shape[i:])
        hits = torch.bincount(pos % cols, minlength=cols)
        assert int(hits.max()) - int(hits.min()) <= 1, (shape, cols, stride)


def test_coprime_stride():
    assert coprime_stride(512 * 64, 4096) == 7  # n // size = 8
    assert coprime_stride(256 * 256 * 9, 5899) == 97  # n // size = 99 = 9 x 11
    assert coprime_stride(100, 100) == 1 and coprime_stride(7, 1) == 6 and coprime_stride(12, 2) == 5


def test_blocked_scan_handles_tail_and_ties():
    """The blocked scan (tensors of ``_DIRECT_BELOW`` elements or more) over the full blocks and the tail past them;
    any valid outcome keeps the 5 largest values when k = 5 (exact: the top 5; thresholded: 4 to 6 kept, all
    ``>= thr``, so ``thr <= 50``)."""
    gen = torch.Generator().manual_seed(8)
    n = (_DIRECT_BELOW // BLOCK + 100) * BLOCK + 37
    x = torch.randn(n, generator=gen)
    x[-5:] = 50.0  # the largest values live in the tail, beyond the last full block
    x[:300] = 7.0  # and a run of ties
    s = select(x, 5, generator=gen, min_samples=1, sample_rate=0.01)
    check(x, 5, s)
    assert set(range(n - 5, n)) <= set(s.indices.tolist()), s


def test_deterministic_given_the_generator():
    x = torch.randn(1 << 18, generator=torch.Generator().manual_seed(9))
    a = select(x, 262, generator=torch.Generator().manual_seed(1)).indices
    b = select(x, 262, generator=torch.Generator().manual_seed(1)).indices
    assert torch.equal(a, b)


def test_k_at_least_numel_selects_everything():
    assert torch.equal(select(torch.randn(10), 10).indices, torch.arange(10))


# --- the sparsifiers built on top -------------------------------------------------------------------------------


def test_topk_compressor_is_exact_and_sorted():
    x = torch.randn(64, 100, generator=torch.Generator().manual_seed(10))
    p = fedcomp.build_compressor("topk", density=0.01).compress(x, "w")
    want = torch.topk(x.abs().view(-1), 64).indices.sort().values
    assert torch.equal(p.indices, want) and torch.equal(p.values.data, x.view(-1)[want])


@pytest.mark.parametrize(("n", "k"), [(10_000, 10), (10_000, 4000), (300, 200)])
def test_randomk_uniform_sorted_seeded(n, k):
    comp = fedcomp.build_compressor("randomk", seed=3)
    counts = torch.zeros(n)
    draws = 400
    for _ in range(draws):
        idx = comp.select(torch.ones(n), k, "w")
        assert idx.numel() == k and torch.all(idx[1:] > idx[:-1]) and 0 <= int(idx[0]) and int(idx[-1]) < n
        counts[idx] += 1
    # every position is hit about draws * k / n times (binomial), none far off
    mean = draws * k / n
    sd = math.sqrt(draws * (k / n) * (1 - k / n))
    assert float((counts - mean).abs().max()) <= 6 * sd + 1
    assert abs(float(counts.mean()) - mean) < 1e-6 * mean + 1e-9
    a = fedcomp.build_compressor("randomk", seed=5)
    state = a.state_dict()
    first = a.select(torch.ones(n), k, "w")
    a.load_state_dict(state)
    assert torch.equal(a.select(torch.ones(n), k, "w"), first)


def test_dgc_compressor_follows_the_warmup_and_keeps_state():
    gen = torch.Generator().manual_seed(12)
    x = torch.randn(200, 500, generator=gen)  # 100k elements
    comp = fedcomp.build_compressor("dgc", density=0.001, warmup_epochs=4, seed=1)
    for epoch, density in [(0, 0.25), (1.5, 0.0625), (2, 0.015625), (3.99, 0.00390625), (4, 0.001), (50, 0.001)]:
        comp.set_epoch(epoch)
        k = round(density * x.numel())
        c = comp.compress(x, "w").nnz
        assert math.ceil(0.8 * k) <= c <= math.floor(1.3 * k), (epoch, c, k)
    assert comp.compress(torch.randn(300, generator=gen), "bias").is_dense
    comp.set_epoch(1)
    state = comp.state_dict()
    a = comp.compress(x, "w")
    other = fedcomp.build_compressor("dgc", density=0.001, warmup_epochs=4, seed=99)
    other.load_state_dict(state)
    b = other.compress(x, "w")
    assert other.epoch == 1 and torch.equal(a.indices, b.indices)

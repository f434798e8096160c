"""The Triton kernels (fedcomp.kernels) against the torch reference, run on the CPU by Triton's interpreter.

``TRITON_INTERPRET=1`` is set here, at import, before anything imports the kernel modules: fedcomp.kernels
imports triton (and defines its kernels) lazily, on the first Triton call, so the order of test modules in a
pytest process does not matter. The only skip is triton not being installed. Sizes stay small (<= 50k elements):
the interpreter runs each program in numpy.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

os.environ["TRITON_INTERPRET"] = "1"

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

triton = pytest.importorskip("triton", reason="triton not installed")

from fedcomp.client.pipeline import build_compressor  # noqa: E402
from fedcomp.compressors.blockwise import BlockwiseConfig, Int4Quantizer, Int8Quantizer  # noqa: E402
from fedcomp.compressors.qsgd import QSGDConfig, QSGDQuantizer  # noqa: E402
from fedcomp.compressors.selection import select  # noqa: E402
from fedcomp.compressors.sign import SignConfig, SignQuantizer  # noqa: E402
from fedcomp.kernels import _backend, hooks  # noqa: E402
from fedcomp.kernels._dgc_buffers import capacity  # noqa: E402
from fedcomp.kernels._dgc_select import velocity_sample  # noqa: E402
from fedcomp.kernels.dgc import fused_dgc_step, sample_plan, start_select  # noqa: E402
from fedcomp.kernels.hooks import find_fused_step, fused_send  # noqa: E402
from fedcomp.kernels.quant import ef_quantize, pack_codes  # noqa: E402
from fedcomp.kernels.scatter import scatter_add  # noqa: E402
from fedcomp.memory.dgc import DGCMemory, DGCMemoryConfig  # noqa: E402
from fedcomp.memory.residual import NoMemory, ResidualMemory  # noqa: E402
from fedcomp.payload import TensorPayload, ValueCoding, Values  # noqa: E402
from fedcomp.wire.bits import pack_uint  # noqa: E402

T = "triton"
FAST = settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])


# ----------------------------------------------------------------------------------------------- dispatch


def test_dispatch_rule():
    cpu = torch.zeros(3)
    assert _backend.resolve(cpu) == "torch"  # auto: CPU tensors take the reference
    assert _backend.resolve(cpu, "triton") == "triton"  # allowed here: the interpreter is on
    with pytest.raises(ValueError):
        _backend.resolve(cpu, "cuda")


def test_package_import_does_not_import_triton():
    code = "import sys, fedcomp.kernels.hooks, fedcomp.kernels.scatter; assert 'triton' not in sys.modules"
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": str(root)}
    env.pop("TRITON_INTERPRET")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=root, env=env)


# ----------------------------------------------------------------------------------------------- DGC step


def dgc_memory(cfg: DGCMemoryConfig, u, v) -> DGCMemory:
    """A ``DGCMemory`` whose state of tensor "t" is a copy of momentum ``u`` and velocity ``v``."""
    mem = DGCMemory(cfg)
    mem.load_state_dict({"u": {"t": u}, "v": {"t": v}})
    return mem


def ref_step(g, u, v, k, cfg: DGCMemoryConfig, gen, threshold=None, **sel):
    """The reference: DGCMemory.compensate -> selection.select (or a fixed threshold) -> DGCMemory.update."""
    mem = dgc_memory(cfg, u, v)
    vv = mem.compensate(g, "t")
    flat = vv.view(-1)
    if threshold is None:
        s = select(flat, k, generator=gen, **sel)
        idx, passes, exact = s.indices, s.passes, s.exact
    else:
        a = flat.abs()
        idx, passes, exact = torch.nonzero((a >= threshold) & (a > 0)).view(-1), 1, False
    p = TensorPayload(tuple(g.shape), Values.f32(flat[idx]), idx)
    mem.update(vv, "t", p)
    return idx, p.values.data, mem.momentum("t"), mem.residual("t"), passes, exact


def kernel_step(g, u, v, k, cfg: DGCMemoryConfig, gen, **opts):
    u, v = u.clone(), v.clone()
    step = fused_dgc_step(g, u, v, k=k, momentum=cfg.momentum, nesterov=cfg.nesterov, masking=cfg.masking,
                          clip_norm=cfg.clip_norm, clip_workers=cfg.clip_workers, generator=gen, backend=T, **opts)
    return step, u, v


def assert_same_step(ref, got):
    idx, vals, u, v, passes, exact = ref
    step, u2, v2 = got
    assert torch.equal(step.indices, idx)
    assert torch.equal(step.values, vals)
    assert torch.equal(u2, u) and torch.equal(v2, v)
    assert (step.passes, step.exact) == (passes, exact)


def random_state(n, seed):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(n, generator=gen) * s for s in (1.0, 0.5, 0.3)]


CONFIGS = {
    "plain": DGCMemoryConfig(),
    "nesterov-clipped": DGCMemoryConfig(nesterov=True, clip_norm=20.0, clip_workers=4),
    "clip-inactive": DGCMemoryConfig(clip_norm=1e6),  # scale == 1 on the device: the unclipped arithmetic
    "no-masking": DGCMemoryConfig(momentum=0.5, masking=False),
}


@pytest.mark.parametrize("name, n", [(name, 30_000) for name in CONFIGS] + [("plain", 70_001)])
def test_dgc_step_matches_reference(name, n):  # 70_001: the reference's blocked scan (n >= 65536) and a tail
    cfg = CONFIGS[name]
    g, u, v = random_state(n, 1)
    ref = ref_step(g, u, v, n // 100, cfg, torch.Generator().manual_seed(5))
    got = kernel_step(g, u, v, n // 100, cfg, torch.Generator().manual_seed(5))
    assert_same_step(ref, got)


def test_velocity_sample_is_the_reference_velocity():
    g, u, v = random_state(20_000, 2)
    cfg = CONFIGS["nesterov-clipped"]
    mem = dgc_memory(cfg, u, v)
    want = mem.compensate(g, "t")[7::13].abs()
    from fedcomp.memory.dgc_math import clip_scale_tensor, clip_threshold

    scale = clip_scale_tensor(g, clip_threshold(cfg.clip_norm, cfg.clip_workers))
    got = velocity_sample(g, u, v, start=7, stride=13, momentum=cfg.momentum, nesterov=True, scale=scale)
    assert torch.equal(got, want)


def crafted(n, k, big, seed=0, min_samples=4096, sample_big=False):
    """g whose sample positions (as the generator seeded ``seed`` will draw them) are tiny (or, with
    ``sample_big``, the only large values), plus ``big`` large distinct values elsewhere."""
    start, stride, _ = sample_plan(n, torch.Generator().manual_seed(seed), 0.01, min_samples)
    gen = torch.Generator().manual_seed(100 + seed)
    g = torch.zeros(n) if not sample_big else torch.rand(n, generator=gen) * 0.01
    mask = torch.zeros(n, dtype=torch.bool)
    mask[start::stride] = True
    g[mask] = (1.0 + torch.rand(int(mask.sum()), generator=gen)) * (10.0 if sample_big else 1e-3)
    if big:
        others = torch.nonzero(~mask).view(-1)
        pick = others[torch.randperm(others.numel(), generator=gen)[:big]]
        g[pick] = 1.0 + torch.rand(big, generator=gen)
    return g


@pytest.mark.parametrize(
    "case, big, sample_big, max_iters, want",
    [
        ("retry", 0, True, 3, (2, False)),  # sample over-estimates the threshold: one lower retry, in band
        ("fallback", 0, True, 1, (1, True)),  # no retry allowed: exact top-k over everything
        ("over-select", 1000, False, 3, (1, True)),  # 1045 candidates > 1.3 k: exact top-k among them
        ("overflow", 3000, False, 3, (1, True)),  # more candidates than the buffer holds: exact top-k of v
    ],
)
def test_dgc_selection_paths(case, big, sample_big, max_iters, want):
    n, k, cfg = 40_000, 400, DGCMemoryConfig()
    g = crafted(n, k, big, sample_big=sample_big)
    u, v = torch.zeros(n), torch.zeros(n)
    if case == "overflow":
        assert big > capacity(k)
    ref = ref_step(g, u, v, k, cfg, torch.Generator().manual_seed(0), max_iters=max_iters)
    assert ref[4:] == want  # the crafted input reaches the intended branch of the reference
    got = kernel_step(g, u, v, k, cfg, torch.Generator().manual_seed(0), max_iters=max_iters)
    assert_same_step(ref, got)


@FAST
@given(
    n=st.integers(1, 6000),
    density=st.floats(0.0005, 0.3),
    nesterov=st.booleans(),
    masking=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_dgc_steps_property(n, density, nesterov, masking, seed):
    cfg = DGCMemoryConfig(momentum=0.9, nesterov=nesterov, masking=masking)
    k = max(1, round(density * n))
    g, u, v = random_state(n, seed)
    ref = ref_step(g, u, v, k, cfg, torch.Generator().manual_seed(seed), min_samples=256)
    got = kernel_step(g, u, v, k, cfg, torch.Generator().manual_seed(seed), min_samples=256)
    assert_same_step(ref, got)


def test_same_threshold_same_indices_and_bounded_fallback():
    g, u, v = random_state(25_000, 3)
    cfg = CONFIGS["plain"]
    mem = dgc_memory(cfg, u, v)
    thr = float(torch.topk(mem.compensate(g, "t").abs(), 500).values[-1])
    ref = ref_step(g, u, v, 400, cfg, None, threshold=thr)
    step, u2, v2 = kernel_step(g, u, v, 400, cfg, None, threshold=thr)
    assert step.indices.numel() == 500 and not step.exact
    assert_same_step(ref, (step, u2, v2))
    # Half the threshold passes far more than the buffer for k = 50 holds (1089): the exact top-k instead.
    step, u3, v3 = kernel_step(g, u, v, 50, cfg, None, threshold=torch.tensor(thr * 0.5))
    assert step.exact and step.indices.numel() == 50
    ref_v = mem.residual("t").clone()  # the compensated velocity before any send
    top = torch.topk(ref_v.abs(), 50).indices.sort().values
    assert torch.equal(step.indices, top) and torch.equal(step.values, ref_v[top])
    ref_v[top] = 0.0
    ref_u = mem.momentum("t").clone()
    ref_u[top] = 0.0
    assert torch.equal(v3, ref_v) and torch.equal(u3, ref_u)


def test_dense_and_edge_k():
    g, u, v = random_state(3000, 4)
    cfg = CONFIGS["plain"]
    for k in (0, 3000, 5000):
        ref = ref_step(g, u, v, k, cfg, None)
        step, u2, v2 = kernel_step(g, u, v, k, cfg, None)
        assert torch.equal(step.indices, ref[0]) and torch.equal(step.values, ref[1])
        assert torch.equal(u2, ref[2]) and torch.equal(v2, ref[3])
    step, u2, v2 = kernel_step(g, u, v, 1, cfg, None, dense=True)
    mem = dgc_memory(cfg, u, v)
    want = mem.compensate(g, "t").clone()
    assert step.indices is None and torch.equal(step.values, want)
    assert torch.equal(v2, torch.zeros_like(v2)) and torch.equal(u2, mem.momentum("t"))  # dense: not masked


# ----------------------------------------------------------------------------------------------- placement

#: Sizes around the kernels' block of 1024 (a block's marks are 32 words) and small ones.
BOUNDARY_SIZES = [1, 31, 32, 33, 1023, 1024, 1025, 2047, 2048, 2049, 3072]


def tied(n: int, levels: int, seed: int) -> torch.Tensor:
    """``n`` values of at most ``levels`` magnitudes (0 among them: ties and zeros everywhere), random signs."""
    gen = torch.Generator().manual_seed(seed)
    mags = torch.tensor([0.0, 1.0, 0.5, 2.0, 3.0])[:levels]
    signs = torch.randint(2, (n,), generator=gen) * 2.0 - 1.0
    return mags[torch.randint(levels, (n,), generator=gen)] * signs


def select_both(x, k, seed, **opts):
    """``selection.select`` and ``start_select`` (with cut points) of ``x`` from the same generator seed."""
    ref = select(x, k, generator=torch.Generator().manual_seed(seed), **opts)
    n = x.numel()
    cuts = torch.tensor(sorted({0, n // 3, n // 2, max(n - 1, 0), n}))
    step, below = start_select(x, k, generator=torch.Generator().manual_seed(seed), cuts=cuts, **opts).resolve()
    return ref, step, below, cuts


def assert_same_selection(x, k, seed, **opts):
    before = x.clone()
    ref, step, below, cuts = select_both(x, k, seed, **opts)
    assert torch.equal(step.indices, ref.indices)
    assert torch.equal(step.values, x[ref.indices])
    assert (step.passes, step.exact) == (ref.passes, ref.exact)
    assert torch.equal(x, before)  # select-only: x is not touched
    if 0 < k < x.numel() and ref.passes == 1 and not ref.exact:  # the first pass's candidates: cut points read
        assert below == torch.searchsorted(ref.indices, cuts).tolist()
    else:
        assert below is None
    return ref


SELECT_SETTINGS = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@SELECT_SETTINGS
@given(
    n=st.one_of(st.sampled_from(BOUNDARY_SIZES), st.integers(2, 6000)),
    k_frac=st.floats(0.0, 0.5),
    values=st.sampled_from(["tied", "normal", "heavy"]),
    levels=st.integers(1, 5),
    min_samples=st.sampled_from([8, 64, 4096]),
    max_iters=st.integers(1, 3),
    seed=st.integers(0, 2**16),
)
def test_start_select_is_the_reference_select(n, k_frac, values, levels, min_samples, max_iters, seed):
    """The device selection (marks, cumsum, placement; no sort) gives ``selection.select``'s indices, passes and
    exactness on tied and zero values and noisy samples (every rule: in band, retries, top-k among the candidates
    or of everything), sizes around the block; ``x`` is untouched and the cut points read with the count are the
    final indices' own."""
    gen = torch.Generator().manual_seed(seed)
    x = {"tied": lambda: tied(n, levels, seed), "normal": lambda: torch.randn(n, generator=gen),
         "heavy": lambda: torch.randn(n, generator=gen) ** 5}[values]()
    k = max(1, min(n - 1, round(k_frac * n)))
    assert_same_selection(x, k, seed, min_samples=min_samples, max_iters=max_iters)


@pytest.mark.parametrize("n, k", [(0, 0), (0, 3), (5, 0), (5, -1), (5, 5), (5, 9), (1024, 1024), (1025, 0)])
def test_start_select_edges(n, k):
    """Empty inputs, k = 0 (nothing) and k >= n (everything): select's results, without a pass."""
    ref = assert_same_selection(torch.randn(n, generator=torch.Generator().manual_seed(n)), k, 0)
    assert ref.passes == 0


@pytest.mark.parametrize(
    "case, big, sample_big, max_iters, want",
    [
        ("in band", None, False, 3, (1, False)),
        ("retry", 0, True, 3, (2, False)),
        ("fallback", 0, True, 1, (1, True)),
        ("over-select", 1000, False, 3, (1, True)),
        ("overflow", 3000, False, 3, (1, True)),
    ],
)
def test_start_select_paths(case, big, sample_big, max_iters, want):
    """The crafted inputs of the DGC step's paths (``crafted``) reach each rule of the selection here too."""
    n, k = 40_000, 400
    x = torch.randn(n, generator=torch.Generator().manual_seed(1)) if big is None else crafted(n, k, big,
                                                                                              sample_big=sample_big)
    ref = assert_same_selection(x, k, 0, max_iters=max_iters)
    assert (ref.passes, ref.exact) == want, case


@pytest.mark.parametrize("n", BOUNDARY_SIZES[4:])
@pytest.mark.parametrize("levels", [2, 5])
def test_dgc_step_at_block_boundaries_with_ties(n, levels):
    """The fused step's placement at sizes around the block, on tied velocities (the threshold equals many values;
    over-selection takes the top-k among candidates of equal magnitude): the reference's indices, values and state
    bits."""
    cfg = CONFIGS["plain"]
    g, u, v = tied(n, levels, 1), tied(n, levels, 2), tied(n, levels, 3)
    for k in (1, n // 50 + 1, n // 3):
        ref = ref_step(g, u, v, k, cfg, torch.Generator().manual_seed(k), min_samples=64)
        got = kernel_step(g, u, v, k, cfg, torch.Generator().manual_seed(k), min_samples=64)
        assert_same_step(ref, got)


def test_placement_is_sorted_and_bounded():
    """A fixed threshold that passes more than the buffer holds: the buffer's first ``capacity`` entries are the
    smallest passing positions in order (what ``top_of_v`` puts back), and the step still equals the exact top-k."""
    from fedcomp.kernels._dgc_select import Selection

    n, k = 20_000, 10
    x = torch.randn(n, generator=torch.Generator().manual_seed(0))
    run = Selection(x, capacity(k))
    run.first(torch.tensor([0.5]))
    c, zero = run.readout()
    want = torch.nonzero(x.abs() >= 0.5).view(-1)
    assert (c, zero) == (want.numel(), False) and c > run.buf.capacity
    assert torch.equal(run.buf.idx, want[: run.buf.capacity])
    assert torch.equal(run.buf.val, x[want[: run.buf.capacity]])


# ----------------------------------------------------------------------------------------------- quantize


DETERMINISTIC = [
    Int8Quantizer(BlockwiseConfig(stochastic=False)),
    Int4Quantizer(BlockwiseConfig(stochastic=False)),
    Int4Quantizer(BlockwiseConfig(block=100, stochastic=False)),  # not a power of two
    Int8Quantizer(BlockwiseConfig(block=5000, stochastic=False)),  # above one tile: two-pass path
    SignQuantizer(),  # one scale for the whole tensor
    SignQuantizer(SignConfig(block=64)),
    SignQuantizer(SignConfig(block=60)),  # packing cannot follow blocks: separate pack pass
]


@pytest.mark.parametrize("q", DETERMINISTIC, ids=lambda q: f"{type(q).__name__}-{q.config.block}")
@pytest.mark.parametrize("n", [1, 777, 20_001])
def test_deterministic_quantize_matches_reference(q, n):
    gen = torch.Generator().manual_seed(n)
    x, e = torch.randn(n, generator=gen), torch.randn(n, generator=gen) * 0.1
    e_ref, e_got = e.clone(), e.clone()
    ref = ef_quantize(q, x, e_ref, pack=True, backend="torch")
    got = ef_quantize(q, x, e_got, pack=True, backend=T)
    assert torch.equal(got.values.data, ref.values.data)
    assert got.values.block == ref.values.block and got.values.coding == ref.values.coding
    assert torch.equal(got.packed, ref.packed)
    if isinstance(q, SignQuantizer):  # a sum: same up to fp32 rounding of the summation order
        torch.testing.assert_close(got.values.scales, ref.values.scales, rtol=2e-6, atol=0)
        torch.testing.assert_close(e_got, e_ref, rtol=0, atol=4 * float(ref.values.scales.max()) * 2**-23)
    else:
        assert torch.equal(got.values.scales, ref.values.scales)
        assert torch.equal(e_got, e_ref)


@pytest.mark.parametrize("coding, q", [(ValueCoding.INT4, Int4Quantizer(BlockwiseConfig(stochastic=False))),
                                       (ValueCoding.SIGN, SignQuantizer(SignConfig(block=256)))])
def test_packing_is_the_wire_format(coding, q):
    x = torch.randn(1000)
    got = ef_quantize(q, x, pack=True, backend=T)
    codes = got.values.data.numpy()
    fields = codes > 0 if coding is ValueCoding.SIGN else codes.view(np.uint8) & np.uint8(15)
    wire = pack_uint(fields, 1 if coding is ValueCoding.SIGN else 4)
    assert got.packed.numpy().tobytes() == wire
    assert pack_codes(got.values.data, coding).numpy().tobytes() == wire


STOCHASTIC = [Int8Quantizer(BlockwiseConfig(seed=1)), Int4Quantizer(BlockwiseConfig(block=128, seed=2)),
              QSGDQuantizer(QSGDConfig(seed=3)), QSGDQuantizer(QSGDConfig(levels=7, bucket=100, seed=4))]


@pytest.mark.parametrize("q", STOCHASTIC, ids=lambda q: f"{type(q).__name__}-{q.qmax}")
def test_stochastic_rounding_distribution(q):
    n = 30_000
    x = torch.randn(n, generator=torch.Generator().manual_seed(9))
    e = torch.zeros(n)
    state = q.state_dict()
    got = ef_quantize(q, x, e, backend=T)
    ref = ef_quantize(q, x, torch.zeros(n), backend="torch")
    v = got.values
    torch.testing.assert_close(v.scales, ref.values.scales, rtol=1e-6, atol=0)
    per = v.scales.repeat_interleave(v.block)[:n]
    r = torch.where(per > 0, x / torch.where(per > 0, per, 1.0), 0.0).clamp(-q.qmax, q.qmax)
    codes = v.data.float()
    assert bool(((codes == r.floor()) | (codes == r.ceil())).all())  # a neighbouring integer, always
    frac = r - r.floor()
    z = float((codes - r).sum()) / math.sqrt(float((frac * (1 - frac)).sum()))
    assert abs(z) < 5  # unbiased: E[code] == r
    up = codes > r.floor()
    assert abs(float(up.float().mean() - frac.mean())) < 0.02
    assert torch.equal(e, x - v.dequantize())  # error feedback keeps exactly what was not sent
    q.load_state_dict(state)  # same generator state -> same seed -> same codes
    assert torch.equal(ef_quantize(q, x, backend=T).values.data, v.data)
    assert not torch.equal(ef_quantize(q, x, backend=T).values.data, v.data)  # next call, next seed


@FAST
@given(n=st.integers(1, 3000), block=st.integers(1, 700), bits=st.sampled_from([4, 8]), seed=st.integers(0, 99))
def test_blockwise_property(n, block, bits, seed):
    cls = Int4Quantizer if bits == 4 else Int8Quantizer
    q = cls(BlockwiseConfig(block=block, stochastic=False))
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=gen) * torch.rand(1, generator=gen) * 10
    x[torch.rand(n, generator=gen) < 0.2] = 0.0
    e1, e2 = torch.zeros(n), torch.zeros(n)
    ref = ef_quantize(q, x, e1, pack=True, backend="torch")
    got = ef_quantize(q, x, e2, pack=True, backend=T)
    assert torch.equal(got.values.data, ref.values.data) and torch.equal(got.values.scales, ref.values.scales)
    assert torch.equal(got.packed, ref.packed) and torch.equal(e1, e2)


# ----------------------------------------------------------------------------------------------- scatter-add


def _payloads(n=12_000, nnz=1500):
    gen = torch.Generator().manual_seed(11)
    idx = torch.randperm(n, generator=gen)[:nnz].sort().values
    out = []
    for dense in (False, True):
        m = n if dense else nnz
        vals = [
            Values.f32(torch.randn(m, generator=gen)),
            Values(ValueCoding.F16, torch.randn(m, generator=gen).half()),
            Values(ValueCoding.BF16, torch.randn(m, generator=gen).bfloat16()),
            Values(ValueCoding.INT8, torch.randint(-127, 128, (m,), generator=gen, dtype=torch.int8),
                   torch.rand(math.ceil(m / 256), generator=gen), 256),
            Values(ValueCoding.SIGN, torch.randint(0, 2, (m,), generator=gen, dtype=torch.int8) * 2 - 1,
                   torch.rand(1, generator=gen), m),
        ]
        out += [TensorPayload((n // 100, 100), v, None if dense else idx) for v in vals]
    return out


def _payload_id(p: TensorPayload) -> str:
    return f"{p.values.coding.name}-{'dense' if p.is_dense else 'sparse'}"


@pytest.mark.parametrize("payload", _payloads(), ids=_payload_id)
def test_scatter_add_matches_add_to(payload):
    t = torch.randn(payload.shape)
    ref, got = t.clone(), t.clone()
    payload.add_to(ref, 0.37)
    scatter_add(got, payload, 0.37, backend=T)
    assert torch.equal(got, ref)


def test_scatter_add_duplicates_add_twice():
    p = TensorPayload((10,), Values.f32(torch.tensor([1.0, 2.0, 3.0])), torch.tensor([3, 3, 5]))
    ref, got = torch.zeros(10), torch.zeros(10)
    p.add_to(ref, 2.0)
    scatter_add(got, p, 2.0, backend=T)
    assert torch.equal(got, ref)


# ----------------------------------------------------------------------------------------------- pipeline hook


SHAPES = {"w": (64, 300), "b": (64,), "c": (20, 40)}


@pytest.mark.parametrize(
    "compressor, memory, options",
    [
        ("dgc", DGCMemoryConfig(), dict(density=0.01)),
        ("dgc", DGCMemoryConfig(nesterov=True, clip_norm=5.0, clip_workers=4), dict(density=0.01, dense_below=1000)),
        ("dgc+int8", DGCMemoryConfig(), dict(density=0.02, stochastic=False)),
        ("int4", None, dict(stochastic=False)),
        ("dgc", None, dict(density=0.01)),  # federated delta exchange: DGC sparsifier with plain error feedback
        ("dgc+int4", None, dict(density=0.02, stochastic=False)),
    ],
)
def test_fused_send_matches_the_reference_pipeline(compressor, memory, options):
    grads = [{n: torch.randn(s, generator=torch.Generator().manual_seed(i)) for n, s in SHAPES.items()}
             for i in range(3)]
    runs = []
    for fused in (False, True):
        mem = DGCMemory(memory) if memory else ResidualMemory()
        comp = build_compressor(compressor, **options)
        sent = []
        for g in grads:
            for name in SHAPES:
                p = fused_send(mem, comp, g[name], name, backend=T) if fused else None
                if p is None:
                    v = mem.compensate(g[name], name)
                    p = comp.compress(v, name)
                    mem.update(v, name, p)
                sent.append(p)
        state = mem.state_dict()
        runs.append((sent, [t for part in state.values() for t in part.values()]))
    (ref, ref_state), (got, got_state) = runs
    for a, b in zip(ref, got, strict=True):
        assert (a.indices is None and b.indices is None) or torch.equal(a.indices, b.indices)
        assert torch.equal(a.values.data, b.values.data)
    assert all(torch.equal(a, b) for a, b in zip(ref_state, got_state, strict=True))


def test_plain_error_feedback_step_matches_residual_memory():
    g, _, e = random_state(30_000, 6)
    mem = ResidualMemory()
    mem.load_state_dict({"errors": {"t": e}})
    x = mem.compensate(g, "t")
    s = select(x, 300, generator=torch.Generator().manual_seed(1))
    p = TensorPayload((30_000,), Values.f32(x[s.indices]), s.indices)
    mem.update(x, "t", p)
    v = e.clone()
    step = fused_dgc_step(g, None, v, k=300, generator=torch.Generator().manual_seed(1), backend=T)
    assert torch.equal(step.indices, s.indices) and torch.equal(step.values, p.values.data)
    assert torch.equal(v, mem.residual("t"))
    with pytest.raises(ValueError):
        fused_dgc_step(g, None, v, k=300, nesterov=True, backend=T)


@pytest.mark.parametrize(
    "memory, compressor, step",
    [
        (DGCMemory, "dgc", "_dgc_send"),
        (ResidualMemory, "dgc", "_dgc_send"),
        (DGCMemory, "dgc+int4", "_dgc_send"),
        (ResidualMemory, "dgc+sign", "_dgc_send"),
        (ResidualMemory, "int8", "_quantize_send"),  # Int8Quantizer: the entry of AbsmaxQuantizer
        (ResidualMemory, "qsgd", "_quantize_send"),
        (DGCMemory, "int8", None),  # momentum state and a quantizer: no kernel
        (ResidualMemory, "topk", None),
        (ResidualMemory, "dgc+fp16", None),  # a quantizer without a kernel after DGC
        (NoMemory, "dgc", None),
    ],
)
def test_fused_step_registry(memory, compressor, step):
    found = find_fused_step(memory(), build_compressor(compressor))
    assert found is (None if step is None else getattr(hooks, step))


def test_fused_send_without_a_step_leaves_the_memory_alone():
    mem = ResidualMemory()
    assert fused_send(mem, build_compressor("topk"), torch.randn(10, 200), "w", backend=T) is None
    assert mem.state_dict() == {"errors": {}}


def test_fused_send_leaves_cpu_tensors_to_the_reference():
    assert fused_send(DGCMemory(), build_compressor("dgc"), torch.randn(10, 200), "w") is None

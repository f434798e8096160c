"""A whole send on the kernel path with its host reads batched (``FusedBatch``: every tensor's DGC step started
before any count is read; the small-tensor group quantized by the kernel; the totals' sums in one flat buffer),
against the torch reference pipeline, under Triton's interpreter on the CPU.

For hypothesis-made models (many small tensors, empty ones, single elements, dense fallbacks under every
small-tensor policy, k = 1) and three sends with a nack in the middle: the same bytes as the reference pipeline's,
the bytes of ``wire.encode`` of the pending update, bitwise the same memory state and totals; and the counts of one
send's host reads do not grow with the number of tensors (benchmarks/send_counts.py).
"""

from __future__ import annotations

import os
from pathlib import Path

os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

pytest.importorskip("triton", reason="triton not installed")

from fedcomp.client.flat_sums import FlatSums  # noqa: E402
from fedcomp.client.pipeline import build  # noqa: E402
from fedcomp.client.totals import Totals  # noqa: E402
from fedcomp.compressors.blockwise import BlockwiseConfig, Int4Quantizer, Int8Quantizer  # noqa: E402
from fedcomp.kernels.dgc import start_dgc_step  # noqa: E402
from fedcomp.kernels.hooks import FusedBatch  # noqa: E402
from fedcomp.kernels.pending import resolve_all  # noqa: E402
from fedcomp.payload import TensorPayload, Values  # noqa: E402
from fedcomp.spec import ModelSpec  # noqa: E402
from fedcomp.wire import encode  # noqa: E402
from tests.clientkit import benchmark_module

FAST = settings(max_examples=12, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
ROOT = Path(__file__).resolve().parents[1]

shapes = st.one_of(
    st.tuples(st.integers(0, 3)),  # empty, single-element and tiny vectors
    st.tuples(st.integers(1, 40), st.integers(1, 60)),  # small and large matrices around dense_below
    st.tuples(st.integers(30, 80), st.integers(40, 64)),
)


def _spec(shape_list) -> ModelSpec:
    return ModelSpec(tuple((f"t{i}", s) for i, s in enumerate(shape_list)))


def _tensors(obj) -> list[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, dict):
        return [t for k in sorted(obj, key=str) for t in _tensors(obj[k])]
    return []


@FAST
@given(
    shape_list=st.lists(shapes, min_size=1, max_size=9),
    name=st.sampled_from(["dgc", "dgc+int8", "dgc+int4", "int8"]),
    memory=st.sampled_from(["dgc", "residual"]),
    small=st.sampled_from(["group", "dense", "each"]),
    density=st.sampled_from([1e-4, 0.01, 0.3]),
    seed=st.integers(0, 2**16),
)
def test_batched_send_equals_the_reference(shape_list, name, memory, small, density, seed):
    spec = _spec(shape_list)
    opts = dict(density=density, small=small, dense_below=64) if name.startswith("dgc") else {}
    if name != "dgc":
        opts["stochastic"] = False  # round to nearest: the kernel's codes are the reference's
    if name == "int8":
        memory = "residual"
    pipes = {b: build(name, spec, memory=memory, backend=b, **opts) for b in ("torch", "triton")}
    gen = torch.Generator().manual_seed(seed)
    for step in range(3):
        grads = {n: torch.randn(s, generator=gen) * (1 + step) for n, s in spec.entries}
        blobs = {b: p.send(grads) for b, p in pipes.items()}
        assert blobs["triton"] == blobs["torch"], f"step {step}"
        assert blobs["triton"] == encode(pipes["triton"].pending[step + 1], spec)
        if step == 1:
            for p in pipes.values():
                assert p.nack(2)
    ref, got = pipes["torch"], pipes["triton"]
    assert all(torch.equal(a, b) for a, b in zip(_tensors(ref.memory.state_dict()),
                                                  _tensors(got.memory.state_dict()), strict=True))
    assert ref.totals.state_dict().keys() == got.totals.state_dict().keys()
    assert all(torch.equal(a, b) for a, b in zip(_tensors(ref.totals.state_dict()),
                                                  _tensors(got.totals.state_dict()), strict=True))
    for p in pipes.values():  # acks take the sums back off, through the flat buffer's views on the kernel path
        assert p.ack(1) and p.ack(3)
    assert all(torch.equal(a, b) for a, b in zip(_tensors(ref.totals.state_dict()),
                                                  _tensors(got.totals.state_dict()), strict=True))


@FAST
@given(n=st.lists(st.integers(1, 3000), min_size=1, max_size=6), density=st.sampled_from([1e-3, 0.02, 0.5]),
       seed=st.integers(0, 2**16))
def test_started_steps_resolved_at_once_equal_one_by_one(n, density, seed):
    """``start_dgc_step`` x N + ``resolve_all`` (one read) == ``fused_dgc_step`` one by one: steps, state."""
    gen = torch.Generator().manual_seed(seed)
    data = [tuple(torch.randn(m, generator=gen) for _ in range(3)) for m in n]
    out = {}
    for mode in ("each", "batched"):
        states = [(g, u.clone(), v.clone()) for g, u, v in data]
        sample = torch.Generator().manual_seed(seed)
        started = [start_dgc_step(g, u, v, k=max(1, round(density * g.numel())), generator=sample,
                                  min_samples=64, backend="triton") for g, u, v in states]
        steps = resolve_all(started) if mode == "batched" else [s.resolve() for s in started]
        out[mode] = (steps, states)
    for a, b in zip(*(out[m][0] for m in out), strict=True):
        assert (a.indices is None) == (b.indices is None)
        assert a.indices is None or torch.equal(a.indices, b.indices)
        assert torch.equal(a.values, b.values) and a.passes == b.passes
    for (_, u1, v1), (_, u2, v2) in zip(*(out[m][1] for m in out), strict=True):
        assert torch.equal(u1, u2) and torch.equal(v1, v2)


def _payload(shape, rng, kind, frac):
    numel = 1
    for d in shape:
        numel *= d
    k = int(frac * numel)
    idx = torch.randperm(numel, generator=rng)[:k].sort().values
    vals = torch.randn(k, generator=rng)
    if kind == "f32":
        return TensorPayload(shape, Values.f32(vals), idx)
    if kind == "dense":
        return TensorPayload(shape, Values.f32(torch.randn(numel, generator=rng)))
    if kind == "dense8":
        quant = Int8Quantizer(BlockwiseConfig(block=16, stochastic=False))
        return TensorPayload(shape, quant.quantize(torch.randn(numel, generator=rng), "x"))
    quant = {"int8": Int8Quantizer(BlockwiseConfig(block=7, stochastic=False)),
             "int4": Int4Quantizer(BlockwiseConfig(block=64, stochastic=False))}[kind]
    return TensorPayload(shape, quant.quantize(vals, "x"), idx)


@FAST
@given(kinds=st.lists(st.tuples(st.sampled_from(["f32", "int8", "int4", "dense", "dense8"]), st.integers(1, 300),
                                st.sampled_from([0.0, 0.01, 0.3, 1.0])), min_size=1, max_size=8),
       seed=st.integers(0, 2**16))
def test_flat_sums_add_what_one_add_per_tensor_adds(kinds, seed):
    rng = torch.Generator().manual_seed(seed)
    payloads = {f"t{i}": _payload((n,), rng, kind, frac) for i, (kind, n, frac) in enumerate(kinds)}
    start = {name: torch.randn(p.shape, generator=rng, dtype=torch.float64) for name, p in payloads.items()}
    ref = Totals({k: t.clone() for k, t in start.items()})
    for name, p in payloads.items():
        ref.add(ref.outstanding, name, p, 1.0)
    got = Totals({k: t.clone() for k, t in start.items()})
    flat = FlatSums.of(got.outstanding, {n: torch.zeros(p.shape) for n, p in payloads.items()})
    assert all(torch.equal(got.outstanding[n], start[n]) for n in payloads)  # copied into the buffer
    rest = flat.add(payloads)
    assert rest == {}
    for name, p in rest.items():
        got.add(got.outstanding, name, p, 1.0)
    assert all(torch.equal(got.outstanding[n], ref.outstanding[n]) for n in payloads)
    assert all(got.outstanding[n].data_ptr() == flat.views[n].data_ptr() for n in payloads)


def _send_counts():
    return benchmark_module("send_counts")


def _selection_read(site: str) -> bool:
    """Whether a host read at ``site`` is one of the selections' (the started steps' readouts read together, or a
    retry pass's own)."""
    return "kernels/pending.py" in site or "kernels/_dgc_select.py" in site


@pytest.mark.parametrize("name", ["dgc", "dgc+int8"])
def test_host_reads_per_send_do_not_grow_with_the_tensors(name):
    """One send of 2 and of 12 large tensors of two sizes (plus small ones): the same number of host reads and of
    kernel launches (the large tensors' DGC steps in one launch per pass: ``fedcomp.kernels.dgc_batch``, though each
    is sampled whole and the padded sample matrix outgrows their elements), and one read of the DGC steps' counts in
    all (a step whose first pass selects too few may read once more: not at this data)."""
    counts = _send_counts()
    reads, launches = {}, {}
    for large in (2, 12):
        spec = ModelSpec(tuple((f"w{i}", (40 if i else 30, 50)) for i in range(large)) + (("b", (7,)), ("c", (3,))))
        pipe = build(name, spec, backend="triton", density=0.05, **({"stochastic": False} if "+" in name else {}))
        gen = torch.Generator().manual_seed(large)
        grads = {n: torch.randn(s, generator=gen) for n, s in spec.entries}
        pipe.send(grads)
        with counts.SendCounts("cpu") as c:
            pipe.send(grads)
        dgc_reads = sum(n for site, n in c.reads.items() if _selection_read(site))
        assert dgc_reads == 1, c.summary()
        assert c.launches["dgc_multi_fused_kernel"] == 1 and c.launches["dgc_multi_place_kernel"] == 1, c.summary()
        assert "dgc_fused_kernel" not in c.launches, c.summary()  # no tensor took the one-tensor step
        reads[large], launches[large] = c.totals()["host_reads"], sum(c.launches.values())
    assert reads[12] == reads[2], reads
    assert launches[12] == launches[2], launches


def test_a_quantized_send_codes_every_tensor_with_one_launch():
    """An ``int8`` send (plain error feedback) of 2 and of 12 tensors: one ``quant_many_kernel`` launch codes them
    all (the batch queues them), no tensor takes the one-tensor kernel, and the launches do not grow."""
    counts = _send_counts()
    launches = {}
    for large in (2, 12):
        spec = ModelSpec(tuple((f"w{i}", (40 if i else 30, 50)) for i in range(large)) + (("b", (7,)),))
        pipe = build("int8", spec, backend="triton", stochastic=False)
        grads = {n: torch.randn(s, generator=torch.Generator().manual_seed(large)) for n, s in spec.entries}
        pipe.send(grads)
        with counts.SendCounts("cpu") as c:
            blob = pipe.send(grads)
        assert blob == encode(pipe.pending[pipe.last_seq], spec)
        assert c.launches["quant_many_kernel"] == 1 and "quant_tile_kernel" not in c.launches, c.summary()
        launches[large] = sum(c.launches.values())
    assert launches[12] == launches[2], launches


#: Host reads of one send below, as SendCounts counts them under the interpreter: the update's finiteness (one for
#: all tensors, before any state changes), the one read of every selection's readout, then the encode's two (its
#: stats, counted twice here as ``.cpu()`` and ``.numpy()``, and the finished bytes). Before the group's selection
#: moved to the device and the threshold test into the readout: 7 (6 without the finiteness read).
SEND_READS = 5


@pytest.mark.parametrize("name", ["dgc", "dgc+int8"])
def test_a_send_reads_the_selections_once(name):
    """A send of large tensors (the fused DGC steps) and small ones (the group's joint selection on the device): the
    selections' counts, threshold tests and the group's cut points come back in one host read, the selection and
    the group split read nothing of their own, and the send's total is ``SEND_READS``: a sync added anywhere in
    the step, the group step or the encode makes it fail."""
    counts = _send_counts()
    spec = ModelSpec(tuple((f"w{i}", (40, 50)) for i in range(3)) + (("b", (7,)), ("c", (3,)), ("d", (4, 5))))
    pipe = build(name, spec, backend="triton", density=0.05, **({"stochastic": False} if "+" in name else {}))
    assert pipe.grouped == ("b", "c", "d")
    gen = torch.Generator().manual_seed(1)
    grads = {n: torch.randn(s, generator=gen) for n, s in spec.entries}
    pipe.send(grads)
    with counts.SendCounts("cpu") as c:
        blob = pipe.send(grads)
    assert blob == encode(pipe.pending[pipe.last_seq], spec)
    assert c.launches["dgc_mark_kernel"] == 1  # the group's selection ran on the device
    assert [n for site, n in c.reads.items() if _selection_read(site)] == [1], c.summary()
    assert not [site for site in c.reads if "compressors/" in site or "kernels/group.py" in site], c.summary()
    assert c.totals()["host_reads"] == SEND_READS, c.summary()


def test_a_batch_leaves_what_it_cannot_fuse_to_the_reference():
    """``add`` is False (and the memory untouched) for a pair without a kernel or a torch-backend tensor."""
    from fedcomp.compressors.base import COMPRESSORS
    from fedcomp.memory.dgc import DGCMemory

    mem = DGCMemory()
    assert not FusedBatch(mem, COMPRESSORS.build("topk"), backend="triton").add("w", torch.randn(10, 200))
    assert not FusedBatch(mem, COMPRESSORS.build("dgc")).add("w", torch.randn(10, 200))  # CPU: torch backend
    assert mem.state_dict() == {"u": {}, "v": {}}
    batch = FusedBatch(mem, COMPRESSORS.build("dgc"), backend="triton")
    assert batch.add("w", torch.randn(10, 200)) and set(batch.finish()) == {"w"} and batch.finish() == {}


@FAST
@given(counts=st.lists(st.sampled_from([0, 1, 2047, 2048, 2049, 5000]), min_size=1, max_size=5),
       kind=st.sampled_from(["kernel", "strided positions", "strided values"]), seed=st.integers(0, 2**16))
def test_put_many_is_index_copy_per_tensor(counts, kind, seed):
    """``put_many`` (one launch over chunks of ``_triton_scatter.BLOCK`` positions, the tensors' addresses in a
    table) == one ``index_copy_`` per tensor, bitwise; tensors it does not take (strided positions or values) go
    the per-tensor way and give the same."""
    from fedcomp.kernels import _triton_scatter as K
    from fedcomp.kernels.scatter import put_many

    assert K.BLOCK == 2048  # the counts above straddle its multiples
    gen = torch.Generator().manual_seed(seed)
    targets = [torch.randn(c + int(torch.randint(0, 50, (1,), generator=gen)), generator=gen) for c in counts]
    positions = [torch.randperm(t.numel(), generator=gen)[:c] for t, c in zip(targets, counts, strict=True)]
    values = [torch.randn(c, generator=gen) for c in counts]
    if kind == "strided positions":
        positions = [torch.stack([p, p], dim=1)[:, 0] for p in positions]
    if kind == "strided values":
        values = [torch.stack([v, v], dim=1)[:, 0] for v in values]
    want = [t.clone().index_copy_(0, p, v) for t, p, v in zip(targets, positions, values, strict=True)]
    put_many(targets, positions, values, backend="triton")
    assert all(torch.equal(t, w) for t, w in zip(targets, want, strict=True))


def _quantizer(kind: str, block: int):
    from fedcomp.compressors.qsgd import QSGDConfig, QSGDQuantizer
    from fedcomp.compressors.sign import SignConfig, SignQuantizer

    return {"int8": lambda: Int8Quantizer(BlockwiseConfig(block=block, stochastic=False)),
            "int4": lambda: Int4Quantizer(BlockwiseConfig(block=block, stochastic=False)),
            "sign": lambda: SignQuantizer(SignConfig(block=block)),
            "int8 stochastic": lambda: Int8Quantizer(BlockwiseConfig(block=block, stochastic=True)),
            "qsgd": lambda: QSGDQuantizer(QSGDConfig(bucket=block))}[kind]()


@FAST
@given(block=st.sampled_from([1, 7, 64, 256, 4096]), kind=st.sampled_from(["int8", "int4", "sign", "int8 stochastic",
                                                                            "qsgd"]),
       residual=st.booleans(), shift=st.sampled_from([0, 1]), seed=st.integers(0, 2**16), data=st.data())
def test_quantize_all_codes_each_tensor_as_one_call_would(block, kind, residual, shift, seed, data):
    """One launch (``quant_many_kernel``: tiles of ``rows`` blocks, a tensor's last tile full or partial, its last
    block full or partial) == one ``ef_quantize`` per tensor: codes, scales and coding errors bitwise for round to
    nearest and sign; for stochastic rounding the reference's scales, codes within one of its codes, and errors
    ``c - q * scale``. With residuals (added, then overwritten in place) or without; tensors 16-byte aligned or
    not (``shift``)."""
    from fedcomp.kernels import _triton_quant as K

    rows = max(1, K.MAX_TILE // (1 << (block - 1).bit_length()))
    size = st.builds(lambda b, r: max(0, b * block + r), st.sampled_from([0, 1, 2, rows - 1, rows, rows + 1]),
                     st.sampled_from([-1, 0, 1]))
    sizes = data.draw(st.lists(size, min_size=1, max_size=5), "sizes")
    from fedcomp.kernels.quant import ef_quantize, quantize_all

    quant = _quantizer(kind, block)
    gen = torch.Generator().manual_seed(seed)
    store = torch.randn(sum(sizes) + shift, generator=gen)
    xs = [t.clone() for t in torch.split(store[shift:], sizes)] if not shift else list(torch.split(store[1:], sizes))
    es = [torch.randn(n, generator=gen) for n in sizes] if residual else None
    ref_errs = [e.clone() if residual else torch.zeros(n) for e, n in zip(es or sizes, sizes, strict=True)]
    refs = [ef_quantize(quant, x, e, backend="triton").values for x, e in zip(xs, ref_errs, strict=True)]
    compensated = [x + e for x, e in zip(xs, es, strict=True)] if residual else xs
    got, errors = quantize_all(quant, xs, es, backend="triton")
    assert len(got) == len(errors) == len(xs)
    for c, values, err, ref, ref_err in zip(compensated, got, errors, refs, ref_errs, strict=True):
        assert values.coding is ref.coding and values.block == ref.block and values.data.shape == ref.data.shape
        assert torch.equal(values.scales, ref.scales)
        if kind in ("int8 stochastic", "qsgd"):
            assert (values.data.int() - ref.data.int()).abs().max().item() <= 1 if c.numel() else True
            assert torch.equal(err, c - values.dequantize())
        else:
            assert torch.equal(values.data, ref.data) and torch.equal(err, ref_err)
    if residual:
        assert all(e is f for e, f in zip(errors, es, strict=True))  # written in place


def test_quantize_all_takes_one_launch_for_many_tensors(monkeypatch):
    """The tensors of a blockwise quantizer go to one ``quant_many_kernel`` launch, not one ``ef_quantize`` each;
    one tensor, and sign's one block per tensor, go the per-tensor way."""
    from fedcomp.compressors.sign import SignConfig, SignQuantizer
    from fedcomp.kernels import _triton_quant as K
    from fedcomp.kernels import quant

    launches = []
    for kernel in ("quant_many_kernel", "quant_tile_kernel", "quant_1d_kernel"):
        jit = getattr(K, kernel)
        monkeypatch.setattr(K, kernel, _Counted(jit, kernel, launches))
    xs = [torch.randn(n) for n in (3, 300, 5000, 0, 1)]
    quant.quantize_all(Int8Quantizer(BlockwiseConfig(block=64, stochastic=False)), xs, backend="triton")
    assert launches == ["quant_many_kernel"]
    launches.clear()
    quant.quantize_all(Int8Quantizer(BlockwiseConfig(block=64, stochastic=False)), xs[:1], backend="triton")
    quant.quantize_all(SignQuantizer(SignConfig()), xs[:2], backend="triton")
    assert launches == ["quant_tile_kernel", "quant_tile_kernel", "quant_tile_kernel"]
    launches.clear()  # a run config's block: up to a tile (4096) one launch; above, one tensor at a time
    quant.quantize_all(Int8Quantizer(BlockwiseConfig(block=K.MAX_TILE, stochastic=False)), xs, backend="triton")
    assert launches == ["quant_many_kernel"]
    launches.clear()
    values, _ = quant.quantize_all(Int8Quantizer(BlockwiseConfig(block=2 * K.MAX_TILE, stochastic=False)), xs,
                                   backend="triton")
    assert "quant_many_kernel" not in launches and [v.data.numel() for v in values] == [x.numel() for x in xs]


class _Counted:
    """A jit kernel whose launches are named in ``log``."""

    def __init__(self, jit, name: str, log: list[str]) -> None:
        self.jit, self.name, self.log = jit, name, log

    def __getitem__(self, grid):
        self.log.append(self.name)
        return self.jit[grid]


@FAST
@given(shape_list=st.lists(shapes, min_size=1, max_size=9),
       name=st.sampled_from(["topk", "dgc", "dgc+int8", "int8", "qsgd", "lowrank"]),
       acked=st.lists(st.integers(1, 3), min_size=1, max_size=3, unique=True), seed=st.integers(0, 2**16))
def test_an_ack_through_the_flat_sums_takes_off_what_one_add_per_tensor_takes_off(shape_list, name, acked, seed):
    """``Totals.on_ack`` by the flat sums' few ops == one ``index_add_``/``add_`` per tensor, bitwise (a copy of the
    totals without the flat buffer acks the same updates one tensor at a time); the sums stay the buffer's views."""
    spec = _spec(shape_list)
    pipe = build(name, spec, **({"density": 0.05} if name in ("topk", "dgc", "dgc+int8") else {}))
    gen = torch.Generator().manual_seed(seed)
    for _ in range(3):
        pipe.send({n: torch.randn(s, generator=gen) for n, s in spec.entries})
    ref = Totals.from_state(pipe.totals.state_dict())  # no flat buffer: the per-tensor path
    assert ref._flat is None and pipe.totals._flat is not None
    views = dict(pipe.totals._flat.views)
    for seq in acked:
        update = pipe.pending[seq]
        assert pipe.ack(seq)
        ref.on_ack(update.tensors)
    got = pipe.totals.outstanding
    assert got.keys() == ref.outstanding.keys()
    assert all(torch.equal(got[n], ref.outstanding[n]) for n in got), name
    assert all(got[n] is v for n, v in views.items())
    assert (pipe.totals.acked, ref.acked) == (len(acked), len(acked))


def test_an_ack_takes_as_many_ops_for_many_tensors_as_for_few():
    """An ack's torch ops do not grow with the number of tensors (one ``index_add_`` per value coding, not a few
    ops per tensor): counted for 3 and 30 tensors."""
    counts = _send_counts()
    ops = {}
    for n in (3, 30):
        spec = ModelSpec(tuple((f"w{i}", (20, 30)) for i in range(n)))
        pipe = build("dgc+int8", spec, density=0.05, stochastic=False)
        gen = torch.Generator().manual_seed(n)
        pipe.send({name: torch.randn(s, generator=gen) for name, s in spec.entries})
        with counts.SendCounts("cpu") as c:
            assert pipe.ack(1)
        ops[n] = c.totals()["torch_ops"]
    assert ops[30] == ops[3], ops


def test_the_backend_choice_looks_triton_up_once(monkeypatch):
    """``resolve`` asks whether triton is installed once per process, not once per tensor (the lookup takes tens
    of microseconds; every fused step asks)."""
    import importlib.util

    from fedcomp.kernels import _backend

    calls = []
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: calls.append(name) or real(name, *a))
    _backend.triton_available.cache_clear()
    x = torch.zeros(3)
    assert [_backend.resolve(x, "triton") for _ in range(50)] == ["triton"] * 50
    assert calls.count("triton") == 1

"""The device wire encode (fedcomp.kernels.encode) against the CPU encoder (fedcomp.wire.encode), byte for byte, run
on the CPU by Triton's interpreter.

``TRITON_INTERPRET=1`` is set here, at import, before anything imports triton (fedcomp.kernels imports it lazily).
Every comparison also checks that the device path took the update (no hand-over to ``wire.encode``), so equal
bytes cannot come from the reference encoding it twice. Sizes stay at most 1M elements.
"""

from __future__ import annotations

import json
import math
import os
import re
import zlib
from pathlib import Path

os.environ["TRITON_INTERPRET"] = "1"

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

pytest.importorskip("triton", reason="triton not installed")

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

import fedcomp  # noqa: E402
import fedcomp.kernels.encode as device  # noqa: E402
from fedcomp.kernels._triton_encode import _golomb_b0  # noqa: E402
from fedcomp.kernels.crc import crc32  # noqa: E402
from fedcomp.payload import FLOAT_DTYPES, TensorPayload, Update, ValueCoding, Values  # noqa: E402
from fedcomp.spec import ModelSpec  # noqa: E402
from fedcomp.wire import WireError, decode, encode  # noqa: E402
from fedcomp.wire.codec import inspect  # noqa: E402
from fedcomp.wire.index import IndexCoding  # noqa: E402

FAST = settings(max_examples=25, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
CODINGS = [c for c in ValueCoding if c is not ValueCoding.LOWRANK]
SPARSIFIERS = ["topk", "randomk", "dgc"]
QUANTIZERS = ["", "+int8", "+int4", "+qsgd", "+sign", "+ternary", "+fp16", "+bf16"]


@pytest.fixture
def handed_over(monkeypatch) -> list[int]:
    """Counts the updates the device path hands to ``wire.encode`` (it must take every valid one)."""
    calls: list[int] = []

    def counting(update, spec):
        calls.append(1)
        return encode(update, spec)

    monkeypatch.setattr(device, "encode", counting)
    return calls


def same_bytes(update: Update, spec: ModelSpec) -> bytes:
    want = encode(update, spec)
    got = device.device_encode(update, spec)
    assert got == want, f"device bytes differ from wire.encode ({len(got)} vs {len(want)} bytes)"
    return got


# ----------------------------------------------------------------------------------------------- payloads


def values_of(rng: np.random.Generator, coding: ValueCoding, n: int, block: int) -> Values:
    if coding.is_float:
        x = rng.standard_normal(n) * 10.0 ** rng.integers(-4, 4, n)
        x[rng.random(n) < 0.1] = -0.0
        return Values(coding, torch.from_numpy(x.astype(np.float32)).to(FLOAT_DTYPES[coding]))
    lo, hi = coding.code_range
    codes = rng.integers(lo, hi + 1, n)
    if coding is ValueCoding.SIGN:
        codes = np.where(codes == 0, 1, codes)
    scales = np.abs(rng.standard_normal(Values.num_blocks(n, block))).astype(np.float32)
    scales[rng.random(scales.size) < 0.1] = 0.0
    return Values(coding, torch.from_numpy(codes.astype(np.int8)), torch.from_numpy(scales), block)


def boundary_positions(rng: np.random.Generator, b: int, n: int) -> np.ndarray:
    """``n`` positions whose gaps sit at the Rice boundaries of ``b``: ``2**b - 1``, ``2**b``, ``2**b + 1``, 0."""
    choices = np.array([(1 << b) - 1, 1 << b, (1 << b) + 1, 0, 2 * (1 << b) - 1])
    return np.cumsum(rng.choice(choices, n) + 1) - 1


@st.composite
def payload_cases(draw, max_numel: int = 5000) -> tuple[tuple[int, ...], TensorPayload]:
    """One tensor's payload: any coding, dense or sparse, with empty tensors, nnz 0, every position, random
    positions, gaps at the Rice boundaries, and odd lengths for the sub-byte codings."""
    seed = draw(st.integers(0, 2**32 - 1))
    rng = np.random.default_rng(seed)
    coding = draw(st.sampled_from(CODINGS))
    block = draw(st.sampled_from([1, 3, 8, 256]))
    kind = draw(st.sampled_from(["dense", "empty", "none", "all", "random", "boundary", "single"]))
    if kind == "boundary":
        b = draw(st.integers(0, 14))
        idx = boundary_positions(rng, b, draw(st.integers(1, min(400, (1 << 18) >> b))))  # numel < 2**20
        numel = int(idx[-1]) + 1 + draw(st.integers(0, 3))
        return (numel,), TensorPayload((numel,), values_of(rng, coding, idx.size, block), torch.from_numpy(idx))
    shapes = [(1,), (7,), (9,), (33,), (3, 5), (64, 75), (max_numel,)]
    shape = (0,) if kind == "empty" else draw(st.sampled_from(shapes))
    numel = int(np.prod(shape))
    if kind == "dense":
        return shape, TensorPayload(shape, values_of(rng, coding, numel, block))
    count = {"empty": 0, "none": 0, "all": numel, "single": min(1, numel)}.get(kind)
    if count is None:
        count = int(rng.integers(0, numel + 1)) if draw(st.booleans()) else max(1, numel // 100)
    idx = np.sort(rng.choice(numel, count, replace=False)).astype(np.int64)
    return shape, TensorPayload(shape, values_of(rng, coding, count, block), torch.from_numpy(idx))


@given(st.lists(payload_cases(), min_size=1, max_size=8), st.integers(0, 2**64 - 1), st.booleans())
@FAST
def test_synthetic_updates_encode_to_the_same_bytes(cases, client_id, meta):
    spec = ModelSpec([(f"t{i}", shape) for i, (shape, _) in enumerate(cases)])
    tensors = {f"t{i}": p for i, (_, p) in enumerate(cases)}
    update = Update(tensors, base_version=3, seq=2**40, client_id=client_id, meta={"loss": 0.25} if meta else {})
    calls = []
    original = device.encode
    device.encode = lambda u, s: calls.append(1) or original(u, s)
    try:
        same_bytes(update, spec)
    finally:
        device.encode = original
    assert not calls, "a valid update was handed to wire.encode"


def test_rice_and_bitmap_choices_are_exercised(handed_over):
    """Both index codings, the nnz > 4096 shortcut, and many RICE parameters, written by the device path."""
    rng = np.random.default_rng(0)
    entries, tensors = [], {}
    for b in range(10):
        idx = boundary_positions(rng, b, 300)
        numel = int(idx[-1]) + 1
        entries.append((f"r{b}", (numel,)))
        tensors[f"r{b}"] = TensorPayload((numel,), values_of(rng, ValueCoding.F32, idx.size, 1), torch.from_numpy(idx))
    half = np.sort(rng.choice(20_000, 10_000, replace=False))  # > 4096 kept, bitmap by the lower bound
    entries.append(("half", (20_000,)))
    tensors["half"] = TensorPayload((20_000,), values_of(rng, ValueCoding.INT4, half.size, 64), torch.from_numpy(half))
    spec = ModelSpec(entries)
    blob = same_bytes(Update(tensors), spec)
    infos = {i.name: i for i in inspect(blob, spec)}
    assert infos["half"].index_coding is IndexCoding.BITMAP
    assert infos["r0"].index_coding is IndexCoding.BITMAP  # gaps 0..2: dense enough for a bitmap
    assert {infos[f"r{b}"].index_coding for b in range(3, 10)} == {IndexCoding.RICE}
    rice_b = sorted({blob[_record_offset(blob, spec, f"r{b}") + 3] for b in range(3, 10)})  # after kind, nnz (2 B)
    assert len(rice_b) >= 4, rice_b  # many different b values were chosen and written
    assert not handed_over


@given(counts=st.lists(st.sampled_from([1, 2047, 2048, 2049, 4097, 6000]), min_size=1, max_size=3),
       spread=st.sampled_from([1, 3, 60, 4000]), dtype=st.sampled_from([torch.int64, torch.int32]),
       strided=st.booleans(), seed=st.integers(0, 2**32 - 1))
@FAST
def test_records_over_many_index_chunks_encode_to_the_same_bytes(counts, spread, dtype, strided, seed):
    """Records of one to three chunks of the index kernels (``CHUNK`` kept indices a program), at the chunks'
    edges, RICE (sparse gaps) and bitmap (dense) choices, int32 indices and strided ones (read from int64 copies)."""
    from fedcomp.kernels import _triton_encode as K

    assert K.CHUNK == 2048  # the counts above straddle its multiples
    rng = np.random.default_rng(seed)
    entries, tensors = [], {}
    for i, count in enumerate(counts):
        idx = np.cumsum(rng.integers(0, spread, count) + 1) - 1  # gaps in [0, spread)
        numel = int(idx[-1]) + 1 + int(rng.integers(0, 5))
        t = torch.from_numpy(np.repeat(idx, 2))[::2] if strided else torch.from_numpy(idx)
        entries.append((f"t{i}", (numel,)))
        tensors[f"t{i}"] = TensorPayload((numel,), values_of(rng, ValueCoding.F32, count, 1), t.to(dtype))
    spec = ModelSpec(entries)
    calls = []
    original = device.encode
    device.encode = lambda u, sp: calls.append(1) or original(u, sp)
    try:
        blob = same_bytes(Update(tensors), spec)
    finally:
        device.encode = original
    assert not calls, "a valid update was handed to wire.encode"
    if spread == 4000 and max(counts) > 2048:  # a RICE record over several chunks: each chunk's unary offset
        assert IndexCoding.RICE in {i.index_coding for i in inspect(blob, spec)}


@triton.jit
def _golomb_kernel(g_ptr, n_ptr, out_ptr, size, N: tl.constexpr):
    i = tl.arange(0, N)
    ok = i < size
    tl.store(out_ptr + i, _golomb_b0(tl.load(g_ptr + i, mask=ok, other=0), tl.load(n_ptr + i, mask=ok, other=1)),
             mask=ok)


@given(st.lists(st.tuples(st.integers(0, 2**62), st.integers(1, 2**40)), min_size=1, max_size=64))
@FAST
def test_the_device_golomb_parameter_is_the_hosts_within_one(pairs):
    """``_golomb_b0`` (exponents and mantissas, no division or log) against ``rice_candidates``' ``b0``, computed in
    float64 by the host: within one (the quotient window's margin), and equal but at near ties."""
    from fedcomp.wire.index import rice_candidates

    gsum, n = (torch.tensor(col, dtype=torch.int64) for col in zip(*pairs, strict=True))
    out = torch.full((len(pairs),), -1, dtype=torch.int64)
    _golomb_kernel[(1,)](gsum, n, out, len(pairs), N=64)
    for (g, k), got in zip(pairs, out.tolist(), strict=True):
        host = rice_candidates(k, g).start + 1 if g * math.log(2) >= 2 * k else 0  # b0 (rice_candidates: b0 - 1 ..)
        assert abs(got - host) <= 1, (g, k, got, host)
        m = g / k * math.log(2)
        if m < 1 or abs(math.log2(m) - round(math.log2(m))) > 1e-9:
            assert got == host, (g, k, got, host)


def _record_offset(blob: bytes, spec: ModelSpec, name: str) -> int:
    """Byte offset of record ``name`` (from the record sizes ``inspect`` reports)."""
    infos = inspect(blob, spec)
    end_of_records = len(blob) - 4
    start = end_of_records - sum(i.nbytes for i in infos)
    for info in infos:
        if info.name == name:
            return start
        start += info.nbytes
    raise KeyError(name)


def test_many_small_tensors_and_empty_ones(handed_over):
    rng = np.random.default_rng(1)
    entries, tensors = [], {}
    for i in range(120):
        n = int(rng.integers(0, 20))
        coding = CODINGS[i % len(CODINGS)]
        count = int(rng.integers(0, n + 1))
        idx = None if i % 3 == 0 else torch.from_numpy(np.sort(rng.choice(n, count, replace=False)).astype(np.int64))
        entries.append((f"s{i}", (n,)))
        tensors[f"s{i}"] = TensorPayload((n,), values_of(rng, coding, n if idx is None else count, 3), idx)
    spec = ModelSpec(entries)
    blob = same_bytes(Update(tensors, seq=9), spec)
    assert decode(blob, spec).seq == 9
    assert not handed_over


# ----------------------------------------------------------------------------------------------- pipelines


@given(
    st.sampled_from([s + q for s in SPARSIFIERS for q in QUANTIZERS]),
    st.lists(st.sampled_from([(0,), (5,), (3, 3), (40, 30), (64, 64), (7, 9, 11), (2000,)]), min_size=1, max_size=6),
    st.sampled_from([0.0005, 0.01, 0.3, 1.0]),
    st.sampled_from(["group", "each", "dense"]),
)
@FAST
def test_every_sparsifying_compressor_through_the_pipeline(name, shapes, density, small):
    """Updates as the pipeline makes them (``backend="triton"``: the fused kernels where the pair has them), for
    every sparsifier alone and composed with every quantizer; density 0.0005 keeps one element (k = max(1, ..))
    or none of a small group, 1.0 keeps all."""
    spec = ModelSpec([(f"p{i}", s) for i, s in enumerate(shapes)])
    pipe = fedcomp.build(name, spec, backend="triton", density=density, small=small, dense_below=100)
    gen = torch.Generator().manual_seed(len(shapes))
    sent = []
    original = device.encode
    device.encode = lambda u, s: sent.append(1) or original(u, s)
    try:
        for _ in range(2):
            blob = pipe.send({n: torch.randn(s, generator=gen) for n, s in spec.entries})
            assert blob == original(pipe.pending[pipe.last_seq], spec)
    finally:
        device.encode = original
    assert not sent, "the pipeline's update was handed to wire.encode"


def test_large_updates_dgc_int8_and_dense_int8(handed_over):
    """1M parameters: DGC at 1% (10k kept: the nnz > 4096 rule) with int8 values, and dense int8 codes."""
    spec = ModelSpec([("w", (1000, 1000)), ("b", (1000,))])
    grads = {"w": torch.randn(1000, 1000, generator=torch.Generator().manual_seed(0)), "b": torch.ones(1000)}
    for name, opts in (("dgc+int8", {"density": 0.01}), ("int8", {})):
        pipe = fedcomp.build(name, spec, backend="triton", **opts)
        blob = pipe.send(grads)
        assert blob == encode(pipe.pending[pipe.last_seq], spec)
    assert not handed_over


# ----------------------------------------------------------------------------------------------- refusals


def _one(payload: TensorPayload) -> tuple[Update, ModelSpec]:
    return Update({"w": payload}), ModelSpec([("w", payload.shape)])


def _f32(*xs: float) -> Values:
    return Values.f32(torch.tensor(xs, dtype=torch.float32))


def _int8(codes: list[int], scales: list[float], block: int = 2, coding=ValueCoding.INT8) -> Values:
    return Values(coding, torch.tensor(codes, dtype=torch.int8), torch.tensor(scales, dtype=torch.float32), block)


REFUSED = {
    "unsorted": TensorPayload((10,), _f32(1, 2), torch.tensor([5, 3])),
    "duplicate": TensorPayload((10,), _f32(1, 2), torch.tensor([3, 3])),
    "negative index": TensorPayload((10,), _f32(1, 2), torch.tensor([-1, 3])),
    "index past numel": TensorPayload((10,), _f32(1, 2), torch.tensor([3, 10])),
    # in a later chunk of the index kernels (2,048 kept indices a program)
    "unsorted late": TensorPayload((9000,), Values.f32(torch.ones(3000)),
                                   torch.arange(3000).index_fill(0, torch.tensor(2500), 0)),
    "past numel late": TensorPayload((3000,), Values.f32(torch.ones(3000)), torch.arange(1, 3001)),
    "wrapping gap": TensorPayload((10,), _f32(1, 2, 3), torch.tensor([0, 3 << 61, -(1 << 62)])),
    "nan value": TensorPayload((2,), _f32(1, float("nan"))),
    "inf bf16": TensorPayload((2,), Values(ValueCoding.BF16, torch.tensor([1.0, float("inf")], dtype=torch.bfloat16))),
    "int8 -128": TensorPayload((2,), _int8([1, -128], [1.0])),
    "int4 8": TensorPayload((2,), _int8([8, 1], [1.0], coding=ValueCoding.INT4)),
    "sign 0": TensorPayload((2,), _int8([0, 1], [1.0], coding=ValueCoding.SIGN)),
    "negative scale": TensorPayload((2,), _int8([1, 1], [-1.0])),
    "nan scale": TensorPayload((2,), _int8([1, 1], [float("nan")])),
    "inf scale": TensorPayload((2,), _int8([1, 1], [float("inf")])),
    "-inf scale": TensorPayload((2,), _int8([1, 1], [float("-inf")])),
    "overflowing product": TensorPayload((2,), _int8([127, 1], [3e38])),
    "wrong dtype": TensorPayload((2,), Values(ValueCoding.F16, torch.ones(2))),
    "scale count": TensorPayload((4,), _int8([1, 1, 1, 1], [1.0])),
}


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_refusals_match_the_cpu_encoder(case):
    update, spec = _one(REFUSED[case])
    with pytest.raises(WireError) as cpu:
        encode(update, spec)
    with pytest.raises(WireError) as dev:
        device.device_encode(update, spec)
    assert str(dev.value) == str(cpu.value) and dev.value.category is cpu.value.category


def test_a_large_scale_with_small_codes_is_encoded_like_the_cpu_does(handed_over):
    """``3e38 x 127`` overflows but the codes are +-1: ``encode`` accepts it (its exact per-block check); the
    device path's bound hands it over and the bytes are the CPU's."""
    update, spec = _one(TensorPayload((2,), _int8([1, -1], [3e38])))
    assert device.device_encode(update, spec) == encode(update, spec)
    assert handed_over == [1]


def test_a_lowrank_update_is_handed_to_the_cpu_encoder(handed_over):
    """LOWRANK (version 2) records are not the device path's: the bytes are ``wire.encode``'s, version 2."""
    p = TensorPayload((4, 3), Values.lowrank(torch.ones(4, 1), torch.tensor([2.0]), torch.ones(3, 1)))
    update, spec = _one(p)
    blob = device.device_encode(update, spec)
    assert blob == encode(update, spec) and blob[3] == 2
    assert handed_over == [1]


def test_bad_identity_raises_like_the_cpu_encoder():
    update, spec = _one(TensorPayload((2,), _f32(1, 2)))
    bad = Update(update.tensors, client_id=-1)
    with pytest.raises(WireError, match="client_id"):
        device.device_encode(bad, spec)


# ----------------------------------------------------------------------------------------------- dispatch, CRC


def test_dispatch_by_backend(monkeypatch):
    update, spec = _one(TensorPayload((2,), _f32(1, 2)))
    monkeypatch.setattr(device, "device_encode", lambda u, s: b"device")
    assert device.encode_update(update, spec, backend="triton") == b"device"
    assert device.encode_update(update, spec, backend="torch") == encode(update, spec)
    assert device.encode_update(update, spec) == encode(update, spec)  # auto: CPU tensors take wire.encode


@given(st.binary(max_size=9000), st.integers(0, 70))
@settings(max_examples=40, deadline=None, derandomize=True)
def test_crc32_matches_zlib(data, extra):
    blob = data + bytes(range(extra))
    got = crc32(torch.frombuffer(bytearray(blob), dtype=torch.uint8) if blob else torch.zeros(0, dtype=torch.uint8))
    assert bytes(got.numpy()) == zlib.crc32(blob).to_bytes(4, "little")


def test_crc32_of_a_long_buffer():
    """Several fold levels (300,000 bytes: 4,688 chunks, two levels of 64)."""
    blob = np.random.default_rng(2).integers(0, 256, 300_000).astype(np.uint8)
    assert bytes(crc32(torch.from_numpy(blob)).numpy()) == zlib.crc32(blob.tobytes()).to_bytes(4, "little")


# ----------------------------------------------------------------------------------------------- the GPU script


def _bench():
    import importlib.util
    import sys

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_send_gpu.py"
    spec = importlib.util.spec_from_file_location("bench_send_gpu", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules["bench_send_gpu"] = module
    spec.loader.exec_module(module)
    return module


def test_the_send_benchmark_runs_tiny_and_flags_different_bytes(tmp_path, monkeypatch, capsys):
    """benchmarks/bench_send_gpu.py --interpret: every path timed, the bytes compared; a device encode that
    writes other bytes makes it exit 1."""
    bench = _bench()
    out = tmp_path / "send.json"
    args = ["--interpret", "--reps", "1", "--cpu-reps", "1", "--compressors", "dgc+int8,int8", "--json", str(out)]
    assert bench.main(args) == 0
    rows = json.loads(out.read_text())
    assert [(r["compressor"], r["identical"]) for r in rows] == [("dgc+int8", True), ("int8", True)]
    assert all(set(r["median_ms"]) == {"kernels", "torch", "cpu"} and r["payload_bytes"] > 0 for r in rows)
    real = device.device_encode
    monkeypatch.setattr(device, "device_encode", lambda u, s: (lambda b: b[:-1] + bytes([b[-1] ^ 1]))(real(u, s)))
    assert bench.main(args[:-2]) == 1
    assert "NO" in capsys.readouterr().out


def test_the_send_count_with_a_profile_says_where_the_host_time_goes(capsys, monkeypatch):
    """``--count --profile N`` (what the GPU script's dgc step runs): the counts, the profile's N functions and the
    line comparing one send's wall time with its device kernels' time."""
    bench = _bench()
    monkeypatch.syspath_prepend(str(Path(bench.__file__).parent))  # as when run as a script: send_counts beside it
    assert bench.main(["--interpret", "--count", "--profile", "3", "--sizes", "tiny", "--compressors", "dgc"]) == 0
    out = capsys.readouterr().out
    assert "host reads" in out and "Ordered by: internal time" in out
    assert re.search(r"one send: [\d.]+ ms wall \([\d.]+ ms under the profiler\), device kernels [\d.]+ ms", out), out


def test_the_host_time_of_a_send_by_hop(capsys, monkeypatch):
    """``--host``: the host's own ms per send by hop (the interpreted kernels' time taken out); the hops lie within
    the send, and the patched functions are put back afterwards."""
    from fedcomp.client import pipeline

    bench = _bench()
    monkeypatch.syspath_prepend(str(Path(bench.__file__).parent))
    before = (pipeline.Pipeline.send, pipeline.encode_update)
    row = bench.host_send("tiny", "dgc+int8", 0.05, "cpu", 2, 16)
    ms = row["host_ms"]
    assert {"send", "fused steps: launch", "fused steps: finish", "wire encode", "ack", "other"} <= set(ms), ms
    inner = sum(v for k, v in ms.items() if k not in ("send", "ack", "other"))
    assert all(v >= 0 for k, v in ms.items() if k != "other") and 0 < inner <= ms["send"], ms
    assert (pipeline.Pipeline.send, pipeline.encode_update) == before
    assert bench.main(["--interpret", "--host", "--reps", "1", "--sizes", "tiny", "--compressors", "dgc"]) == 0
    assert re.search(r"tiny \(\d+ tensors, \d+ fused\) dgc: .*send [\d.]+", capsys.readouterr().out)

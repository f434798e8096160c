"""Wire codec: round trips, index-coding choice, bit-level layout against reference encoders, byte budget."""

from __future__ import annotations

import math
import pathlib
import zlib

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fedcomp.payload import FLOAT_DTYPES, TensorPayload, Update, ValueCoding, Values
from fedcomp.spec import ModelSpec
from fedcomp.wire import WireError, check, decode, encode, encoded_size_breakdown
from fedcomp.wire.bits import Reader, pack_uint, packed_len, unpack_uint, varint
from fedcomp.wire.codec import MAGIC, VERSION, default_max_bytes, encode_with, inspect
from fedcomp.wire.index import IndexCoding, encode_index, plan, rice_lower_bound, rice_plan, rice_size

SETTINGS = settings(max_examples=300, derandomize=True, deadline=None, suppress_health_check=[HealthCheck.too_slow])

SHAPES = [(), (1,), (7,), (3, 5), (2, 3, 2, 2), (0,), (4, 0), (64,), (9, 17), (1000,)]
DENSITIES = ["dense", "empty", "single", "sparse", "half", "all"]
BLOCKS = [1, 3, 8, 256]
_INT_VIEW = {torch.float32: torch.int32, torch.float16: torch.int16, torch.bfloat16: torch.int16}
#: The codings of values at positions (LOWRANK carries factors and has its own tests: tests/test_lowrank.py).
CODINGS = [c for c in ValueCoding if c is not ValueCoding.LOWRANK]


# ------------------------------------------------------------------------------------------------ builders


def float_values(rng: np.random.Generator, coding: ValueCoding, n: int) -> Values:
    """Heavy-tailed values over many binades, with signed zeros and subnormals mixed in."""
    x = rng.standard_t(3, n) * 10.0 ** rng.integers(-6, 6, n)
    specials = np.array([-0.0, 0.0, 1e-45, -3e-39, 6e-8, 1.0])
    pick = rng.random(n) < 0.2
    x[pick] = rng.choice(specials, int(pick.sum()))
    limit = 65000.0 if coding is ValueCoding.F16 else 1e38
    t = torch.from_numpy(np.clip(x, -limit, limit).astype(np.float32))
    return Values(coding, t.to(FLOAT_DTYPES[coding]))


def quantized_values(rng: np.random.Generator, coding: ValueCoding, n: int, block: int) -> Values:
    lo, hi = coding.code_range
    codes = rng.integers(lo, hi + 1, n)
    if coding is ValueCoding.SIGN:
        codes = np.where(codes == 0, 1, codes)
    scales = np.abs(rng.standard_normal(Values.num_blocks(n, block)) * 1e-3).astype(np.float32)  # scales >= 0
    return Values(coding, torch.from_numpy(codes.astype(np.int8)), torch.from_numpy(scales), block)


def make_values(rng: np.random.Generator, coding: ValueCoding, n: int, block: int = 256) -> Values:
    return float_values(rng, coding, n) if coding.is_float else quantized_values(rng, coding, n, block)


def make_payload(seed: int, shape: tuple[int, ...], coding: ValueCoding, density: str, block: int) -> TensorPayload:
    rng = np.random.default_rng(seed)
    numel = math.prod(shape)
    if density == "dense":
        return TensorPayload(shape, make_values(rng, coding, numel, block))
    nnz = {
        "empty": 0,
        "single": min(1, numel),
        "sparse": min(numel, int(rng.integers(0, max(1, numel // 10) + 1))),
        "half": numel // 2,
        "all": numel,
    }[density]
    idx = np.sort(rng.choice(numel, nnz, replace=False)) if nnz else np.zeros(0, dtype=np.int64)
    return TensorPayload(shape, make_values(rng, coding, nnz, block), torch.from_numpy(idx.astype(np.int64)))


@st.composite
def updates(draw, max_tensors: int = 4) -> tuple[Update, ModelSpec]:
    n = draw(st.integers(1, max_tensors))
    entries, tensors = [], {}
    for i in range(n):
        shape = draw(st.sampled_from(SHAPES))
        p = make_payload(
            draw(st.integers(0, 2**32 - 1)),
            shape,
            draw(st.sampled_from(CODINGS)),
            draw(st.sampled_from(DENSITIES)),
            draw(st.sampled_from(BLOCKS)),
        )
        entries.append((f"layer{i}.weight", shape))
        tensors[f"layer{i}.weight"] = p
    meta = draw(st.dictionaries(st.text(max_size=8), st.floats(allow_nan=False, allow_infinity=False), max_size=2))
    ids = st.integers(0, 2**64 - 1)
    update = Update(tensors, base_version=draw(ids), seq=draw(ids), client_id=draw(ids), meta=meta)
    return update, ModelSpec(tuple(entries))


def bitwise(t: torch.Tensor) -> torch.Tensor:
    """Integer view, so -0.0 != 0.0 and every payload bit counts."""
    return t.view(_INT_VIEW[t.dtype]) if t.dtype in _INT_VIEW else t


def assert_same(a: Update, b: Update) -> None:
    assert (a.client_id, a.seq, a.base_version) == (b.client_id, b.seq, b.base_version)
    assert a.meta == b.meta and list(a.tensors) == list(b.tensors)
    for name, pa in a.tensors.items():
        pb = b.tensors[name]
        assert pa.shape == pb.shape
        if pa.indices is None:
            assert pb.indices is None
        else:
            assert pb.indices.dtype == torch.int64 and torch.equal(pa.indices, pb.indices)
        va, vb = pa.values, pb.values
        assert (va.coding, va.block) == (vb.coding, vb.block)
        assert va.data.dtype == vb.data.dtype and torch.equal(bitwise(va.data), bitwise(vb.data))
        if va.scales is None:
            assert vb.scales is None
        else:
            assert vb.scales.dtype == torch.float32 and torch.equal(bitwise(va.scales), bitwise(vb.scales))


# ------------------------------------------------------------------------------------------------ round trips


@SETTINGS
@given(updates())
def test_round_trip_is_exact(case):
    update, spec = case
    blob = encode(update, spec)
    assert blob[:3] == MAGIC and blob[3] == VERSION and blob[4:12] == spec.fingerprint
    assert zlib.crc32(blob[:-4]) == int.from_bytes(blob[-4:], "little")
    decoded = decode(blob, spec)
    assert_same(update, decoded)
    assert encode(update, spec) == blob  # deterministic
    assert encode(decoded, spec) == blob  # canonical
    assert check(update, spec) is None and check(decoded, spec) is None  # what encodes, check lets through


@SETTINGS
@given(updates(max_tensors=2), st.sampled_from([IndexCoding.BITMAP, IndexCoding.RICE]))
def test_each_index_coding_round_trips_and_the_chosen_one_is_smallest(case, forced):
    update, spec = case
    blob = encode_with(update, spec, index_coding=forced)
    assert_same(update, decode(blob, spec))
    sparse = [i for i in inspect(blob, spec) if i.index_coding is not IndexCoding.DENSE]
    assert all(i.index_coding is forced for i in sparse)
    assert len(encode(update, spec)) <= len(blob)


@pytest.mark.parametrize("coding", CODINGS)
@pytest.mark.parametrize("density", DENSITIES)
def test_every_coding_and_density(coding, density):
    shape = (5, 13)  # 65 elements: partial last byte and, for block 8, a partial last block
    spec = ModelSpec((("w", shape),))
    update = Update({"w": make_payload(7, shape, coding, density, 8)}, 1, 2, 3)
    assert_same(update, decode(encode(update, spec), spec))


def test_chosen_index_coding_per_density():
    numel = 4096
    spec = ModelSpec((("w", (numel,)),))
    chosen = {}
    for density in ("single", "sparse", "half", "all"):
        update = Update({"w": make_payload(3, (numel,), ValueCoding.F32, density, 0)})
        blob = encode(update, spec)
        sizes = {c: len(encode_with(update, spec, index_coding=c)) for c in (IndexCoding.BITMAP, IndexCoding.RICE)}
        chosen[density] = inspect(blob, spec)[0].index_coding
        assert len(blob) == min(sizes.values())
        assert sizes[chosen[density]] == len(blob)
    assert chosen["single"] is IndexCoding.RICE and chosen["sparse"] is IndexCoding.RICE
    assert chosen["half"] is IndexCoding.BITMAP and chosen["all"] is IndexCoding.BITMAP


def test_decoded_types_and_independence_from_the_blob():
    spec = ModelSpec((("a", (40,)), ("b", (6, 7)), ("c", (9,))))
    update = Update(
        {
            "a": make_payload(1, (40,), ValueCoding.BF16, "sparse", 0),
            "b": make_payload(2, (6, 7), ValueCoding.TERNARY, "dense", 4),
            "c": make_payload(3, (9,), ValueCoding.INT4, "half", 2),
        }
    )
    blob = bytearray(encode(update, spec))
    out = decode(blob, spec)
    assert out.tensors["a"].values.data.dtype == torch.bfloat16
    assert out.tensors["b"].values.data.dtype == torch.int8 and out.tensors["b"].indices is None
    assert out.tensors["c"].indices.dtype == torch.int64
    before = out.tensors["b"].values.data.clone()
    blob[30:] = bytes(len(blob) - 30)  # the decoded tensors must not alias the input buffer
    assert torch.equal(out.tensors["b"].values.data, before)
    out.tensors["b"].values.data.add_(0)  # writable
    torch.testing.assert_close(out.to_dense()["b"], update.to_dense()["b"])
    assert_same(update, decode(memoryview(encode(update, spec)), spec))


def test_meta_round_trips_and_rejects_non_finite():
    spec = ModelSpec((("w", (3,)),))
    tensors = {"w": TensorPayload((3,), Values.f32(torch.ones(3)))}
    update = Update(tensors, meta={"loss": 0.25, "examples": 128.0, "ü": -1.0})
    assert decode(encode(update, spec), spec).meta == update.meta
    for bad in ({"loss": float("nan")}, {"x" * 256: 1.0}, {"loss": "high"}, {1: 1.0}):
        with pytest.raises(WireError, match="meta"):
            encode(Update(tensors, meta=bad), spec)


def test_worked_example_in_the_spec_document():
    doc = (pathlib.Path(__file__).parents[1] / "docs" / "wire-format.md").read_text()
    documented = bytes.fromhex(doc.split("<!-- example-hex -->")[1].split("```")[1])
    spec = ModelSpec((("w", (1000,)), ("b", (4,))))
    w = Values(ValueCoding.INT8, torch.tensor([127, -5, 64], dtype=torch.int8), torch.tensor([0.01]), 256)
    b = Values(ValueCoding.F16, torch.tensor([1.0, -0.5, 0.0, 2.0]).half())
    update = Update({"w": TensorPayload((1000,), w, torch.tensor([3, 700, 701])), "b": TensorPayload((4,), b)}, 0, 1, 7)
    assert encode(update, spec) == documented
    assert_same(update, decode(documented, spec))


# ------------------------------------------------------------------------------------------------ size accounting


def test_breakdown_of_a_known_layout():
    spec = ModelSpec((("w", (10,)), ("q", (100,))))
    codes = torch.ones(3, dtype=torch.int8)
    update = Update(
        {
            "w": TensorPayload((10,), Values.f32(torch.arange(10.0))),
            "q": TensorPayload((100,), Values(ValueCoding.INT8, codes, torch.ones(2), 2), torch.tensor([5, 50, 99])),
        },
        seq=300,
    )
    blob = encode(update, spec)
    parts = encoded_size_breakdown(blob, spec)
    # fixed 12, client/seq(2 bytes)/base 4, count 1, meta 1, w kind 1, q kind+nnz 2, rice b+qsum 2, block+nscales 2
    # gaps 5, 44, 48: RICE b=4 (qsum 5: 8 unary bits = 1 byte, 3 x 4 remainder bits = 2 bytes) beats a 13-byte bitmap
    assert parts == {"header": 25, "index": 3, "scales": 8, "values": 43, "crc": 4}
    assert sum(parts.values()) == len(blob)


@SETTINGS
@given(updates())
def test_breakdown_sums_to_the_blob(case):
    update, spec = case
    blob = encode(update, spec)
    parts = encoded_size_breakdown(blob, spec)
    assert sum(parts.values()) == len(blob) and parts["crc"] == 4
    assert sum(i.nbytes for i in inspect(blob, spec)) < len(blob)
    assert len(blob) <= default_max_bytes(spec)


def int8_blockwise(x: torch.Tensor, block: int = 256) -> Values:
    n = x.numel()
    padded = torch.zeros(Values.num_blocks(n, block) * block)
    padded[:n] = x
    scales = padded.view(-1, block).abs().amax(1) / 127
    per = scales.repeat_interleave(block)[:n]
    codes = torch.round(x / torch.where(per > 0, per, 1)).to(torch.int8)
    return Values(ValueCoding.INT8, codes, scales, block)


@pytest.mark.parametrize("shape", [(1_000_000,), (1000, 1000)])
def test_byte_budget_at_one_in_a_thousand_with_int8(shape):
    gen = torch.Generator().manual_seed(0)
    grad = torch.from_numpy(np.random.default_rng(0).standard_t(3, math.prod(shape)).astype(np.float32))
    grad = grad * torch.rand(grad.numel(), generator=gen)
    k = grad.numel() // 1000
    idx = torch.topk(grad.abs(), k).indices.sort().values
    spec = ModelSpec((("w", shape),))
    update = Update({"w": TensorPayload(shape, int8_blockwise(grad[idx]), idx)}, 12, 34, 5)
    blob = encode(update, spec)
    assert len(blob) / k <= 2.6
    assert_same(update, decode(blob, spec))


# ------------------------------------------------------------------------------------------------ bit layout


def ref_pack(values, width: int) -> bytes:
    acc = 0
    for i, v in enumerate(values):
        acc |= int(v) << (i * width)
    return acc.to_bytes(packed_len(len(values), width), "little")


@settings(max_examples=400, derandomize=True, deadline=None)
@given(st.integers(0, 32), st.data())
def test_fixed_width_fields_match_a_reference_packer(width, data):
    values = data.draw(st.lists(st.integers(0, (1 << width) - 1), max_size=70))
    arr = np.array(values, dtype=np.int64)
    packed = pack_uint(arr, width)
    assert bytes(packed) == ref_pack(values, width)
    back = unpack_uint(Reader(packed, 0, len(packed)), len(values), width, "test", "index")
    assert back.tolist() == values


@settings(max_examples=200, derandomize=True, deadline=None)
@given(st.integers(2, 32), st.sampled_from([8, 16, 24]), st.data())
def test_fields_unpacked_chunk_by_chunk_match_a_reference_packer(width, chunk, data):
    """Chunks of ``UNPACK_CHUNK`` fields (small here, so a few dozen fields span several) read the same values."""
    from unittest import mock

    values = data.draw(st.lists(st.integers(0, (1 << width) - 1), max_size=70))
    packed = ref_pack(values, width)
    with mock.patch("fedcomp.wire.bits.UNPACK_CHUNK", chunk):
        back = unpack_uint(Reader(packed, 0, len(packed)), len(values), width, "test", "index")
    assert back.tolist() == values


def test_wide_fields_cost_their_result_and_a_bounded_scratch():
    """A million 32-bit fields (a blob under the default size cap can claim them as RICE remainders) cost the
    int64 result and a few MB: the bit matrix of them all took 288 bytes per field, 60 times the blob."""
    import tracemalloc

    count = 1_000_000
    packed = np.random.default_rng(0).integers(0, 256, size=count * 4, dtype=np.uint8).tobytes()
    tracemalloc.start()
    try:
        back = unpack_uint(Reader(packed, 0, len(packed)), count, 32, "test", "index")
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert back.dtype == np.int64 and int(back[1]) == int.from_bytes(packed[4:8], "little")
    assert peak < 8 * count + 8 * 2**20, peak


@settings(max_examples=300, derandomize=True, deadline=None)
@given(st.integers(0, 2**64 - 1))
def test_varint_round_trip_and_minimal(value):
    raw = varint(value)
    assert len(raw) == max(1, math.ceil(value.bit_length() / 7))
    r = Reader(raw + b"\x00", 0, len(raw) + 1)
    assert r.varint("v") == value and r.pos == len(raw)


def test_varint_rejects_overlong_and_non_minimal():
    with pytest.raises(WireError, match="non-minimal"):
        Reader(b"\x80\x00", 0, 2).varint("v")
    with pytest.raises(WireError, match="longer"):
        Reader(b"\xff" * 11, 0, 11).varint("v")
    with pytest.raises(WireError, match="limit"):
        Reader(varint(300), 0, 2).varint("v", max_value=299)
    with pytest.raises(WireError):
        varint(-1)


def ref_rice(idx: list[int], b: int) -> tuple[bytes, bytes]:
    """Reference Rice coder, one element at a time: q zeros then a one; then b-bit remainders."""
    unary, rems, prev = [], [], -1
    for i in idx:
        g = i - prev - 1
        prev = i
        unary += [0] * (g >> b) + [1]
        rems.append(g & ((1 << b) - 1))
    return ref_pack(unary, 1), ref_pack(rems, b)


@settings(max_examples=300, derandomize=True, deadline=None)
@given(st.sets(st.integers(0, 5000), max_size=60))
def test_rice_and_bitmap_streams_match_reference_coders(positions):
    idx = np.array(sorted(positions), dtype=np.int64)
    rp = plan(idx, 5001, IndexCoding.RICE)
    params, stream = encode_index(rp, idx, 5001)
    unary, rems = ref_rice(idx.tolist(), rp.b)
    assert params == bytes([rp.b]) + varint(rp.qsum) and stream == unary + rems
    assert rp.size == len(params) + len(stream) == rice_size(idx.size, rp.qsum, rp.b)
    bp = plan(idx, 5001, IndexCoding.BITMAP)
    assert encode_index(bp, idx, 5001)[1] == ref_pack([int(i in positions) for i in range(5001)], 1)


@settings(max_examples=300, derandomize=True, deadline=None)
@given(st.lists(st.integers(0, 10**6), min_size=1, max_size=50))
def test_rice_lower_bound_is_a_lower_bound(gap_list):
    g = np.array(gap_list, dtype=np.int64)
    bound = rice_lower_bound(g.size, int(g.sum()))
    assert all(bound <= rice_size(g.size, int((g >> b).sum()), b) for b in range(33))


@pytest.mark.parametrize("density", [0.3, 0.01, 0.001, 0.0001])
def test_rice_parameter_is_optimal_for_geometric_gaps(density):
    g = np.random.default_rng(1).geometric(density, 20_000) - 1
    best = min(rice_size(g.size, int((g >> b).sum()), b) for b in range(33))
    assert rice_plan(g).size == best


# ------------------------------------------------------------------------------------------------ encode refuses


def _one(payload: TensorPayload, shape=(10,)) -> tuple[Update, ModelSpec]:
    return Update({"w": payload}), ModelSpec((("w", shape),))


IDX = torch.tensor([1, 4, 7])
CODES = torch.tensor([1, -2, 3], dtype=torch.int8)
FLT_MAX = float(torch.finfo(torch.float32).max)


def sparse(values: Values, idx: torch.Tensor = IDX) -> TensorPayload:
    return TensorPayload((10,), values, idx)


def q(coding=ValueCoding.INT8, codes=CODES, scales=None, block=4) -> Values:
    return Values(coding, codes, torch.ones(1) if scales is None else scales, block)


NAN, INF = float("nan"), float("inf")
BAD_PAYLOADS = {
    "nan f32": (TensorPayload((10,), Values.f32(torch.full((10,), NAN))), "NaN"),
    "inf f16": (sparse(Values(ValueCoding.F16, torch.tensor([1, INF, 2]).half())), "Inf"),
    "nan bf16": (sparse(Values(ValueCoding.BF16, torch.tensor([NAN] * 3).bfloat16())), "NaN"),
    "nan scale": (sparse(q(scales=torch.tensor([NAN]))), "scales"),
    "inf scale": (sparse(q(scales=torch.tensor([-INF]))), "scales"),
    "shape": (TensorPayload((2, 5), Values.f32(torch.zeros(10))), "shape"),
    "length": (sparse(Values.f32(torch.zeros(2))), "3 entries"),
    "unsorted": (sparse(Values.f32(torch.zeros(3)), torch.tensor([4, 1, 7])), "increasing"),
    "duplicate": (sparse(Values.f32(torch.zeros(3)), torch.tensor([1, 1, 7])), "increasing"),
    "range": (sparse(Values.f32(torch.zeros(3)), torch.tensor([1, 4, 10])), "outside"),
    "negative": (sparse(Values.f32(torch.zeros(3)), torch.tensor([-1, 4, 7])), "outside"),
    "float idx": (sparse(Values.f32(torch.zeros(3)), IDX.float()), "integers"),
    "2-d idx": (sparse(Values.f32(torch.zeros(3)), IDX.view(3, 1)), "1-D"),
    "dtype": (sparse(Values(ValueCoding.F16, torch.zeros(3))), "float16"),
    "int8 -128": (sparse(q(codes=torch.tensor([1, -128, 3], dtype=torch.int8))), "codes"),
    "sign zero": (sparse(q(ValueCoding.SIGN, codes=torch.tensor([1, 0, -1], dtype=torch.int8))), "SIGN"),
    "int4 range": (sparse(q(ValueCoding.INT4, codes=CODES * 4)), "codes"),
    "ternary range": (sparse(q(ValueCoding.TERNARY, codes=CODES)), "codes"),
    "scale count": (sparse(q(scales=torch.ones(2))), "scales"),
    "block": (sparse(q(block=0)), "block"),
    "code dtype": (sparse(q(codes=CODES.int())), "int8"),
    "float scales": (sparse(Values(ValueCoding.F32, torch.zeros(3), torch.ones(1))), "no scales"),
    "negative scale": (sparse(q(scales=torch.tensor([-0.5]))), "negative"),
    "int8 overflow": (sparse(q(codes=torch.tensor([1, 127, 3], dtype=torch.int8), scales=torch.tensor([3e38]))),
                      "NaN or Inf"),
    "int4 overflow": (sparse(q(ValueCoding.INT4, scales=torch.tensor([FLT_MAX / 2]))), "NaN or Inf"),
}


@pytest.mark.parametrize("encoder", [encode, check], ids=["encode", "check"])
@pytest.mark.parametrize("case", sorted(BAD_PAYLOADS))
def test_encode_refuses_inconsistent_payloads(case, encoder):
    """``check`` (a client reading its saved updates) refuses what ``encode`` refuses, with the same message."""
    payload, match = BAD_PAYLOADS[case]
    update, spec = _one(payload)
    with pytest.raises(WireError, match=match):
        encoder(update, spec)


@pytest.mark.parametrize("coding", [ValueCoding.INT8, ValueCoding.INT4])
def test_encode_accepts_products_up_to_the_float32_edge(coding):
    """The largest code times the largest scale that stays finite round-trips; one ulp more is refused.
    (For ±1 codes the edge is the largest finite scale itself.)"""
    top = coding.code_range[1]
    edge = torch.tensor([FLT_MAX / top], dtype=torch.float32)
    while not torch.isfinite(edge * top):
        edge = torch.nextafter(edge, torch.zeros(1))
    codes = torch.full((3,), top, dtype=torch.int8)
    update, spec = _one(sparse(Values(coding, codes, edge, 4)))
    assert torch.equal(decode(encode(update, spec), spec).tensors["w"].values.scales, edge)
    over = torch.nextafter(edge, torch.full((1,), math.inf))
    with pytest.raises(WireError, match="NaN or Inf"):
        encode(_one(sparse(Values(coding, codes, over, 4)))[0], spec)


@pytest.mark.parametrize("encoder", [encode, check], ids=["encode", "check"])
def test_encode_refuses_bad_update_fields(encoder):
    spec = ModelSpec((("w", (2,)), ("b", (1,))))
    ok = {"w": TensorPayload((2,), Values.f32(torch.ones(2))), "b": TensorPayload((1,), Values.f32(torch.ones(1)))}
    with pytest.raises(WireError, match="missing"):
        encoder(Update({"w": ok["w"]}), spec)
    with pytest.raises(WireError, match="unexpected"):
        encoder(Update({**ok, "x": ok["b"]}), spec)
    for field, value in (("seq", -1), ("client_id", 2**64), ("base_version", 1.5)):
        update = Update(dict(ok))
        setattr(update, field, value)
        with pytest.raises(WireError, match=field):
            encoder(update, spec)

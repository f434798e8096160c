"""Hostile input to ``decode``: every defect must raise ``WireError`` and nothing else.

Two attack families: corruption the CRC catches (truncation, bit flips), and structural defects behind a
valid CRC, built with the small record builder below (an independent writer of docs/wire-format.md).
"""

from __future__ import annotations

import math
import tracemalloc
import zlib

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fedcomp.payload import TensorPayload, Update, ValueCoding, Values
from fedcomp.server import wire_reason
from fedcomp.spec import ModelSpec
from fedcomp.wire import WireError, decode, encode
from fedcomp.wire.bits import varint
from fedcomp.wire.codec import MAGIC, VERSION, VERSIONS, default_max_bytes, encode_with
from fedcomp.wire.index import IndexCoding


def fuzz(n: int):
    return settings(max_examples=n, derandomize=True, deadline=None, suppress_health_check=list(HealthCheck))


V, IC = ValueCoding, IndexCoding

# ------------------------------------------------------------------------------------------------ raw builder


def seal(body: bytes) -> bytes:
    return body + zlib.crc32(body).to_bytes(4, "little")


def header(spec: ModelSpec, *, version=VERSION, fp=None, ids=(0, 0, 0), count=None, meta=b"\x00") -> bytes:
    ids_raw = b"".join(varint(i) for i in ids)
    count_raw = varint(len(spec) if count is None else count)
    return MAGIC + bytes([version]) + (fp or spec.fingerprint) + ids_raw + count_raw + meta


def bits_le(bits) -> bytes:
    """Pack 0/1 values little-endian (bit i -> byte i // 8, bit i % 8), one at a time."""
    acc = sum(int(b) << i for i, b in enumerate(bits))
    return acc.to_bytes((len(bits) + 7) // 8, "little")


def fields_le(values, width: int) -> bytes:
    return bits_le([(int(v) >> j) & 1 for v in values for j in range(width)])


def floats(values, dtype="<f4") -> bytes:
    return np.asarray(values, dtype=dtype).tobytes()


def quant(block: int, scales, codes: bytes, nscales: int | None = None) -> bytes:
    n = len(scales) if nscales is None else nscales
    return varint(block) + varint(n) + floats(scales) + codes


def kind(icoding: IndexCoding, vcoding: int) -> bytes:
    return bytes([icoding << 4 | vcoding])


def dense(vcoding: int, values: bytes) -> bytes:
    return kind(IC.DENSE, vcoding) + values


def bitmap(vcoding: int, nnz: int, bitmap_bytes: bytes, values: bytes) -> bytes:
    return kind(IC.BITMAP, vcoding) + varint(nnz) + bitmap_bytes + values


def rice_streams(idx, b: int) -> tuple[int, bytes, bytes]:
    unary, rems, prev = [], [], -1
    for i in idx:
        g = i - prev - 1
        prev = i
        unary += [0] * (g >> b) + [1]
        rems.append(g & ((1 << b) - 1))
    return len(unary) - len(rems), bits_le(unary), fields_le(rems, b)


def rice(vcoding: int, nnz: int, b: int, qsum: int, unary: bytes, rems: bytes, values: bytes) -> bytes:
    return kind(IC.RICE, vcoding) + varint(nnz) + bytes([b]) + varint(qsum) + unary + rems + values


def rice_of(vcoding: int, idx, b: int, values: bytes) -> bytes:
    qsum, unary, rems = rice_streams(idx, b)
    return rice(vcoding, len(idx), b, qsum, unary, rems, values)


def one(shape: tuple[int, ...]) -> ModelSpec:
    return ModelSpec((("w", shape),))


def rejects(blob: bytes, spec: ModelSpec, match: str | None = None, **kw) -> WireError:
    with pytest.raises(WireError, match=match) as err:
        decode(blob, spec, **kw)
    return err.value


# ------------------------------------------------------------------------------------------------ corpus

SPEC = ModelSpec((("conv.weight", (4, 3, 3, 3)), ("fc.weight", (10, 32)), ("fc.bias", (10,)), ("scalar", ())))


def _payload(rng: np.random.Generator, shape, coding: ValueCoding, nnz: int | None) -> TensorPayload:
    numel = math.prod(shape)
    n = numel if nnz is None else nnz
    if coding.is_float:
        data = torch.from_numpy(rng.standard_normal(n).astype(np.float32)).to(
            {V.F32: torch.float32, V.F16: torch.float16, V.BF16: torch.bfloat16}[coding]
        )
        values = Values(coding, data)
    else:
        lo, hi = coding.code_range
        codes = rng.integers(lo, hi + 1, n)
        codes = np.where(codes == 0, 1, codes) if coding is V.SIGN else codes
        block = int(rng.integers(1, 9))
        scales = torch.from_numpy(rng.random(Values.num_blocks(n, block)).astype(np.float32))
        values = Values(coding, torch.from_numpy(codes.astype(np.int8)), scales, block)
    idx = None if nnz is None else torch.from_numpy(np.sort(rng.choice(numel, nnz, replace=False)))
    return TensorPayload(tuple(shape), values, idx)


def _corpus() -> list[bytes]:
    blobs = []
    for seed, coding in enumerate(c for c in ValueCoding if c is not ValueCoding.LOWRANK):  # tests/test_lowrank.py
        rng = np.random.default_rng(seed)
        tensors = {}
        for name, shape in SPEC.entries:
            numel = math.prod(shape)
            nnz = [None, 0, 1, numel // 20, numel // 2][int(rng.integers(0, 5))]
            tensors[name] = _payload(rng, shape, coding, nnz)
        update = Update(tensors, base_version=seed, seq=seed * 1000, client_id=2**40 + seed, meta={"loss": 0.5})
        for forced in (None, IC.BITMAP, IC.RICE):
            blobs.append(encode_with(update, SPEC, index_coding=forced))
    return blobs


CORPUS = _corpus()
blobs = st.sampled_from(range(len(CORPUS))).map(CORPUS.__getitem__)


def test_corpus_decodes():
    for blob in CORPUS:
        decode(blob, SPEC)


def test_builder_writes_what_the_encoder_writes():
    spec = ModelSpec((("a", (100,)), ("b", (5,)), ("c", (2, 2))))
    codes = torch.tensor([1, -1, 1], dtype=torch.int8)
    update = Update(
        {
            "a": TensorPayload((100,), Values.f32(torch.tensor([1.0, -2.0, 3.0])), torch.tensor([2, 9, 29])),
            "b": TensorPayload((5,), Values(V.SIGN, codes, torch.tensor([0.5, 2.0]), 2), torch.tensor([0, 3, 4])),
            "c": TensorPayload((2, 2), Values(V.F16, torch.tensor([1.0, 2.0, 3.0, 4.0]).half())),
        },
        base_version=7,
        seq=300,
        client_id=1,
    )
    a = rice_of(V.F32, [2, 9, 29], 2, floats([1, -2, 3]))
    b = bitmap(V.SIGN, 3, bits_le([1, 0, 0, 1, 1]), quant(2, [0.5, 2.0], bits_le([1, 0, 1])))
    c = dense(V.F16, floats([1, 2, 3, 4], "<f2"))
    expect = seal(header(spec, ids=(1, 300, 7)) + a + b + c)
    assert encode(update, spec) == expect
    assert decode(expect, spec).seq == 300


# ------------------------------------------------------------------------------------------------ CRC-caught corruption


def test_every_truncation_fails():
    for blob in CORPUS:
        for cut in range(len(blob)):
            rejects(blob[:cut], SPEC)


def test_every_truncation_behind_a_valid_crc_fails():
    for blob in CORPUS:
        body = blob[:-4]
        for cut in range(len(body)):
            rejects(seal(body[:cut]), SPEC)


@fuzz(3000)
@given(blobs, st.sets(st.integers(0, 10**6), min_size=1, max_size=3))
def test_bit_flips_are_caught(blob, positions):
    bad = bytearray(blob)
    for p in positions:
        bad[(p // 8) % len(blob)] ^= 1 << (p % 8)
    if bytes(bad) == blob:  # flips cancelled out
        return
    first = next(i for i, (x, y) in enumerate(zip(bad, blob, strict=True)) if x != y)
    err = rejects(bytes(bad), SPEC)
    assert ("magic" in str(err) or "version" in str(err)) if first < 4 else "CRC" in str(err)


@fuzz(2000)
@given(blobs, st.lists(st.tuples(st.integers(0, 10**6), st.integers(0, 255)), min_size=1, max_size=4))
def test_resealed_byte_overwrites_never_yield_an_invalid_update(blob, edits):
    body = bytearray(blob[:-4])
    for pos, value in edits:
        body[pos % len(body)] = value
    _decodes_to_valid_or_rejects(seal(bytes(body)))


@fuzz(1000)
@given(st.binary(max_size=300), st.sampled_from([0, 1, 2, 3]))
def test_random_records_behind_a_valid_header_and_crc(records, ids):
    _decodes_to_valid_or_rejects(seal(header(SPEC, ids=(ids, ids, ids)) + records))


@fuzz(1000)
@given(st.binary(max_size=200))
def test_random_bytes(junk):
    rejects(junk, SPEC)
    rejects(MAGIC + bytes([VERSION]) + junk, SPEC)


def _decodes_to_valid_or_rejects(blob: bytes) -> None:
    """Either WireError, or an update ``encode`` accepts (sorted unique in-range indices, finite after
    dequantization, in range)."""
    try:
        update = decode(blob, SPEC)
    except WireError:
        return
    for p in update.tensors.values():
        if p.indices is not None:
            assert torch.all(p.indices[1:] > p.indices[:-1])
        assert torch.isfinite(p.values.dequantize()).all()
    encode(update, SPEC)


# ------------------------------------------------------------------------------------------------ size cap, identity


@fuzz(300)
@given(blobs, st.integers(0, 10**4))
def test_size_cap(blob, cap):
    if len(blob) > cap:
        rejects(blob, SPEC, "max_bytes", max_bytes=cap)
    else:
        decode(blob, SPEC, max_bytes=cap)


def test_default_size_cap_rejects_before_reading():
    spec = one((10,))
    cap = default_max_bytes(spec)
    assert cap == 2 * 40 + 64 * 1024
    rejects(seal(header(spec) + dense(V.F32, floats(range(10))) + bytes(cap)), spec, "max_bytes")


def test_wrong_fingerprint():
    blob = CORPUS[0]
    renamed = ModelSpec((("conv.w", (4, 3, 3, 3)),) + SPEC.entries[1:])
    reshaped = ModelSpec((("conv.weight", (4, 27)),) + SPEC.entries[1:])
    reordered = ModelSpec(SPEC.entries[::-1])
    for other in (renamed, reshaped, reordered):
        rejects(blob, other, "fingerprint")
    forged = bytearray(blob[:-4])
    forged[4:12] = bytes(8)
    rejects(seal(bytes(forged)), SPEC, "fingerprint")


@fuzz(300)
@given(st.integers(0, 255), blobs)
def test_unknown_version_and_bad_magic(version, blob):
    body = bytearray(blob[:-4])
    if version != VERSION:  # version 2 is only for updates holding a LOWRANK record; the corpus has none
        body[3] = version
        rejects(seal(bytes(body)), SPEC, "without a LOWRANK record" if version in VERSIONS else "unknown codec version")
    body[3] = VERSION
    body[version % 3] ^= 0x20
    rejects(seal(bytes(body)), SPEC, "magic")


# ------------------------------------------------------------------------------------------------ structural attacks


shapes = st.sampled_from([(1,), (7,), (8,), (3, 5), (2, 2, 2, 2), (100,)])


@fuzz(400)
@given(shapes, st.data())
def test_rice_index_past_numel(shape, data):
    numel = math.prod(shape)
    good = sorted(data.draw(st.sets(st.integers(0, numel - 1), max_size=4)))
    beyond = data.draw(st.integers(numel, numel + 300))
    idx = good + [beyond]
    b = data.draw(st.integers(0, 9))
    blob = seal(header(one(shape)) + rice_of(V.F32, idx, b, floats(range(len(idx)))))
    rejects(blob, one(shape), "numel")


@fuzz(300)
@given(shapes, st.integers(0, 9), st.data())
def test_rice_boundary_last_position_is_accepted(shape, b, data):
    numel = math.prod(shape)
    idx = sorted(data.draw(st.sets(st.integers(0, max(0, numel - 2)), max_size=3)) | {numel - 1})
    out = decode(seal(header(one(shape)) + rice_of(V.F32, idx, b, floats(range(len(idx))))), one(shape))
    assert out.tensors["w"].indices.tolist() == idx


@fuzz(400)
@given(shapes, st.integers(0, 8), st.data())
def test_rice_stream_inconsistencies(shape, b, data):
    numel = math.prod(shape)
    idx = sorted(data.draw(st.sets(st.integers(0, numel - 1), min_size=1, max_size=5)))
    qsum, unary, rems = rice_streams(idx, b)
    n, vals = len(idx), floats(range(len(idx)))
    spec = one(shape)
    attack = data.draw(st.sampled_from(["qsum+", "qsum-", "nnz+", "nnz-", "b>32", "unary pad", "rem pad"]))
    if attack == "qsum+":
        body = rice(V.F32, n, b, qsum + data.draw(st.integers(1, 9)), unary + b"\x00", rems, vals)
    elif attack == "qsum-" and qsum:
        body = rice(V.F32, n, b, qsum - 1, unary, rems, vals)
    elif attack == "nnz+":
        body = rice(V.F32, n + 1, b, qsum, unary, rems, vals + floats([0]))
    elif attack == "nnz-":
        body = rice(V.F32, n - 1, b, qsum, unary, rems, vals[:-4])
    elif attack == "b>32":
        body = rice(V.F32, n, data.draw(st.integers(33, 255)), qsum, unary, rems, vals)
    elif attack == "unary pad" and (n + qsum) % 8:
        body = rice(V.F32, n, b, qsum, unary[:-1] + bytes([unary[-1] | 0x80]), rems, vals)
    elif attack == "rem pad" and (n * b) % 8:
        body = rice(V.F32, n, b, qsum, unary, rems[:-1] + bytes([rems[-1] | 0x80]), vals)
    else:
        return
    rejects(seal(header(spec) + body), spec)


@fuzz(400)
@given(shapes, st.data())
def test_nnz_beyond_numel(shape, data):
    numel = math.prod(shape)
    nnz = data.draw(st.one_of(st.integers(numel + 1, numel + 10), st.integers(numel + 1, 2**64 - 1)))
    coding = data.draw(st.sampled_from([IC.BITMAP, IC.RICE]))
    body = kind(coding, V.F32) + varint(nnz) + bits_le([1] * numel) + floats(range(numel))
    rejects(seal(header(one(shape)) + body), one(shape), "nnz")


@fuzz(400)
@given(shapes, st.data())
def test_bitmap_popcount_and_padding(shape, data):
    numel = math.prod(shape)
    bits = data.draw(st.lists(st.integers(0, 1), min_size=numel, max_size=numel))
    ones = sum(bits)
    nnz = data.draw(st.integers(0, numel).filter(lambda k: k != ones))
    rejects(seal(header(one(shape)) + bitmap(V.F32, nnz, bits_le(bits), floats(range(nnz)))), one(shape))
    if numel % 8:
        raw = bits_le(bits)
        raw = raw[:-1] + bytes([raw[-1] | (1 << data.draw(st.integers(numel % 8, 7)))])
        rejects(seal(header(one(shape)) + bitmap(V.F32, ones, raw, floats(range(ones)))), one(shape), "padding")


CODE_WIDTH = {V.INT8: 8, V.INT4: 4, V.TERNARY: 2, V.SIGN: 1}
INVALID_FIELD = {V.INT8: 0x80, V.INT4: 8, V.TERNARY: 2}


@fuzz(400)
@given(st.sampled_from([V.INT8, V.INT4, V.TERNARY]), st.integers(1, 20), st.data())
def test_codes_outside_the_range(coding, n, data):
    width = CODE_WIDTH[coding]
    fields = data.draw(st.lists(st.sampled_from([0, 1]), min_size=n, max_size=n))
    fields[data.draw(st.integers(0, n - 1))] = INVALID_FIELD[coding]
    spec = one((n,))
    rejects(seal(header(spec) + dense(coding, quant(n, [1.0], fields_le(fields, width)))), spec, "codes outside")


@fuzz(300)
@given(st.sampled_from([V.INT4, V.TERNARY, V.SIGN]), st.integers(1, 20), st.data())
def test_code_padding_bits(coding, n, data):
    width = CODE_WIDTH[coding]
    if (n * width) % 8 == 0:
        return
    raw = bytearray(fields_le([1] * n, width))
    raw[-1] |= 1 << data.draw(st.integers((n * width) % 8, 7))
    spec = one((n,))
    rejects(seal(header(spec) + dense(coding, quant(n, [1.0], bytes(raw)))), spec, "padding")


@fuzz(400)
@given(st.sampled_from([V.INT8, V.INT4, V.TERNARY, V.SIGN]), st.integers(0, 40), st.integers(1, 9), st.data())
def test_wrong_scale_count(coding, n, block, data):
    want = Values.num_blocks(n, block)
    count = data.draw(st.integers(0, want + 5).filter(lambda c: c != want))
    codes = fields_le([1] * n, CODE_WIDTH[coding])
    spec = one((max(n, 1),))
    body = bitmap(coding, n, bits_le([1] * n + [0] * (spec.total_numel - n)), quant(block, [1.0] * count, codes))
    rejects(seal(header(spec) + body), spec, "scales for")


@fuzz(200)
@given(st.sampled_from([V.INT8, V.INT4, V.TERNARY, V.SIGN]), st.integers(1, 20))
def test_zero_block(coding, n):
    spec = one((n,))
    body = dense(coding, varint(0) + varint(0) + fields_le([1] * n, CODE_WIDTH[coding]))
    rejects(seal(header(spec) + body), spec, "block")


NON_FINITE = {
    V.F32: ("<u4", [0x7F800000, 0xFF800000, 0x7FC00000, 0x7F800001, 0xFFFFFFFF]),
    V.F16: ("<u2", [0x7C00, 0xFC00, 0x7E00, 0x7C01, 0xFFFF]),
    V.BF16: ("<u2", [0x7F80, 0xFF80, 0x7FC0, 0x7F81, 0xFFFF]),
}


@fuzz(600)
@given(st.sampled_from([V.F32, V.F16, V.BF16]), st.integers(1, 12), st.booleans(), st.data())
def test_non_finite_values(coding, n, sparse, data):
    dtype, specials = NON_FINITE[coding]
    words = data.draw(st.lists(st.integers(0, 0x3000), min_size=n, max_size=n))
    words[data.draw(st.integers(0, n - 1))] = data.draw(st.sampled_from(specials))
    values = np.asarray(words, dtype=dtype).tobytes()
    spec = one((n,))
    body = rice_of(coding, list(range(n)), 0, values) if sparse else dense(coding, values)
    rejects(seal(header(spec) + body), spec, "NaN or Inf")


@fuzz(300)
@given(st.sampled_from([V.INT8, V.INT4, V.TERNARY, V.SIGN]), st.integers(1, 20), st.data())
def test_non_finite_scales(coding, n, data):
    block = data.draw(st.integers(1, n))
    scales = np.ones(Values.num_blocks(n, block), dtype="<f4")
    scales[data.draw(st.integers(0, scales.size - 1))] = data.draw(st.sampled_from([np.nan, np.inf, -np.inf]))
    codes = fields_le([1] * n, CODE_WIDTH[coding])
    spec = one((n,))
    rejects(seal(header(spec) + dense(coding, quant(block, scales, codes))), spec, "scales contain")


FLT_MAX = float(np.finfo(np.float32).max)
TINY = float(np.finfo(np.float32).smallest_subnormal)
QUANTIZED = [V.INT8, V.INT4, V.TERNARY, V.SIGN]


def _edge_scales() -> list[float]:
    """Scales on both sides of the float32 overflow edge of every code magnitude, and ordinary ones."""
    out = [0.0, -0.0, TINY, 1.0, 3e38, FLT_MAX, float(np.nextafter(np.float32(FLT_MAX), np.float32(0)))]
    for m in (7, 127):
        edge = np.float32(FLT_MAX / m)
        out += [float(edge), float(np.nextafter(edge, np.float32(0))), float(np.nextafter(edge, np.float32(np.inf)))]
    return out


scales_near_overflow = st.one_of(st.sampled_from(_edge_scales()), st.floats(0.0, FLT_MAX, width=32))


def code_fields(coding: ValueCoding, codes) -> bytes:
    """The code section of ``codes`` (SIGN: bit 1 = +1; others: two's complement fields)."""
    fields = [int(c > 0) for c in codes] if coding is V.SIGN else codes
    return fields_le(fields, CODE_WIDTH[coding])


def dequantized_f32(codes, scales, block: int) -> np.ndarray:
    """``code * scale`` in float32 arithmetic, one value per code (reference for ``Values.dequantize``)."""
    per = np.asarray(scales, dtype=np.float32)[np.arange(len(codes)) // block]
    with np.errstate(over="ignore", invalid="ignore"):
        return np.asarray(codes, dtype=np.float32) * per


@fuzz(800)
@given(st.sampled_from(QUANTIZED), st.integers(1, 24), st.data())
def test_decode_accepts_exactly_the_records_that_dequantize_finite(coding, n, data):
    """Finite, non-negative scales and legal codes: decode succeeds iff every code x scale is finite in float32;
    otherwise a ``WireError`` the server files under ``wire/non-finite``."""
    block = data.draw(st.integers(1, n))
    lo, hi = coding.code_range
    legal = st.sampled_from([-1, 1]) if coding is V.SIGN else st.integers(lo, hi)
    codes = data.draw(st.lists(st.one_of(legal, st.sampled_from([lo, hi])), min_size=n, max_size=n))
    nb = Values.num_blocks(n, block)
    scales = data.draw(st.lists(scales_near_overflow, min_size=nb, max_size=nb))
    spec = one((n,))
    blob = seal(header(spec) + dense(coding, quant(block, scales, code_fields(coding, codes))))
    want = dequantized_f32(codes, scales, block)
    if np.isfinite(want).all():
        got = decode(blob, spec).tensors["w"].values.dequantize()
        assert torch.equal(got, torch.from_numpy(want))
    else:
        err = rejects(blob, spec, "NaN or Inf")
        assert wire_reason(err).startswith("wire/non-finite")


@pytest.mark.parametrize("coding", QUANTIZED)
def test_huge_scale_with_small_codes_is_accepted(coding):
    """The per-block bound |scale| x largest code is only a shortcut: a block whose codes stay small is decoded."""
    codes = [0, 1, -1, 0] if coding is V.TERNARY else [1, -1, 1, -1]
    spec = one((8,))
    big = code_fields(coding, codes + [1] * 4)
    blob = seal(header(spec) + dense(coding, quant(4, [FLT_MAX, 1.0], big)))
    assert torch.isfinite(decode(blob, spec).tensors["w"].values.dequantize()).all()


@fuzz(300)
@given(st.sampled_from(QUANTIZED), st.integers(1, 20), st.data())
def test_negative_scales_are_rejected(coding, n, data):
    block = data.draw(st.integers(1, n))
    scales = np.ones(Values.num_blocks(n, block), dtype="<f4")
    scales[data.draw(st.integers(0, scales.size - 1))] = data.draw(st.floats(-FLT_MAX, -TINY, width=32))
    spec = one((n,))
    rejects(seal(header(spec) + dense(coding, quant(block, scales, code_fields(coding, [1] * n)))), spec, "negative")


def test_negative_zero_scale_is_accepted_bit_for_bit():
    spec = one((2,))
    blob = seal(header(spec) + dense(V.INT8, quant(2, [-0.0], bytes([1, 0x81]))))
    scales = decode(blob, spec).tensors["w"].values.scales
    assert scales.view(torch.int32).tolist() == [np.float32(-0.0).view(np.int32)]
    assert encode(decode(blob, spec), spec) == blob


@fuzz(400)
@given(st.integers(0, 15), st.integers(0, 15))
def test_coding_ids(icode, vcode):
    spec = one((4,))
    body = bytes([icode << 4 | vcode]) + varint(4) + bytes(64)
    if icode > 2:
        rejects(seal(header(spec) + body), spec, "unknown index coding")
    elif vcode > 6:
        rejects(seal(header(spec) + body), spec, "unknown value coding")


@fuzz(300)
@given(blobs, st.binary(min_size=1, max_size=40))
def test_trailing_bytes(blob, extra):
    rejects(seal(blob[:-4] + extra), SPEC, "trailing")


@fuzz(200)
@given(blobs, st.integers(0, 2**64 - 1))
def test_tensor_count(blob, count):
    if count == len(SPEC):
        return
    rest = decode_offsets(blob)
    rejects(seal(header(SPEC, ids=rest["ids"], count=count) + blob[rest["after_count"] : -4]), SPEC, "tensor count")


def decode_offsets(blob: bytes) -> dict:
    """The header ids and the offset just past the tensor count, read independently of the codec."""
    pos, ids = 12, []
    for _ in range(4):
        value, shift = 0, 0
        while True:
            byte = blob[pos]
            pos += 1
            value |= (byte & 0x7F) << shift
            shift += 7
            if not byte & 0x80:
                break
        ids.append(value)
    return {"ids": tuple(ids[:3]), "after_count": pos}


def meta_entry(key: bytes, value: float) -> bytes:
    return varint(len(key)) + key + np.float64(value).astype("<f8").tobytes()


META_ATTACKS = {
    "duplicate": (varint(2) + meta_entry(b"a", 1.0) + meta_entry(b"a", 2.0), "duplicate"),
    "utf8": (varint(1) + meta_entry(b"\xff\xfe", 1.0), "UTF-8"),
    "nan": (varint(1) + meta_entry(b"loss", float("nan")), "not finite"),
    "inf": (varint(1) + meta_entry(b"loss", float("-inf")), "not finite"),
    "count": (varint(2**40) + meta_entry(b"a", 1.0), "meta count"),
    "key length": (varint(1) + varint(256) + b"k" * 256 + bytes(8), "key length"),
    "short": (varint(3) + meta_entry(b"a", 1.0), None),
}


@pytest.mark.parametrize("attack", sorted(META_ATTACKS))
def test_meta_attacks(attack):
    meta, match = META_ATTACKS[attack]
    spec = one((2,))
    rejects(seal(header(spec, meta=meta) + dense(V.F32, floats([1, 2]))), spec, match)


@fuzz(300)
@given(st.integers(0, 4), st.integers(1, 3))
def test_non_minimal_varints(field, extra):
    ids = [b"\x05", b"\x05", b"\x05", b"\x01", b"\x00"]  # client, seq, base, count, meta count
    ids[field] = bytes([ids[field][0] | 0x80]) + b"\x80" * (extra - 1) + b"\x00"
    spec = one((2,))
    body = MAGIC + bytes([VERSION]) + spec.fingerprint + b"".join(ids) + dense(V.F32, floats([1, 2]))
    rejects(seal(body), spec, "non-minimal")


HUGE = [2**31, 2**40, 2**62, 2**64 - 1]


@pytest.mark.parametrize("attack", ["nnz", "qsum", "block", "nscales", "meta", "dense"])
@pytest.mark.parametrize("huge", HUGE)
def test_huge_claimed_counts_allocate_nothing(attack, huge):
    numel = 2**40 if attack in ("nnz", "dense") else 1000
    spec = one((numel,))
    records = {
        "nnz": kind(IC.RICE, V.F32) + varint(huge) + b"\x00\x00",
        "qsum": kind(IC.RICE, V.F32) + varint(3) + b"\x00" + varint(huge) + bytes(16),
        "block": kind(IC.DENSE, V.INT8) + varint(huge) + varint(1) + bytes(16),
        "nscales": kind(IC.RICE, V.INT8) + varint(1) + b"\x00\x00\x01" + varint(1) + varint(huge) + bytes(16),
        "meta": dense(V.F32, bytes(16)),
        "dense": dense(V.F32, bytes(16)),
    }
    blob = seal(header(spec, meta=varint(huge) if attack == "meta" else b"\x00") + records[attack])
    tracemalloc.start()
    try:
        rejects(blob, spec, max_bytes=10**6)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20


def test_format_cannot_express_unsorted_or_duplicate_indices():
    """Gaps are >= 0 by construction: the nearest a writer gets to a duplicate is a valid neighbour."""
    spec = one((10,))
    for idx in ([3, 3], [5, 2]):
        with pytest.raises(WireError, match="increasing"):
            encode(Update({"w": TensorPayload((10,), Values.f32(torch.ones(2)), torch.tensor(idx))}), spec)
    zero_gap = rice(V.F32, 2, 0, 3, bits_le([0, 0, 0, 1, 1]), b"", floats([1, 2]))
    assert decode(seal(header(spec) + zero_gap), spec).tensors["w"].indices.tolist() == [3, 4]


def test_encode_rejects_nan_gradients():
    spec = one((3, 4))
    grad = torch.randn(3, 4)
    grad[1, 2] = float("nan")
    with pytest.raises(WireError, match="'w'.*NaN"):
        encode(Update({"w": TensorPayload((3, 4), Values.f32(grad))}), spec)
    with pytest.raises(WireError, match="NaN"):
        encode(Update({"w": TensorPayload((3, 4), Values.f32(grad[1]), torch.tensor([0, 2, 5, 9]))}), spec)

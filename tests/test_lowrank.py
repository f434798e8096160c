"""The ``lowrank`` compressor (PowerSGD-style) and the LOWRANK value coding (wire version 2).

Round trips are exact, the error-feedback contract holds per tensor through the real pipeline and decoder, the
warm-started power iteration reproduces low-rank matrices and converges to the best rank-r approximation, a
restored state continues bit for bit, and every corrupt LOWRANK record raises ``WireError``.
"""

from __future__ import annotations

import io
import math
import zlib

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fedcomp.client.pipeline import build, build_compressor
from fedcomp.compressors.base import COMPRESSORS
from fedcomp.compressors.lowrank import LowRank, LowRankConfig
from fedcomp.kernels.hooks import find_fused_step
from fedcomp.memory.residual import ResidualMemory
from fedcomp.payload import LOWRANK_LIMIT, TensorPayload, Update, ValueCoding, Values
from fedcomp.registry import ConfigError
from fedcomp.server.aggregate import SparseAccumulator
from fedcomp.server.checks import update_norm
from fedcomp.spec import ModelSpec
from fedcomp.wire import WireCategory, WireError, decode, encode, encoded_size_breakdown
from fedcomp.wire.bits import varint
from fedcomp.wire.codec import LOWRANK_VERSION, MAGIC, VERSION, inspect

FUZZ = settings(max_examples=60, derandomize=True, deadline=None, suppress_health_check=list(HealthCheck))
SPEC = ModelSpec((("conv.weight", (16, 3, 3, 3)), ("conv.bias", (16,)), ("fc.weight", (40, 48)), ("fc.bias", (40,))))


def randn(*shape: int, seed: int = 0, scale: float = 1.0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale


def grads(spec: ModelSpec, seed: int) -> dict[str, torch.Tensor]:
    return {name: randn(*shape, seed=seed * 100 + i) for i, (name, shape) in enumerate(spec.entries)}


def lowrank_payload(m: int, n: int, r: int, seed: int = 0, shape: tuple[int, ...] | None = None) -> TensorPayload:
    p, q = randn(m, r, seed=seed), randn(n, r, seed=seed + 1)
    s = randn(r, seed=seed + 2).abs()
    return TensorPayload(shape or (m, n), Values.lowrank(p, s, q))


# ------------------------------------------------------------------------------------------------ the coding


@FUZZ
@given(
    st.integers(1, 12), st.lists(st.integers(1, 6), min_size=1, max_size=3), st.integers(1, 12),
    st.integers(0, 2**31), st.sampled_from([1e-20, 1e-3, 1.0, 1e6, 1e15]),
)
def test_round_trip_equals_the_factor_product(m, rest, r, seed, magnitude):
    shape = (m, *rest)
    n = math.prod(rest)
    r = min(r, m, n)
    p, q = randn(m, r, seed=seed), randn(n, r, seed=seed + 1, scale=magnitude)
    s = randn(r, seed=seed + 2).abs()
    s[0] = 0.0 if seed % 5 == 0 else s[0]  # a zero component is allowed
    spec = ModelSpec((("w", shape), ("b", (3,))))
    bias = TensorPayload((3,), Values.f32(torch.tensor([1.0, -0.0, 2.5])))
    update = Update({"w": TensorPayload(shape, Values.lowrank(p, s, q)), "b": bias}, 1, 2, 3)
    blob = encode(update, spec)
    assert blob[3] == LOWRANK_VERSION
    got = decode(blob, spec).tensors["w"]
    sent = update.tensors["w"].values
    assert (got.values.coding, got.values.block, got.indices, got.shape) == (ValueCoding.LOWRANK, m, None, shape)
    assert torch.equal(got.values.data.view(torch.int32), sent.data.view(torch.int32))
    assert torch.equal(got.values.scales.view(torch.int32), sent.scales.view(torch.int32))
    want = (p.double() * s.double()) @ q.double().T
    dense = got.to_dense()
    assert dense.shape == shape and torch.equal(dense, update.tensors["w"].to_dense())
    tol = 1e-5 * sent.lowrank_bound() + 1e-35  # float32 rounding of r products and their sum
    assert torch.allclose(dense.double().reshape(m, n), want, rtol=0, atol=tol)
    assert got.nnz == got.numel and len(got.values) == r * (m + n)
    assert encode(decode(blob, spec), spec) == blob  # canonical


def test_values_lowrank_example_and_size_accounting():
    v = Values.lowrank(torch.ones(3, 1), torch.tensor([2.0]), torch.ones(4, 1))
    assert v.dequantize().reshape(3, 4).eq(2.0).all() and len(v) == 7
    spec = ModelSpec((("w", (3, 4)),))
    blob = encode(Update({"w": TensorPayload((3, 4), v)}), spec)
    sections = encoded_size_breakdown(blob, spec)
    assert sections["scales"] == 4 and sections["values"] == 4 * 7 and sum(sections.values()) == len(blob)
    [info] = inspect(blob, spec)
    assert (info.value_coding, info.nnz, info.numel) == (ValueCoding.LOWRANK, 12, 12)


def test_an_update_without_lowrank_keeps_version_1_bytes():
    spec = ModelSpec((("w", (4, 5)),))
    blob = encode(Update({"w": TensorPayload((4, 5), Values.f32(torch.arange(20.0)))}), spec)
    assert blob[3] == VERSION == 1


def test_payload_bytes_of_a_large_matrix():
    m = n = 256
    r = 4
    spec = ModelSpec((("w", (m, n)),))
    pipe = build("lowrank", spec, rank=r)
    blob = pipe.send({"w": randn(m, n)})
    factors = 4 * r * (m + n + 1)  # factors and scales, float32
    assert factors <= len(blob) < factors + 40  # + header, rank varint, CRC
    assert len(blob) < 4 * m * n / 10


# ------------------------------------------------------------------------------------------------ the compressor


def test_registered_with_a_validated_frozen_config():
    comp = build_compressor("lowrank", rank=2, dense_below=10, seed=3)
    assert isinstance(comp, LowRank) and COMPRESSORS.get("lowrank") is LowRank
    assert comp.config == LowRankConfig(rank=2, dense_below=10, seed=3)
    for bad in ({"rank": 0}, {"rank": 1.5}, {"rank": True}, {"dense_below": -1}, {"seed": -1}):
        with pytest.raises(ConfigError):
            build_compressor("lowrank", **bad)
    with pytest.raises(ValueError):
        LowRankConfig(rank=-2)
    with pytest.raises(AttributeError):
        comp.config.rank = 8  # frozen


def test_small_one_d_and_unprofitable_tensors_go_dense_fp32():
    comp = LowRank(LowRankConfig(rank=20))
    for shape in [(40,), (10, 10), (33, 33), (2048, 1), ()]:  # 1-D, < dense_below, r (m + n + 1) >= m n, n = 1
        x = randn(*shape, seed=1) if shape else torch.tensor(2.0)
        p = comp.compress(x, "t")
        assert p.values.coding is ValueCoding.F32 and p.indices is None and torch.equal(p.to_dense(), x)
        assert p.values.data.data_ptr() != x.data_ptr()  # a copy: the memory writes into its input
    assert comp.rank_for((64, 64)) == 20 and comp.rank_for((64, 3, 3, 3)) == 0 and comp.rank_for((8, 8)) == 0
    four = LowRank(LowRankConfig(rank=4))
    assert four.rank_for((64, 3, 3, 3)) == 4 and four.rank_for((5, 4096)) == 4 and four.rank_for((3, 4096)) == 0


def test_a_rank_r_matrix_is_reproduced_to_float32_tolerance():
    m, n, r = 96, 64, 3
    target = randn(m, r, seed=1) @ randn(n, r, seed=2).T
    for rank in (r, r + 2):  # exact rank, and more columns than the matrix needs
        comp = LowRank(LowRankConfig(rank=rank, seed=5))
        for _ in range(3):
            sent = comp.compress(target, "w").to_dense()
            assert (sent - target).abs().max() <= 1e-5 * target.abs().max()


def test_warm_start_converges_to_the_best_rank_r_approximation():
    m, n, r = 96, 64, 4
    u, _ = torch.linalg.qr(randn(m, m, seed=3))
    v, _ = torch.linalg.qr(randn(n, n, seed=4))
    sigma = 0.7 ** torch.arange(n, dtype=torch.float32)
    target = (u[:, :n] * sigma) @ v.T
    best = float(torch.linalg.vector_norm(sigma[r:]))  # Eckart-Young
    warm, cold = LowRank(LowRankConfig(rank=r)), LowRank(LowRankConfig(rank=r))
    for _ in range(10):
        warm_err = float(torch.linalg.vector_norm(target - warm.compress(target, "w").to_dense()))
        cold.qs.clear()  # no warm start: a fresh random Q each step
        cold_err = float(torch.linalg.vector_norm(target - cold.compress(target, "w").to_dense()))
    assert warm_err < 1.001 * best  # converged
    assert cold_err > 1.2 * best  # one iteration from a random Q is far from it: the warm start does the work


def test_no_fused_kernel_path_is_taken():
    assert find_fused_step(ResidualMemory(), LowRank()) is None


# ------------------------------------------------------------------------------------------------ pipeline


@FUZZ
@given(st.integers(0, 2**31), st.integers(1, 5), st.sampled_from(["none", "nack", "ack"]))
def test_memory_contract_per_tensor_through_pipeline_and_decoder(seed, steps, resolve):
    pipe = build("lowrank", SPEC, rank=2, dense_below=256, seed=seed % 1000)
    before = {name: torch.zeros(shape) for name, shape in SPEC.entries}
    for t in range(steps):
        g = grads(SPEC, seed + t)
        decoded = decode(pipe.send(g), SPEC)
        assert {decoded.tensors[n].values.coding for n in ("conv.weight", "fc.weight")} == {ValueCoding.LOWRANK}
        sent = decoded.to_dense()
        for name in SPEC.names:  # input (with the carried residual) == sent + residual
            total = g[name] + before[name]
            tol = 1e-5 * float(total.abs().max()) + 1e-6
            assert torch.allclose(sent[name] + pipe.memory.residual(name), total, rtol=0, atol=tol), name
        if resolve == "nack":  # what the server did not apply goes back into the memory
            pipe.nack(pipe.last_seq)
            for name in SPEC.names:
                assert torch.allclose(pipe.memory.residual(name), g[name] + before[name], atol=1e-5), name
        elif resolve == "ack":
            pipe.ack(pipe.last_seq)
        before = {name: pipe.memory.residual(name).clone() for name in SPEC.names}
    for name in SPEC.names:  # outstanding == residual + pending (what fedcomp check verifies)
        pending = sum((u.tensors[name].to_dense().double() for u in pipe.pending.values()), torch.zeros(()))
        rhs = pipe.memory.residual(name).double() + pending
        assert torch.allclose(pipe.totals.outstanding[name], rhs, atol=1e-4), name


def test_norm_bound_scales_a_lowrank_update_and_conserves():
    pipe = build("lowrank", SPEC, rank=2)
    g = grads(SPEC, 7)
    blob = pipe.send(g, max_norm=0.5)
    sent = decode(blob, SPEC).to_dense()
    norm = math.sqrt(sum(float(t.double().square().sum()) for t in sent.values()))
    assert norm <= 0.5
    for name in SPEC.names:
        assert torch.allclose(sent[name] + pipe.memory.residual(name), g[name], atol=1e-5)


def saved(state: dict) -> dict:
    """Through bytes, as a client session saves it (``torch.load(weights_only=True)``)."""
    buf = io.BytesIO()
    torch.save(state, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


def test_state_dict_round_trip_gives_identical_next_payloads():
    a = build("lowrank", SPEC, rank=3, dense_below=256, seed=11)
    for t in range(3):
        a.send(grads(SPEC, t))
    a.ack(1)  # 2 and 3 stay pending, saved as LOWRANK payloads
    b = build("lowrank", SPEC, rank=3, dense_below=256, seed=11)
    b.load_state_dict(saved(a.state_dict()))
    assert set(b.compressor.qs) == {"conv.weight", "fc.weight"}
    assert a.nack(2) and b.nack(2)
    for t in range(3, 6):
        g = grads(SPEC, t)
        assert a.send(g) == b.send(g)
    fresh = build("lowrank", SPEC, rank=3, dense_below=256, seed=11)
    fresh.load_state_dict(saved({**a.state_dict(), "compressor": fresh.compressor.state_dict()}))
    assert fresh.send(grads(SPEC, 6)) != a.send(grads(SPEC, 6))  # the same memory without the warm Q differs


# ------------------------------------------------------------------------------------------------ the server


def test_accumulator_adds_the_product_and_rejects_a_misshapen_factor_layout():
    spec = ModelSpec((("w", (12, 2, 5)),))
    good = lowrank_payload(12, 10, 3, shape=(12, 2, 5))
    acc = SparseAccumulator(spec)
    acc.add({"w": good}, 2.0)
    assert torch.allclose(acc.result("sum")["w"], 2 * good.to_dense())
    v = good.values
    for bad in (
        Values(v.coding, v.data, v.scales, 10),  # block is not shape[0]
        Values(v.coding, v.data[:-3], v.scales, 12),  # Q one row short
        Values(v.coding, v.data, None, 12),  # no scales, no rank
    ):
        with pytest.raises(ValueError):
            acc.add({"w": TensorPayload((12, 2, 5), bad)}, 1.0)
    huge = Values.lowrank(torch.full((12, 1), 1e30), torch.tensor([1.0]), torch.full((10, 1), 1e30))
    with pytest.raises(ValueError, match="NaN or Inf"):
        acc.add({"w": TensorPayload((12, 2, 5), huge)}, 1.0)
    assert acc.count == 1 and torch.allclose(acc.result("sum")["w"], 2 * good.to_dense())


def test_the_server_norm_of_a_lowrank_update_is_the_norm_of_the_tensor():
    p = lowrank_payload(12, 10, 3)
    assert update_norm(Update({"w": p})) == pytest.approx(float(p.to_dense().double().norm()), rel=1e-5)


# ------------------------------------------------------------------------------------------------ hostile input


def seal(body: bytes) -> bytes:
    return body + zlib.crc32(body).to_bytes(4, "little")


def blob_of(spec: ModelSpec, records: bytes, version: int = LOWRANK_VERSION) -> bytes:
    """An independent writer of docs/wire-format.md: header (ids 0, no meta), the records, the CRC."""
    return seal(MAGIC + bytes([version]) + spec.fingerprint + b"\x00\x00\x00" + varint(len(spec)) + b"\x00" + records)


def lowrank_record(rank: int, scales, factors, kind: int = 0x07) -> bytes:
    return bytes([kind]) + varint(rank) + np.asarray(scales, "<f4").tobytes() + np.asarray(factors, "<f4").tobytes()


ONE = ModelSpec((("w", (3, 4)),))
GOOD = lowrank_record(2, [1.0, 0.5], np.linspace(-1, 1, 2 * 7))


def rejects(blob: bytes, spec: ModelSpec = ONE, match: str | None = None, category=None) -> WireError:
    with pytest.raises(WireError, match=match) as err:
        decode(blob, spec)
    if category is not None:
        assert err.value.category is category, err.value
    return err.value


def test_the_independent_writer_matches_the_encoder():
    data = torch.from_numpy(np.linspace(-1, 1, 14).astype(np.float32))
    values = Values(ValueCoding.LOWRANK, data, torch.tensor([1.0, 0.5]), 3)
    assert encode(Update({"w": TensorPayload((3, 4), values)}), ONE) == blob_of(ONE, GOOD)
    assert torch.equal(decode(blob_of(ONE, GOOD), ONE).tensors["w"].values.data, data)


DEFECTS = {
    "rank 0": (lowrank_record(0, [], []), ONE, "rank 0 outside", WireCategory.SHAPE),
    "rank > min(m, n)": (lowrank_record(4, [1] * 4, [0.1] * 28), ONE, "rank 4 outside", WireCategory.SHAPE),
    "factors cut short": (lowrank_record(2, [1, 1], [0.1] * 13), ONE, "needs 64 bytes", WireCategory.TRUNCATED),
    "1-D tensor": (lowrank_record(1, [1], [0.1] * 8), ModelSpec((("w", (8,)),)), "ndim >= 2", WireCategory.SHAPE),
    "sparse record": (lowrank_record(1, [1], [0.1] * 7, kind=0x17), ONE, "index coding DENSE", None),
    "NaN factor": (lowrank_record(1, [1], [0.1] * 6 + [np.nan]), ONE, "NaN or Inf", WireCategory.NON_FINITE),
    "Inf scale": (lowrank_record(1, [np.inf], [0.1] * 7), ONE, "NaN or Inf", WireCategory.NON_FINITE),
    "negative scale": (lowrank_record(1, [-1.0], [0.1] * 7), ONE, "negative scale", WireCategory.MALFORMED),
    "huge factors": (lowrank_record(1, [1.0], [1e30] * 7), ONE, "overflow float32", WireCategory.NON_FINITE),
    "huge scale": (lowrank_record(1, [1e38], [2.0] * 7), ONE, "overflow float32", WireCategory.NON_FINITE),
    "trailing byte": (GOOD + b"\x00", ONE, "trailing bytes", WireCategory.MALFORMED),
    "rank 2**63": (b"\x07\x80\x80\x80\x80\x80\x80\x80\x80\x80\x01", ONE, "rank", None),
}


@pytest.mark.parametrize(("record", "spec", "match", "category"), DEFECTS.values(), ids=DEFECTS.keys())
def test_structural_defects_behind_a_valid_crc(record, spec, match, category):
    rejects(blob_of(spec, record), spec, match, category)


def test_version_rules():
    rejects(blob_of(ONE, GOOD, version=VERSION), match="unknown value coding id 7")  # LOWRANK needs version 2
    dense = b"\x00" + np.arange(12, dtype="<f4").tobytes()
    rejects(blob_of(ONE, dense), match="without a LOWRANK record")  # version 2 is only for LOWRANK updates
    assert decode(blob_of(ONE, dense, version=VERSION), ONE).tensors["w"].values.coding is ValueCoding.F32
    rejects(blob_of(ONE, GOOD, version=3), match="unknown codec version", category=WireCategory.CODEC_VERSION)


def test_encode_refuses_what_decode_rejects():
    spec = ModelSpec((("w", (6, 5)),))
    ok = lowrank_payload(6, 5, 2).values
    bad = {
        "block": Values(ok.coding, ok.data, ok.scales, 5),
        "length": Values(ok.coding, ok.data[:-1], ok.scales, 6),
        "rank": Values(ok.coding, torch.zeros(6 * (6 + 5)), torch.ones(6), 6),
        "nan": Values(ok.coding, ok.data * float("nan"), ok.scales, 6),
        "negative": Values(ok.coding, ok.data, -ok.scales - 1, 6),
        "overflow": Values(ok.coding, ok.data * 1e30, ok.scales + 1, 6),
        "dtype": Values(ok.coding, ok.data.double(), ok.scales, 6),
        "no scales": Values(ok.coding, ok.data, None, 6),
    }
    for what, values in bad.items():
        with pytest.raises(WireError):
            encode(Update({"w": TensorPayload((6, 5), values)}), spec)
            pytest.fail(what)
    with pytest.raises(WireError, match="dense record"):
        encode(Update({"w": TensorPayload((6, 5), ok, torch.arange(len(ok)))}), spec)
    with pytest.raises(WireError, match="ndim >= 2"):
        encode(Update({"v": TensorPayload((30,), ok)}), ModelSpec((("v", (30,)),)))


def lowrank_blob() -> bytes:
    pipe = build("lowrank", SPEC, rank=2, dense_below=256)
    pipe.send(grads(SPEC, 0))
    return pipe.send(grads(SPEC, 1))


BLOB = lowrank_blob()


def test_every_truncation_raises_wire_error():
    for cut in range(len(BLOB)):
        rejects(BLOB[:cut], SPEC)


@settings(FUZZ, max_examples=300)
@given(st.data())
def test_mutations_raise_wire_error_or_decode_to_finite_values(data):
    """Byte edits resealed with a valid CRC reach the record parser: it raises ``WireError`` and nothing else, and
    whatever it accepts multiplies out to finite values of the right shapes."""
    body = bytearray(BLOB[:-4])
    for _ in range(data.draw(st.integers(1, 4))):
        pos = data.draw(st.integers(12, len(body) - 1))
        body[pos] = data.draw(st.integers(0, 255))
    if data.draw(st.booleans()):
        cut = data.draw(st.integers(12, len(body)))
        body = body[:cut] + bytes(data.draw(st.binary(max_size=8)))
    try:
        update = decode(seal(bytes(body)), SPEC)
    except WireError:
        return
    for name, shape in SPEC.entries:
        dense = update.tensors[name].to_dense()
        assert dense.shape == shape and bool(torch.isfinite(dense).all())


def test_the_bound_is_what_both_ends_apply():
    v = Values.lowrank(torch.full((2, 1), 2.0**63), torch.tensor([1.0]), torch.full((3, 1), 2.0**64))
    assert v.lowrank_bound() == LOWRANK_LIMIT and v.finite_after() and not v.finite_after(2.0)
    spec = ModelSpec((("w", (2, 3)),))
    blob = encode(Update({"w": TensorPayload((2, 3), v)}), spec)
    assert bool(torch.isfinite(decode(blob, spec).tensors["w"].to_dense()).all())
    over = Values.lowrank(torch.full((2, 1), 2.0**64), torch.tensor([1.0]), torch.full((3, 1), 2.0**64))
    with pytest.raises(WireError, match="overflow"):
        encode(Update({"w": TensorPayload((2, 3), over)}), spec)


@pytest.mark.parametrize("q", [0.0, 1e-30], ids=["q-zero", "q-tiny"])
def test_factors_whose_partial_product_overflows_float32_multiply_out_finite(q):
    """Within the bound, ``P diag(s)`` alone may pass float32's range (1e38 x 1e30) while ``Q`` scales it back:
    the product is taken in float64, so what ``decode`` accepts the server adds as finite values (it used to add
    NaN with ``Q = 0`` and Inf with a tiny ``Q``, at an update norm of 0 or 1e8)."""
    spec = ModelSpec((("w", (2, 2)),))
    v = Values.lowrank(torch.full((2, 1), 1e38), torch.tensor([1e30]), torch.full((2, 1), q))
    update = decode(encode(Update({"w": TensorPayload((2, 2), v)}), spec), spec)
    expected = torch.full((4,), 1e38 * 1e30 * q, dtype=torch.float64).float()
    assert torch.equal(update.tensors["w"].values.dequantize(), expected)
    acc = SparseAccumulator(spec)
    acc.add(update, weight=1.0)
    assert torch.equal(acc.result(normalize="count")["w"].reshape(-1), expected)
    assert math.isclose(update_norm(update), float(expected.double().norm()), rel_tol=1e-6)

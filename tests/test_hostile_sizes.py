"""Sizes a hostile server chooses: a small message must never make a node allocate far more than it carries.

Three ways in: a layout (shapes, dtypes, names) that is not a model's; a downlink record whose values are a
product (LOWRANK factors) far larger than its bytes; a quantizer ``block``/``bucket`` (run config, or a wire
header's ``block``) far larger than the tensor. Each is refused with the error type the node already turns into a
failed task (``RecordError``, ``WireError``/``DownlinkError``), or bounded by the tensor's own size.
"""

from __future__ import annotations

import contextlib
import json
import math
import time
import zlib
from unittest import mock

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from flwr.app import ConfigRecord, Context, Message, Metadata, MetricRecord, RecordDict
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.profiler import ProfilerActivity, profile

from fedcomp.compressors._blocks import MAX_PAD
from fedcomp.compressors.base import COMPRESSORS
from fedcomp.downlink import replica as replica_module
from fedcomp.downlink.envelope import FULL_CODINGS, DownlinkError, Kind, decode_envelope, encode_envelope
from fedcomp.downlink.model import DIGEST_BYTES, encode_dense, materialize
from fedcomp.downlink.replica import receive
from fedcomp.flower import records
from fedcomp.flower.mod import compression_mod
from fedcomp.kernels.quant import quantize_all
from fedcomp.payload import FLOAT_DTYPES, TensorPayload, Update, ValueCoding, Values
from fedcomp.spec import ModelSpec
from fedcomp.task.config import Compression
from fedcomp.wire import WireError, decode, encode
from fedcomp.wire.bits import Reader, varint
from fedcomp.wire.codec import MAGIC
from fedcomp.wire.values import MAX_BLOCK


def fuzz(n: int):
    return settings(max_examples=n, derandomize=True, deadline=None, suppress_health_check=list(HealthCheck))


def unchecked_spec(entries) -> ModelSpec:
    """A spec with ``entries`` as they are (what a server that does not use fedcomp's ModelSpec can describe)."""
    spec = ModelSpec((("x", (1,)),))
    object.__setattr__(spec, "entries", tuple(entries))
    return spec


# ---------------------------------------------------------------------------------------- shapes and layouts


@pytest.mark.parametrize("count", [-1, -4, -(2**40)])
def test_the_reader_refuses_a_negative_count_and_does_not_move(count):
    r = Reader(b"\x00" * 16, 8, 16)
    for read in (lambda: r.need(count, "x"), lambda: r.take(count, "x", "values"),
                 lambda: r.array("<f4", count, "x", "values")):
        with pytest.raises(WireError, match="negative byte count"):
            read()
    assert r.pos == 8 and r.sections == {}


def test_decode_refuses_a_negative_dimension_instead_of_reading_backwards():
    """The audit's cycle: three empty tensors, then one of shape (-1,) stepping back over their 4 bytes."""
    spec = unchecked_spec([("z", (0,)), ("a", (-1,)), ("f", (2,))])
    body = (MAGIC + b"\x01" + spec.fingerprint + varint(0) * 3 + varint(3) + varint(0)
            + b"\x00" + b"\x00" + b"\x00" + np.ones(2, "<f4").tobytes())
    blob = body + zlib.crc32(body).to_bytes(4, "little")
    with pytest.raises(WireError, match="negative byte count"):
        decode(blob, spec)


@pytest.mark.parametrize("shape", [(-1,), (2, -3), (True,), (2.0,), ("3",), [3], None])
def test_model_spec_takes_only_tuples_of_ints_at_least_zero(shape):
    with pytest.raises(ValueError, match="shape must be a tuple of ints >= 0"):
        ModelSpec((("w", shape),))


def test_model_spec_refuses_a_name_twice_and_a_name_that_is_not_text():
    for entries in ((("w", (2,)), ("w", (3,))), ((7, (2,)),)):
        with pytest.raises(ValueError, match="distinct strings"):
            ModelSpec(entries)
    assert ModelSpec([("w", torch.Size([2, 0])), ("b", ())]).names == ["w", "b"]  # torch shapes, scalars, empty


BAD_LAYOUTS = {
    "negative": [["w", [-1], "float32"]],
    "negatives": [["w", [-2, -3], "float32"]],
    "bool dim": [["w", [True], "float32"]],
    "float dim": [["w", [2.5], "float32"]],
    "text dim": [["w", ["2"], "float32"]],
    "shape not a list": [["w", 2, "float32"]],
    "name twice": [["w", [2], "float32"], ["w", [3], "float32"]],
    "name not text": [[5, [2], "float32"]],
    "unknown dtype": [["w", [2], "floatx"]],
    "object dtype": [["w", [2], "object"], ["v", [2], "float32"]],
    "text dtype": [["w", [2], "str"]],
    "dtype not text": [["w", [2], 32]],
    "two fields": [["w", [2]]],
    "not a list": {"w": [2]},
}


@pytest.mark.parametrize("name", list(BAD_LAYOUTS))
def test_a_malformed_layout_is_a_record_error(name):
    with pytest.raises(records.RecordError, match="malformed array layout"):
        records.ArrayLayout.from_json(json.dumps(BAD_LAYOUTS[name]))


def valid(layout: records.ArrayLayout) -> bool:
    names = [n for n, _, _ in layout.entries]
    return len(set(names)) == len(names) and all(
        isinstance(n, str) and isinstance(s, tuple) and all(type(d) is int and d >= 0 for d in s)
        and np.dtype(d).kind in "biufc" for n, s, d in layout.entries)


JSON = st.recursive(st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats() | st.text(max_size=8),
                    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=4), inner, max_size=3),
                    max_leaves=12)
DIMS = st.integers(-3, 2**40) | st.booleans() | st.floats(-2, 5) | st.text(max_size=2) | st.none()
ENTRY = st.tuples(st.sampled_from(["w", "b", "w.running_mean", 3, None]),
                  st.lists(DIMS, max_size=3) | DIMS,
                  st.sampled_from(["float32", "float16", "float64", "int64", "bool", "floatx", "object", "str",
                                   "V8", "(2,)f4", "S3", "", 1]))


#: Entries that are valid but for at most a field or two (a negative or boolean dimension, a name twice, a dtype with
#: no numbers), so that hostile layouts that parse reach the checks, where ``ENTRY`` rarely parses at all.
NEAR = st.tuples(st.sampled_from(["w", "b", "w.running_mean"]),
                 st.lists(st.integers(-2, 4) | st.just(True), max_size=3),
                 st.sampled_from(["float32", "float16", "int64", "bool", "float32", "float32", "object", "V8"]))


@fuzz(1500)
@given(st.one_of(JSON, st.lists(ENTRY.map(list), max_size=4), st.lists(NEAR.map(list), min_size=1, max_size=3)))
def test_any_layout_json_is_a_valid_layout_or_a_record_error(value):
    try:
        layout = records.ArrayLayout.from_json(json.dumps(value))
    except records.RecordError:
        return
    assert valid(layout), layout.entries
    layout.spec()  # a valid layout always makes a valid spec


def mod_task_with_layout(layout: list, blob: bytes) -> Message:
    comp = Compression("topk", "residual", "density=0.25", "fp16")
    task = records.ModTask(1, 0, [], False, "arrays", comp.to_flat(),
                           records.ArrayLayout.of_spec(ModelSpec((("w", (2,)),))))
    content = records.add_mod_task(RecordDict({"config": ConfigRecord({})}), task, blob)
    content.config_records[records.CONTROL][records.LAYOUT] = json.dumps(layout)
    meta = Metadata(run_id=1, message_id="t", src_node_id=1, dst_node_id=9, reply_to_message_id="", group_id="0",
                    created_at=time.time(), ttl=60.0, message_type="train")
    return Message(content=content, metadata=meta)


def never_trains(msg: Message, context: Context) -> Message:
    raise AssertionError("the train function must not be called")


@pytest.mark.parametrize("layout, blob_spec", [
    ([["w", [-1], "float32"]], None),
    ([["w", [2], "floatx"]], ModelSpec((("w", (2,)),))),
    ([["w", [2], "int64"], ["v", [2], "float32"]], ModelSpec((("v", (2,)),))),  # int64 "w" never came
])
def test_the_mod_turns_a_hostile_layout_into_a_record_error(layout, blob_spec):
    spec = blob_spec or ModelSpec((("w", (2,)),))
    blob = encode_dense({n: torch.zeros(s) for n, s in spec.entries}, spec, 0)
    with pytest.raises(records.RecordError):
        compression_mod(mod_task_with_layout(layout, blob), Context(1, 9, {}, RecordDict(), {}), never_trains)


def test_a_layout_of_empty_and_zero_size_arrays_still_trains():
    spec = ModelSpec((("w", (0,)),))
    blob = encode_dense({"w": torch.zeros(0)}, spec, 0)

    def trained(m, c):
        arrays = m.content.array_records["arrays"]
        return Message(RecordDict({"arrays": arrays, "metrics": MetricRecord({"num-examples": 1})}), reply_to=m)

    reply = compression_mod(mod_task_with_layout([["w", [0], "float32"]], blob), Context(1, 9, {}, RecordDict(), {}),
                            trained)
    assert not reply.has_error() and records.CONTROL in reply.content


# ---------------------------------------------------------------------------------------- downlink records


def full_copy(payloads: dict[str, TensorPayload], spec: ModelSpec, version: int = 5) -> bytes:
    part = encode(Update(payloads, base_version=version), spec)
    return encode_envelope(Kind.FULL, version, version, bytes(DIGEST_BYTES), [part])  # digest: checked last


def rank_one(m: int, n: int) -> TensorPayload:
    return TensorPayload((m, n), Values.lowrank(torch.ones(m, 1), torch.ones(1), torch.ones(n, 1)))


def test_a_lowrank_full_copy_is_refused_before_it_is_materialized(monkeypatch):
    """The audit's bomb: a rank-1 record of a 16384 x 16384 tensor, 131 kB for 1 GiB (here 2048 x 2048)."""
    made = []
    monkeypatch.setattr(replica_module, "materialize", lambda *a: made.append(a))
    spec = ModelSpec((("w", (2048, 2048)),))
    with pytest.raises(DownlinkError, match="record 'w' is LOWRANK"):
        receive(full_copy({"w": rank_one(2048, 2048)}, spec), spec, None)
    assert not made


@pytest.mark.parametrize("values", [
    Values.lowrank(torch.ones(64, 1), torch.ones(1), torch.ones(64, 1)),
    Values(ValueCoding.INT8, torch.ones(64 * 64, dtype=torch.int8), torch.ones(1), 64 * 64),
    Values(ValueCoding.F16, torch.ones(64 * 64, dtype=torch.float16)),
])
def test_the_dense_modes_plain_message_takes_fp32_records_only(values):
    spec = ModelSpec((("w", (64, 64)),))
    blob = encode(Update({"w": TensorPayload((64, 64), values)}, base_version=3), spec)
    with pytest.raises(DownlinkError, match="dense model: record 'w' is"):
        receive(blob, spec, None)


def test_deltas_for_another_model_than_the_replica_are_refused_before_they_are_applied():
    """A replica of a 2-value model and deltas that declare a 2048 x 2048 one (a rank-1 LOWRANK part)."""
    small = ModelSpec((("w", (2,)),))
    held = receive(encode_dense({"w": torch.ones(2)}, small, 4), small, None)
    big = ModelSpec((("w", (2048, 2048)),))
    part = encode(Update({"w": rank_one(2048, 2048)}, base_version=4, seq=5), big)
    blob = encode_envelope(Kind.DELTAS, 5, 4, bytes(DIGEST_BYTES), [part])
    with pytest.raises(DownlinkError, match="for another model than the replica's"):
        receive(blob, big, held)


def payload_of(coding: ValueCoding, m: int, n: int, block: int) -> TensorPayload:
    numel = m * n
    if coding is ValueCoding.LOWRANK:
        return rank_one(m, n)
    if coding.is_float:
        return TensorPayload((m, n), Values(coding, torch.ones(numel, dtype=FLOAT_DTYPES[coding])))
    scales = torch.ones(Values.num_blocks(numel, block))
    return TensorPayload((m, n), Values(coding, torch.ones(numel, dtype=torch.int8), scales, block))


@fuzz(300)
@given(st.sampled_from(list(ValueCoding)), st.integers(1, 48), st.integers(1, 48), st.integers(1, 3000))
def test_an_accepted_full_copy_materializes_at_most_4_bytes_per_byte_it_came_in(coding, m, n, block):
    spec = ModelSpec((("w", (m, n)),))
    blob = full_copy({"w": payload_of(coding, m, n, block)}, spec)
    try:
        env = decode_envelope(blob, spec)
    except DownlinkError:
        assert coding not in FULL_CODINGS
        return
    tensors = materialize(env.parts[0], spec)
    assert sum(4 * t.numel() for t in tensors.values()) <= 4 * len(blob)


# ---------------------------------------------------------------------------------------- blocks and buckets


def torch_bytes(fn) -> int:
    """Bytes torch allocated on the CPU while ``fn()`` ran (freed ones included)."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    return sum(max(e.self_cpu_memory_usage, 0) for e in prof.key_averages())


def padded_blocked(values: torch.Tensor, block: int) -> torch.Tensor:
    """``blocked`` as it was: every tensor zero-padded to whole blocks (the reference for the wire bytes)."""
    n = values.numel()
    nb = math.ceil(n / block)
    pad = nb * block - n
    return (F.pad(values, (0, pad)) if pad else values).reshape(nb, block)


QUANTIZERS = {"int8": "block", "int4": "block", "qsgd": "bucket", "sign": "block", "ternary": "block"}
BLOCKED_IN = ("fedcomp.compressors.blockwise", "fedcomp.compressors.sign", "fedcomp.compressors.ternary")


def quantized_bytes(name: str, x: torch.Tensor, block: int) -> bytes:
    q = COMPRESSORS.build(name, **{QUANTIZERS[name]: block}, **({} if name in ("sign", "ternary") else {"seed": 7}))
    spec = ModelSpec((("w", tuple(x.shape)),))
    return encode(Update({"w": q.compress(x, "w")}), spec)


@fuzz(400)
@given(st.sampled_from(list(QUANTIZERS)), st.integers(1, 700), st.data())
def test_quantizer_bytes_are_unchanged_for_any_block_up_to_the_tensor_size_and_past_it_within_max_pad(name, n, data):
    """Every block <= n, and any block padded as before (up to ``n + MAX_PAD``: the defaults 256 and 512 on small
    tensors), gives the bytes of the padded reference; only a block past that is one unpadded block."""
    block = data.draw(st.integers(1, n) | st.integers(n, n + 5000) | st.just(n + MAX_PAD), "block")
    x = torch.from_numpy(np.random.default_rng(n).standard_normal(n).astype(np.float32))
    x[: n // 3] = 0.0  # zero blocks and ternary's zeros
    got = quantized_bytes(name, x, block)
    with contextlib.ExitStack() as stack:
        for module in BLOCKED_IN:
            stack.enter_context(mock.patch(f"{module}.blocked", padded_blocked))
        assert got == quantized_bytes(name, x, block)


@pytest.mark.parametrize("name", list(QUANTIZERS))
def test_a_block_far_larger_than_the_tensor_costs_no_memory_beyond_it(name):
    """The audit's ``block=100000000`` on a 3-value tensor padded it to 400 MB; here 2**26 (256 MiB before)."""
    x = torch.tensor([0.5, -1.0, 2.0])
    assert torch_bytes(lambda: quantized_bytes(name, x, 2**26)) < 64 * 1024
    payload = decode(quantized_bytes(name, x, 2**26), ModelSpec((("w", (3,)),))).tensors["w"]
    assert payload.values.block == 2**26 and payload.values.scales.numel() == 1  # the block on the wire as set


def test_a_sent_update_with_a_huge_block_costs_no_memory_beyond_the_model():
    """What the mod does with the server's ``dgc+int8 density=1.0 block=...`` on a 6-value model."""
    comp = Compression.from_flat({"compressor": "dgc+int8", "options": f"density=1.0 block={2**26}"})
    pipeline = comp.pipeline(ModelSpec((("w", (3,)), ("b", (3,)))))
    assert torch_bytes(lambda: pipeline.send({"w": torch.ones(3), "b": torch.ones(3)})) < 256 * 1024


def test_quantize_all_does_not_pad_tensors_to_a_huge_block():
    """A block far larger than the tensors (the server's run config) costs no memory beyond them: blocks larger
    than a tile take one call per tensor, which pads nothing past ``MAX_PAD``."""
    q = COMPRESSORS.build("int8", block=2**26, stochastic=False)
    xs = [torch.tensor([1.0, -2.0, 3.0]), torch.tensor([0.5, 0.25])]
    assert torch_bytes(lambda: quantize_all(q, xs, backend="torch")) < 64 * 1024
    values, _ = quantize_all(q, xs, backend="torch")
    assert [v.data.tolist() for v in values] == [[42, -85, 127], [127, 64]]


def quantized_record(coding: ValueCoding, count: int, block: int) -> bytes:
    """A dense record of ``count`` codes with ``block`` in its header (and the scale count that block needs)."""
    codes = torch.ones(count, dtype=torch.int8)
    values = Values(coding, codes, torch.ones(Values.num_blocks(count, block)), block)
    return encode(Update({"w": TensorPayload((count,), values)}), ModelSpec((("w", (count,)),)))


@fuzz(150)
@given(st.sampled_from([ValueCoding.INT8, ValueCoding.INT4, ValueCoding.SIGN, ValueCoding.TERNARY]),
       st.integers(1, 3000), st.one_of(st.integers(1, 3000), st.integers(1, MAX_BLOCK)))
def test_decoding_any_header_block_allocates_a_bounded_multiple_of_the_values(coding, count, block):
    """A header's ``block`` is the sender's: whatever it says, decoding and dequantizing allocate O(count)."""
    blob = quantized_record(coding, count, block)
    spec = ModelSpec((("w", (count,)),))
    out = []
    assert torch_bytes(lambda: out.append(decode(blob, spec).tensors["w"].to_dense())) <= 32 * count + 4096
    assert out[0].shape == (count,)

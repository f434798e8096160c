"""fedcomp.tensortree: any tree it accepts comes back bit-exact; anything torn, corrupt or lying is a TreeError."""

from __future__ import annotations

import io
import json
import struct
import zlib

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fedcomp import tensortree
from fedcomp.tensortree import DTYPES, TreeError, dumps, loads

_HEAD = struct.Struct("<4sBII")


@st.composite
def tensors(draw):
    dtype = DTYPES[draw(st.sampled_from(sorted(DTYPES)))]
    shape = draw(st.lists(st.integers(0, 5), max_size=3))
    n = 1
    for s in shape:
        n *= s
    itemsize = torch.empty(0, dtype=dtype).element_size()
    raw = draw(st.binary(min_size=n * itemsize, max_size=n * itemsize))
    t = torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(dtype) if raw else torch.empty(0, dtype=dtype)
    return t.reshape(shape)


plain = st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats(allow_nan=True) | st.text(max_size=8)
leaves = plain | st.binary(max_size=100) | tensors()
keys = st.integers(-5, 5) | st.text(max_size=4) | st.tuples(st.integers(0, 3), st.text(max_size=2))
trees = st.recursive(
    leaves,
    lambda kids: st.lists(kids, max_size=4) | st.tuples(kids, kids) | st.dictionaries(keys, kids, max_size=4),
    max_leaves=20,
)


def same(a, b) -> bool:
    """Equal with types kept: tensors bitwise (NaN payloads included), floats by their bits."""
    if isinstance(a, torch.Tensor):
        return (isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape
                and a.reshape(-1).view(torch.uint8).tolist() == b.reshape(-1).view(torch.uint8).tolist())
    if isinstance(a, dict):
        return type(b) is dict and list(a) == list(b) and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, float):
        return type(b) is float and struct.pack("<d", a) == struct.pack("<d", b) or (a != a and b != b)
    return type(a) is type(b) and a == b


@settings(max_examples=150, deadline=None)
@given(trees)
def test_any_tree_comes_back_the_same(tree):
    assert same(tree, loads(dumps(tree)))


@settings(max_examples=60, deadline=None)
@given(trees, st.data())
def test_a_torn_or_flipped_byte_string_is_refused(tree, data):
    blob = dumps(tree)
    cut = data.draw(st.integers(0, len(blob) - 1))
    with pytest.raises(TreeError):
        loads(blob[:cut])
    pos = data.draw(st.integers(0, len(blob) - 1))
    bit = data.draw(st.integers(0, 7))
    flipped = bytearray(blob)
    flipped[pos] ^= 1 << bit
    with pytest.raises(TreeError):
        loads(bytes(flipped))


def _forge(skeleton: dict | bytes, data: bytes = b"") -> bytes:
    """A byte string with a valid header and CRC around ``skeleton``: only the contents can be wrong."""
    skel = skeleton if isinstance(skeleton, bytes) else json.dumps(skeleton).encode()
    body = skel + bytes(-(_HEAD.size + len(skel)) % 64) + data
    return _HEAD.pack(b"FCTT", 1, len(skel), zlib.crc32(body)) + body


@pytest.mark.parametrize(
    "skeleton, data, what",
    [
        ({"tree": {"t": 0}, "tensors": [["float32", [4], 0, 16]]}, bytes(8), "outside the data"),
        ({"tree": {"t": 0}, "tensors": [["float32", [3], 0, 16]]}, bytes(16), "is not 16 bytes"),
        ({"tree": {"t": 0}, "tensors": [["float32", [-4], 0, -16]]}, bytes(16), "is not"),
        ({"tree": {"t": 0}, "tensors": [["float32", [1], 8, 4]]}, bytes(16), "outside"),
        ({"tree": {"t": 0}, "tensors": [["complex64", [1], 0, 8]]}, bytes(8), "bad table entry"),
        ({"tree": {"t": 0}, "tensors": [["float32", [2.0], 0, 8]]}, bytes(8), "must be integers"),
        ({"tree": {"t": 0}, "tensors": {"0": 1}}, b"", "not a list"),
        ({"tree": {"t": 1}, "tensors": [["uint8", [1], 0, 1]]}, bytes(64), "bad node"),
        ({"tree": {"x": []}, "tensors": []}, b"", "bad node"),
        ({"tree": {"d": [[{"l": []}, 1]]}, "tensors": []}, b"", "unhashable"),
        ({"tensors": []}, b"", "bad skeleton"),
        # empty tensors whose other dimensions no stride can span
        ({"tree": {"t": 0}, "tensors": [["float32", [0, 2**63], 0, 0]]}, b"", "too large"),
        ({"tree": {"t": 0}, "tensors": [["float32", [0, 2**62, 2**62], 0, 0]]}, b"", "too large"),
        # a bytes node is a 1-D uint8 tensor, never another dtype or shape
        ({"tree": {"b": 0}, "tensors": [["bfloat16", [2], 0, 4]]}, bytes(64), "bad node"),
        ({"tree": {"b": 0}, "tensors": [["uint8", [2, 2], 0, 4]]}, bytes(64), "bad node"),
    ],
)
def test_a_skeleton_that_lies_is_refused_with_what_is_wrong(skeleton, data, what):
    with pytest.raises(TreeError, match=what):
        loads(_forge(skeleton, data))


def test_deep_nesting_and_foreign_bytes_are_refused():
    deep = b'{"tensors":[],"tree":' + b'{"l":[' * 100_000 + b"0" + b"]}" * 100_000 + b"}"
    with pytest.raises(TreeError, match="deep|skeleton"):
        loads(_forge(deep))
    for foreign in (b"", b"FCT", b"FCTT\x02" + bytes(20), b"\x00garbage" * 100, b"PK\x03\x04 not a zip"):
        with pytest.raises(TreeError):
            loads(foreign)


def test_a_state_written_by_torch_save_is_still_read():
    tree = {"u": torch.arange(5.0), "pending": {3: {"seq": 3}}, "name": "dgc"}
    buf = io.BytesIO()
    torch.save(tree, buf)
    back = loads(buf.getvalue())
    assert torch.equal(back["u"], tree["u"]) and back["pending"] == {3: {"seq": 3}} and back["name"] == "dgc"


def test_what_it_cannot_hold_is_refused_when_written():
    with pytest.raises(TreeError, match="set"):
        dumps({"s": {1, 2}})
    with pytest.raises(TreeError, match="complex"):
        dumps(torch.zeros(2, dtype=torch.complex64))


def test_loaded_tensors_are_writable_and_independent():
    back = loads(dumps({"u": torch.zeros(3), "v": torch.ones(3)}))
    back["u"].add_(2.0)
    assert back["u"].tolist() == [2.0] * 3 and back["v"].tolist() == [1.0] * 3
    assert tensortree.MAGIC == b"FCTT"

"""A tree of tensors as one checked byte string: what a client keeps between tasks.

``dumps(tree)`` writes nested dicts, lists and tuples of tensors, ``bytes`` and plain values (``None``, bool,
int, float, str) as a JSON skeleton followed by each tensor's raw bytes (64-byte aligned); ``loads`` gives the
same tree back, every tensor bit-exact, on the CPU. It replaces ``torch.save``/``torch.load`` for the client
state: the same ~10-20 MB take a memory copy and a CRC instead of pickling into a zip archive (a few ms against
about 0.1 s a task; docs/results.md), and reading it runs no pickle at all.

Layout::

    b"FCTT" | u8 version | u32 skeleton length | u32 CRC-32 of everything after this field | skeleton | data

``loads`` validates before it builds anything: magic, version, lengths, CRC, JSON, every node's tag, dtype
(one of ``DTYPES``), shape, and that every tensor's bytes lie inside the data; anything else raises
``TreeError`` (a ``ValueError``) naming what is wrong. A state written by earlier releases (a ``torch.save``
zip archive) is still read, with ``torch.load(weights_only=True)``.

>>> import torch
>>> tree = {"u": torch.arange(3.0), "pending": {7: (b"blob", None)}, "seq": 2}
>>> back = loads(dumps(tree))
>>> back["u"].tolist(), back["pending"], back["seq"]
([0.0, 1.0, 2.0], {7: (b'blob', None)}, 2)
"""

from __future__ import annotations

import io
import json
import math
import struct
import zlib
from typing import Any

import torch

MAGIC = b"FCTT"
VERSION = 1
_HEAD = struct.Struct("<4sBII")
_ALIGN = 64
#: The dtypes a tree may hold, by the name the skeleton gives them.
DTYPES = {
    str(d).removeprefix("torch."): d
    for d in (
        torch.float64,
        torch.float32,
        torch.float16,
        torch.bfloat16,
        torch.int64,
        torch.int32,
        torch.int16,
        torch.int8,
        torch.uint8,
        torch.bool,
    )
}
_PLAIN = (type(None), bool, int, float, str)
_ZIP = b"PK\x03\x04"  # what torch.save wrote before this format
#: A bound on a tensor's element count, its empty dimensions counted as 1 (torch's strides must fit an int64).
_MAX_ELEMENTS = 2**60


class TreeError(ValueError):
    """A byte string that is not a tree ``dumps`` wrote (torn, corrupt or foreign), or a tree it cannot write."""


def dumps(tree: Any) -> bytes:
    """``tree`` as bytes (see the module docstring); ``TreeError`` on a type it cannot hold."""
    table: list[list[Any]] = []
    chunks: list[Any] = []  # after the skeleton: each array's bytes, then zeros up to the next 64-byte offset
    pad, size = bytes(_ALIGN), 0

    def leaf(tag: str, dtype: str, shape: list[int], raw: Any) -> dict[str, int]:
        nonlocal size
        table.append([dtype, shape, size, len(raw)])
        chunks.extend((raw, pad[: -len(raw) % _ALIGN]))
        size += len(raw) + (-len(raw) % _ALIGN)
        return {tag: len(table) - 1}

    def node(o: Any) -> Any:
        if isinstance(o, _PLAIN):
            return o
        if isinstance(o, torch.Tensor):
            name = str(o.dtype).removeprefix("torch.")
            if name not in DTYPES:
                raise TreeError(f"cannot hold a tensor of {o.dtype}")
            t = o.detach().to("cpu").contiguous()
            return leaf("t", name, list(t.shape), t.reshape(-1).view(torch.uint8).numpy().data)
        if isinstance(o, (bytes, bytearray, memoryview)):
            return leaf("b", "uint8", [len(o)], memoryview(o).cast("B"))
        if isinstance(o, dict):
            return {"d": [[node(k), node(v)] for k, v in o.items()]}
        if isinstance(o, list):
            return {"l": [node(v) for v in o]}
        if isinstance(o, tuple):
            return {"u": [node(v) for v in o]}
        raise TreeError(f"cannot hold a {type(o).__name__}")

    skeleton = json.dumps({"tree": node(tree), "tensors": table}, separators=(",", ":")).encode()
    body = [skeleton, pad[: -(_HEAD.size + len(skeleton)) % _ALIGN], *chunks]
    crc = 0
    for c in body:
        crc = zlib.crc32(c, crc)
    return b"".join([_HEAD.pack(MAGIC, VERSION, len(skeleton), crc), *body])


def loads(data: bytes | bytearray | memoryview) -> Any:
    """The tree ``dumps`` wrote, validated (module docstring); ``TreeError`` on anything else."""
    view = memoryview(data)
    if bytes(view[:4]) == _ZIP:
        return _legacy(view)
    if len(view) < _HEAD.size:
        raise TreeError(f"{len(view)} bytes is shorter than the header")
    magic, version, skel_len, crc = _HEAD.unpack_from(view)
    if magic != MAGIC:
        raise TreeError("not a tensor tree (bad magic)")
    if version != VERSION:
        raise TreeError(f"tensor tree version {version}, this build reads {VERSION}")
    start = _HEAD.size + skel_len
    if start > len(view):
        raise TreeError("truncated: the skeleton runs past the end")
    if zlib.crc32(view[_HEAD.size :]) != crc:
        raise TreeError("CRC mismatch: the bytes are torn or corrupt")
    try:
        head = json.loads(bytes(view[_HEAD.size : start]))
        table, tree = head["tensors"], head["tree"]
    except (ValueError, KeyError, TypeError, RecursionError) as exc:
        raise TreeError(f"bad skeleton: {exc}") from None
    if not isinstance(table, list):
        raise TreeError("bad skeleton: the tensor table is not a list")
    base = start + (-start % _ALIGN)
    buf = bytearray(view[base:])  # one copy the tensors share: writable, aligned by the 64-byte offsets
    tensors = [_tensor(entry, buf, i) for i, entry in enumerate(table)]
    try:
        return _build(tree, tensors)
    except RecursionError:
        raise TreeError("the skeleton nests too deep") from None


def _tensor(entry: Any, buf: bytearray, i: int) -> torch.Tensor:
    try:
        name, shape, offset, nbytes = entry
        dtype = DTYPES[name]
    except (TypeError, ValueError, KeyError) as exc:
        raise TreeError(f"tensor {i}: bad table entry {entry!r} ({exc})") from None
    if not (isinstance(shape, list) and all(type(x) is int for x in (*shape, offset, nbytes))):
        raise TreeError(f"tensor {i}: bad table entry {entry!r} (shape, offset and size must be integers)")
    itemsize = torch.empty(0, dtype=dtype).element_size()
    if any(s < 0 for s in shape) or math.prod(shape) * itemsize != nbytes:
        raise TreeError(f"tensor {i}: shape {shape} of {name} is not {nbytes} bytes")
    if math.prod(max(s, 1) for s in shape) > _MAX_ELEMENTS:
        raise TreeError(f"tensor {i}: shape {str(shape)[:80]} is too large for a tensor")
    if offset < 0 or offset % _ALIGN or offset + nbytes > len(buf):
        raise TreeError(f"tensor {i}: bytes {offset}..{offset + nbytes} lie outside the data ({len(buf)} bytes)")
    if nbytes == 0:
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(buf, dtype=dtype, count=nbytes // itemsize, offset=offset).reshape(shape)


def _build(o: Any, tensors: list[torch.Tensor]) -> Any:
    if isinstance(o, _PLAIN):
        return o
    if isinstance(o, dict) and len(o) == 1:
        ((tag, body),) = o.items()
        if tag in ("t", "b") and type(body) is int and 0 <= body < len(tensors):
            t = tensors[body]
            if tag == "t":
                return t
            if t.dtype is torch.uint8 and t.dim() == 1:  # bytes are written as a 1-D uint8 tensor, and only so
                return t.numpy().tobytes()
        if tag in ("d", "l", "u") and isinstance(body, list):
            if tag == "l":
                return [_build(v, tensors) for v in body]
            if tag == "u":
                return tuple(_build(v, tensors) for v in body)
            if all(isinstance(kv, list) and len(kv) == 2 for kv in body):
                return {_key(_build(k, tensors)): _build(v, tensors) for k, v in body}
    raise TreeError(f"bad node in the skeleton: {str(o)[:80]}")


def _key(k: Any) -> Any:
    try:
        hash(k)
    except TypeError:
        raise TreeError(f"unhashable dict key {str(k)[:80]}") from None
    return k


def first_line(exc: BaseException) -> str:
    """An exception in one line, ``"TypeName: the first line of its message"``, for one-line errors. torch's
    message for a ``weights_only`` refusal advises ``weights_only=False``, which would run the file's code: the
    line keeps only the unpickler's reason.

    >>> first_line(ValueError("bad value\\nmore"))
    'ValueError: bad value'
    >>> first_line(RuntimeError("Weights only load failed. Re-run with weights_only=False ... "
    ...                         "WeightsUnpickler error: \\n\\nUnsupported operand 62\\n\\nCheck the docs"))
    'RuntimeError: not plain tensors and data (Unsupported operand 62)'
    """
    text = str(exc).strip()
    if "Weights only load failed" in text:
        why = text.partition("WeightsUnpickler error:")[2].strip().splitlines()
        text = f"not plain tensors and data ({why[0].strip()})" if why else "not plain tensors and data"
    return f"{type(exc).__name__}: {text.splitlines()[0] if text else ''}".rstrip(": ")


def _legacy(view: memoryview) -> Any:
    try:
        return torch.load(io.BytesIO(view), weights_only=True, map_location="cpu")
    except Exception as exc:  # noqa: BLE001 - torch.load raises many types on a torn or foreign file
        raise TreeError(f"not a readable torch.save archive: {first_line(exc)}") from None

"""The public model's arithmetic, shared by the server (``broadcaster``) and the client (``replica``).

Both ends build ``P`` with these functions only (CPU float32, ``index_add`` in index order), which is why a
client's replica is bitwise equal to the server's public model:

>>> spec = ModelSpec((("w", (2, 2)),))
>>> p = {"w": torch.ones(2, 2)}
>>> blob = encode_dense(p, spec, version=3)             # the dense fp32 full copy (wire blob, base version 3)
>>> q = materialize(decode(blob, spec), spec)           # its float32 tensors again (``fedcomp.wire.decode``)
>>> model_digest(q, spec) == model_digest(p, spec)
True
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping

import torch

from fedcomp.payload import TensorPayload, Update, Values
from fedcomp.spec import ModelSpec
from fedcomp.wire import encode

DIGEST_BYTES = 16


def model_digest(tensors: Mapping[str, torch.Tensor], spec: ModelSpec) -> bytes:
    """128-bit BLAKE2b of the tensors' float32 bytes (CPU, contiguous) in spec order: the replica check."""
    h = hashlib.blake2b(digest_size=DIGEST_BYTES)
    for name in spec.names:
        h.update(tensors[name].detach().to("cpu", torch.float32).contiguous().numpy())  # its buffer: no copy
    return h.digest()


def cpu_f32(tensors: Mapping[str, torch.Tensor], spec: ModelSpec) -> dict[str, torch.Tensor]:
    """Float32 CPU copies of the spec's tensors (never aliasing ``tensors``)."""
    return {n: tensors[n].detach().to("cpu", torch.float32, copy=True) for n in spec.names}


def materialize(update: Update, spec: ModelSpec) -> dict[str, torch.Tensor]:
    """The float32 CPU tensors of a full-copy part (dequantized). Server and client both call this."""
    return {name: update.tensors[name].to_dense() for name in spec.names}


def apply_part(tensors: dict[str, torch.Tensor], update: Update, spec: ModelSpec) -> None:
    """``P += decoded delta`` in place, tensor by tensor in spec order. Server and client both call this."""
    for name in spec.names:
        update.tensors[name].add_to(tensors[name], 1.0)


def encode_dense(tensors: Mapping[str, torch.Tensor], spec: ModelSpec, version: int) -> bytes:
    """The model as one wire blob of dense fp32 records, seq 0, base version = ``version``: the ``dense`` mode's
    message and the part of every fp32 full copy."""
    payloads = {n: TensorPayload(spec.shape(n), Values.f32(tensors[n])) for n in spec.names}
    return encode(Update(payloads, version), spec)


def dense_fp32_bytes(spec: ModelSpec) -> int:
    """Payload bytes of the ``dense`` mode's message for ``spec`` (the baseline of downlink ratios)."""
    return len(encode_dense({n: torch.zeros(s) for n, s in spec.entries}, spec, 0))


__all__ = ["DIGEST_BYTES", "apply_part", "cpu_f32", "dense_fp32_bytes", "encode_dense", "materialize", "model_digest"]

"""A send pipeline's saved parts, written and read back: pending updates as plain tensors and numbers, and the
checks that a saved state fits the model before any of it is used.

A state file is its node's own, but it may be torn by hand or written by another build: what would only fail at
a later nack or send (a residual of another shape, a pending update for a tensor the model lacks, a quantized
block of 0) is refused when the state is read, with a ``ValueError`` (``WireError`` for a pending update: it is
checked by the wire encoder, the same rules an update meets when it is sent).

>>> import torch
>>> from fedcomp.spec import ModelSpec
>>> spec = ModelSpec.from_tensors({"w": torch.zeros(2, 3)})
>>> check_table({"w": torch.zeros(2, 3)}, spec, "residual")
>>> check_table({"w": torch.zeros(6)}, spec, "residual")
Traceback (most recent call last):
ValueError: residual 'w': shape (6,), the model's is (2, 3)
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from fedcomp.client.finite import non_finite
from fedcomp.payload import TensorPayload, Update, ValueCoding, Values
from fedcomp.spec import ModelSpec
from fedcomp.wire import check, decode


def update_state(update: Update) -> dict[str, Any]:
    """A pending update as plain tensors and numbers (what ``fedcomp.tensortree`` and ``torch.load`` read back)."""
    return {
        "base_version": update.base_version,
        "client_id": update.client_id,
        "tensors": {name: _payload_state(p) for name, p in update.tensors.items()},
    }


def _payload_state(p: TensorPayload) -> dict[str, Any]:
    v = p.values
    return {
        "shape": list(p.shape),
        "coding": int(v.coding),
        "data": v.data.clone(),  # compact copies: a view would save the whole tensor it views
        "scales": None if v.scales is None else v.scales.clone(),
        "block": v.block,
        "indices": None if p.indices is None else p.indices.clone(),
    }


def update_from_state(state: Any, seq: int, spec: ModelSpec) -> Update:
    """A pending update saved by ``update_state``, checked by ``fedcomp.wire.check`` (``encode``'s checks) against
    ``spec`` (every tensor of the model, its shape, codes, scales, blocks and indices: ``WireError`` otherwise),
    or an encoded blob (states saved before payloads were kept are decoded once, here). Other malformed entries
    raise ``KeyError`` / ``TypeError`` / ``ValueError``."""
    if isinstance(state, (bytes, bytearray)):
        return decode(bytes(state), spec)
    tensors = {
        name: TensorPayload(
            tuple(int(d) for d in t["shape"]),
            Values(ValueCoding(int(t["coding"])), t["data"], t["scales"], int(t["block"])),
            t["indices"],
        )
        for name, t in state["tensors"].items()
    }
    update = Update(tensors, int(state["base_version"]), seq, int(state["client_id"]))
    check(update, spec)  # whether the wire would send this update (encode's checks, no bytes written)
    return update


def check_memory(state: Mapping[str, Any], spec: ModelSpec) -> None:
    """``ValueError`` unless every table of a memory's saved state (residuals; momentums and velocities) passes
    ``check_table``."""
    for table in state.values():
        check_table(table, spec, "saved memory")


def check_table(table: Any, spec: ModelSpec, what: str) -> None:
    """``ValueError`` unless ``table`` maps names of ``spec`` to finite floating-point tensors of their shapes (a
    residual, a momentum or a running sum; a name may be missing: not made yet). A NaN there would poison every
    later send."""
    if not isinstance(table, Mapping):
        raise ValueError(f"{what}: not a table of tensors")
    shapes = dict(spec.entries)
    for name, t in table.items():
        if name not in shapes:
            raise ValueError(f"{what} {str(name)[:60]!r}: no such tensor in the model")
        if not isinstance(t, torch.Tensor) or not t.is_floating_point():
            raise ValueError(f"{what} {name!r}: not a floating-point tensor")
        if tuple(t.shape) != tuple(shapes[name]):
            raise ValueError(f"{what} {name!r}: shape {tuple(t.shape)}, the model's is {tuple(shapes[name])}")
    if bad := non_finite(table):
        raise ValueError(f"{what} {bad[0]!r}: NaN or Inf")

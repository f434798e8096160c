"""What ``Pipeline.send`` takes: the spec's tensors, each of its shape, finite and under ``MAX_MAGNITUDE``, in any
memory layout. Checked before the send changes any state, so a refused update leaves the client as it was."""

from __future__ import annotations

from collections.abc import Mapping

import torch

from fedcomp.client.finite import non_finite
from fedcomp.spec import ModelSpec

#: An update holding a magnitude this large is refused like NaN or Inf: error feedback adds updates up in float32
#: (the memory, DGC's momentum), and a few such sums would overflow it. No gradient comes near.
MAX_MAGNITUDE = 2.0**64


class NonFiniteUpdate(ValueError):
    """An update to send holds NaN, Inf or a magnitude of ``MAX_MAGNITUDE`` or more: ``Pipeline.send`` refuses it
    and changes nothing."""


class UpdateMismatch(ValueError):
    """An update to send lacks a tensor of the spec or holds one of another shape: ``Pipeline.send`` refuses it
    and changes nothing."""


def admit(spec: ModelSpec, tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The spec's tensors of ``tensors`` (others are left out), each contiguous (the memories view them flat);
    ``UpdateMismatch`` for a missing tensor or another shape, ``NonFiniteUpdate`` for NaN, Inf or a magnitude of
    ``MAX_MAGNITUDE`` or more.

    >>> spec = ModelSpec((("w", (2, 3)),))
    >>> admit(spec, {"w": torch.ones(3, 2).T, "extra": torch.ones(1)})["w"].is_contiguous()
    True
    >>> admit(spec, {"w": torch.ones(3, 2)})  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    fedcomp.client.admit.UpdateMismatch: update does not fit the model: ['w (3, 2), spec (2, 3)']: refused, ...
    """
    wrong = [f"{n} missing" if n not in tensors else f"{n} {tuple(tensors[n].shape)}, spec {tuple(shape)}"
             for n, shape in spec.entries if n not in tensors or tuple(tensors[n].shape) != tuple(shape)]
    if wrong:
        raise UpdateMismatch(f"update does not fit the model: {wrong[:5]}: refused, the client's state is unchanged")
    bad = non_finite(tensors, limit=MAX_MAGNITUDE)
    if bad:
        raise NonFiniteUpdate(f"update holds NaN or Inf in {bad[:5]} (or a magnitude of 2**64 or more): refused, "
                              "the client's state is unchanged")
    return {n: tensors[n].contiguous() for n in spec.names}

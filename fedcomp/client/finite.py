"""Which tensors of a table hold NaN or Inf: the check before a send (``Pipeline.send``) and on a saved state's
memory and running sums when it is read (``fedcomp.client.saved``)."""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch


def non_finite(tensors: Mapping[str, torch.Tensor], limit: float = math.inf) -> list[str]:
    """Names of the tensors holding NaN or Inf, or a magnitude of ``limit`` or more: each floating tensor's largest
    magnitude (NaN when it holds one; a maximum never overflows) is compared with ``limit``, taken by one
    multi-tensor reduction and one host read per device.

    >>> non_finite({"a": torch.tensor([1.0, float("nan")]), "b": torch.ones(3), "c": torch.tensor([-float("inf")])})
    ['a', 'c']
    >>> non_finite({"a": torch.tensor([2.0**64]), "b": torch.tensor([2.0**63])}, limit=2.0**64)
    ['a']
    """
    by_device: dict[torch.device, list[str]] = {}
    for name, t in tensors.items():
        if t.numel() and (t.is_floating_point() or t.is_complex()):
            by_device.setdefault(t.device, []).append(name)
    bad = []
    for names in by_device.values():
        peaks = torch._foreach_norm([tensors[n] for n in names], math.inf)  # max |x|, NaN-propagating
        ok = (torch.stack([p.float() for p in peaks]) < limit).tolist()  # False for NaN, and Inf with no limit
        bad += [n for n, fine in zip(names, ok, strict=True) if not fine]
    return sorted(bad)

"""A step started on the device and finished on the host. ``PendingStep`` holds what the host must read (a small
int32 readout on the device) and what to do with it; ``resolve_all`` finishes many started steps after **one** host
read of all their readouts. The DGC steps (``fedcomp.kernels.dgc``), the small tensors' group step
(``fedcomp.kernels.group``) and a send's batch (``fedcomp.kernels.hooks``) start their work this way, so a send
waits on the device once for all of them:

    >>> import torch
    >>> steps = [PendingStep(torch.tensor([3, 4], dtype=torch.int32), sum), PendingStep.done("ready")]
    >>> resolve_all(steps)
    [7, 'ready']
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

import torch

T = TypeVar("T")


@dataclass(frozen=True)
class PendingStep(Generic[T]):
    """A started step: ``readout`` (1-D int32 on the device, what the host must read to finish: for a DGC step
    the selected count and whether the threshold is 0; ``None`` when nothing is left to read) and
    ``finish(readout as a list of ints) -> T`` (a ``DGCStep`` for the steps here), the O(k) rest once the readout
    is on the host."""

    readout: torch.Tensor | None
    finish: Callable[[list[int]], T]

    @staticmethod
    def done(result: T) -> PendingStep[T]:
        return PendingStep(None, lambda _: result)

    def resolve(self) -> T:
        """The result, reading its own readout (one host read)."""
        return self.finish([] if self.readout is None else self.readout.tolist())


def resolve_all(steps: Sequence[PendingStep[T]]) -> list[T]:
    """Every started step finished, in order, after **one** host read of all their readouts."""
    return [s.finish(read) for s, read in zip(steps, read_all(steps), strict=True)]


def read_all(steps: Sequence[PendingStep]) -> list[list[int]]:
    """The readouts of ``steps`` on the host, by **one** host read (``[]`` for a step with none): each step's
    ``finish`` argument, for a caller that finishes them in an order of its own."""
    readouts = [s.readout for s in steps if s.readout is not None]
    host = torch.cat(readouts).tolist() if readouts else []
    out, at = [], 0
    for s in steps:
        width = 0 if s.readout is None else s.readout.numel()
        out.append(host[at: at + width])
        at += width
    return out

"""The error-feedback memory role.

A ``Memory`` wraps a compressor so nothing the client computed is lost. Per tensor name, one send step is::

    v = memory.compensate(x, name)      # fold the input into the state, return what to compress
    p = compressor.compress(v, name)
    memory.update(v, name, p)           # keep what p did not carry

and ``memory.restore(name, p)`` puts back a payload the server did not apply (nack). A fused send step (the GPU
kernels, ``fedcomp.kernels.fused_send``) does all three at once on the live state that ``step_state`` exposes.

State lives on the device of the tensors it compensates: ``memory.to(device)`` moves it (a GPU client calls it
with its training device after building or loading a memory), ``restore`` moves a payload decoded on the CPU to
the state's device, and ``state_dict`` returns tensors where they are (save them through the CPU).

Contract (checked by the conservation tests): for every name, after any sequence of steps and restores,
``Σ inputs == Σ decompress(p) over applied payloads + residual(name)`` (up to fp rounding), where "inputs"
are what the memory accumulates: the raw tensors for plain error feedback, the momentum-corrected
updates ``u_t`` for DGC (so the velocity identity ``Σ u_t == Σ sent + v`` holds there).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from fedcomp.payload import TensorPayload
from fedcomp.registry import Registry

MEMORIES: Registry[Memory] = Registry("memory")


@dataclass(frozen=True)
class StepState:
    """The live state of one tensor name (or of a group of names, flat: ``Memory.group_state``), for a fused send step
    that updates it in place (contiguous fp32).

    ``velocity``: what is accumulated and not yet sent (DGC's ``v``, plain error feedback's ``e``); ``momentum``:
    DGC's ``u`` (``None`` without momentum); ``rule``: the memory's DGC options (``DGCMemoryConfig``; ``None``
    for plain error feedback). Example::

        state = ResidualMemory().step_state("w", torch.zeros(3))
        state.velocity.add_(1.0)        # is the memory's residual of "w"
    """

    velocity: torch.Tensor
    momentum: torch.Tensor | None = None
    rule: Any = None


class Memory(ABC):
    Config: ClassVar[type | None] = None

    def __init__(self, config: Any = None) -> None:
        self.config = config if config is not None else (self.Config() if self.Config else None)
        self.device = torch.device("cpu")  # where restore creates missing state and load_state_dict puts state

    @abstractmethod
    def compensate(self, tensor: torch.Tensor, name: str) -> torch.Tensor:
        """Fold ``tensor`` into the state; return the tensor to compress. Must not modify ``tensor``."""

    @abstractmethod
    def update(self, compensated: torch.Tensor, name: str, payload: TensorPayload) -> None:
        """Record that ``payload`` (compressed from ``compensated``) was sent; keep the rest. O(nnz) if sparse."""

    @abstractmethod
    def restore(self, name: str, payload: TensorPayload) -> None:
        """A sent payload was not applied by the server: add it back so its mass is sent later."""

    @abstractmethod
    def residual(self, name: str) -> torch.Tensor:
        """What has been computed but not yet sent (zeros for an unseen name is not required)."""

    @abstractmethod
    def to(self, device: torch.device | str) -> Memory:
        """Move every state tensor to ``device`` and make it the memory's ``device``; returns ``self``."""

    def step_state(self, name: str, like: torch.Tensor) -> StepState | None:
        """The live state of ``name`` for a fused send step, created as zeros shaped like ``like`` (on its device)
        at a name's first step; ``None`` (the default): this memory keeps no state a fused step can use."""
        del name, like
        return None

    def group_state(self, names: Sequence[str]) -> StepState | None:
        """The live state of the group ``names`` (the small tensors a pipeline compresses jointly) as flat 1-D
        buffers, their per-name tensors rebound to views of them (``fedcomp.memory.flat``), for a step over the
        whole group (``fedcomp.kernels.group``); ``None`` (the default, and while a name has no state yet): the
        caller runs the reference steps."""
        del names
        return None

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        del state


def moved(state: dict[str, torch.Tensor], device: torch.device) -> dict[str, torch.Tensor]:
    """``state`` with every tensor on ``device`` (tensors already there are kept, not copied)."""
    return {k: t.to(device) for k, t in state.items()}

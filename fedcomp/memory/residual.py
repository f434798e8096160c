"""Plain error feedback (Seide et al. 2014; Karimireddy et al. 2019) and a no-memory baseline."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from fedcomp.memory.base import MEMORIES, Memory, StepState, moved
from fedcomp.memory.flat import FlatState
from fedcomp.payload import TensorPayload


@MEMORIES.register("residual")
class ResidualMemory(Memory):
    """``compensate(x) = x + e``; ``update`` sets ``e = compensated - decompress(payload)``.

    Keeps exactly what the compressor dropped, including quantization error of the kept values, so
    ``Σ x == Σ sent + e``. Use it for quantizers and for federated delta exchange (the client sends its
    local-training model delta every round).
    """

    def __init__(self, config: Any = None) -> None:
        super().__init__(config)
        self.errors: dict[str, torch.Tensor] = {}
        self._flat: FlatState | None = None  # the group's residuals as views of one buffer (group_state)

    def compensate(self, tensor: torch.Tensor, name: str) -> torch.Tensor:
        e = self.errors.get(name)
        x = tensor.detach().float()
        return x.clone() if e is None else x + e

    def update(self, compensated: torch.Tensor, name: str, payload: TensorPayload) -> None:
        e = compensated  # compensate returned a fresh tensor: reuse it as the new residual
        payload.add_to(e, -1.0)
        self.errors[name] = e

    def restore(self, name: str, payload: TensorPayload) -> None:
        """Add ``payload`` (any device) back into ``e``; an unseen name starts from zeros on ``self.device``."""
        e = self.errors.get(name)
        if e is None:
            e = self.errors[name] = torch.zeros(payload.shape, device=self.device)
        payload.add_to(e, 1.0)

    def residual(self, name: str) -> torch.Tensor:
        return self.errors[name]

    def step_state(self, name: str, like: torch.Tensor) -> StepState:
        """``e`` of ``name`` as the velocity (no momentum, no DGC rule): a fused step adds ``x`` to it and keeps
        there what it did not send."""
        e = self.errors.get(name)
        if e is None:
            e = self.errors[name] = torch.zeros_like(like)
        return StepState(e)

    def group_state(self, names: Sequence[str]) -> StepState | None:
        """``e`` of every name of ``names`` as one flat buffer (the per-name residuals become views of it); ``None``
        while a name has no residual (its first step)."""
        self._flat = FlatState.bind((self.errors,), names, self._flat)
        return None if self._flat is None else StepState(self._flat.bufs[0])

    def to(self, device: torch.device | str) -> ResidualMemory:
        self.device = torch.device(device)
        self.errors = moved(self.errors, self.device)
        return self

    def state_dict(self) -> dict[str, Any]:
        return {"errors": {k: v.clone() for k, v in self.errors.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Copies of the saved residuals, on ``self.device``."""
        self.errors = {k: v.to(self.device, copy=True) for k, v in state["errors"].items()}


@MEMORIES.register("none")
class NoMemory(Memory):
    """No error feedback: what the compressor drops is lost (for comparisons only)."""

    def compensate(self, tensor: torch.Tensor, name: str) -> torch.Tensor:
        return tensor.detach().float()

    def update(self, compensated: torch.Tensor, name: str, payload: TensorPayload) -> None:
        pass

    def restore(self, name: str, payload: TensorPayload) -> None:
        pass

    def residual(self, name: str) -> torch.Tensor:
        raise KeyError(f"memory 'none' keeps no residual ({name!r})")

    def to(self, device: torch.device | str) -> NoMemory:
        self.device = torch.device(device)  # no state to move
        return self

"""DGC memory: momentum correction, local gradient accumulation, momentum factor masking and local gradient
clipping (Lin et al., "Deep Gradient Compression", ICLR 2018, Sec. 3.2).

Two ways to use compression in fedcomp, pick by what the client sends:

* **Per-step gradient exchange** (the paper's setting; datacenter clients, one message per SGD step): compress
  each step's gradient with ``memory="dgc"`` (the default of the ``"dgc"`` compressor). The momentum lives here,
  on the client; the server sums the sparse velocities it receives and applies them with *plain SGD*
  (``w -= lr * Σ sent``, no server momentum: it would apply momentum twice).
* **Local-training delta exchange** (federated: H local steps, then the model delta): compress the delta with
  ``memory="residual"`` (plain error feedback). The local optimizer already used momentum and the server
  optimizer (FedAvg/FedAvgM/FedAdam) handles any global momentum, so momentum correction here would be wrong.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from fedcomp.memory.base import MEMORIES, Memory, StepState, moved
from fedcomp.memory.dgc_math import accumulate_, clip_scale, clip_threshold, first_step, mask_
from fedcomp.memory.flat import FlatState
from fedcomp.payload import TensorPayload


@dataclass(frozen=True)
class DGCMemoryConfig:
    """``momentum`` m; ``nesterov``; ``masking`` = momentum factor masking; ``clip_norm`` = per-tensor L2 clip
    threshold (``None``: no clipping), scaled by ``clip_workers ** -0.5`` when ``clip_workers`` = N is set (the
    paper's local clipping: this worker's share of a global threshold, if all N had the same distribution).
    The memory sees one tensor at a time, so the norm is per tensor, not over the whole model."""

    momentum: float = 0.9
    nesterov: bool = False
    masking: bool = True
    clip_norm: float | None = None
    clip_workers: int | None = None

    def __post_init__(self) -> None:
        if not 0.0 <= self.momentum < 1.0:
            raise ValueError(f"momentum must be in [0, 1), got {self.momentum}")
        if self.clip_norm is not None and not self.clip_norm > 0:
            raise ValueError(f"clip_norm must be > 0, got {self.clip_norm}")
        if self.clip_workers is not None and self.clip_workers < 1:
            raise ValueError(f"clip_workers must be >= 1, got {self.clip_workers}")


@MEMORIES.register("dgc")
class DGCMemory(Memory):
    """Per tensor: momentum ``u`` and velocity ``v`` (the accumulated, not yet sent, momentum-corrected update).

    One step with gradient ``g`` (after optional clipping, which never modifies the caller's tensor)::

        u <- m * u + g                      # momentum correction: accumulate velocity, not gradients
        v <- v + u                          # (Nesterov: v <- v + g + m * u, with the new u)
        p = compress(v)                     # v is returned as the live state: compress must not modify it
        v <- v - decompress(p)              # O(nnz); with quantized values v keeps their quantization error
        u[sent] <- 0                        # momentum factor masking (sparse payloads only)

    Momentum factor masking stops stale momentum from pushing sent coordinates again; ``v`` at the sent positions
    is exactly 0 after an fp32 send. Tensors sent dense (small tensors under the sparsifier's ``small="dense"``
    rule) are *not* masked: every coordinate is sent every step, so masking would zero their momentum each step
    and they would train with plain SGD; unmasked, ``v`` is emptied and ``u`` carries the momentum as usual. Under
    the default ``small="group"`` small tensors arrive as sparse payloads and are masked like any other.

    ``restore(name, p)`` (nack) adds the payload back into ``v`` only. ``u`` is left as it is: its masking was a
    client-side decision already taken and the restored mass will be sent again from ``v``.

    Conservation: with inflow ``a_t = u_t`` (Nesterov: ``g_t + m u_t``), ``Σ a_t == Σ applied + v``.
    """

    Config = DGCMemoryConfig

    def __init__(self, config: DGCMemoryConfig | None = None) -> None:
        super().__init__(config)
        self.momentums: dict[str, torch.Tensor] = {}
        self.velocities: dict[str, torch.Tensor] = {}
        self._flat: FlatState | None = None  # the group's u and v as views of two buffers (group_state)

    def compensate(self, tensor: torch.Tensor, name: str) -> torch.Tensor:
        """Fold gradient ``tensor`` into ``u`` and ``v``; return ``v`` itself (live state, do not modify it).

        Cost: two in-place passes (``u = g + m u`` in one op, then ``v += u``), no temporaries; clipping adds one
        read for the norm. A tensor's first step allocates its state. The arithmetic: ``fedcomp.memory.dgc_math``.
        """
        g = tensor.detach()
        if g.dtype != torch.float32:
            g = g.float()
        cfg = self.config
        scale = clip_scale(g, clip_threshold(cfg.clip_norm, cfg.clip_workers))
        u = self.momentums.get(name)
        if u is None:  # first step from u = v = 0; contiguous state
            u, v = first_step(g, momentum=cfg.momentum, nesterov=cfg.nesterov, scale=scale)
            self.momentums[name], self.velocities[name] = u, v
            return v
        v = self.velocities[name]
        accumulate_(g, u, v, momentum=cfg.momentum, nesterov=cfg.nesterov, scale=scale)
        return v

    def update(self, compensated: torch.Tensor, name: str, payload: TensorPayload) -> None:
        """``v -= decompress(payload)`` in O(nnz); sparse payloads also zero ``u`` at the sent positions."""
        del compensated  # the live v
        payload.add_to(self.velocities[name], -1.0)
        if self.config.masking and payload.indices is not None:
            mask_(self.momentums[name], payload.indices)

    def restore(self, name: str, payload: TensorPayload) -> None:
        """Add ``payload`` (any device) back into ``v``; an unseen name starts from zeros on ``self.device``."""
        v = self.velocities.get(name)
        if v is None:
            v = self.velocities[name] = torch.zeros(payload.shape, device=self.device)
            self.momentums[name] = torch.zeros(payload.shape, device=self.device)
        payload.add_to(v, 1.0)

    def residual(self, name: str) -> torch.Tensor:
        return self.velocities[name]

    def momentum(self, name: str) -> torch.Tensor:
        """The momentum ``u`` of ``name`` (live state)."""
        return self.momentums[name]

    def step_state(self, name: str, like: torch.Tensor) -> StepState:
        """``v`` and ``u`` of ``name`` with this memory's config as the rule. Zero state at a name's first step
        makes the fused step's ``u = m * 0 + g`` equal ``compensate``'s ``u = g``."""
        if name not in self.momentums:
            self.momentums[name] = torch.zeros_like(like)
            self.velocities[name] = torch.zeros_like(like)
        return StepState(self.velocities[name], self.momentums[name], self.config)

    def group_state(self, names: Sequence[str]) -> StepState | None:
        """``v`` and ``u`` of every name of ``names`` as two flat buffers (the per-name tensors become views of
        them), this memory's config as the rule; ``None`` while a name has no state (its first step)."""
        self._flat = FlatState.bind((self.velocities, self.momentums), names, self._flat)
        return None if self._flat is None else StepState(self._flat.bufs[0], self._flat.bufs[1], self.config)

    def state_dict(self) -> dict[str, Any]:
        return {
            "u": {k: t.clone() for k, t in self.momentums.items()},
            "v": {k: t.clone() for k, t in self.velocities.items()},
        }

    def to(self, device: torch.device | str) -> DGCMemory:
        self.device = torch.device(device)
        self.momentums = moved(self.momentums, self.device)
        self.velocities = moved(self.velocities, self.device)
        return self

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Copies of the saved ``u`` and ``v``, on ``self.device``."""
        self.momentums = {k: t.to(self.device, copy=True) for k, t in state["u"].items()}
        self.velocities = {k: t.to(self.device, copy=True) for k, t in state["v"].items()}

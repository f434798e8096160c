"""The compressor role.

A ``Compressor`` maps one float tensor to a ``TensorPayload``. It is lossy and forgetful by design: what it
drops is kept by the error-feedback ``Memory`` (fedcomp.memory), never here. Two kinds:

* ``Sparsifier`` chooses positions (``select``) and sends their exact fp32 values;
* ``Quantizer`` keeps every position and codes the values (``quantize``);

and ``Composed`` runs a sparsifier then quantizes the kept values (e.g. ``dgc+int8``).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from fedcomp.payload import TensorPayload, Values
from fedcomp.registry import Registry

COMPRESSORS: Registry[Compressor] = Registry("compressor")


class Compressor(ABC):
    """Tensor → ``TensorPayload``. Subclasses declare options in a frozen ``Config`` dataclass."""

    Config: ClassVar[type | None] = None
    #: Memory used when a pipeline names none ("residual" = plain error feedback).
    default_memory: ClassVar[str] = "residual"

    def __init__(self, config: Any = None) -> None:
        self.config = config if config is not None else (self.Config() if self.Config else None)

    @abstractmethod
    def compress(self, tensor: torch.Tensor, name: str) -> TensorPayload:
        """Compress ``tensor`` (float32, any shape). Must not modify ``tensor``."""

    def set_epoch(self, epoch: float) -> None:
        """Training progress in epochs (or rounds); schedules such as sparsity warm-up read it."""

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        del state


class Seeded:
    """Mixin: a private ``torch.Generator`` for stochastic rounding or sampling, saved in ``state_dict``."""

    def _init_rng(self, seed: int) -> None:
        self.generator = torch.Generator().manual_seed(seed)

    def state_dict(self) -> dict[str, Any]:
        return {"rng": self.generator.get_state()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.generator.set_state(state["rng"])


@dataclass(frozen=True)
class SparsifierConfig:
    """Options every sparsifier shares.

    Dense rule: a tensor with ``ndim <= 1`` (biases, norm scales) or fewer than ``dense_below`` elements is
    sent whole as fp32; it is a tiny share of the bytes and sparsifying it hurts accuracy (DGC, Sec. 3).
    """

    density: float = 0.001
    dense_below: int = 1024

    def __post_init__(self) -> None:
        if not 0.0 < self.density <= 1.0:
            raise ValueError(f"density must be in (0, 1], got {self.density}")
        if self.dense_below < 0:
            raise ValueError("dense_below must be >= 0")


class Sparsifier(Compressor):
    """Keeps a subset of positions with their exact fp32 values."""

    Config: ClassVar[type] = SparsifierConfig

    def sends_dense(self, tensor: torch.Tensor) -> bool:
        return tensor.dim() <= 1 or tensor.numel() < self.config.dense_below

    def density_for(self, name: str) -> float:
        """Fraction of elements to keep now (schedules override)."""
        del name
        return self.config.density

    @abstractmethod
    def select(self, flat: torch.Tensor, k: int, name: str) -> torch.Tensor:
        """Sorted unique int64 positions of ``flat`` to send; about ``k`` of them, at least one if ``flat`` != 0."""

    def compress(self, tensor: torch.Tensor, name: str) -> TensorPayload:
        shape = tuple(tensor.shape)
        flat = tensor.detach().reshape(-1)
        if self.sends_dense(tensor):
            return TensorPayload(shape, Values.f32(flat.clone()))
        k = max(1, round(self.density_for(name) * flat.numel()))
        idx = self.select(flat, k, name).to(flat.device)  # random-k draws on its CPU generator
        return TensorPayload(shape, Values.f32(flat[idx]), idx)


class Quantizer(Compressor):
    """Keeps every position and codes the values."""

    @abstractmethod
    def quantize(self, values: torch.Tensor, name: str) -> Values:
        """Code a 1-D float32 tensor of values."""

    def compress(self, tensor: torch.Tensor, name: str) -> TensorPayload:
        return TensorPayload(tuple(tensor.shape), self.quantize(tensor.detach().reshape(-1).float(), name))


class Composed(Compressor):
    """Sparsify, then quantize the kept values. Tensors the sparsifier sends dense stay fp32.

    Under error feedback the memory sees the dequantized payload, so it keeps both the values that were not
    selected and the quantization error of those that were.
    """

    def __init__(self, sparsifier: Sparsifier, quantizer: Quantizer) -> None:
        super().__init__(None)
        self.sparsifier, self.quantizer = sparsifier, quantizer
        self.default_memory = sparsifier.default_memory  # type: ignore[misc]

    def compress(self, tensor: torch.Tensor, name: str) -> TensorPayload:
        p = self.sparsifier.compress(tensor, name)
        if p.is_dense:
            return p
        return TensorPayload(p.shape, self.quantizer.quantize(p.values.data, name), p.indices)

    def set_epoch(self, epoch: float) -> None:
        self.sparsifier.set_epoch(epoch)
        self.quantizer.set_epoch(epoch)

    def state_dict(self) -> dict[str, Any]:
        return {"sparsifier": self.sparsifier.state_dict(), "quantizer": self.quantizer.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.sparsifier.load_state_dict(state["sparsifier"])
        self.quantizer.load_state_dict(state["quantizer"])

"""DGC sparsifier: sampled-threshold top-k with the paper's exponential sparsity warm-up (Lin et al. 2018).

Pair it with the ``"dgc"`` memory (its default: momentum correction, accumulation, masking, clipping) for
per-step gradient exchange, or with ``memory="residual"`` for federated model-delta exchange; see
``fedcomp.memory.dgc`` for which to use when.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from fedcomp.compressors.base import COMPRESSORS, Seeded, Sparsifier, SparsifierConfig
from fedcomp.compressors.schedule import WarmupSchedule
from fedcomp.compressors.selection import select
from fedcomp.registry import check_ranges


@dataclass(frozen=True)
class DGCConfig(SparsifierConfig):
    """DGC options on top of ``density`` (final density, 0.001), ``dense_below`` (1024) and ``small`` (``"group"``).

    ``warmup_epochs``: length of the sparsity warm-up in the unit ``set_epoch`` is fed (epochs or rounds); 0 = none.
    The paper warms up over 4 of 164 epochs (densities 25%, 6.25%, 1.56%, 0.39%, then 0.1%). Keep it a small share
    of training, a few percent: the warm-up stages send far more bytes, so in a short run they dominate the total.
    ``sample_rate`` / ``min_samples``: share / least number of elements sampled to estimate the threshold.
    ``max_iters``: threshold passes before falling back to exact top-k. ``seed``: sampling generator seed.
    """

    warmup_epochs: float = 0.0
    sample_rate: float = 0.01
    min_samples: int = 4096
    max_iters: int = 3
    seed: int = 0

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 0 <= self.warmup_epochs < math.inf:  # NaN too: it turned the warm-up off
            raise ValueError(f"warmup_epochs must be finite and >= 0, got {self.warmup_epochs}")
        if not 0.0 < self.sample_rate <= 1.0:
            raise ValueError(f"sample_rate must be in (0, 1], got {self.sample_rate}")
        check_ranges(("min_samples", self.min_samples, ">= 1", self.min_samples >= 1),
                     ("max_iters", self.max_iters, ">= 1", self.max_iters >= 1), error=ValueError)


@COMPRESSORS.register("dgc")
class DGC(Seeded, Sparsifier):
    """Keeps about ``density_for(name) * numel`` largest-magnitude elements, found with
    ``fedcomp.compressors.selection``
    (count within [0.8k, 1.3k], or exactly k after an exact top-k). Default memory: ``"dgc"``.

    Call ``set_epoch(e)`` as training progresses to drive the warm-up; ``state_dict`` keeps the sampling generator
    and the epoch.
    """

    Config: ClassVar[type] = DGCConfig
    default_memory: ClassVar[str] = "dgc"

    def __init__(self, config: DGCConfig | None = None) -> None:
        super().__init__(config)
        self._init_rng(self.config.seed)
        self.schedule = WarmupSchedule(self.config.density, self.config.warmup_epochs)
        self.epoch = 0.0

    def set_epoch(self, epoch: float) -> None:
        self.epoch = float(epoch)

    def density_for(self, name: str) -> float:
        del name
        return self.schedule.density(self.epoch)

    def set_density(self, density: float) -> None:
        """The new final density; warm-up stages denser than it still apply while they last."""
        super().set_density(density)
        self.schedule = WarmupSchedule(self.config.density, self.config.warmup_epochs)

    def select(self, flat: torch.Tensor, k: int, name: str) -> torch.Tensor:
        del name
        cfg = self.config
        return select(
            flat,
            k,
            generator=self.generator,
            sample_rate=cfg.sample_rate,
            min_samples=cfg.min_samples,
            max_iters=cfg.max_iters,
        ).indices

    def state_dict(self) -> dict[str, Any]:
        return {"rng": self.generator.get_state(), "epoch": self.epoch}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        epoch = float(state["epoch"])
        if not math.isfinite(epoch) or epoch < 0:
            raise ValueError(f"a saved epoch must be a finite number >= 0, got {epoch}")
        self.generator.set_state(state["rng"])
        self.epoch = epoch

"""Random-k sparsification: ``k`` positions drawn uniformly without replacement, values unscaled.

With error feedback (``"residual"`` memory, the default) the unsent mass is delayed, not lost, so the values are
sent as they are; no ``numel / k`` rescaling (that is only for the unbiased, memoryless variant).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import torch

from fedcomp.compressors.base import COMPRESSORS, Seeded, Sparsifier, SparsifierConfig


@dataclass(frozen=True)
class RandomKConfig(SparsifierConfig):
    """``seed`` of the private generator (saved and restored with ``state_dict``)."""

    seed: int = 0


@COMPRESSORS.register("randomk")
class RandomK(Seeded, Sparsifier):
    """Uniformly random ``k`` of ``numel`` positions, sorted. Cost O(k log k) for ``k << numel`` (no permutation
    of the whole tensor). Options: ``density`` (0.001), ``dense_below`` (1024), ``small`` (``"group"``),
    ``seed`` (0)."""

    Config: ClassVar[type] = RandomKConfig

    def __init__(self, config: RandomKConfig | None = None) -> None:
        super().__init__(config)
        self._init_rng(self.config.seed)

    def select(self, flat: torch.Tensor, k: int, name: str) -> torch.Tensor:
        del name
        return uniform_positions(flat.numel(), k, self.generator)


def uniform_positions(n: int, k: int, generator: torch.Generator) -> torch.Tensor:
    """A uniformly random ``k``-subset of ``range(n)`` as sorted int64.

    For ``k << n``: draw with replacement until at least ``k`` distinct positions are found, then keep a uniform
    ``k`` of them. The process is invariant under permutations of ``range(n)``, so the result is uniform.
    """
    k = min(k, n)
    if 2 * k >= n:
        return torch.randperm(n, generator=generator)[:k].sort().values
    picked = torch.zeros(0, dtype=torch.int64)
    while picked.numel() < k:
        # d draws give about (n - have) * (1 - exp(-d / n)) new distinct positions: ask for 5% more than needed
        have = picked.numel()
        d = math.ceil(-n * math.log1p(-(k - have) / (n - have)) * 1.05) + 16
        picked = torch.unique(torch.cat([picked, torch.randint(n, (d,), generator=generator)]))
    if picked.numel() > k:  # keep a uniform k of them, in their sorted order
        keep = torch.zeros(picked.numel(), dtype=torch.bool)
        keep[torch.randperm(picked.numel(), generator=generator)[:k]] = True
        picked = picked[keep]
    return picked

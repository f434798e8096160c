"""Sync-round client selection (fraction, minimum, over-selection)."""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

from fedcomp.registry import ConfigError

#: The largest ``over_selection``: a round opens at most 101 times its target of tasks (as many as are available).
MAX_OVER_SELECTION = 100.0


@dataclass(frozen=True)
class ClientSelection:
    """Sync-round client selection: ``fraction`` of the available clients, at least ``min_clients``, times
    ``1 + over_selection`` (Bonawitz et al. 2019); the round closes once ``target`` replies were accepted."""

    fraction: float = 1.0
    min_clients: int = 1
    over_selection: float = 0.0

    def __post_init__(self) -> None:
        if not 0 < self.fraction <= 1:
            raise ConfigError(f"fraction must be in (0, 1], got {self.fraction}")
        if self.min_clients < 1 or not 0 <= self.over_selection <= MAX_OVER_SELECTION:
            raise ConfigError(f"min_clients must be >= 1 and over_selection in [0, {MAX_OVER_SELECTION:g}], got "
                              f"{self.min_clients!r} and {self.over_selection!r}")

    def target(self, available: int) -> int:
        return min(available, max(self.min_clients, math.ceil(self.fraction * available)))

    def size(self, available: int) -> int:
        """How many of ``available`` clients a round selects: ``target`` times ``1 + over_selection``."""
        return min(available, math.ceil(self.target(available) * (1 + self.over_selection)))

    def choose(self, clients: list[int], rng: random.Random) -> tuple[list[int], int]:
        """Returns (selected clients, target number of accepted replies)."""
        return sorted(rng.sample(sorted(clients), self.size(len(clients)))), self.target(len(clients))

"""Sparsity warm-up (DGC, Lin et al. 2018, Sec. 3.3).

Early in training the gradients change fast and a very sparse update delays too much of them, so DGC starts
with a low sparsity and raises it exponentially: the paper uses densities 25%, 6.25%, 1.5625% and 0.390625%
(sparsity 75%, 93.75%, 98.4375%, 99.6%) over the first four epochs, then the final 0.1% (99.9% sparsity).

General rule implemented here: warm-up stage ``j`` (0-based) keeps density ``0.25 ** (j + 1)`` for every ``j``
where that is still larger than the final density; the stages split ``warmup_epochs`` into equal parts, and
from ``warmup_epochs`` on the final density applies. ``epoch`` may be fractional and may count federated rounds
instead of epochs: the schedule only compares it with ``warmup_epochs``.

Note: the authors' released code computes a different sequence (a geometric interpolation from 1 towards the
final density, so its stages depend on the final density); this module implements the sequence the paper states.
"""

from __future__ import annotations

from dataclasses import dataclass, field

#: Density multiplier between consecutive warm-up stages (sparsity 75%, 93.75%, ...).
STAGE_FACTOR = 0.25


@dataclass(frozen=True)
class WarmupSchedule:
    """Density to use at a point of training. ``warmup_epochs <= 0`` means no warm-up.

    >>> s = WarmupSchedule(0.001, warmup_epochs=4)
    >>> [s.density(e) for e in (0, 1, 2, 3, 4)]
    [0.25, 0.0625, 0.015625, 0.00390625, 0.001]
    """

    final_density: float
    warmup_epochs: float = 0.0
    stages: tuple[float, ...] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        if not 0.0 < self.final_density <= 1.0:
            raise ValueError(f"final_density must be in (0, 1], got {self.final_density}")
        if self.warmup_epochs < 0:
            raise ValueError(f"warmup_epochs must be >= 0, got {self.warmup_epochs}")
        stages: list[float] = []
        d = STAGE_FACTOR
        while d > self.final_density:
            stages.append(d)
            d *= STAGE_FACTOR
        object.__setattr__(self, "stages", tuple(stages) if self.warmup_epochs > 0 else ())

    def density(self, epoch: float) -> float:
        """Density at ``epoch`` (fractional epochs or rounds, counted from 0)."""
        if not self.stages or epoch >= self.warmup_epochs:
            return self.final_density
        stage = int(max(epoch, 0.0) / self.warmup_epochs * len(self.stages))
        return self.stages[min(stage, len(self.stages) - 1)]

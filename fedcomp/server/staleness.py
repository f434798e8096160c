"""Staleness weights for asynchronous aggregation: ``fn(tau) -> weight`` with tau = server version − base version.

Registry ``STALENESS`` (``build_staleness("hinge", a=10, b=4)``); every function is 1 at tau = 0, positive and
non-increasing in tau, and raises ``ValueError`` for tau < 0 (an update from the future is a protocol bug):

* ``"constant"``: 1;
* ``"polynomial"``: ``(1 + tau) ** -a`` (FedAsync, Xie et al. 2019; ``a`` = 0.5);
* ``"hinge"``: 1 if ``tau <= b`` else ``1 / (a * (tau - b) + 1)`` (FedAsync; ``a`` = 10, ``b`` = 4);
* ``"fedbuff"``: ``1 / sqrt(1 + tau)`` (FedBuff, Nguyen et al. 2022).
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass
from typing import Any, ClassVar

from fedcomp.registry import Registry

STALENESS: Registry[StalenessFn] = Registry("staleness function")


class StalenessFn:
    """Base: validates tau and delegates to ``weight``."""

    Config: ClassVar[type | None] = None

    def __init__(self, config: Any = None) -> None:
        self.config = config if config is not None else (self.Config() if self.Config else None)

    def __call__(self, tau: int) -> float:
        if isinstance(tau, bool):
            raise TypeError("staleness tau must be an int, got bool")
        tau = operator.index(tau)  # rejects floats; accepts numpy integers
        if tau < 0:
            raise ValueError(f"staleness tau must be >= 0, got {tau}")
        return self.weight(tau)

    def weight(self, tau: int) -> float:
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.config!r})" if self.config is not None else f"{type(self).__name__}()"


@STALENESS.register("constant")
class Constant(StalenessFn):
    """Weight 1 whatever the staleness (plain async SGD / FedAvg within the staleness bound)."""

    def weight(self, tau: int) -> float:
        return 1.0


@STALENESS.register("polynomial")
class Polynomial(StalenessFn):
    """``(1 + tau) ** -a``; ``a >= 0``."""

    @dataclass(frozen=True)
    class Config:
        a: float = 0.5

        def __post_init__(self) -> None:
            if not (math.isfinite(self.a) and self.a >= 0):
                raise ValueError(f"a must be finite and >= 0, got {self.a}")

    def weight(self, tau: int) -> float:
        return float((1.0 + tau) ** -self.config.a)


@STALENESS.register("hinge")
class Hinge(StalenessFn):
    """1 up to ``b`` versions stale, then ``1 / (a (tau - b) + 1)``; ``a, b >= 0``."""

    @dataclass(frozen=True)
    class Config:
        a: float = 10.0
        b: int = 4

        def __post_init__(self) -> None:
            if not (math.isfinite(self.a) and self.a >= 0):
                raise ValueError(f"a must be finite and >= 0, got {self.a}")
            if self.b < 0:
                raise ValueError(f"b must be >= 0, got {self.b}")

    def weight(self, tau: int) -> float:
        a, b = self.config.a, self.config.b
        return 1.0 if tau <= b else 1.0 / (a * (tau - b) + 1.0)


@STALENESS.register("fedbuff")
class FedBuff(StalenessFn):
    """``1 / sqrt(1 + tau)``."""

    def weight(self, tau: int) -> float:
        return 1.0 / math.sqrt(1.0 + tau)


def build_staleness(name: str = "constant", **options: Any) -> StalenessFn:
    """Staleness function ``name`` from ``STALENESS``; unknown options raise ``ConfigError``."""
    return STALENESS.build(name, **options)

"""``StrategyWrapper``: the methods a strategy wrapper passes through unchanged, kept out of the wrapper.

As Flower's DP wrappers share theirs in a base class, ``Compressed`` inherits evaluation and the summary of the
wrapped strategy from here, so its own body is only what compression changes (training).

    >>> from flwr.serverapp.strategy import FedAvg
    >>> StrategyWrapper(FedAvg()).strategy.__class__.__name__
    'FedAvg'
"""

from __future__ import annotations

from collections.abc import Iterable

from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Strategy


class StrategyWrapper(Strategy):
    """Holds ``strategy`` and passes evaluation and the summary through to it; subclasses override training."""

    def __init__(self, strategy: Strategy) -> None:
        self.strategy = strategy

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.strategy!r})"

    def summary(self) -> None:
        self.strategy.summary()

    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        return self.strategy.configure_train(server_round, arrays, config, grid)

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        return self.strategy.aggregate_train(server_round, replies)

    def configure_evaluate(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        return self.strategy.configure_evaluate(server_round, arrays, config, grid)

    def aggregate_evaluate(self, server_round: int, replies: Iterable[Message]) -> MetricRecord | None:
        return self.strategy.aggregate_evaluate(server_round, replies)

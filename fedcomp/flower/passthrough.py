"""``StrategyWrapper``: the methods a strategy wrapper passes through unchanged, kept out of the wrapper.

As Flower's DP wrappers share theirs in a base class, ``Compressed`` inherits evaluation and the summary of the
wrapped strategy from here, so its own body is only what compression changes (training). ``start`` is Flower's
``Strategy.start`` on a ``PromptGrid`` (``fedcomp.flower.grid``): each round ends when its replies are in, not
at Flower's next 3 s pull.

    >>> from flwr.serverapp.strategy import FedAvg
    >>> StrategyWrapper(FedAvg()).strategy.__class__.__name__
    'FedAvg'
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Result, Strategy

from fedcomp.flower.grid import prompt


class StrategyWrapper(Strategy):
    """Holds ``strategy`` and passes evaluation and the summary through to it; subclasses override training."""

    def __init__(self, strategy: Strategy) -> None:
        self.strategy = strategy

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.strategy!r})"

    def summary(self) -> None:
        self.strategy.summary()

    def start(
        self,
        grid: Grid,
        initial_arrays: ArrayRecord,
        num_rounds: int = 3,
        timeout: float = 3600,
        train_config: ConfigRecord | None = None,
        evaluate_config: ConfigRecord | None = None,
        evaluate_fn: Callable[[int, ArrayRecord], MetricRecord | None] | None = None,
    ) -> Result:
        """Flower's ``Strategy.start``, unchanged, on ``prompt(grid)``: Flower's grids wrapped in a
        ``PromptGrid`` (same replies, each round over as soon as they are in), any other grid as it is."""
        return super().start(
            grid=prompt(grid),
            initial_arrays=initial_arrays,
            num_rounds=num_rounds,
            timeout=timeout,
            train_config=train_config,
            evaluate_config=evaluate_config,
            evaluate_fn=evaluate_fn,
        )

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

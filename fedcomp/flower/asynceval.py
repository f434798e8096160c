"""Federated evaluation between model versions of ``Compressed(strategy, mode="async", fed_eval_every=N)``.

Every N versions (and at the last one) the wrapped strategy's own ``configure_evaluate`` of that version and the
current model goes to its nodes (its ``fraction_evaluate``, ``min_evaluate_nodes``, its evaluate config), the
replies come back through ``Grid.send_and_receive`` (on ``grid.prompt(grid)``, as a sync round's do) within the
run's task ``timeout``, and its ``aggregate_evaluate`` makes the version's metrics: they land in Flower's
``Result.evaluate_metrics_clientapp[version]``, in the version's ``metrics.jsonl`` row as ``fed_<name>`` and in
``summary.json``'s ``federated_evaluation`` rows. The loop waits for it: no train reply is judged and no task sent
meanwhile (the nodes still running a train task answer the evaluation after it).

    >>> fed = FederatedEvaluation(strategy, grid, model=lambda: current, every=5, last=40,
    ...                           config=ConfigRecord(), timeout=60.0, result=Result())  # doctest: +SKIP
    >>> reporter.row_hooks.append(lambda: fed(proto.version))  # doctest: +SKIP
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from flwr.app import ArrayRecord, ConfigRecord
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Result, Strategy

from fedcomp.flower.grid import prompt


class FederatedEvaluation:
    """Call with a version: ``{}`` unless one is due (every ``every`` versions, and at ``last``), else the
    aggregated metrics as ``{"fed_<name>": value}`` (numbers only) for the version's row; ``rows`` holds one
    ``{"version", "clients", "fed_<name>"...}`` per evaluation (``clients``: the replies without an error)."""

    def __init__(self, strategy: Strategy, grid: Grid, model: Callable[[], ArrayRecord], every: int, last: int,
                 config: ConfigRecord, timeout: float, result: Result) -> None:
        if every < 1:
            raise ValueError(f"every must be >= 1, got {every}")
        self.strategy, self.grid, self.model = strategy, prompt(grid), model
        self.every, self.last, self.config, self.timeout, self.result = every, last, config, timeout, result
        self.rows: list[dict[str, Any]] = []

    def __call__(self, version: int) -> dict[str, float]:
        if version < 1 or (version % self.every and version < self.last):
            return {}
        config = ConfigRecord(dict(self.config))  # the strategy adds server-round to what it is given
        messages = list(self.strategy.configure_evaluate(version, self.model(), config, self.grid))
        if not messages:
            return {}
        replies = list(self.grid.send_and_receive(messages, timeout=self.timeout))
        metrics = self.strategy.aggregate_evaluate(version, replies)
        if metrics is None:
            return {}
        self.result.evaluate_metrics_clientapp[version] = metrics
        out = {f"fed_{k}": float(v) for k, v in metrics.items() if isinstance(v, (int, float))}
        self.rows.append({"version": version, "clients": sum(not r.has_error() for r in replies), **out})
        return out

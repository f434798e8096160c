"""The update buffer: accepted updates summed until the next server step, then one optimizer step.

One count: the accumulator's (``SparseAccumulator.count`` and ``total_weight``). The buffer adds decoded,
judged updates as they are (``trusted``: ``fedcomp.decode`` validated them and the checks bounded the weight).

>>> buf = UpdateBuffer(spec, params, SERVER_OPTIMIZERS.build("sgd", lr=1.0), ProtocolConfig())  # doctest: +SKIP
>>> buf.add(update, weight=1.0); buf.step(); buf.count  # doctest: +SKIP
0
"""

from __future__ import annotations

import torch

from fedcomp.payload import Update
from fedcomp.protocol import ProtocolConfig
from fedcomp.server.aggregate import SparseAccumulator
from fedcomp.server.optimizers import ServerOptimizer
from fedcomp.spec import ModelSpec


class UpdateBuffer:
    """``Σ w Δ`` of the accepted updates since the last step, on ``config.aggregate_device``; ``step`` applies
    ``params -= lr * direction(Σ w Δ / Z)`` (``Z`` by ``config.normalize``) and empties it."""

    def __init__(
        self, spec: ModelSpec, params: dict[str, torch.Tensor], optimizer: ServerOptimizer, config: ProtocolConfig
    ) -> None:
        self.params, self.optimizer, self.normalize = params, optimizer, config.normalize
        self.accumulator = SparseAccumulator(spec, device=config.aggregate_device)

    @property
    def count(self) -> int:
        """Updates added since the last step (the accumulator's own count; its ``total_weight`` is their weight)."""
        return self.accumulator.count

    def add(self, update: Update, weight: float) -> None:
        self.accumulator.add(update, weight=weight, trusted=True)

    def step(self) -> None:
        if not self.count:
            raise RuntimeError("step() with an empty buffer")
        aggregate = self.accumulator.result(normalize=self.normalize)
        aggregate = {name: t.to(self.params[name].device) for name, t in aggregate.items()}
        with torch.no_grad():
            self.optimizer.step(self.params, aggregate)
        self.accumulator.reset()

"""Model, data and training: ordinary PyTorch, nothing fedcomp-specific."""

from __future__ import annotations

import torch
from sklearn.datasets import load_digits
from torch import nn

#: The run config's defaults (pyproject.toml); ``flwr.simulation.run_simulation`` hands apps an empty run config.
DEFAULTS = {"num-server-rounds": 20, "local-epochs": 1, "lr": 0.1, "compressor": "default", "density": 0.1,
            "mode": "sync", "buffer-size": 2, "max-staleness": 4}


def settings(run_config) -> dict:
    return {**DEFAULTS, **dict(run_config)}


class Net(nn.Module):
    """An MLP for 8x8 digits (85k parameters)."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 10))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x)


def load_data(partition_id: int, num_partitions: int) -> tuple[tuple[torch.Tensor, torch.Tensor], ...]:
    """This node's share of the first 1,500 images (every ``num_partitions``-th one) and the last 297 as test."""
    x, y = load_digits(return_X_y=True)
    x = torch.tensor(x / 16.0, dtype=torch.float32)
    y = torch.tensor(y, dtype=torch.long)
    train = (x[:1500][partition_id::num_partitions], y[:1500][partition_id::num_partitions])
    return train, (x[1500:], y[1500:])


def train(model: nn.Module, data: tuple[torch.Tensor, torch.Tensor], epochs: int, lr: float, seed: int) -> float:
    """``epochs`` of SGD in batches of 32; returns the mean loss."""
    x, y = data
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    gen = torch.Generator().manual_seed(seed)
    model.train()
    total, steps = 0.0, 0
    for _ in range(epochs):
        for idx in torch.randperm(len(x), generator=gen).split(32):
            opt.zero_grad()
            loss = nn.functional.cross_entropy(model(x[idx]), y[idx])
            loss.backward()
            opt.step()
            total, steps = total + loss.item(), steps + 1
    return total / max(steps, 1)


def test(model: nn.Module, data: tuple[torch.Tensor, torch.Tensor]) -> tuple[float, float]:
    """(loss, accuracy) on ``data``."""
    x, y = data
    model.eval()
    with torch.no_grad():
        out = model(x)
    return nn.functional.cross_entropy(out, y).item(), (out.argmax(1) == y).float().mean().item()

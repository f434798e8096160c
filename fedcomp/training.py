"""The product's task without Flower: its datasets and model by run config, and evaluation.

Shared by the ServerApp (held-out evaluation), the ClientApp (local data) and the simulations. ``run`` is any
object with the ``RunConfig`` attributes it reads (``dataset``, ``model``, ``seed``, ``partitioner``,
``dirichlet_alpha``).
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any

import torch
import torch.nn.functional as F

from fedcomp.data import Split, load_dataset, partition
from fedcomp.models import build_model


@lru_cache(maxsize=4)
def datasets(name: str, seed: int) -> tuple[Split, Split]:
    del seed  # the split of the shipped datasets is fixed by their own config
    return load_dataset(name)


def node_partition(run: Any, node: Any) -> Split:
    """Partition ``node.partition_id`` of ``node.num_partitions`` of the training split (iid or Dirichlet, seeded
    by the run's seed)."""
    train, _ = datasets(run.dataset, run.seed)
    opts: dict[str, Any] = {"seed": run.seed}
    if run.partitioner == "dirichlet":
        opts["alpha"] = run.dirichlet_alpha
    parts = partition(run.partitioner, train.y, node.num_partitions, **opts)
    return train.subset(parts[node.partition_id])


def make_model(run: Any, split: Split) -> torch.nn.Module:
    return build_model(run.model, in_shape=split.in_shape, num_classes=split.num_classes, seed=run.seed)


def evaluate(model: torch.nn.Module, split: Split, device: torch.device, batch: int = 512) -> dict[str, float]:
    """Accuracy (0..1) and mean cross-entropy of ``model`` on ``split``."""
    model.eval()
    correct, loss = 0, 0.0
    with torch.no_grad():
        for i in range(0, len(split), batch):
            x, y = split.x[i : i + batch].to(device), split.y[i : i + batch].to(device)
            out = model(x)
            loss += F.cross_entropy(out, y, reduction="sum").item()
            correct += int((out.argmax(1) == y).sum().item())
    n = max(len(split), 1)
    return {"accuracy": correct / n, "loss": loss / n, "num_examples": float(len(split))}

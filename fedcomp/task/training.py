"""The product's task without Flower: datasets, model and loss by run config, batches, evaluation.

Shared by the ServerApp (held-out evaluation), the ClientApp (local data and training) and the simulations.
``run`` is any object with the ``RunConfig`` attributes read here (``dataset``, ``dataset_kwargs``, ``model``,
``model_kwargs``, ``loss``, ``seed``, ``partitioner``, ``dirichlet_alpha``, ``plugins``: the
``PluginPolicy`` that says which plug-in modules may be imported). Models, datasets and losses are
built-ins or plug-ins (``fedcomp.task.plugins``): a dataset is any pair of torch ``Dataset`` of ``(input, label)``
items; batches come from a ``torch.utils.data.DataLoader`` (no worker processes; the in-memory built-in
datasets hand it whole batches by tensor indexing).

>>> train, test = datasets(RunConfig())                                   # doctest: +SKIP
>>> model = make_model(RunConfig(), train)                                # doctest: +SKIP
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from functools import lru_cache
from typing import Any

import numpy as np
import torch
from torch.overrides import TorchFunctionMode
from torch.utils.data import BatchSampler, DataLoader, Dataset, Sampler, SequentialSampler, Subset

from fedcomp.registry import ConfigError
from fedcomp.task.data import DATASETS, Split, base_name, input_values, load_dataset, partition
from fedcomp.task.models import MODELS, build_model
from fedcomp.task.plugins import GROUPS, PluginPolicy, build_loss, resolve


@lru_cache(maxsize=4)
def _load(name: str, options: tuple[tuple[str, Any], ...], policy: PluginPolicy) -> tuple[Dataset, Dataset]:
    if base_name(name) in DATASETS:
        return load_dataset(name, **dict(options))
    factory = resolve(name, DATASETS, GROUPS["dataset"], policy)
    out = factory(**dict(options))
    if not (isinstance(out, tuple) and len(out) == 2 and all(_is_dataset(d) for d in out)):
        raise ConfigError(f"dataset {name!r} must return (train, test) torch Datasets, got {type(out).__name__}")
    return out


def _is_dataset(d: Any) -> bool:
    return hasattr(d, "__getitem__") and hasattr(d, "__len__")


def datasets(run: Any) -> tuple[Dataset, Dataset]:
    """``(train, test)`` of the run's dataset (cached: every call with the same dataset and options shares them)."""
    return _load(run.dataset, tuple(sorted(run.dataset_kwargs.items())), run.plugins)


def dataset_values(run: Any) -> int:
    """The input values the run's dataset would make on a node, counted from its options before anything is loaded
    (``fedcomp.task.data.input_values``): 0 for a dataset of a fixed size and for a plug-in (code the node's
    operator allowed)."""
    if base_name(run.dataset) in DATASETS:
        return input_values(run.dataset, **run.dataset_kwargs)
    return 0


def labels(data: Dataset) -> np.ndarray:
    """The integer labels of ``data``: its ``targets`` (built-ins, torchvision), through a ``Subset``, or read
    item by item."""
    if isinstance(data, Subset):
        return labels(data.dataset)[np.asarray(data.indices, dtype=np.int64)]
    targets = getattr(data, "targets", None)
    if targets is not None:
        return np.asarray(targets).reshape(-1)
    return np.asarray([int(data[i][1]) for i in range(len(data))])


def node_partition(run: Any, node: Any) -> Dataset:
    """Partition ``node.partition_id`` of ``node.num_partitions`` of the training split (iid or Dirichlet by label,
    seeded by the run's seed)."""
    train, _ = datasets(run)
    opts: dict[str, Any] = {"seed": run.seed}
    if run.partitioner == "dirichlet":
        opts["alpha"] = run.dirichlet_alpha
    parts = partition(run.partitioner, labels(train), node.num_partitions, **opts)
    return subset(train, parts[node.partition_id])


def subset(data: Dataset, indices: Any) -> Dataset:
    """The samples of ``data`` at ``indices`` (an in-memory ``Split`` stays one)."""
    return data.subset(indices) if isinstance(data, Split) else Subset(data, [int(i) for i in indices])


def input_shape(data: Dataset) -> tuple[int, int, int]:
    """``(C, H, W)`` of the inputs (a flat feature vector of F values reads as ``(1, 1, F)``)."""
    if isinstance(data, Split):
        return data.in_shape
    shape = tuple(int(d) for d in torch.as_tensor(data[0][0]).shape)
    return (1,) * (3 - len(shape)) + shape if len(shape) < 3 else shape  # type: ignore[return-value]


def num_classes(data: Dataset) -> int:
    given = getattr(data.dataset if isinstance(data, Subset) else data, "num_classes", None)
    return int(given) if given is not None else int(labels(data).max()) + 1


def make_model(run: Any, data: Dataset) -> torch.nn.Module:
    """The run's model: a built-in for ``data``'s input shape and classes, or a plug-in factory called with
    ``model-options``; initialised from ``run.seed`` (the global RNG is left as it was)."""
    if run.model in MODELS:
        return build_model(run.model, input_shape(data), num_classes(data), seed=run.seed, **run.model_kwargs)
    factory = resolve(run.model, MODELS, GROUPS["model"], run.plugins)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(run.seed)
        model = factory(**run.model_kwargs)
    if not isinstance(model, torch.nn.Module):
        raise ConfigError(f"model {run.model!r} must return a torch.nn.Module, got {type(model).__name__}")
    return model


def parameter_count(run: Any, data: Dataset) -> int | None:
    """The parameters of the run's model for ``data``, counted on torch's meta device (no memory for their values,
    no initialisation), so a node can refuse a model too large before building it; ``None`` when the model
    cannot be built there (a plug-in that reads or computes tensor values while it builds).

    >>> from fedcomp.task.config import RunConfig
    >>> data = Split(torch.zeros(4, 1, 1, 3), torch.zeros(4, dtype=torch.int64), 2, "toy")
    >>> parameter_count(RunConfig(model="mlp", model_options="hidden=8"), data)  # 3 x 8 + 8, 8 x 2 + 2
    50
    """
    try:
        with torch.device("meta"), _SkipFills():
            model = make_model(run, data)
        return sum(p.numel() for p in model.parameters())
    except Exception:  # noqa: BLE001 - a plug-in the meta device cannot build is counted once built
        return None


class _SkipFills(TorchFunctionMode):
    """In-place ops on meta tensors (the initialisers' ``normal_``, ``uniform_``, ``zero_``, ...) return the
    tensor as it is: shapes need no values, and torch's meta ``normal_`` would import its compiler (~1 s)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name, first = getattr(func, "__name__", ""), args[0] if args else None
        if name.endswith("_") and not name.startswith("__") and isinstance(first, torch.Tensor) and first.is_meta:
            return first
        return func(*args, **(kwargs or {}))


def run_loss(run: Any) -> Any:
    """The run's loss callable (a plug-in loss only as ``run.plugins`` allows)."""
    return build_loss(run.loss, run.plugins)


def loader(
    data: Dataset, batch_size: int, generator: torch.Generator | None = None, shuffle: bool = True
) -> DataLoader:
    """One epoch of ``(inputs, labels)`` batches in a ``DataLoader`` (shuffled by ``generator``; no workers).

    An in-memory ``Split`` is indexed a batch at a time (one tensor gather, no per-sample collation)."""
    order = Shuffle(len(data), generator) if shuffle else SequentialSampler(data)
    if isinstance(data, Split):
        return DataLoader(data, sampler=BatchSampler(order, batch_size, drop_last=False), batch_size=None)
    return DataLoader(data, batch_size=batch_size, sampler=order, num_workers=0)


class Shuffle(Sampler[int]):
    """One ``torch.randperm(n, generator=generator)`` per epoch: exactly one draw from the generator per epoch
    (``RandomSampler`` makes a second, empty one), so seeded runs keep their order."""

    def __init__(self, n: int, generator: torch.Generator | None) -> None:
        self.n, self.generator = n, generator

    def __iter__(self) -> Iterator[int]:
        return iter(torch.randperm(self.n, generator=self.generator).tolist())

    def __len__(self) -> int:
        return self.n


def batches(data: Dataset, batch_size: int, generator: torch.Generator, device: torch.device) -> Iterator[Any]:
    """Endless ``(inputs, labels)`` batches on ``device``, a new shuffle each epoch."""
    while True:
        for xb, yb in loader(data, batch_size, generator):
            yield xb.to(device), yb.to(device)


def evaluate(
    model: torch.nn.Module, data: Dataset, device: torch.device, batch: int = 512, loss: Any = None
) -> dict[str, float]:
    """Mean ``loss`` (a loss name or callable; default: cross-entropy) of ``model`` on ``data``, and accuracy
    (0..1; NaN when the outputs are not class scores for integer labels)."""
    loss_fn = build_loss(loss or "cross_entropy") if loss is None or isinstance(loss, str) else loss
    model.eval()
    correct, total, seen, classes = 0, 0.0, 0, True
    with torch.no_grad():
        for x, y in loader(data, batch, shuffle=False):
            x, y = x.to(device), y.to(device)
            out = model(x)
            total += float(loss_fn(out, y)) * len(y)
            seen += len(y)
            classes = classes and out.ndim == 2 and not torch.is_floating_point(y)
            if classes:
                correct += int((out.argmax(1) == y).sum().item())
    n = max(seen, 1)
    return {"accuracy": correct / n if classes else math.nan, "loss": total / n, "num_examples": float(seen)}

"""Plug-ins: a model, a dataset or a loss named by registry name, by import path, or by installed entry point.

``resolve("mlp", MODELS, "fedcomp.models")`` returns the built-in; ``resolve("mypkg.nets:make_net", ...)`` imports
``mypkg.nets`` and returns its ``make_net``; ``resolve("mynet", ...)`` finds an entry point ``mynet`` in the group
``fedcomp.models`` of an installed distribution. Nothing is registered in fedcomp's source for a plug-in.

The contracts (README, "Bring your own model and data"):

* model factory: ``factory(**model_options) -> torch.nn.Module``;
* dataset factory: ``factory(**dataset_options) -> (train, test)``, two ``torch.utils.data.Dataset`` of
  ``(input, label)`` items (the product partitions ``train`` across clients, IID or Dirichlet by label);
* loss: any ``(output, target) -> scalar tensor`` callable.

A name that is neither registered, importable nor an entry point raises ``ConfigError`` naming what is known.

>>> resolve("cross_entropy", LOSSES, "fedcomp.losses")  # doctest: +ELLIPSIS
<class 'fedcomp.task.plugins.CrossEntropy'>
"""

from __future__ import annotations

import importlib
from importlib.metadata import entry_points
from typing import Any

import torch
from torch.nn import functional as F

from fedcomp.registry import ConfigError, Registry

#: Entry-point groups of installed plug-ins.
GROUPS = {"model": "fedcomp.models", "dataset": "fedcomp.datasets", "loss": "fedcomp.losses"}


def is_import_path(name: str) -> bool:
    return ":" in name and not name.startswith("hf:")


def resolve(name: str, registry: Registry[Any], group: str) -> Any:
    """The registered class, the ``module:attr`` object, or the entry point ``name`` of ``group``."""
    if name in registry:
        return registry.get(name)
    if is_import_path(name):
        module, _, attr = name.partition(":")
        try:
            obj: Any = importlib.import_module(module)
        except ImportError as exc:
            raise ConfigError(f"{registry.role} {name!r}: cannot import {module!r} ({exc})") from exc
        for part in attr.split("."):
            if not hasattr(obj, part):
                raise ConfigError(f"{registry.role} {name!r}: {module!r} has no attribute {attr!r}")
            obj = getattr(obj, part)
        if not callable(obj):
            raise ConfigError(f"{registry.role} {name!r} is not callable")
        return obj
    found = [ep for ep in entry_points(group=group) if ep.name == name]
    if found:
        try:
            return found[0].load()
        except Exception as exc:  # a broken plug-in is a configuration problem, said in one line
            raise ConfigError(f"{registry.role} {name!r}: entry point {found[0].value!r} fails to load: {exc}") from exc
    plugins = sorted(ep.name for ep in entry_points(group=group))
    raise ConfigError(
        f"unknown {registry.role} {name!r}; known: {', '.join(registry.names() + plugins)}, "
        f"or 'package.module:callable'"
    )


# ---------------------------------------------------------------------------------------------------- losses

LOSSES: Registry[Any] = Registry("loss")


@LOSSES.register("cross_entropy")
class CrossEntropy:
    """Mean cross-entropy of logits ``(N, C)`` against integer labels ``(N,)``."""

    def __call__(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(output, target)


@LOSSES.register("mse")
class MeanSquaredError:
    """Mean squared error (regression; targets of the output's shape)."""

    def __call__(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(output, target.to(output.dtype).reshape(output.shape))


def build_loss(name: str) -> Any:
    """A loss callable: a registered name (instantiated) or a plug-in callable (used as it is)."""
    obj = resolve(name, LOSSES, GROUPS["loss"])
    return obj() if name in LOSSES else obj

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

**A run config is data, not code.** On a client node it comes from whoever may submit a run, and Flower's FAB
signatures do not cover run-config overrides. So an import path is imported only when the ``PluginPolicy`` in
force allows its module: a node allows what its operator named (``flower-client --allow-plugin mypkg``: ``mypkg``
and its submodules); the server and one-machine simulations trust the run they were given (``TRUSTED``).
Registered names and entry points installed on the node are always allowed (installing is the operator's act).
Nothing of a module that is not allowed is imported: the check reads the name only.

>>> resolve("cross_entropy", LOSSES, "fedcomp.losses")  # doctest: +ELLIPSIS
<class 'fedcomp.task.plugins.CrossEntropy'>
"""

from __future__ import annotations

import importlib
import re
from dataclasses import dataclass
from importlib.metadata import entry_points
from typing import Any

import torch
from torch.nn import functional as F

from fedcomp.registry import ConfigError, Registry

#: Entry-point groups of installed plug-ins.
GROUPS = {"model": "fedcomp.models", "dataset": "fedcomp.datasets", "loss": "fedcomp.losses"}


#: The flag a node operator uses to allow a plug-in module (named in refusals), and the environment variable that
#: does the same for every node a process runs (``flwr run`` simulations: set it where the SuperLink starts).
ALLOW_FLAG = "flower-client --allow-plugin"
ALLOW_ENV = "FEDCOMP_ALLOW_PLUGINS"
_MODULE = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*")
_ATTR = re.compile(r"[A-Za-z]\w*(\.[A-Za-z]\w*)*")  # no private or dunder parts: no way out through __globals__


class PluginNotAllowed(ConfigError):
    """A run config named a plug-in module that this process's ``PluginPolicy`` does not allow."""


@dataclass(frozen=True)
class PluginPolicy:
    """Which modules may be imported for plug-ins named by import path: ``modules`` (each allows itself and its
    submodules), or any module with ``any_module`` (a process that trusts its run config: server, simulation).

    >>> PluginPolicy.parse("mypkg other.nets").allows("mypkg.models")
    True
    >>> PluginPolicy().allows("os"), TRUSTED.allows("os")
    (False, True)
    """

    modules: frozenset[str] = frozenset()
    any_module: bool = False

    @staticmethod
    def parse(text: str) -> PluginPolicy:
        """``"a b.c"`` (spaces or commas) -> those modules; ``"*"`` -> any module; ``""`` -> none."""
        names = frozenset(n for n in re.split(r"[\s,]+", text.strip()) if n)
        if "*" in names:
            return TRUSTED
        bad = sorted(n for n in names if not _MODULE.fullmatch(n))
        if bad:
            raise ConfigError(f"allow-plugins: not module names: {', '.join(bad)}")
        return PluginPolicy(names)

    def __or__(self, other: PluginPolicy) -> PluginPolicy:
        return PluginPolicy(self.modules | other.modules, self.any_module or other.any_module)

    def allows(self, module: str) -> bool:
        return self.any_module or any(module == m or module.startswith(m + ".") for m in self.modules)

    def to_text(self) -> str:
        return "*" if self.any_module else " ".join(sorted(self.modules))


#: A process that trusts its run config (the server runs the submitter's ServerApp anyway; a local simulation
#: runs its user's scenario).
TRUSTED = PluginPolicy(any_module=True)
#: A client node's default: registered names and installed entry points only.
NODE_DEFAULT = PluginPolicy()


def is_import_path(name: str) -> bool:
    return ":" in name and not name.startswith("hf:")


def import_module_of(name: str) -> str:
    """The module an import path ``"pkg.mod:attr"`` names (``""`` for any other name)."""
    return name.partition(":")[0] if is_import_path(name) else ""


def resolve(name: str, registry: Registry[Any], group: str, policy: PluginPolicy = NODE_DEFAULT) -> Any:
    """The registered class, the ``module:attr`` object (only a module ``policy`` allows, and only an object that
    module defines), or the entry point ``name`` of ``group``. ``PluginNotAllowed`` before any import otherwise."""
    if name in registry:
        return registry.get(name)
    if is_import_path(name):
        return _import(name, registry.role, group, policy)
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


def _import(name: str, role: str, group: str, policy: PluginPolicy) -> Any:
    module, _, attr = name.partition(":")
    if not _MODULE.fullmatch(module) or not _ATTR.fullmatch(attr):
        raise ConfigError(f"{role} {name!r}: expected 'package.module:callable' (public names only)")
    if not policy.allows(module):
        raise PluginNotAllowed(
            f"{role} {name!r}: this node does not allow the plug-in module {module!r}; its operator may allow it "
            f"with '{ALLOW_FLAG} {module}' or install it as an entry point of {group!r}"
        )
    try:
        obj: Any = importlib.import_module(module)
    except ImportError as exc:
        raise ConfigError(f"{role} {name!r}: cannot import {module!r} ({exc})") from exc
    for part in attr.split("."):
        if not hasattr(obj, part) or isinstance(getattr(obj, part), type(importlib)):
            raise ConfigError(f"{role} {name!r}: {module!r} has no attribute {attr!r} (modules are not plug-ins)")
        obj = getattr(obj, part)
    if not callable(obj):
        raise ConfigError(f"{role} {name!r} is not callable")
    defined_in = str(getattr(obj, "__module__", "") or "")
    if not policy.any_module and not policy.allows(defined_in):
        raise PluginNotAllowed(f"{role} {name!r} is defined in {defined_in or 'an unknown module'!r}, which this "
                               f"node does not allow (a plug-in must be defined in an allowed module)")
    return obj


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


def build_loss(name: str, policy: PluginPolicy = NODE_DEFAULT) -> Any:
    """A loss callable: a registered name (instantiated) or a plug-in callable (used as it is)."""
    obj = resolve(name, LOSSES, GROUPS["loss"], policy)
    return obj() if name in LOSSES else obj

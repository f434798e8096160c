"""What the product's train function keeps of a node between tasks (``Bench``), and the node's typed settings.

``clients.task`` keeps one ``Bench`` per node id as module-level state: in a warm worker (``clients.worker``)
or a simulator's process the node's data partition, test share and model are made once per run; in a cold
``flwr-clientapp`` once per task. The client session is ``compression_mod``'s (``context.state`` and the node's
``state-dir``), never the bench's.

>>> bench = Bench(); bench.use(context, torch.device("cpu"))  # doctest: +SKIP
>>> split, model = bench.training(run, node, torch.device("cpu"))  # doctest: +SKIP
"""

from __future__ import annotations

from typing import Any

import torch
from flwr.app import Context

from clients.channel import node_settings
from fedcomp.spec import ModelSpec
from fedcomp.task.config import NodeConfig, RunConfig
from fedcomp.task.training import dataset_values, make_model, node_partition, parameter_count


def load_tensors(model: torch.nn.Module, tensors: dict[str, torch.Tensor]) -> None:
    """Copy ``tensors`` (CPU, by parameter name) into ``model``'s parameters."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name in tensors:
                p.copy_(tensors[name].to(p.device))


def configs(context: Context) -> tuple[RunConfig, NodeConfig]:
    """The typed run and node config of ``context`` (the worker's keys left out of the node config). The run
    config imports only the plug-in modules the node allows (``allow-plugins``): ``PluginNotAllowed`` otherwise,
    before anything of that module is imported."""
    node = NodeConfig.from_flower(node_settings(context.node_config))
    return RunConfig.from_flower(context.run_config, plugins=node.plugins), node


class Bench:
    """A node's data, test share, model and spec, valid for one key (run id, node id, run config, node config,
    device), so a new run or other settings never reuse a wrong one."""

    def __init__(self) -> None:
        self.key: tuple | None = None
        self.split: Any = None
        self.test: Any = None
        self.model: torch.nn.Module | None = None
        self.initial: dict[str, torch.Tensor] = {}
        self.spec: ModelSpec | None = None

    def use(self, context: Context, device: torch.device) -> None:
        """Forget everything when ``context`` asks for another run, other settings or another device."""
        key = (context.run_id, context.node_id, tuple(sorted(context.run_config.items())),
               tuple(sorted(node_settings(context.node_config).items())), str(device))
        if key != self.key:
            self.__init__()  # type: ignore[misc]
            self.key = key

    def training(self, run: RunConfig, node: NodeConfig, device: torch.device) -> tuple[Any, torch.nn.Module]:
        """The node's partition and the run's model on ``device``, reset to its initial weights. ``TaskRefused``
        when the run asks more of the node than it allows (``NodeConfig.admit``): the examples per task before
        anything is loaded, the model's parameters before it is built (counted on the meta device)."""
        node.admit(run, dataset_values=dataset_values(run))
        if self.model is None:
            split = node_partition(run, node)
            counted = parameter_count(run, split)
            node.admit(run, counted or 0)
            model = make_model(run, split)
            if counted is None:  # a plug-in model the meta device cannot build: counted once built
                node.admit(run, sum(p.numel() for p in model.parameters()))
            self.split, self.model = split, model
            self.spec = ModelSpec.from_module(self.model)
            self.initial = {k: v.detach().clone() for k, v in self.model.state_dict().items()}
            self.model.to(device)
        else:
            self.model.load_state_dict(self.initial)
        return self.split, self.model

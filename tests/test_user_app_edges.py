"""A user's own Flower app through the two lines (``ClientApp(mods=[compression_mod])``, ``Compressed(FedAvg())``),
on what a model or a run may hold: a learnable scalar (a temperature, CLIP's logit scale) and one outlier round
against the server's ``max_update_norm``. In-process federation (``benchmarks.flowerkit.LocalGrid``)."""

from __future__ import annotations

import logging

import pytest
import torch
from flwr.app import ArrayRecord, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.serverapp.strategy import FedAvg

from benchmarks.flowerkit import LocalGrid, server_identity
from fedcomp.flower import Compressed, compression_mod

NODES = [100 + i for i in range(4)]


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(64, 10)
        self.temperature = torch.nn.Parameter(torch.tensor(1.0))  # 0-d


def client(step) -> ClientApp:
    """A train function that moves each parameter by ``step(node, round, name, shape)``."""
    app = ClientApp(mods=[compression_mod])

    @app.train()
    def train(msg: Message, ctx) -> Message:
        model = Net()
        model.load_state_dict(msg.content["arrays"].to_torch_state_dict())
        rnd = int(msg.content["config"]["server-round"])
        with torch.no_grad():
            for name, p in model.named_parameters():
                p.add_(step(ctx.node_id, rnd, name, p.shape))
        return Message(RecordDict({"arrays": ArrayRecord(model.state_dict()),
                                   "metrics": MetricRecord({"num-examples": 10})}), reply_to=msg)

    return app


def run(app: ClientApp, strategy, rounds: int):
    logging.getLogger("flwr").setLevel(logging.ERROR)
    grid = LocalGrid({node: (app, {}) for node in NODES})
    with server_identity():
        return strategy.start(grid, ArrayRecord(Net().state_dict()), num_rounds=rounds)


@pytest.mark.parametrize("compressor, density", [("dgc+int4", 0.1), ("dgc+int8", 0.01), ("topk", 0.1)])
def test_a_learnable_scalar_trains_under_joint_small_tensor_selection(compressor, density):
    """The small tensors share one selection, each ranked by its own scale. Divided by its own RMS, a scalar's key
    was 1 at every step and lost to any tensor with spread: it stayed at 1.0 for good while plain FedAvg took it to
    2.0. Ranked by the steps' worth of input it holds, what waits is sent."""
    def step(node, rnd, name, shape):
        g = torch.Generator().manual_seed(rnd * 10 + node)
        return torch.tensor(0.05) if name == "temperature" else 0.01 * torch.randn(shape, generator=g)

    res = run(client(step), Compressed(FedAvg(fraction_evaluate=0.0, min_available_nodes=4), compressor,
                                       density=density), rounds=20)
    temperature = float(res.arrays["temperature"].numpy())
    assert temperature > 1.5, temperature  # plain FedAvg: 2.0; waiting mass is sent late, never lost


def test_one_outlier_round_over_the_norm_bound_costs_no_node_its_later_rounds():
    """Node 101 moves 50 times further in round 2. The task carries the bound and the node sends at most that
    norm, keeping the rest in its residual: no update is rejected. (Rejected and nacked, the update went back into
    the residual and was over the bound again in every later round.)"""
    def step(node, rnd, name, shape):
        return torch.full(shape, 0.5 if (node == 101 and rnd == 2) else 0.01)

    res = run(client(step), Compressed(FedAvg(fraction_evaluate=0.0, min_available_nodes=4), "int8",
                                       max_update_norm=1.0), rounds=6)
    rounds = res.train_metrics_clientapp
    assert [(m["fedcomp-applied"], m["fedcomp-rejected"]) for m in rounds.values()] == [(4, 0)] * 6, rounds

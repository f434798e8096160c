"""The ordinary Flower app of ``benchmarks/async_app_sim.py``, in a module of its own so that Ray's worker processes
can import it: an MLP on scikit-learn's digits (1,500 training images split over ``NODES`` nodes, 297 held out),
its own train function (one epoch of SGD, momentum 0.9, batches of 32, ``lr`` from the task's config), node 0
sleeping ``slow_s`` seconds more per task. Nothing of fedcomp in it but the ``mods`` it is given.
"""

from __future__ import annotations

import time
from functools import cache

import torch
from flwr.app import ArrayRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from sklearn.datasets import load_digits
from torch import nn

NODES = 4


@cache
def digits() -> tuple[torch.Tensor, torch.Tensor]:
    x, y = load_digits(return_X_y=True)
    return torch.tensor(x / 16.0, dtype=torch.float32), torch.tensor(y, dtype=torch.long)


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))


def accuracy(arrays: ArrayRecord) -> float:
    net = model()
    net.load_state_dict(arrays.to_torch_state_dict())
    x, y = digits()
    with torch.no_grad():
        return float((net(x[1500:]).argmax(1) == y[1500:]).float().mean())


def client_app(mods: list, slow_s: float) -> ClientApp:
    """The user's ClientApp: nothing of fedcomp in it but ``mods``."""
    app = ClientApp(mods=mods)

    @app.train()
    def train(msg: Message, context: Context) -> Message:
        node = int(context.node_config["partition-id"])
        if node == 0:
            time.sleep(slow_s)
        net = model()
        net.load_state_dict(msg.content["arrays"].to_torch_state_dict())
        x, y = digits()
        x, y = x[:1500][node::NODES], y[:1500][node::NODES]
        opt = torch.optim.SGD(net.parameters(), lr=float(msg.content["config"]["lr"]), momentum=0.9)
        gen = torch.Generator().manual_seed(int(msg.content["config"]["server-round"]) * 1000 + node)
        for idx in torch.randperm(len(x), generator=gen).split(32):
            opt.zero_grad()
            nn.functional.cross_entropy(net(x[idx]), y[idx]).backward()
            opt.step()
        metrics = MetricRecord({"num-examples": len(x)})
        return Message(RecordDict({"arrays": ArrayRecord(net.state_dict()), "metrics": metrics}), reply_to=msg)

    return app

"""A small Flower app for the hostile-reply tests: a BatchNorm model (its running statistics travel dense) and a
ClientApp that trains it one SGD step under ``compression_mod``, as a Flower user's app would.

>>> reply = app(train_message, context)  # doctest: +SKIP
"""

from __future__ import annotations

import torch
from flwr.app import ArrayRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from fedcomp.flower import compression_mod


def net() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8), torch.nn.Linear(8, 2))


app = ClientApp(mods=[compression_mod])


@app.train()
def train(msg: Message, context: Context) -> Message:
    model = net()
    model.load_state_dict(msg.content["arrays"].to_torch_state_dict())
    gen = torch.Generator().manual_seed(int(context.node_id))
    x, y = torch.randn(16, 4, generator=gen), torch.randint(0, 2, (16,), generator=gen)
    loss = torch.nn.functional.cross_entropy(model(x), y)
    loss.backward()
    with torch.no_grad():
        for p in model.parameters():
            p -= 0.1 * p.grad
    metrics = MetricRecord({"num-examples": 16, "train-loss": float(loss.detach())})
    return Message(RecordDict({"arrays": ArrayRecord(model.state_dict()), "metrics": metrics}), reply_to=msg)

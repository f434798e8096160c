"""A plain Flower ClientApp with module-level state, for the warm-node tests (tests/test_warm_app.py).

Its train function answers with how many messages this module has served, the process id, the id of its model
object and what it read from the context, and counts in ``context.state`` too (Flower's per-node state). The
``fail`` config key makes it raise; ``error`` makes it reply with an error.
"""

from __future__ import annotations

import os

import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.app.error import Error
from flwr.clientapp import ClientApp

app = ClientApp()
MODEL = torch.nn.Linear(3, 2)  # made once per process: its id shows the same object served every message
CALLS = {"n": 0}
print(f"counting_app imported in pid {os.getpid()}", flush=True)


@app.train()
def train(msg: Message, context: Context) -> Message:
    config = msg.content.config_records["config"]
    if config.get("fail"):
        raise ValueError("asked to fail")
    if config.get("error"):
        return Message(Error(7, "asked for an error reply"), reply_to=msg)
    CALLS["n"] += 1
    seen = int(context.state.config_records["counter"]["n"]) if "counter" in context.state else 0
    context.state["counter"] = ConfigRecord({"n": seen + 1})
    with torch.no_grad():
        MODEL.weight.add_(1.0)  # training moves the kept model
    metrics = MetricRecord({"calls": CALLS["n"], "state-count": seen + 1, "pid": os.getpid(), "model-id": id(MODEL),
                            "partition": int(context.node_config["partition-id"]),
                            "weight": float(MODEL.weight[0, 0]), "x2": 2.0 * float(config["x"])})
    reply = RecordDict({"metrics": metrics, "arrays": ArrayRecord(MODEL.state_dict()),
                        "echo": ConfigRecord({"greeting": str(context.run_config["greeting"]),
                                              "type": msg.metadata.message_type})})
    return Message(reply, reply_to=msg)

"""A plain Flower ClientApp with module-level state, for the warm-node tests (tests/test_warm_app.py).

Its train function answers with how many messages this module has served, the process id, the id of its model
object and what it read from the context, and counts in ``context.state`` too (Flower's per-node state). The
``fail`` config key makes it raise; ``error`` makes it reply with an error. Its ServerApp sends ``rounds``
train messages to the first node, one after another, and writes their metrics as JSON to ``out``.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.app.error import Error
from flwr.clientapp import ClientApp
from flwr.serverapp import Grid, ServerApp

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


server = ServerApp()


@server.main()
def main(grid: Grid, context: Context) -> None:
    end = time.monotonic() + 300
    while not list(grid.get_node_ids()) and time.monotonic() < end:
        time.sleep(0.2)
    node = sorted(grid.get_node_ids())[0]
    rows = []
    for i in range(int(context.run_config["rounds"])):
        msg = Message(RecordDict({"config": ConfigRecord({"x": float(i)})}), dst_node_id=node, message_type="train")
        (reply,) = grid.send_and_receive([msg])
        rows.append(dict(reply.content.metric_records["metrics"]) if reply.has_content() else {"error": 1})
    Path(str(context.run_config["out"])).write_text(json.dumps(rows))

"""The ClientApp: Flower's usual train/evaluate functions. fedcomp adds one mod."""

from __future__ import annotations

from flwr.app import ArrayRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from digits_app.task import Net, load_data, settings, test
from digits_app.task import train as train_model
from fedcomp.flower import compression_mod

app = ClientApp(mods=[compression_mod])  # the plain app: ClientApp()


@app.train()
def train(msg: Message, context: Context) -> Message:
    model = Net()
    model.load_state_dict(msg.content["arrays"].to_torch_state_dict())
    data, _ = load_data(int(context.node_config["partition-id"]), int(context.node_config["num-partitions"]))
    seed = int(msg.content["config"]["server-round"]) * 1000 + int(context.node_config["partition-id"])
    cfg = settings(context.run_config)
    loss = train_model(model, data, int(cfg["local-epochs"]), float(cfg["lr"]), seed)
    metrics = MetricRecord({"train-loss": loss, "num-examples": len(data[0])})
    return Message(RecordDict({"arrays": ArrayRecord(model.state_dict()), "metrics": metrics}), reply_to=msg)


@app.evaluate()
def evaluate(msg: Message, context: Context) -> Message:
    model = Net()
    model.load_state_dict(msg.content["arrays"].to_torch_state_dict())
    _, data = load_data(int(context.node_config["partition-id"]), int(context.node_config["num-partitions"]))
    loss, acc = test(model, data)
    metrics = MetricRecord({"eval-loss": loss, "eval-acc": acc, "num-examples": len(data[0])})
    return Message(RecordDict({"metrics": metrics}), reply_to=msg)

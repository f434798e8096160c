"""The fedcomp Flower ``ClientApp``.

Per ``train`` message: apply the server's acks/nacks to the error-feedback pipeline (a nack restores that
update into the residual), load the global model from the task's blob, train (``local-mode``), compress and
encode the pseudo-gradient, and reply with one blob, one small ConfigRecord and one MetricRecord. Pipeline
state (residual, momentum, RNG, sequence numbers, pending updates) lives in ``context.state`` between tasks.
Node settings come from ``context.node_config``: ``partition-id``, ``num-partitions``, ``gpu``,
``device-class``. ``gpu=true`` without CUDA raises ``GpuUnavailableError`` (the server sees the error reply).
"""

from __future__ import annotations

import time

import torch
from flwr.app import Array, ArrayRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from clients import records
from clients.config import NodeConfig, RunConfig
from clients.train import LOCAL_TRAINERS, ClientState, datasets, evaluate, make_model, node_partition, select_device
from fedcomp.protocol import ReplyMeta
from fedcomp.spec import ModelSpec
from fedcomp.wire import decode

STATE_KEY = "fedcomp"
STATE_STYPE = "fedcomp/client-state"

app = ClientApp()


def load_state(context: Context, run: RunConfig, spec: ModelSpec) -> ClientState:
    rec = context.state.array_records.get(STATE_KEY)
    if rec is None or "state" not in rec:
        return ClientState.fresh(run, spec)
    return ClientState.from_bytes(bytes(rec["state"].data), run, spec)


def save_state(context: Context, state: ClientState) -> None:
    data = state.to_bytes()
    context.state[STATE_KEY] = ArrayRecord(
        {"state": Array(dtype="uint8", shape=(len(data),), stype=STATE_STYPE, data=data)}
    )


def load_global(model: torch.nn.Module, spec: ModelSpec, blob: bytes) -> int:
    """Copy the downlink model into ``model``; returns its version."""
    update = decode(blob, spec)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name in update.tensors:
                p.copy_(update.tensors[name].to_dense().to(p.device))
    return update.base_version


@app.train()
def train(msg: Message, context: Context) -> Message:
    t0 = time.perf_counter()
    run = RunConfig.from_flower(context.run_config)
    node = NodeConfig.from_flower(context.node_config)
    device = select_device(node)
    task = records.read_task(msg.content)
    split = node_partition(run, node)
    model = make_model(run, split)
    spec = ModelSpec.from_module(model)
    state = load_state(context, run, spec)
    applied = state.side.apply(task.resolutions)
    version = load_global(model, spec, task.model)
    if version != task.base_version:
        raise records.RecordError(f"model blob is version {version}, task says {task.base_version}")
    model.to(device)
    generator = torch.Generator().manual_seed(run.seed * 1_000_003 + node.partition_id * 7919 + task.task_id)
    result = LOCAL_TRAINERS.get(run.local_mode)()(model, split, run, device, generator)
    state.steps_done += run.local_steps
    state.pipeline.set_epoch(state.steps_done * run.batch_size / max(len(split), 1))
    blob = state.pipeline.send(result.pseudo_grad, base_version=task.base_version, client_id=context.node_id)
    seq = state.pipeline.last_seq
    state.side.sent(task.task_id, seq)
    save_state(context, state)
    metrics = {
        "train-loss": result.loss,
        "train-seconds": time.perf_counter() - t0,
        "payload-bytes": float(len(blob)),
        "dense-bytes": float(spec.dense_bytes),
        "pending": float(len(state.pipeline.pending)),
        "acked": float(applied.get("applied", 0)),
        "nacked": float(sum(v for k, v in applied.items() if k != "applied")),
        "gpu": float(device.type == "cuda"),
    }
    meta = ReplyMeta(task.task_id, seq, result.num_examples, state.incarnation)
    return Message(records.reply_content(blob, meta, metrics), reply_to=msg)


@app.evaluate()
def evaluate_model(msg: Message, context: Context) -> Message:
    """Federated evaluation of the task's model on this node's share of the test split."""
    run = RunConfig.from_flower(context.run_config)
    node = NodeConfig.from_flower(context.node_config)
    device = select_device(node)
    _, test = datasets(run.dataset, run.seed)
    n = node.num_partitions
    local = test.subset(list(range(node.partition_id, len(test), n)))
    model = make_model(run, local)
    load_global(model, ModelSpec.from_module(model), records.read_blob(msg.content, "model"))
    res = evaluate(model.to(device), local, device)
    return Message(RecordDict({"metrics": MetricRecord(res)}), reply_to=msg)

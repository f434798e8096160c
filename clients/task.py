"""The product's ClientApp on the public path: its train function under ``compression_mod``.

A train message goes strategy (``Compressed``) -> ``compression_mod`` (acks/nacks, the session, the downlink,
the node's ``state-dir``) -> ``train`` here (local training on the node's partition) -> ``compression_mod``
(compress with error feedback, the reply) -> the server: the same path as any Flower user's app. The train
function hands the pseudo-gradient to the mod as torch tensors on the training device (``hand_update``), so a
GPU node compresses it with the fused kernels without a copy through an ArrayRecord. Served warm, by the
node's worker (``clients.forward``, ``clients.host``), the node's data partition and model (a
``clients.bench.Bench``, one per node id) live across tasks as module-level state.

Node settings: ``clients.bench.configs`` (``partition-id``, ``num-partitions``, ``gpu``, ``allow-plugins``, ...); run
settings: the product's run config (model, dataset, local steps, ...). The model arrives as an ArrayRecord (the
model's parameters and buffers by name): the strategy's, or the one ``compression_mod`` rebuilt from the
downlink blob of the product's loops. The batches are seeded with the run's seed, the node's partition and
fedcomp's task id (``compression_mod.current_task``), so a simulation is reproducible whichever server runs it.

>>> reply = app(train_message, context)  # doctest: +SKIP
"""

from __future__ import annotations

import zlib

import torch
from flwr.app import ArrayRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from clients.bench import Bench, configs, load_tensors
from clients.trainer import LOCAL_TRAINERS, select_device
from fedcomp.flower.mod import compression_mod, current_task, hand_update
from fedcomp.flower.records import CONFIG, SERVER_ROUND
from fedcomp.task.config import NodeConfig, RunConfig
from fedcomp.task.training import datasets, evaluate, run_loss, subset

app = ClientApp(mods=[compression_mod])
BENCHES: dict[int, Bench] = {}  # node id -> what the node keeps between tasks (in a warm worker: for the run)


def _model_arrays(msg: Message) -> ArrayRecord:
    arrays = list(msg.content.array_records.values())
    if len(arrays) != 1:
        raise ValueError(f"a task carries one ArrayRecord (the model), this one {len(arrays)}")
    return arrays[0]


def _load(model: torch.nn.Module, arrays: ArrayRecord) -> None:
    """The task's model into ``model``: parameters by name, and the buffers (running statistics) it carries."""
    state = {k: torch.from_numpy(arrays[k].numpy().copy()) for k in arrays}
    load_tensors(model, state)
    with torch.no_grad():
        for name, buf in model.named_buffers():
            if name in state:
                buf.copy_(state[name].to(buf.device, buf.dtype))


def _task_seed(msg: Message) -> int:
    """The task's share of the batch seed: fedcomp's task id (``current_task``: unique per task of a server run,
    whichever server sends it), else the message's group and round (a message without fedcomp's record)."""
    task = current_task()
    if task is not None:
        return task.task_id
    config = msg.content.config_records.get(CONFIG) or next(iter(msg.content.config_records.values()), {})
    return zlib.crc32(f"{msg.metadata.group_id}/{config.get(SERVER_ROUND, 0)}".encode())


def _node(context: Context) -> tuple[RunConfig, NodeConfig, torch.device, Bench]:
    """The run and node settings, the training device and the node's kept ``Bench`` (reset for another run)."""
    run, node = configs(context)
    device = select_device(node)
    bench = BENCHES.setdefault(context.node_id, Bench())
    bench.use(context, device)
    return run, node, device, bench


@app.train()
def train(msg: Message, context: Context) -> Message:
    """Local training (``local-mode``) from the task's model; the pseudo-gradient goes to the mod as it is."""
    run, node, device, bench = _node(context)
    split, model = bench.training(run, node, device)
    _load(model, _model_arrays(msg))
    task = _task_seed(msg)
    generator = torch.Generator().manual_seed(run.seed * 1_000_003 + node.partition_id * 7919 + task)
    result = LOCAL_TRAINERS.get(run.local_mode)()(model, split, run, device, generator)
    hand_update(result.pseudo_grad, steps=run.local_steps,
                steps_per_epoch=max(len(split), 1) / run.batch_size)
    metrics = {"num-examples": result.num_examples, "train-loss": result.loss,
               "gpu": float(device.type == "cuda")}  # no wall times: compression_mod reports the task's seconds
    return Message(RecordDict({"metrics": MetricRecord(metrics)}), reply_to=msg)


@app.evaluate()
def evaluate_model(msg: Message, context: Context) -> Message:
    """The task's model on this node's share of the test split."""
    run, node, device, bench = _node(context)
    split, model = bench.training(run, node, device)  # first: what the node allows is checked before any load
    if bench.test is None:
        _, test = datasets(run)
        bench.test = subset(test, range(node.partition_id, len(test), node.num_partitions))
    _load(model, _model_arrays(msg))
    res = evaluate(model, bench.test, device, loss=run_loss(run))
    return Message(RecordDict({"metrics": MetricRecord({**res, "num-examples": len(bench.test)})}), reply_to=msg)

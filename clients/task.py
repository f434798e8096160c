"""The product's ClientApp on the public path: its train function under ``compression_mod``.

A train message goes strategy (``Compressed``) -> ``compression_mod`` (acks/nacks, the session, the downlink,
the node's ``state-dir``) -> ``train`` here (local training on the node's partition) -> ``compression_mod``
(compress with error feedback, the reply) -> the server: the same path as any Flower user's app. The train
function hands the pseudo-gradient to the mod as torch tensors on the training device (``hand_update``), so a
GPU node compresses it with the fused kernels without a copy through an ArrayRecord. Served warm, by the
node's worker (``clients.forward``, ``clients.host``), the node's data partition and model (a
``clients.work.Bench``, one per node id) live across tasks as module-level state.

Node settings: ``clients.work``'s (``partition-id``, ``num-partitions``, ``gpu``, ``allow-plugins``, ...); run
settings: the product's run config (model, dataset, local steps, ...). The model arrives as the strategy's
ArrayRecord (the model's parameters and buffers by name).

>>> reply = app(train_message, context)  # doctest: +SKIP
"""

from __future__ import annotations

import time
import zlib

import torch
from flwr.app import ArrayRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from clients.trainer import LOCAL_TRAINERS, select_device
from clients.work import Bench, configs, load_tensors
from fedcomp.flower.mod import compression_mod, hand_update
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


@app.train()
def train(msg: Message, context: Context) -> Message:
    """Local training (``local-mode``) from the task's model; the pseudo-gradient goes to the mod as it is."""
    t0 = time.perf_counter()
    run, node = configs(context)
    device = select_device(node)
    bench = BENCHES.setdefault(context.node_id, Bench())
    bench.use(context, device)
    split, model = bench.training(run, node, device)
    _load(model, _model_arrays(msg))
    config = next(iter(msg.content.config_records.values()), {})
    task = zlib.crc32(f"{msg.metadata.group_id}/{config.get('server-round', 0)}".encode())
    generator = torch.Generator().manual_seed(run.seed * 1_000_003 + node.partition_id * 7919 + task)
    result = LOCAL_TRAINERS.get(run.local_mode)()(model, split, run, device, generator)
    hand_update(result.pseudo_grad, steps=run.local_steps,
                steps_per_epoch=max(len(split), 1) / run.batch_size)
    metrics = {"num-examples": result.num_examples, "train-loss": result.loss,
               "train-seconds": time.perf_counter() - t0, "gpu": float(device.type == "cuda")}
    return Message(RecordDict({"metrics": MetricRecord(metrics)}), reply_to=msg)


@app.evaluate()
def evaluate_model(msg: Message, context: Context) -> Message:
    """The task's model on this node's share of the test split."""
    run, node = configs(context)
    device = select_device(node)
    bench = BENCHES.setdefault(context.node_id, Bench())
    bench.use(context, device)
    if bench.test is None:
        _, test = datasets(run)
        bench.test = subset(test, range(node.partition_id, len(test), node.num_partitions))
    split, model = bench.training(run, node, device)
    _load(model, _model_arrays(msg))
    res = evaluate(model, bench.test, device, loss=run_loss(run))
    return Message(RecordDict({"metrics": MetricRecord({**res, "num-examples": len(bench.test)})}), reply_to=msg)

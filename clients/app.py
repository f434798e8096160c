"""The fedcomp Flower ``ClientApp``.

Per ``train`` message it follows the ``fedcomp.flower.ClientSession`` contract (the same session
``compression_mod`` uses): apply the server's acks/nacks (a nack restores that update into the residual), load
the global model from the task's blob, train (``local-mode``), compress and encode the pseudo-gradient, and
reply with one blob, one small ConfigRecord and one MetricRecord. The session (residual, momentum, RNG,
sequence numbers, pending updates) lives in ``context.state`` between tasks. Unlike the mod, the pseudo-gradient
goes from the trainer to the pipeline as torch tensors on the training device (a GPU node compresses it with
the fused kernels without a copy to the CPU).
Node settings come from ``context.node_config``: ``partition-id``, ``num-partitions``, ``gpu``,
``device-class``, ``state-dir``, ``kernels``. ``gpu=true`` without CUDA raises ``GpuUnavailableError`` (the server
sees the error reply). With ``gpu=true`` the model, the pseudo-gradient and the error-feedback state stay on the
GPU, so the send step takes the fused Triton kernels (``kernels=auto``; ``torch`` forces the reference steps,
``triton`` the kernels); the saved state goes through the CPU.

With ``state-dir`` the state is also written there (``client-state.pt``, atomically, before the reply leaves)
and a run that starts with an empty ``context.state`` (a resumed server submits a new run) continues from it:
a server restart then loses no residual. A task marked ``resync`` (the first after a server restart) makes the
client nack every update still pending once the task's acks/nacks are applied.
"""

from __future__ import annotations

import time

import torch
from flwr.app import Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from clients.trainer import LOCAL_TRAINERS, select_device
from fedcomp.flower import records
from fedcomp.flower.config import NodeConfig, RunConfig
from fedcomp.flower.session import ClientSession
from fedcomp.spec import ModelSpec
from fedcomp.task.training import datasets, evaluate, make_model, node_partition, subset
from fedcomp.wire import decode

app = ClientApp()


def load_tensors(model: torch.nn.Module, tensors: dict[str, torch.Tensor]) -> None:
    """Copy ``tensors`` (CPU, by parameter name) into ``model``'s parameters."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name in tensors:
                p.copy_(tensors[name].to(p.device))


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
    session = ClientSession.load(
        context, run.compression, spec, node.state_dir, device=device, backend=node.kernel_backend
    )
    applied = session.resolve(task.resolutions, task.resync)
    replica = session.receive_model(context, spec, task.model)
    if replica.version != task.base_version:
        raise records.RecordError(f"model blob is version {replica.version}, task says {task.base_version}")
    load_tensors(model, replica.tensors)
    model.to(device)
    generator = torch.Generator().manual_seed(run.seed * 1_000_003 + node.partition_id * 7919 + task.task_id)
    result = LOCAL_TRAINERS.get(run.local_mode)()(model, split, run, device, generator)
    session.steps_done += run.local_steps
    session.pipeline.set_epoch(session.steps_done * run.batch_size / max(len(split), 1))
    if task.density:  # the server's choice for this task (density="auto", fedcomp.server.linkaware)
        session.pipeline.compressor.set_density(task.density)
    blob, seq = session.send(task.task_id, result.pseudo_grad, task.base_version, context.node_id)
    session.save(context, node.state_dir)
    metrics = {
        "train-loss": result.loss,
        "train-seconds": time.perf_counter() - t0,
        "payload-bytes": float(len(blob)),
        "dense-bytes": float(spec.dense_bytes),
        "pending": float(len(session.pipeline.pending)),
        "acked": float(applied.get("applied", 0)),
        "nacked": float(sum(v for k, v in applied.items() if k != "applied")),
        "resynced": float(task.resync),
        "gpu": float(device.type == "cuda"),
    }
    meta = session.reply_meta(task.task_id, seq, result.num_examples)  # incarnation + other pending tasks
    return Message(records.reply_content(blob, meta, metrics), reply_to=msg)


@app.evaluate()
def evaluate_model(msg: Message, context: Context) -> Message:
    """Federated evaluation of the task's model on this node's share of the test split."""
    run = RunConfig.from_flower(context.run_config)
    node = NodeConfig.from_flower(context.node_config)
    device = select_device(node)
    _, test = datasets(run)
    n = node.num_partitions
    local = subset(test, range(node.partition_id, len(test), n))
    model = make_model(run, local)
    load_tensors(model, decode(records.read_blob(msg.content, "model"), ModelSpec.from_module(model)).to_dense())
    res = evaluate(model.to(device), local, device, loss=run.loss)
    return Message(RecordDict({"metrics": MetricRecord(res)}), reply_to=msg)

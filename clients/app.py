"""The fedcomp Flower ``ClientApp``.

Per ``train`` message: apply the server's acks/nacks to the error-feedback pipeline (a nack restores that
update into the residual), load the global model from the task's blob, train (``local-mode``), compress and
encode the pseudo-gradient, and reply with one blob, one small ConfigRecord and one MetricRecord. Pipeline
state (residual, momentum, RNG, sequence numbers, pending updates) lives in ``context.state`` between tasks.
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

import os
import time
from pathlib import Path

import torch
from flwr.app import Array, ArrayRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from clients import records
from clients.config import NodeConfig, RunConfig
from clients.train import LOCAL_TRAINERS, ClientState, datasets, evaluate, make_model, node_partition, select_device
from fedcomp.downlink import Replica, receive
from fedcomp.protocol import ReplyMeta
from fedcomp.spec import ModelSpec
from fedcomp.wire import decode

STATE_KEY = "fedcomp"
STATE_STYPE = "fedcomp/client-state"
STATE_FILE = "client-state.pt"

app = ClientApp()


def load_state(
    context: Context,
    run: RunConfig,
    spec: ModelSpec,
    state_dir: str = "",
    *,
    device: torch.device | str = "cpu",
    backend: str | None = None,
) -> ClientState:
    """The node's state: ``context.state``, else ``state_dir/client-state.pt``, else a fresh one; its
    error-feedback memory on ``device``, its pipeline sending with kernel ``backend``."""
    rec = context.state.array_records.get(STATE_KEY)
    if rec is not None and "state" in rec:
        return ClientState.from_bytes(bytes(rec["state"].data), run, spec, device=device, backend=backend)
    path = Path(state_dir) / STATE_FILE if state_dir else None
    if path is not None and path.exists():
        return ClientState.from_bytes(path.read_bytes(), run, spec, device=device, backend=backend)
    return ClientState.fresh(run, spec, device=device, backend=backend)


def save_state(context: Context, state: ClientState, state_dir: str = "") -> None:
    data = state.to_bytes()
    context.state[STATE_KEY] = ArrayRecord(
        {"state": Array(dtype="uint8", shape=(len(data),), stype=STATE_STYPE, data=data)}
    )
    if state_dir:
        folder = Path(state_dir)
        folder.mkdir(parents=True, exist_ok=True)
        tmp = folder / (STATE_FILE + ".tmp")
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, folder / STATE_FILE)


def load_global(model: torch.nn.Module, spec: ModelSpec, blob: bytes) -> int:
    """Copy the downlink model into ``model``; returns its version."""
    update = decode(blob, spec)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name in update.tensors:
                p.copy_(update.tensors[name].to_dense().to(p.device))
    return update.base_version


REPLICA_KEY = "fedcomp-replica"
REPLICA_STYPE = "fedcomp/replica"


def load_replica(context: Context, run: RunConfig, model: torch.nn.Module, spec: ModelSpec, blob: bytes) -> int:
    """Apply the task's downlink message to the node's replica of the public model (``fedcomp.downlink``), keep
    the replica in ``context.state`` and copy it into ``model``; returns its version.

    The replica is verified against the server's fingerprint: a message that does not fit it raises
    ``DownlinkError`` (the server's next task then carries a full copy), never a training on a wrong model.
    """
    rec = context.state.array_records.get(REPLICA_KEY)
    held = Replica.from_bytes(bytes(rec["replica"].data), spec) if rec is not None and "replica" in rec else None
    replica = receive(blob, spec, held)
    if run.downlink != "dense":
        data = replica.to_bytes(spec)
        arr = Array(dtype="uint8", shape=(len(data),), stype=REPLICA_STYPE, data=data)
        context.state[REPLICA_KEY] = ArrayRecord({"replica": arr})
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name in replica.tensors:
                p.copy_(replica.tensors[name].to(p.device))
    return replica.version


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
    state = load_state(context, run, spec, node.state_dir, device=device, backend=node.kernel_backend)
    applied = state.side.apply(task.resolutions)
    if task.resync:
        applied["resync"] = state.side.resync()
    version = load_replica(context, run, model, spec, task.model)
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
    save_state(context, state, node.state_dir)
    metrics = {
        "train-loss": result.loss,
        "train-seconds": time.perf_counter() - t0,
        "payload-bytes": float(len(blob)),
        "dense-bytes": float(spec.dense_bytes),
        "pending": float(len(state.pipeline.pending)),
        "acked": float(applied.get("applied", 0)),
        "nacked": float(sum(v for k, v in applied.items() if k != "applied")),
        "resynced": float(task.resync),
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

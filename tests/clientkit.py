"""A client driven through the real ``ClientApp``, for the device-path tests (tests/test_client_device.py on the
CPU under Triton's interpreter, tests/test_client_cuda.py on a GPU with the real kernels).

Importing this module sets nothing: whether ``kernels=triton`` runs the interpreter or the compiled kernels is
the importing test module's choice (``TRITON_INTERPRET`` before triton's first import).
"""

from __future__ import annotations

import importlib.util
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from flwr.app import Context, Message, Metadata, RecordDict

from clients.app import app
from fedcomp.flower import records
from fedcomp.flower.session import ClientSession
from fedcomp.kernels.hooks import FusedBatch
from fedcomp.protocol import Outcome, Resolution, Task
from fedcomp.server.loops import encode_model
from fedcomp.spec import ModelSpec
from fedcomp.task.config import NodeConfig, RunConfig
from fedcomp.task.training import make_model, node_partition
from fedcomp.wire import decode

NODE_ID = 17
RUNS = {  # small model, few local steps: the interpreter runs every Triton program in numpy
    "dgc-delta": {"compressor": "dgc", "memory": "residual", "local-mode": "delta"},
    "dgc+int8-gradient": {
        "compressor": "dgc+int8",
        "memory": "dgc",
        "local-mode": "gradient",
        "compressor-options": "density=0.05 stochastic=false",
    },
}
BASE = {"model": "mlp", "dataset": "digits", "local-steps": 2, "batch-size": 32, "compressor-options": "density=0.05"}


def kernel_tensors(run_config: dict, spec: ModelSpec) -> int:
    """Tensors the send step hands to the fused steps (``FusedBatch.add``): all but the small-tensor group
    (``Pipeline.grouped``), which takes the reference selection on every device."""
    compression = RunConfig.from_flower(run_config).compression
    return len(spec.names) - len(ClientSession.fresh(compression, spec).pipeline.grouped)


def tensors_of(obj) -> list[torch.Tensor]:
    """Every tensor in nested dicts / lists (a state dict), in order."""
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, dict):
        return [t for v in obj.values() for t in tensors_of(v)]
    if isinstance(obj, (list, tuple)):
        return [t for v in obj for t in tensors_of(v)]
    return []


def spec_and_model(run: RunConfig) -> tuple[ModelSpec, torch.nn.Module]:
    model = make_model(run, node_partition(run, NodeConfig()))
    return ModelSpec.from_module(model), model


def train_message(
    task_id: int, resolutions: list[Resolution], model_blob: bytes, run: RunConfig, spec: ModelSpec, run_key: int = 0
) -> Message:
    """The product loops' train message of task ``task_id`` (``records.TaskFormat``: the model as ``model_blob``)."""
    tasks = records.TaskFormat(run.compression.to_flat(), records.ArrayLayout.of_spec(spec))
    task = Task(task_id, NODE_ID, 0, 0.0, 60.0, resolutions=resolutions, run_key=run_key)
    meta = Metadata(
        run_id=1,
        message_id=f"task-{task_id}",
        src_node_id=1,
        dst_node_id=NODE_ID,
        reply_to_message_id="",
        group_id="0",
        created_at=time.time(),
        ttl=60.0,
        message_type=records.TRAIN,
    )
    return Message(content=tasks.content(task, model_blob), metadata=meta)


@dataclass
class Driven:
    blobs: list[bytes]  # the reply blobs
    states: list[dict]  # the memory's state_dict after each task (loaded from context.state)
    fused: int = 0  # tensors sent by a kernel
    devices: set[str] = field(default_factory=set)  # devices of the tensors the send step got


def drive(run_config: dict, node: dict, monkeypatch) -> Driven:
    """Three train tasks through the real ClientApp (task 2 nacks task 1's update: the restore path, task 3 acks
    task 2's)."""
    out = Driven([], [])
    real = FusedBatch.add

    def counting(self, name, tensor):
        fused = real(self, name, tensor)
        out.fused += fused
        out.devices.add(tensor.device.type)
        return fused

    run = RunConfig.from_flower(run_config)
    spec, model = spec_and_model(run)
    model_blob = encode_model(dict(model.named_parameters()), spec, 0)
    ctx = Context(1, NODE_ID, {"partition-id": 0, "num-partitions": 2, **node}, RecordDict(), dict(run_config))
    resolutions = [[], [Resolution(1, 1, Outcome.LOST)], [Resolution(2, 2, Outcome.APPLIED)]]
    for task_id, res in enumerate(resolutions, start=1):
        with monkeypatch.context() as m:
            m.setattr(FusedBatch, "add", counting)
            reply = app(train_message(task_id, res, model_blob, run, spec), ctx)
        assert reply.has_content(), reply.error
        blob, meta = records.read_mod_reply(reply.content)
        assert meta.seq == task_id and meta.pending == ()  # task 1 nacked at task 2, task 2 acked at task 3
        out.blobs.append(blob)
        out.states.append(ClientSession.load(ctx, run.compression, spec).pipeline.memory.state_dict())
    return out




def assert_same_updates(ref: Driven, got: Driven, spec: ModelSpec, memory: str) -> None:
    """Same indices, values within rtol 1e-6, identical memory state after every task."""
    for ref_blob, got_blob in zip(ref.blobs, got.blobs, strict=True):
        a_update, b_update = decode(ref_blob, spec), decode(got_blob, spec)
        for n in spec.names:
            a, b = a_update.tensors[n], b_update.tensors[n]
            assert (a.indices is None) == (b.indices is None), n
            if a.indices is not None:
                assert torch.equal(a.indices, b.indices), n
            assert a.values.coding == b.values.coding, n
            torch.testing.assert_close(b.values.dequantize(), a.values.dequantize(), rtol=1e-6, atol=0)
    for ref_state, got_state in zip(ref.states, got.states, strict=True):
        ref_t, got_t = tensors_of(ref_state), tensors_of(got_state)
        assert len(ref_t) == len(got_t) == len(spec.names) * (2 if memory == "dgc" else 1)
        assert all(torch.equal(a, b) for a, b in zip(ref_t, got_t, strict=True))


def benchmark_module(name: str):
    """``benchmarks/NAME.py`` loaded as module ``NAME`` (the scripts are not a package's modules)."""
    path = Path(__file__).resolve().parents[1] / "benchmarks" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def run_beside_a_hostile_node(tmp_path: Path, hostile, mode: str = "async") -> tuple[dict, list[dict]]:
    """A product run of 3 versions on the in-process grid, async (K = 2) or sync (every node each round): node 11
    is ``hostile(msg, context)`` (a ClientApp callable), nodes 12 and 13 the product's ClientApp. Returns
    ``summary.json`` and the ``metrics.jsonl`` rows of ``tmp_path / "out"``."""
    import json

    from benchmarks.flowerkit import LocalGrid, server_identity
    from server_app.app import main

    run_config = {"num-versions": 3, "mode": mode, "buffer-size": 2, "concurrency": 3, "task-timeout": 60.0,
                  "round-timeout": 60.0, "min-clients": 3, "poll-interval": 0.05, "node-wait": 60.0,
                  "out-dir": str(tmp_path / "out")}
    apps = {11: (hostile, {"partition-id": 0, "num-partitions": 3}),
            **{12 + i: (app, {"partition-id": 1 + i, "num-partitions": 3}) for i in range(2)}}
    with server_identity():
        main(LocalGrid(apps, run_config), Context(1, 0, {}, RecordDict(), dict(run_config)))
    out = tmp_path / "out"
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return json.loads((out / "summary.json").read_text()), rows

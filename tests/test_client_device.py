"""The client's device path: the pseudo-gradient and the error-feedback state stay on the training device, the
send step takes the kernel backend the node config asks for (``kernels``), and saved state goes through the CPU.

``TRITON_INTERPRET=1`` is set at import, before anything imports triton, so ``kernels=triton`` runs the real
Triton kernels on the CPU (as tests/test_kernels.py does). The ``meta`` device stands in for "another device"
where a test only needs to see where tensors end up; the CUDA tests are in tests/test_client_cuda.py.

The bitwise state comparisons need an interpreter that rounds ``tl.fma`` once, as the GPU does: Triton 3.9's
(constraints.txt) does; 3.6's multiplies and then adds, and the DGC momentum then differs in the last bit from
the second task on.
"""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402

triton = pytest.importorskip("triton", reason="triton not installed")

from clients.launcher import node_config, parser  # noqa: E402
from clients.trainer import LOCAL_TRAINERS  # noqa: E402
from fedcomp import tensortree  # noqa: E402
from fedcomp.client.pipeline import Pipeline, build  # noqa: E402
from fedcomp.flower.session import ClientSession  # noqa: E402
from fedcomp.kernels.hooks import FusedBatch  # noqa: E402
from fedcomp.memory.dgc import DGCMemory  # noqa: E402
from fedcomp.memory.residual import NoMemory, ResidualMemory  # noqa: E402
from fedcomp.registry import ConfigError  # noqa: E402
from fedcomp.spec import ModelSpec  # noqa: E402
from fedcomp.task.config import NodeConfig, RunConfig  # noqa: E402
from fedcomp.task.training import make_model, node_partition  # noqa: E402
from tests.clientkit import (  # noqa: E402
    BASE,
    RUNS,
    assert_same_updates,
    drive,
    kernel_tensors,
    spec_and_model,
    tensors_of,
)


@pytest.mark.parametrize("name", list(RUNS))
def test_triton_client_sends_what_the_torch_client_sends(name, monkeypatch):
    run_config = {**BASE, **RUNS[name]}
    spec, _ = spec_and_model(RunConfig.from_flower(run_config))
    ref = drive(run_config, {"kernels": "torch"}, monkeypatch)
    got = drive(run_config, {"kernels": "triton"}, monkeypatch)
    # the kernels ran for every tensor outside the small-tensor group, in every task
    assert ref.fused == 0 and got.fused == 3 * kernel_tensors(run_config, spec) > 0
    assert_same_updates(ref, got, spec, RUNS[name]["memory"])


@pytest.mark.parametrize("trainer", ["delta", "gradient"])
def test_trainers_leave_the_pseudo_gradient_on_the_training_device(trainer, monkeypatch):
    """No ``Tensor.cpu`` and no ``Tensor.to(cpu)`` of a parameter-shaped tensor during the trainer (on a GPU node
    the pseudo-gradient would land on the CPU and miss the kernels). The batches' ``.to(device)`` is allowed."""
    run = RunConfig(model="mlp", local_steps=2, local_mode=trainer)
    split = node_partition(run, NodeConfig())
    model = make_model(run, split)
    calls: list[str] = []
    real_cpu, real_to = torch.Tensor.cpu, torch.Tensor.to
    param_shapes = {tuple(p.shape) for p in model.parameters()}

    def spy_cpu(self, *args, **kwargs):
        calls.append("cpu")
        return real_cpu(self, *args, **kwargs)

    def spy_to(self, *args, **kwargs):
        target = kwargs.get("device", args[0] if args else None)
        if isinstance(target, (str, torch.device)) and torch.device(target).type == "cpu":
            if tuple(self.shape) in param_shapes:
                calls.append(f"to({target})")
        return real_to(self, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "cpu", spy_cpu)
    monkeypatch.setattr(torch.Tensor, "to", spy_to)
    result = LOCAL_TRAINERS.get(trainer)()(model, split, run, torch.device("cpu"), torch.Generator().manual_seed(0))
    monkeypatch.undo()
    assert calls == []
    params = dict(model.named_parameters())
    for n, t in result.pseudo_grad.items():
        assert t.device == params[n].device and t.shape == params[n].shape
        assert t.data_ptr() != params[n].data_ptr()  # a fresh tensor, not the live parameter


def test_client_app_hands_the_trainer_output_to_the_pipeline_as_is(monkeypatch):
    """Between the trainer and ``Pipeline.send`` nothing copies or moves the pseudo-gradient."""
    produced: list[dict[str, torch.Tensor]] = []
    received: list[dict[str, torch.Tensor]] = []
    trainer_cls = LOCAL_TRAINERS.get("delta")
    real_call, real_send = trainer_cls.__call__, Pipeline.send

    def recording_call(self, *args, **kwargs):
        result = real_call(self, *args, **kwargs)
        produced.append(dict(result.pseudo_grad))
        return result

    def recording_send(self, tensors, **kwargs):
        received.append(dict(tensors))
        return real_send(self, tensors, **kwargs)

    monkeypatch.setattr(trainer_cls, "__call__", recording_call)
    monkeypatch.setattr(Pipeline, "send", recording_send)
    drive({**BASE, **RUNS["dgc-delta"]}, {}, monkeypatch)
    assert len(produced) == len(received) == 3
    for out, got in zip(produced, received, strict=True):
        assert out.keys() == got.keys() and all(out[n] is got[n] for n in out)


# ---- Memory.to / Pipeline.to -------------------------------------------------------------------------------


def stepped(memory_name: str, compressor: str = "dgc") -> Pipeline:
    """A pipeline after two sends of a 3-tensor spec on the CPU (every state tensor exists)."""
    spec = ModelSpec((("w", (40, 50)), ("b", (40,)), ("c", (30, 40))))
    pipe = build(compressor, spec, memory=memory_name, density=0.05)
    for seed in range(2):
        g = torch.Generator().manual_seed(seed)
        pipe.send({n: torch.randn(s, generator=g) for n, s in spec.entries})
    return pipe


@pytest.mark.parametrize("memory_name", ["residual", "dgc", "none"])
def test_memory_to_moves_every_state_tensor_and_returns_self(memory_name):
    pipe = stepped(memory_name)
    memory = pipe.memory
    before = tensors_of(memory.state_dict())
    assert len(before) == {"residual": 3, "dgc": 6, "none": 0}[memory_name]
    assert memory.to("cpu") is memory and memory.device == torch.device("cpu")
    assert all(torch.equal(a, b) for a, b in zip(before, tensors_of(memory.state_dict()), strict=True))
    assert pipe.to("meta") is pipe  # Pipeline.to moves its memory
    assert memory.device == torch.device("meta")
    after = tensors_of(memory.state_dict())
    assert len(after) == len(before) and all(t.device.type == "meta" for t in after)
    assert all(a.shape == b.shape for a, b in zip(before, after, strict=True))


@pytest.mark.parametrize("memory_name", ["residual", "dgc"])
def test_nack_restores_a_cpu_decoded_payload_into_state_on_another_device(memory_name):
    """``restore`` gets the payload decoded from CPU bytes; the state is elsewhere (``meta`` here, the GPU on a
    GPU node): the payload moves to the state, and a name without state gets it on the memory's device."""
    pipe = stepped(memory_name).to("meta")
    assert pipe.nack(2) and pipe.nack(1)  # index_add_ of CPU indices/values into meta state would raise
    assert all(t.device.type == "meta" for t in tensors_of(pipe.memory.state_dict()))
    fresh = build("dgc", pipe.spec, memory=memory_name, density=0.05)
    fresh.pending = dict(stepped(memory_name).pending)
    fresh.to("meta")
    assert fresh.nack(1)  # no state yet: created on the memory's device, not the payload's
    state = tensors_of(fresh.memory.state_dict())
    assert len(state) == len(fresh.spec.names) * (2 if memory_name == "dgc" else 1)
    assert all(t.device.type == "meta" for t in state)


def test_load_state_dict_puts_state_on_the_memory_device():
    for memory in (ResidualMemory(), DGCMemory()):
        src = stepped("dgc" if isinstance(memory, DGCMemory) else "residual").memory.state_dict()
        memory.to("meta").load_state_dict(src)
        assert all(t.device.type == "meta" for t in tensors_of(memory.state_dict()))
    assert NoMemory().to("meta").device == torch.device("meta")


# ---- client state through the CPU ------------------------------------------------------------------------


def kernels_only(self, name, tensor, real=FusedBatch.add):
    """``FusedBatch.add`` that fails when a tensor would take the reference steps."""
    assert real(self, name, tensor), "expected the fused kernel path"
    return True


def test_client_state_round_trip_after_a_triton_step(monkeypatch):
    run = RunConfig.from_flower({**BASE, **RUNS["dgc+int8-gradient"]})
    spec, _ = spec_and_model(run)
    state = ClientSession.fresh(run.compression, spec, backend="triton")
    g = torch.Generator().manual_seed(3)
    with monkeypatch.context() as m:  # every tensor outside the small-tensor group takes a kernel
        m.setattr(FusedBatch, "add", kernels_only)
        state.pipeline.send({n: torch.randn(s, generator=g) for n, s in spec.entries})
    data = state.to_bytes()
    raw = tensortree.loads(data)  # the tensors as saved: every one through the CPU
    saved = tensors_of(raw["pipeline"]["memory"])
    assert len(saved) == 2 * len(spec.names) and all(t.device.type == "cpu" for t in saved)
    back = ClientSession.from_bytes(data, run.compression, spec, backend="triton")
    assert back.pipeline.backend == "triton" and back.pipeline.memory.device == torch.device("cpu")
    assert all(torch.equal(a, b) for a, b in zip(saved, tensors_of(back.pipeline.memory.state_dict()), strict=True))
    moved = ClientSession.from_bytes(data, run.compression, spec, device="meta")  # onto the training device
    assert moved.pipeline.backend is None and moved.pipeline.memory.device == torch.device("meta")
    assert all(t.device.type == "meta" for t in tensors_of(moved.pipeline.memory.state_dict()))
    assert ClientSession.fresh(run.compression, spec, device="meta").pipeline.memory.device == torch.device("meta")


# ---- the kernels node-config key --------------------------------------------------------------------------


def test_kernels_node_config_key():
    assert NodeConfig.from_flower({}).kernel_backend is None
    assert NodeConfig.from_flower({"kernels": "auto"}).kernel_backend is None
    assert NodeConfig.from_flower({"kernels": "torch"}).kernel_backend == "torch"
    assert NodeConfig.from_flower({"kernels": "triton"}).kernel_backend == "triton"
    with pytest.raises(ConfigError, match=r"kernels must be one of auto, torch, triton, got 'cuda'"):
        NodeConfig.from_flower({"kernels": "cuda"})
    with pytest.raises(ConfigError, match="backend must be one of torch, triton"):
        build("dgc", ModelSpec((("w", (4,)),)), backend="auto")


def test_bad_kernels_value_fails_the_client_task_clearly(monkeypatch):
    with pytest.raises(ConfigError, match="kernels must be one of"):
        drive({**BASE, **RUNS["dgc-delta"]}, {"kernels": "Triton"}, monkeypatch)


def test_flower_client_kernels_flag():
    args = parser().parse_args(["--server", "h:1", "--kernels", "triton"])
    assert 'kernels="triton"' in node_config(args)
    assert "kernels" not in node_config(parser().parse_args(["--server", "h:1"]))  # unset: the node's default
    with pytest.raises(SystemExit):
        parser().parse_args(["--server", "h:1", "--kernels", "cuda"])

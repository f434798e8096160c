"""The client's device path on a CUDA device with the compiled Triton kernels: ``gpu=true`` keeps the state on the
GPU and saves it through the CPU, and the kernels' updates equal the torch reference's on the GPU.

Run alone (``pytest tests/test_client_cuda.py``, as benchmarks/gpu_session.sh does) the kernels are the compiled
ones; in a process where another module set ``TRITON_INTERPRET=1`` first (the whole suite) they run under
the interpreter. Without a CUDA device every test here is skipped; the same comparisons on the CPU are in
tests/test_client_device.py.
"""

from __future__ import annotations

import pytest
import torch

from fedcomp import tensortree
from fedcomp.flower.session import ClientSession
from fedcomp.task.config import RunConfig
from tests.clientkit import BASE, RUNS, assert_same_updates, drive, kernel_tensors, spec_and_model, tensors_of

pytest.importorskip("triton", reason="triton not installed")

CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@CUDA
def test_cuda_state_is_saved_through_the_cpu_and_loaded_back_on_the_gpu():
    run = RunConfig.from_flower({**BASE, **RUNS["dgc+int8-gradient"]})
    spec, _ = spec_and_model(run)
    state = ClientSession.fresh(run.compression, spec, device="cuda")
    g = torch.Generator().manual_seed(3)
    state.pipeline.send({n: torch.randn(s, generator=g).cuda() for n, s in spec.entries})
    assert all(t.is_cuda for t in tensors_of(state.pipeline.memory.state_dict()))
    raw = tensortree.loads(state.to_bytes())
    assert all(t.device.type == "cpu" for t in tensors_of(raw["pipeline"]))
    back = ClientSession.from_bytes(state.to_bytes(), run.compression, spec, device="cuda")
    assert all(t.is_cuda for t in tensors_of(back.pipeline.memory.state_dict()))
    assert back.pipeline.nack(1)  # CPU-decoded payload into GPU state


@CUDA
@pytest.mark.parametrize("name", list(RUNS))
def test_gpu_client_takes_the_kernels_and_matches_the_torch_gpu_client(name, monkeypatch):
    """``gpu=true`` with the default ``kernels=auto``: CUDA tensors reach the send step and every tensor takes a
    kernel; the update equals the same node's with ``kernels=torch`` (the reference steps on the GPU)."""
    run_config = {**BASE, **RUNS[name]}
    spec, _ = spec_and_model(RunConfig.from_flower(run_config))
    ref = drive(run_config, {"gpu": True, "kernels": "torch"}, monkeypatch)
    got = drive(run_config, {"gpu": True}, monkeypatch)
    assert ref.devices == got.devices == {"cuda"}
    assert ref.fused == 0 and got.fused == 3 * kernel_tensors(run_config, spec) > 0
    assert_same_updates(ref, got, spec, RUNS[name]["memory"])

"""``fedcomp.task.heap.keep_freed_memory``: a training step of the main job's model stops page-faulting."""

from __future__ import annotations

import ctypes.util
import resource
import sys

import torch

from fedcomp.task.heap import keep_freed_memory
from fedcomp.task.models import build_model


def faults_per_step(steps: int = 10) -> float:
    """Minor page faults per SGD step of resnet-1m (GroupNorm) on a batch of 32 8x8 digits, after 5 to warm up."""
    model = build_model("resnet-1m", (1, 8, 8), 10, seed=0, norm="group")
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    x, y = torch.randn(32, 1, 8, 8), torch.randint(0, 10, (32,))

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()

    for _ in range(5):
        step()
    start = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(steps):
        step()
    return (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - start) / steps


def test_a_training_step_reuses_freed_memory():
    glibc = sys.platform.startswith("linux") and "libc.so" in (ctypes.util.find_library("c") or "")
    took = keep_freed_memory()
    assert took == glibc  # glibc takes both settings; another C library is left alone and says so
    if took:
        # without the settings, about 1,500 faults per step here (a fresh process: python tests/test_heap.py)
        assert faults_per_step() < 150


if __name__ == "__main__":
    print(f"faults per step, glibc's defaults: {faults_per_step():.0f}")


def test_the_warm_worker_keeps_freed_memory_before_it_serves(monkeypatch):
    from clients import channel, worker

    order = []

    class Stop(Exception):
        pass

    def listen(endpoint):
        order.append("listen")
        raise Stop

    monkeypatch.setattr(worker, "watch_parent", lambda: None)
    monkeypatch.setattr(worker, "keep_freed_memory", lambda: order.append("heap") or True)
    monkeypatch.setattr(channel, "listen", listen)
    try:
        worker.main(["--socket", "unused.sock", "--key-file", "unused.key"])
    except Stop:
        pass
    assert order == ["heap", "listen"]

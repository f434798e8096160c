"""The product's local training, without Flower objects.

``LOCAL_TRAINERS`` (registry) turns the global model into the pseudo-gradient a client sends:

* ``"delta"``: H local SGD steps on the node's partition; sends ``old - new`` (use with the ``residual``
  memory and a server optimizer with lr ~1: FedAvg / FedBuff);
* ``"gradient"``: the mean gradient of H minibatches at the global model; sends it (use with the ``dgc``
  memory, whose momentum correction makes it per-step DGC, and the server lr as the learning rate).

The pseudo-gradient stays on the training device up to the pipeline (a GPU node compresses with the fused
kernels), and so does the pipeline's error-feedback state (``fedcomp.flower.ClientSession`` saves it through
the CPU).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.data import Dataset

from fedcomp.registry import Registry
from fedcomp.task.config import NodeConfig, RunConfig
from fedcomp.task.training import batches, run_loss


class GpuUnavailableError(RuntimeError):
    """``gpu=true`` on a node without a usable CUDA device. Never falls back to the CPU silently."""


def select_device(node: NodeConfig) -> torch.device:
    """``cuda`` when the node asked for a GPU (and one exists), else ``cpu``."""
    if not node.gpu:
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise GpuUnavailableError(
            f"gpu=true but torch {torch.__version__} sees no CUDA device on this node "
            f"(CUDA build: {torch.version.cuda or 'none'}); refusing to fall back to the CPU"
        )
    return torch.device("cuda")


LOCAL_TRAINERS: Registry[Any] = Registry("local trainer")


@dataclass
class LocalResult:
    pseudo_grad: dict[str, torch.Tensor]
    num_examples: int
    loss: float


class LocalTrainer:
    """Base: ``__call__(model, data, run, device, generator) -> LocalResult``.

    ``data`` is the node's torch ``Dataset`` of ``(input, label)`` items, read through a ``DataLoader``
    (``fedcomp.task.training.batches``); the loss is the run's (``loss``: a built-in name or a plug-in callable). The
    pseudo-gradient's tensors are on the training ``device`` (the model's), fresh (not views of the model's
    parameters or gradients), never copied to the CPU: a GPU node compresses them where they are (fused kernels).
    """

    def setup(self, data: Dataset, run: RunConfig, generator: torch.Generator, device: torch.device):
        return batches(data, run.batch_size, generator, device), run_loss(run)


@LOCAL_TRAINERS.register("delta")
class DeltaTrainer(LocalTrainer):
    def __call__(self, model, split, run, device, generator) -> LocalResult:
        params = {n: p for n, p in model.named_parameters() if p.requires_grad}
        old = {n: p.detach().clone() for n, p in params.items()}
        opt = torch.optim.SGD(params.values(), lr=run.local_lr, momentum=run.local_momentum)
        model.train()
        it, loss_fn = self.setup(split, run, generator, device)
        total, seen = 0.0, 0
        for _ in range(run.local_steps):
            xb, yb = next(it)
            opt.zero_grad(set_to_none=True)
            loss = loss_fn(model(xb), yb)
            loss.backward()
            opt.step()
            total += loss.item() * len(yb)
            seen += len(yb)
        delta = {n: old[n] - p.detach() for n, p in params.items()}
        return LocalResult(delta, seen, total / max(seen, 1))


@LOCAL_TRAINERS.register("gradient")
class GradientTrainer(LocalTrainer):
    def __call__(self, model, split, run, device, generator) -> LocalResult:
        params = {n: p for n, p in model.named_parameters() if p.requires_grad}
        model.train()
        model.zero_grad(set_to_none=True)
        it, loss_fn = self.setup(split, run, generator, device)
        total, seen = 0.0, 0
        for _ in range(run.local_steps):
            xb, yb = next(it)
            loss = loss_fn(model(xb), yb) / run.local_steps
            loss.backward()
            total += loss.item() * run.local_steps * len(yb)
            seen += len(yb)
        grads = {n: p.grad.detach().clone() for n, p in params.items()}
        return LocalResult(grads, seen, total / max(seen, 1))


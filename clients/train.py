"""Client-side work, without Flower objects: the node's data and model, local training, persistent state.

``LOCAL_TRAINERS`` (registry) turns the global model into the pseudo-gradient a client sends:

* ``"delta"``: H local SGD steps on the node's partition; sends ``old - new`` (use with the ``residual``
  memory and a server optimizer with lr ~1: FedAvg / FedBuff);
* ``"gradient"``: the mean gradient of H minibatches at the global model; sends it (use with the ``dgc``
  memory, whose momentum correction makes it per-step DGC, and the server lr as the learning rate).

The pseudo-gradient stays on the training device up to the pipeline (a GPU node compresses with the fused
kernels), and so does the pipeline's error-feedback state; ``ClientState`` saves it through the CPU.
"""

from __future__ import annotations

import io
import random
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import torch
import torch.nn.functional as F

from clients.config import NodeConfig, RunConfig
from fedcomp.data import Split, load_dataset, partition
from fedcomp.models import build_model
from fedcomp.pipeline import Pipeline, build
from fedcomp.protocol import ClientSide
from fedcomp.registry import ConfigError, Registry
from fedcomp.spec import ModelSpec


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


@lru_cache(maxsize=4)
def datasets(name: str, seed: int) -> tuple[Split, Split]:
    del seed  # the split of the shipped datasets is fixed by their own config
    return load_dataset(name)


def node_partition(run: RunConfig, node: NodeConfig) -> Split:
    """This node's share of the training split (iid or Dirichlet, seeded by the run's seed)."""
    train, _ = datasets(run.dataset, run.seed)
    opts: dict[str, Any] = {"seed": run.seed}
    if run.partitioner == "dirichlet":
        opts["alpha"] = run.dirichlet_alpha
    parts = partition(run.partitioner, train.y, node.num_partitions, **opts)
    return train.subset(parts[node.partition_id])


def make_model(run: RunConfig, split: Split) -> torch.nn.Module:
    return build_model(run.model, in_shape=split.in_shape, num_classes=split.num_classes, seed=run.seed)


def make_pipeline(run: RunConfig, spec: ModelSpec, backend: str | None = None) -> Pipeline:
    """The run's compressor and memory, sending with kernel ``backend`` (``NodeConfig.kernel_backend``)."""
    return build(run.compressor, spec, memory=run.memory or None, backend=backend, **run.compressor_kwargs)


LOCAL_TRAINERS: Registry[Any] = Registry("local trainer")


@dataclass
class LocalResult:
    pseudo_grad: dict[str, torch.Tensor]
    num_examples: int
    loss: float


class LocalTrainer:
    """Base: ``__call__(model, split, run, device, generator) -> LocalResult``.

    The pseudo-gradient's tensors are on the training ``device`` (the model's), fresh (not views of the model's
    parameters or gradients), never copied to the CPU: a GPU node compresses them where they are (fused kernels).
    """

    def batches(self, split: Split, run: RunConfig, generator: torch.Generator, device: torch.device):
        while True:
            order = torch.randperm(len(split), generator=generator)
            for start in range(0, len(order), run.batch_size):
                idx = order[start : start + run.batch_size]
                yield split.x[idx].to(device), split.y[idx].to(device)


@LOCAL_TRAINERS.register("delta")
class DeltaTrainer(LocalTrainer):
    def __call__(self, model, split, run, device, generator) -> LocalResult:
        params = {n: p for n, p in model.named_parameters() if p.requires_grad}
        old = {n: p.detach().clone() for n, p in params.items()}
        opt = torch.optim.SGD(params.values(), lr=run.local_lr, momentum=run.local_momentum)
        model.train()
        it = self.batches(split, run, generator, device)
        total, seen = 0.0, 0
        for _ in range(run.local_steps):
            xb, yb = next(it)
            opt.zero_grad(set_to_none=True)
            loss = F.cross_entropy(model(xb), yb)
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
        it = self.batches(split, run, generator, device)
        total, seen = 0.0, 0
        for _ in range(run.local_steps):
            xb, yb = next(it)
            loss = F.cross_entropy(model(xb), yb) / run.local_steps
            loss.backward()
            total += loss.item() * run.local_steps * len(yb)
            seen += len(yb)
        grads = {n: p.grad.detach().clone() for n, p in params.items()}
        return LocalResult(grads, seen, total / max(seen, 1))


def evaluate(model: torch.nn.Module, split: Split, device: torch.device, batch: int = 512) -> dict[str, float]:
    """Accuracy (0..1) and mean cross-entropy of ``model`` on ``split``."""
    model.eval()
    correct, loss = 0, 0.0
    with torch.no_grad():
        for i in range(0, len(split), batch):
            x, y = split.x[i : i + batch].to(device), split.y[i : i + batch].to(device)
            out = model(x)
            loss += F.cross_entropy(out, y, reduction="sum").item()
            correct += int((out.argmax(1) == y).sum().item())
    n = max(len(split), 1)
    return {"accuracy": correct / n, "loss": loss / n, "num_examples": float(len(split))}


@dataclass
class ClientState:
    """What a node keeps between tasks (``context.state``): its pipeline (error-feedback memory, RNG,
    sequence numbers, pending updates), which task each pending seq answered, its incarnation id, and the
    number of local steps done (the DGC warm-up schedule reads epochs from it).

    ``fresh`` and ``from_bytes`` put the pipeline's memory on the training ``device`` and send with kernel
    ``backend``; ``to_bytes`` saves every tensor through the CPU, so a state loads on any node.
    """

    side: ClientSide
    incarnation: int
    steps_done: int = 0

    @property
    def pipeline(self) -> Pipeline:
        return self.side.pipeline

    @staticmethod
    def fresh(
        run: RunConfig, spec: ModelSpec, *, device: torch.device | str = "cpu", backend: str | None = None
    ) -> ClientState:
        pipe = make_pipeline(run, spec, backend).to(device)
        return ClientState(ClientSide(pipe), random.SystemRandom().getrandbits(62) or 1)

    def to_bytes(self) -> bytes:
        buf = io.BytesIO()
        torch.save(
            {
                "pipeline": _on_cpu(self.pipeline.state_dict()),
                "task_seqs": dict(self.side.task_seqs),
                "incarnation": self.incarnation,
                "steps_done": self.steps_done,
            },
            buf,
        )
        return buf.getvalue()

    @staticmethod
    def from_bytes(
        data: bytes,
        run: RunConfig,
        spec: ModelSpec,
        *,
        device: torch.device | str = "cpu",
        backend: str | None = None,
    ) -> ClientState:
        try:
            state = torch.load(io.BytesIO(data), weights_only=True, map_location="cpu")
        except Exception as exc:  # a corrupt state is a config problem, not a silent reset
            raise ConfigError(f"client state cannot be loaded: {exc}") from exc
        pipe = make_pipeline(run, spec, backend)
        pipe.load_state_dict(state["pipeline"])
        pipe.to(device)
        return ClientState(ClientSide(pipe, state["task_seqs"]), int(state["incarnation"]), int(state["steps_done"]))


def _on_cpu(obj: Any) -> Any:
    """``obj`` (nested dicts, lists, tuples) with every tensor copied to the CPU (CPU tensors kept as they are)."""
    if isinstance(obj, torch.Tensor):
        return obj.cpu()
    if isinstance(obj, dict):
        return {k: _on_cpu(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_on_cpu(v) for v in obj)
    return obj

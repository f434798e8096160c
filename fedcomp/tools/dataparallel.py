"""In-process data-parallel training: W workers, one compressed message per worker per step.

Every step each worker computes a gradient on its own shard, runs the send step of its pipeline
(compensate → compress → update → encode), and the "server" decodes every blob, averages the updates
with a ``SparseAccumulator`` and applies them with a server optimizer. Nothing is shared between workers
except the bytes, so the byte counts are exactly what a real deployment would move.

Methods are named presets (``METHODS``): dense SGD with server momentum, and DGC, where momentum lives on
the workers (momentum correction) and the server applies the averaged velocity with plain SGD.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from fedcomp.client.pipeline import build
from fedcomp.registry import check_ranges
from fedcomp.server.aggregate import SparseAccumulator
from fedcomp.server.optimizers import SERVER_OPTIMIZERS
from fedcomp.spec import ModelSpec
from fedcomp.task.config import SEED_END
from fedcomp.task.data import DATASETS, batches, load_dataset, partition_iid
from fedcomp.task.models import MODELS, build_model
from fedcomp.wire import decode


@dataclass(frozen=True)
class Method:
    """A compression method: compressor + memory options for the workers, optimizer for the server."""

    compressor: str
    options: dict[str, Any] = field(default_factory=dict)
    memory: str | None = None
    server_momentum: float = 0.0


METHODS: dict[str, Method] = {
    "dense": Method("identity", memory="none", server_momentum=0.9),
    "dgc": Method("dgc", {"density": 0.001, "momentum": 0.9}),
    "dgc+int8": Method("dgc+int8", {"density": 0.001, "momentum": 0.9}),
    "topk": Method("topk", {"density": 0.001}, memory="residual", server_momentum=0.9),
    "qsgd": Method("qsgd", memory="residual", server_momentum=0.9),
    "int8": Method("int8", memory="residual", server_momentum=0.9),
}


#: Learning-rate multipliers as a function of training progress in [0, 1).
LR_SCHEDULES: dict[str, Callable[[float], float]] = {
    "constant": lambda progress: 1.0,
    "cosine": lambda progress: 0.5 * (1.0 + math.cos(math.pi * progress)),
}


@dataclass(frozen=True)
class DPConfig:
    """One data-parallel run. ``warmup_epochs`` applies to methods with a sparsity schedule (DGC)."""

    method: str = "dgc"
    dataset: str = "digits"
    model: str = "cnn"
    workers: int = 4
    batch_size: int = 32
    epochs: int = 60
    lr: float = 0.05
    weight_decay: float = 1e-4
    warmup_epochs: float = 4.0
    lr_schedule: str = "cosine"
    seed: int = 0

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"unknown method {self.method!r}; known: {', '.join(METHODS)}")
        v = {n: getattr(self, n) for n in ("workers", "batch_size", "epochs", "warmup_epochs", "weight_decay")}
        check_ranges(*((n, v[n], ">= 1", v[n] >= 1) for n in ("workers", "batch_size", "epochs")),
                     ("lr", self.lr, "finite and > 0", 0 < self.lr < math.inf),
                     *((n, v[n], ">= 0", v[n] >= 0) for n in ("warmup_epochs", "weight_decay")),
                     ("seed", self.seed, "in [0, 2**32)", 0 <= self.seed < SEED_END))
        MODELS.get(self.model)  # unknown names raise ConfigError (a ValueError) naming the known ones
        DATASETS.get(self.dataset.split(":", 1)[0] if self.dataset.startswith("hf:") else self.dataset)
        if self.lr_schedule not in LR_SCHEDULES:
            raise ValueError(f"unknown lr_schedule {self.lr_schedule!r}; known: {', '.join(LR_SCHEDULES)}")


@dataclass
class DPResult:
    config: dict[str, Any]
    accuracy: float
    loss: float
    steps: int
    uplink_bytes: int  # every encoded worker message, summed
    dense_bytes: int  # the same messages as dense fp32 (4 bytes per parameter)
    warmup_uplink_bytes: int  # part of uplink_bytes spent during the sparsity warm-up
    warmup_steps: int
    wall_s: float
    history: list[dict[str, float]]

    @property
    def compression(self) -> float:
        return self.dense_bytes / max(1, self.uplink_bytes)

    @property
    def steady_compression(self) -> float:
        """Compression after warm-up (what a long run converges to)."""
        steps = self.steps - self.warmup_steps
        sent = self.uplink_bytes - self.warmup_uplink_bytes
        return (self.dense_bytes * steps / self.steps) / max(1, sent) if steps > 0 else float("nan")

    def summary(self) -> dict[str, Any]:
        return {
            "method": self.config["method"],
            "accuracy": self.accuracy,
            "loss": self.loss,
            "steps": self.steps,
            "uplink_bytes": self.uplink_bytes,
            "bytes_per_step": self.uplink_bytes / max(1, self.steps),
            "compression": self.compression,
            "steady_compression": self.steady_compression,
            "wall_s": self.wall_s,
        }


@torch.no_grad()
def evaluate(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, batch: int = 1024) -> tuple[float, float]:
    """(accuracy in %, mean loss) on a whole split."""
    model.eval()
    correct, loss = 0, 0.0
    for i in range(0, len(y), batch):
        out = model(x[i : i + batch])
        loss += F.cross_entropy(out, y[i : i + batch], reduction="sum").item()
        correct += (out.argmax(1) == y[i : i + batch]).sum().item()
    model.train()
    return 100.0 * correct / len(y), loss / len(y)


def _pipelines(method: Any, spec: ModelSpec, cfg: DPConfig) -> list[Any]:
    """One send pipeline per worker (DGC methods with the run's warm-up), without running totals: a worker's
    state is never saved nor checked, and they cost two dense passes a step."""
    options = dict(method.options)
    if "dgc" in method.compressor:
        options["warmup_epochs"] = cfg.warmup_epochs
    return [build(method.compressor, spec, memory=method.memory, totals=False, **options) for _ in range(cfg.workers)]


def run(cfg: DPConfig, progress: Callable[[dict[str, float]], None] | None = None) -> DPResult:
    """Train ``cfg.epochs`` epochs; return final test accuracy and byte counts. Deterministic given the seed."""
    torch.manual_seed(cfg.seed)
    method = METHODS[cfg.method]
    train, test = load_dataset(cfg.dataset)
    model = build_model(cfg.model, in_shape=tuple(train.x.shape[1:]), num_classes=train.num_classes)
    params = {n: p for n, p in model.named_parameters() if p.requires_grad}
    spec = ModelSpec.from_tensors(params)
    shards = partition_iid(len(train.y), cfg.workers, seed=cfg.seed)
    pipes = _pipelines(method, spec, cfg)
    opt = SERVER_OPTIMIZERS.build("sgd", lr=cfg.lr, momentum=method.server_momentum)
    acc = SparseAccumulator(spec)
    steps_per_epoch = min(len(s) for s in shards) // cfg.batch_size
    if steps_per_epoch < 1:
        raise ValueError("batch_size is larger than a worker's shard")
    uplink = warm_bytes = warm_steps = step = 0
    history: list[dict[str, float]] = []
    t0 = time.perf_counter()
    for epoch in range(cfg.epochs):
        loaders = [
            batches(train.x[s], train.y[s], cfg.batch_size, seed=cfg.seed * 100003 + epoch * 101 + w)
            for w, s in enumerate(shards)
        ]
        for i in range(steps_per_epoch):
            in_warmup = epoch + i / steps_per_epoch < cfg.warmup_epochs and "dgc" in method.compressor
            acc.reset()
            for w, pipe in enumerate(pipes):
                pipe.set_epoch(epoch + i / steps_per_epoch)
                xb, yb = next(loaders[w])
                model.zero_grad(set_to_none=True)
                F.cross_entropy(model(xb), yb).backward()
                grads = {n: p.grad + cfg.weight_decay * p.detach() for n, p in params.items()}
                blob = pipe.send(grads, base_version=step, client_id=w)
                pipe.ack(pipe.last_seq)
                uplink += len(blob)
                warm_bytes += len(blob) if in_warmup else 0
                acc.add(decode(blob, spec), weight=1.0)
            # the schedule scales the averaged update: exactly lr_t for DGC, whose momentum is on the workers
            scale = LR_SCHEDULES[cfg.lr_schedule](step / (cfg.epochs * steps_per_epoch))
            with torch.no_grad():
                opt.step(params, {n: t.mul_(scale) for n, t in acc.result(normalize="count").items()})
            step += 1
            warm_steps += int(in_warmup)
        accuracy, loss = evaluate(model, test.x, test.y)
        row = {"epoch": epoch + 1, "step": step, "accuracy": accuracy, "loss": loss, "uplink_bytes": uplink}
        history.append(row)
        if progress:
            progress(row)
    return DPResult(
        config=asdict(cfg),
        accuracy=history[-1]["accuracy"],
        loss=history[-1]["loss"],
        steps=step,
        uplink_bytes=uplink,
        dense_bytes=spec.dense_bytes * cfg.workers * step,
        warmup_uplink_bytes=warm_bytes,
        warmup_steps=warm_steps,
        wall_s=time.perf_counter() - t0,
        history=history,
    )

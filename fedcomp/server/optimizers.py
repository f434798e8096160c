"""Server optimizers: apply an aggregated pseudo-gradient to the global model.

Convention: ``step(params, pseudo_grad)`` updates ``params`` in place as ``params -= lr * direction(pseudo_grad)``.
For delta exchange clients send ``old - new`` (so ``"sgd"`` with ``lr=1`` is FedAvg: the new global model is the
average of the client models); for per-step exchange they send gradients (or momentum-corrected velocities) and
``lr`` is the server's learning rate.

Registry ``SERVER_OPTIMIZERS``: ``"sgd"`` (momentum, Nesterov), and the adaptive federated optimizers of Reddi et
al. (2021), "Adaptive Federated Optimization": ``"adam"`` (FedAdam), ``"yogi"`` (FedYogi), ``"adagrad"``
(FedAdagrad). ``pseudo_grad`` may cover a subset of ``params`` (others are left as they are); names outside
``params`` or shape mismatches raise ``ValueError`` before anything is changed. State tensors are allocated
lazily with each parameter's dtype and device; ``state_dict()`` returns copies, ``load_state_dict`` copies in.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from fedcomp.registry import Registry

SERVER_OPTIMIZERS: Registry[ServerOptimizer] = Registry("server optimizer")


def _check_lr(lr: float) -> None:
    if not (math.isfinite(lr) and lr >= 0):
        raise ValueError(f"lr must be finite and >= 0, got {lr}")


def _check_beta(name: str, beta: float) -> None:
    if not 0.0 <= beta < 1.0:
        raise ValueError(f"{name} must be in [0, 1), got {beta}")


class ServerOptimizer:
    """Base: validation, step counting and state (de)serialisation of named per-parameter buffers."""

    Config: ClassVar[type | None] = None
    #: names of the per-parameter state buffers (dict name -> tensor each)
    buffers: ClassVar[tuple[str, ...]] = ()

    def __init__(self, config: Any = None) -> None:
        self.config = config if config is not None else (self.Config() if self.Config else None)
        self.steps = 0
        self.state: dict[str, dict[str, torch.Tensor]] = {b: {} for b in self.buffers}

    @torch.no_grad()
    def step(self, params: Mapping[str, torch.Tensor], pseudo_grad: Mapping[str, torch.Tensor]) -> None:
        """``params[n] -= lr * direction`` for every ``n`` in ``pseudo_grad``, in place."""
        for name, g in pseudo_grad.items():
            if name not in params:
                raise ValueError(f"pseudo-gradient for {name!r}, which is not a parameter")
            want = tuple(params[name].shape)
            if tuple(g.shape) != want:
                raise ValueError(f"tensor {name!r}: pseudo-gradient shape {tuple(g.shape)} != parameter shape {want}")
        self.steps += 1
        for name, g in pseudo_grad.items():
            p = params[name]
            self._update(name, p, g.to(device=p.device, dtype=p.dtype))

    def _update(self, name: str, p: torch.Tensor, g: torch.Tensor) -> None:
        raise NotImplementedError

    def _buf(self, kind: str, name: str, like: torch.Tensor, init: float = 0.0) -> torch.Tensor:
        store = self.state[kind]
        if name not in store:
            store[name] = torch.full_like(like, init)
        return store[name]

    def state_dict(self) -> dict[str, Any]:
        return {"steps": self.steps, **{k: {n: t.clone() for n, t in v.items()} for k, v in self.state.items()}}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.steps = int(state["steps"])
        self.state = {k: {n: t.clone() for n, t in state[k].items()} for k in self.buffers}


@SERVER_OPTIMIZERS.register("sgd")
class SGD(ServerOptimizer):
    """``buf = momentum * buf + g``; direction = ``g + momentum * buf`` (Nesterov) or ``buf``; like torch.optim.SGD
    with dampening 0. ``momentum=0`` keeps no state and the step is ``params -= lr * g``."""

    @dataclass(frozen=True)
    class Config:
        lr: float = 1.0
        momentum: float = 0.0
        nesterov: bool = False

        def __post_init__(self) -> None:
            _check_lr(self.lr)
            _check_beta("momentum", self.momentum)
            if self.nesterov and self.momentum == 0:
                raise ValueError("nesterov needs momentum > 0")

    buffers = ("momentum",)

    def _update(self, name: str, p: torch.Tensor, g: torch.Tensor) -> None:
        c = self.config
        if c.momentum == 0:
            p.sub_(g, alpha=c.lr)
            return
        buf = self._buf("momentum", name, p)
        buf.mul_(c.momentum).add_(g)
        direction = g.add(buf, alpha=c.momentum) if c.nesterov else buf
        p.sub_(direction, alpha=c.lr)


@dataclass(frozen=True)
class AdaptiveConfig:
    """Options of FedAdam / FedYogi / FedAdagrad.

    Defaults follow Reddi et al. (2021): ``beta1`` 0.9, ``beta2`` 0.99, ``eps`` (their tau, the adaptivity
    degree) 1e-3. ``lr`` (their server rate eta) must be tuned per task; they searched it on a log grid.
    ``bias_correction`` (default off, as in their Algorithm 2) divides m and v by ``1 - beta^t`` like Adam.
    Second moments start at 0.
    """

    lr: float = 0.01
    beta1: float = 0.9
    beta2: float = 0.99
    eps: float = 1e-3
    bias_correction: bool = False

    def __post_init__(self) -> None:
        _check_lr(self.lr)
        _check_beta("beta1", self.beta1)
        _check_beta("beta2", self.beta2)
        if not (math.isfinite(self.eps) and self.eps > 0):
            raise ValueError(f"eps must be finite and > 0, got {self.eps}")


class _Adaptive(ServerOptimizer):
    """``m = b1 m + (1 - b1) g``; ``v`` per subclass; ``params -= lr * m / (sqrt(v) + eps)``."""

    Config = AdaptiveConfig
    buffers = ("m", "v")
    #: whether ``bias_correction`` also rescales v (not for Adagrad's running sum)
    bias_correct_v: ClassVar[bool] = True

    def _second_moment(self, v: torch.Tensor, g2: torch.Tensor) -> None:
        raise NotImplementedError

    def _update(self, name: str, p: torch.Tensor, g: torch.Tensor) -> None:
        c = self.config
        m, v = self._buf("m", name, p), self._buf("v", name, p)
        m.mul_(c.beta1).add_(g, alpha=1.0 - c.beta1)
        self._second_moment(v, g * g)
        if c.bias_correction:
            m_hat = m / (1.0 - c.beta1**self.steps)
            v_hat = v / (1.0 - c.beta2**self.steps) if self.bias_correct_v else v
        else:
            m_hat, v_hat = m, v
        p.addcdiv_(m_hat, v_hat.sqrt().add_(c.eps), value=-c.lr)


@SERVER_OPTIMIZERS.register("adam")
class FedAdam(_Adaptive):
    """FedAdam: ``v = b2 v + (1 - b2) g^2``."""

    def _second_moment(self, v: torch.Tensor, g2: torch.Tensor) -> None:
        v.mul_(self.config.beta2).add_(g2, alpha=1.0 - self.config.beta2)


@SERVER_OPTIMIZERS.register("yogi")
class FedYogi(_Adaptive):
    """FedYogi: ``v = v - (1 - b2) g^2 sign(v - g^2)`` (v grows additively, never faster than Adam's)."""

    def _second_moment(self, v: torch.Tensor, g2: torch.Tensor) -> None:
        v.sub_(torch.sign(v - g2) * g2, alpha=1.0 - self.config.beta2)


@SERVER_OPTIMIZERS.register("adagrad")
class FedAdagrad(_Adaptive):
    """FedAdagrad: ``v = v + g^2`` (``beta2`` unused; bias correction applies to m only)."""

    bias_correct_v = False

    def _second_moment(self, v: torch.Tensor, g2: torch.Tensor) -> None:
        v.add_(g2)


def build_server_optimizer(name: str = "sgd", **options: Any) -> ServerOptimizer:
    """Server optimizer ``name`` from ``SERVER_OPTIMIZERS``; unknown options raise ``ConfigError``."""
    return SERVER_OPTIMIZERS.build(name, **options)

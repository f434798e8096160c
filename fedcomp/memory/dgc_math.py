"""The DGC update arithmetic, once (Lin et al. 2018, Sec. 3.2): local gradient clipping, momentum correction,
local accumulation and momentum factor masking, on explicit state tensors (``u`` momentum, ``v`` velocity).

``DGCMemory`` runs it on its per-name state; ``fedcomp.kernels.dgc`` runs it as the torch reference of the fused
step, and the Triton kernels (``fedcomp.kernels._triton_dgc``) mirror it operation by operation, fma for fma, so
both give bitwise the same ``u`` and ``v``. Example::

    g = torch.tensor([3.0, 0.0, 4.0, 0.0])
    scale = clip_scale(g, clip_threshold(1.0, None))      # ||g|| = 5 > 1: scale 0.2
    u, v = first_step(g, momentum=0.9, nesterov=False, scale=scale)       # u = v = 0.2 g
    accumulate_(g, u, v, momentum=0.9, nesterov=False, scale=scale)      # u = 0.9 u + 0.2 g; v += u
    mask_(u, torch.tensor([2]))                            # u[2] = 0 (v[2] was sent)
"""

from __future__ import annotations

import math

import torch


def clip_threshold(clip_norm: float | None, clip_workers: int | None) -> float | None:
    """The per-tensor L2 clip threshold of ``DGCMemoryConfig``: ``clip_norm * clip_workers ** -0.5``
    (``clip_norm`` alone without ``clip_workers``; ``None``: no clipping)."""
    if clip_norm is None:
        return None
    return clip_norm * (clip_workers**-0.5 if clip_workers else 1.0)


def clip_scale(g: torch.Tensor, threshold: float | None) -> float:
    """``threshold / ||g||`` if ``||g|| > threshold`` and finite, else 1 (also for ``threshold=None``). One host
    sync for the norm."""
    if threshold is None:
        return 1.0
    norm = float(torch.linalg.vector_norm(g))
    return threshold / norm if norm > threshold and math.isfinite(norm) else 1.0


def clip_scale_tensor(g: torch.Tensor, threshold: float) -> torch.Tensor:
    """``clip_scale`` as a device scalar (shape ``(1,)``, fp32), without a host sync: computed in fp64 and rounded
    once, like the Python-float scale handed to torch as ``alpha``."""
    norm = torch.linalg.vector_norm(g).double()
    ok = (norm > threshold) & torch.isfinite(norm)
    return torch.where(ok, threshold / norm, torch.ones_like(norm)).float().reshape(1)


def first_step(g: torch.Tensor, *, momentum: float, nesterov: bool,
               scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """New contiguous fp32 ``(u, v)`` of a tensor's first step, from ``u = v = 0``: ``u = scale * g``, ``v = u``
    (Nesterov: ``v = (1 + m) u``)."""
    u = torch.mul(g, scale, out=torch.empty(g.shape, device=g.device))
    v = u.mul(1.0 + momentum) if nesterov else u.clone()
    return u, v


def accumulate_(g: torch.Tensor, u: torch.Tensor, v: torch.Tensor, *, momentum: float, nesterov: bool,
                scale: float = 1.0) -> None:
    """Momentum correction and accumulation, in place: ``u <- m u + scale g``, then ``v <- v + u`` (Nesterov:
    ``v <- v + scale g + m u``, with the new ``u``). Unclipped (``scale == 1``), ``u = g + m u`` is one fma pass."""
    if scale == 1.0:
        torch.add(g, u, alpha=momentum, out=u)
    else:
        u.mul_(momentum).add_(g, alpha=scale)
    if nesterov:
        v.add_(g, alpha=scale).add_(u, alpha=momentum)
    else:
        v.add_(u)


def mask_(u: torch.Tensor, indices: torch.Tensor) -> None:
    """Momentum factor masking: ``u`` (any shape, contiguous) is zeroed at the flat ``indices`` that were sent."""
    u.view(-1).index_fill_(0, indices, 0.0)

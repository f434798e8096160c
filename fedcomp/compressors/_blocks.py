"""Shared helpers for the quantizers: block views, per-block reductions, rounding, config checks.

A 1-D tensor of ``n`` values is cut into ``ceil(n / block)`` blocks; the last one may be partial. Helpers pad the
last block with zeros, which leaves sums, maxima and norms unchanged; use ``block_counts`` for the true sizes.
``block`` comes from the server's run config: padding beyond both ``n`` and ``MAX_PAD`` values (a block far larger
than the tensor) is not done, the tensor is then its one block unpadded, so memory stays within twice the tensor
plus ``MAX_PAD`` values.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F


def check_int(name: str, value: object, low: int, high: int | None = None) -> None:
    """Raise ``ValueError`` unless ``value`` is an int (not a bool) in ``[low, high]``."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an int, got {value!r}")
    if value < low or (high is not None and value > high):
        bounds = f">= {low}" if high is None else f"in [{low}, {high}]"
        raise ValueError(f"{name} must be {bounds}, got {value}")


def check_block(block: int | None) -> None:
    """``None`` (one block for the whole tensor) or an int >= 1."""
    if block is not None:
        check_int("block", block, 1)


def effective_block(block: int | None, n: int) -> int:
    """The block size to use for ``n`` values: ``block``, or ``n`` (at least 1) when ``block`` is ``None``."""
    return max(n, 1) if block is None else block


#: Zero values a tensor may be padded with beyond its own size (4 MiB of fp32; any block up to ``n + MAX_PAD`` is
#: padded as it always was, so its codes and scales are unchanged).
MAX_PAD = 1 << 20


def blocked(values: torch.Tensor, block: int) -> torch.Tensor:
    """``values`` (1-D) as ``(num_blocks, block)``, zero-padded; ``(1, n)`` when the padding would exceed both ``n``
    and ``MAX_PAD`` (a block far larger than the tensor). A view when no padding is needed: never write to it."""
    n = values.numel()
    nb = math.ceil(n / block)
    pad = nb * block - n
    if pad > max(n, MAX_PAD):  # only when block > n: the one block of the tensor's n values
        return values.reshape(1, n)
    if pad:
        values = F.pad(values, (0, pad))
    return values.reshape(nb, block)


def block_counts(n: int, block: int, device: torch.device | None = None) -> torch.Tensor:
    """Number of real (unpadded) values in each block, as float32."""
    nb = math.ceil(n / block)
    counts = torch.full((nb,), float(block), device=device)
    if nb:
        counts[-1] = n - (nb - 1) * block
    return counts


def positive_or_one(den: torch.Tensor) -> torch.Tensor:
    """``den`` with its zeros replaced by 1. Dividing a block by its scale this way maps an all-zero block to zeros
    (no NaN) without a per-element ``where``: a scale is 0 only when its block is (or rounds to) zero."""
    return torch.where(den > 0, den, 1.0)


def divide(t: torch.Tensor, d: float) -> torch.Tensor:
    """``t / d`` rounded once (IEEE division) on every device. ``t / d`` with a Python number is not: torch's CUDA
    kernels multiply by the reciprocal of a scalar divisor, one ulp off the quotient for some ``t`` (e.g. an
    absmax / 127), which moves codes and residuals; a 0-dim tensor on ``t``'s device is divided elementwise.

    >>> divide(torch.tensor([1.0, 254.0]), 127)
    tensor([0.0079, 2.0000])
    """
    return t / t.new_full((), d)


def l2_norms(blocks: torch.Tensor, divisor: float = 1.0) -> torch.Tensor:
    """``||row||_2 / divisor`` per row, as ``absmax * (||row / absmax|| / divisor)``: no overflow in the squares;
    a result beyond fp32's range saturates at the largest finite fp32 value."""
    absmax = blocks.abs().amax(dim=1)
    unit_norm = torch.linalg.vector_norm(blocks / positive_or_one(absmax)[:, None], dim=1)
    top = torch.finfo(blocks.dtype).max
    return (absmax * divide(unit_norm, divisor)).clamp_(max=top)


def stochastic_round_(r: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """Round each value down or up to a neighbouring integer with ``P(up) = r - floor(r)``: ``E[out] == r``.

    In place: ``r`` (a float tensor the caller owns) is overwritten; returns the rounded tensor. Uses
    ``floor(r) + (u < frac)`` rather than ``floor(r + u)``: the fraction is exact in floating point, so the result
    is always ``floor(r)`` or ``ceil(r)`` (``r + u`` can round past ``ceil(r)``).
    """
    # non_blocking: a host draw copied to a GPU without waiting for the work queued there (values unchanged)
    u = torch.rand(r.shape, generator=generator, device=generator.device).to(r.device, non_blocking=True)
    low = torch.floor(r)
    u.lt_(r.sub_(low))  # r := frac(r); u := 1.0 where u < frac, else 0.0
    return low.add_(u)

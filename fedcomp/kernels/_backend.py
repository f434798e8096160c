"""Backend choice for the kernel path: Triton for CUDA tensors, the torch reference for everything else.

Triton is imported lazily (only when a Triton kernel is about to run), so ``import fedcomp.kernels`` never
imports triton and a process can still set ``TRITON_INTERPRET=1`` afterwards. The interpreter runs the same
kernels on CPU tensors; it is how CI checks them without a GPU.
"""

from __future__ import annotations

import functools
import importlib.util
import os

import torch

KERNEL_BACKENDS = ("torch", "triton")


@functools.cache
def triton_available() -> bool:
    """Whether triton is installed (without importing it); looked up once per process (a lookup takes tens of
    microseconds, and every fused step asks)."""
    return importlib.util.find_spec("triton") is not None


def interpreting() -> bool:
    """Whether Triton's CPU interpreter is requested (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on")


def to_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on ``device`` without waiting for the device: pinned and non-blocking on CUDA (the pinned copy
    is kept by torch's caching host allocator until the transfer is done), a plain ``to`` elsewhere.

    >>> to_device(torch.arange(3), torch.device("cpu")).tolist()
    [0, 1, 2]
    """
    if device.type == "cuda":
        return host.pin_memory().to(device, non_blocking=True)
    return host.to(device)


def resolve(tensor: torch.Tensor, backend: str | None = None) -> str:
    """The backend to use for ``tensor``.

    ``None`` (auto): ``"triton"`` for a CUDA tensor when triton is installed, else ``"torch"``. An explicit
    ``"triton"`` on a CPU tensor needs the interpreter (``TRITON_INTERPRET=1`` set before triton's import).
    """
    if backend is None:
        return "triton" if tensor.is_cuda and triton_available() else "torch"
    if backend not in KERNEL_BACKENDS:
        raise ValueError(f"backend must be one of {KERNEL_BACKENDS} or None, got {backend!r}")
    if backend == "triton":
        if not triton_available():
            raise RuntimeError("backend 'triton' requested but triton is not installed")
        if not tensor.is_cuda and not interpreting():
            raise RuntimeError("backend 'triton' on CPU tensors needs TRITON_INTERPRET=1 set before importing triton")
    return backend

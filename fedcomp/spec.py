"""The model spec: ordered tensor names and shapes, and a fingerprint both ends agree on."""

from __future__ import annotations

import hashlib
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class ModelSpec:
    """Ordered ``(name, shape)`` pairs of the float tensors an update covers.

    ``fingerprint`` (8 bytes) is a hash of names and shapes: a payload built for another model (or another
    ordering) fails to decode instead of being applied to the wrong tensors.

    Names are distinct strings and shapes tuples of ints >= 0 (not bools); anything else is a ``ValueError`` at
    construction (a negative dimension would make negative byte counts downstream).
    """

    entries: tuple[tuple[str, tuple[int, ...]], ...]

    def __post_init__(self) -> None:
        if (problem := entries_problem(self.entries)) is not None:
            raise ValueError(problem)

    @staticmethod
    def from_tensors(tensors: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]]) -> ModelSpec:
        items = tensors.items() if isinstance(tensors, Mapping) else tensors
        return ModelSpec(tuple((name, tuple(int(d) for d in t.shape)) for name, t in items))

    @staticmethod
    def from_module(module: torch.nn.Module) -> ModelSpec:
        """Spec over the module's trainable parameters, in ``named_parameters()`` order."""
        return ModelSpec.from_tensors((n, p) for n, p in module.named_parameters() if p.requires_grad)

    @property
    def names(self) -> list[str]:
        return [n for n, _ in self.entries]

    def shape(self, name: str) -> tuple[int, ...]:
        return dict(self.entries)[name]

    def numel(self, name: str) -> int:
        return math.prod(self.shape(name))

    @property
    def total_numel(self) -> int:
        return sum(math.prod(s) for _, s in self.entries)

    @property
    def dense_bytes(self) -> int:
        """Size of the model as dense fp32, the baseline every compression ratio is against."""
        return 4 * self.total_numel

    @property
    def fingerprint(self) -> bytes:
        h = hashlib.blake2b(digest_size=8)
        for name, shape in self.entries:
            h.update(name.encode())
            h.update(b"\0")
            h.update(",".join(map(str, shape)).encode())
            h.update(b"\n")
        return h.digest()

    def __len__(self) -> int:
        return len(self.entries)


def entries_problem(entries: Iterable[tuple[object, object]]) -> str | None:
    """What is wrong with ``(name, shape)`` pairs, in words (``None``: nothing): names must be distinct strings and
    shapes tuples of ints >= 0 (``is_shape``).

    >>> entries_problem([("w", (2,)), ("w", (3,))])
    "names must be distinct strings: 'w' is not a str or comes twice"
    """
    seen: set[object] = set()
    for name, shape in entries:
        if not isinstance(name, str) or name in seen:
            return f"names must be distinct strings: {name!r} is not a str or comes twice"
        seen.add(name)
        if not is_shape(shape):
            return f"{name!r}: shape must be a tuple of ints >= 0, got {shape!r}"
    return None


def is_shape(shape: object) -> bool:
    """Whether ``shape`` is a tuple of ints >= 0 (bools are not dimensions).

    >>> is_shape((3, 0)), is_shape((-1,)), is_shape([3]), is_shape((True,))
    (True, False, False, False)
    """
    return isinstance(shape, tuple) and all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape)

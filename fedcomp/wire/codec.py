"""Placeholder: implemented by the wire-codec work."""

from __future__ import annotations

from fedcomp.payload import Update
from fedcomp.spec import ModelSpec


def encode(update: Update, spec: ModelSpec) -> bytes:
    raise NotImplementedError


def decode(blob: bytes, spec: ModelSpec, *, max_bytes: int | None = None) -> Update:
    raise NotImplementedError


def encoded_size_breakdown(blob: bytes, spec: ModelSpec) -> dict[str, int]:
    raise NotImplementedError

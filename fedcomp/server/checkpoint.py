"""Atomic file writes: a crash leaves the old file or the new one, never a torn one.

One helper for every state that must survive a crash: the server checkpoint (``server_loop.Reporter``) and the
client session (``fedcomp.flower.ClientSession.save``).

>>> atomic_write(tmp_path / "state.pt", b"...")  # doctest: +SKIP
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO


def atomic_write(path: str | os.PathLike[str], data: bytes | Callable[[BinaryIO], object]) -> None:
    """Write ``data`` (bytes, or a function that writes into the open file) to ``path.tmp``, flush and fsync it,
    then ``os.replace`` it over ``path``."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        if isinstance(data, (bytes, bytearray, memoryview)):
            f.write(data)
        else:
            data(f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)

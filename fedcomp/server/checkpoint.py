"""Atomic file writes: a crash leaves the old file or the new one, never a torn one.

One helper for every state that must survive a crash: the server checkpoint (``server_loop.Reporter``) and the
client session (``fedcomp.flower.ClientSession.save``).

>>> atomic_write(tmp_path / "state.pt", b"...")  # doctest: +SKIP
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO


def atomic_write(
    path: str | os.PathLike[str], data: bytes | Callable[[BinaryIO], object], mode: int = 0o600
) -> None:
    """Write ``data`` (bytes, or a function that writes into the open file) to a temporary file of its own beside
    ``path`` (a unique name per writer, created with ``mode``: owner-only by default), flush and fsync it, then
    ``os.replace`` it over ``path`` and fsync the folder. Two writers never share a temporary file; the last
    replace wins whole."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        os.fchmod(fd, mode)
        with os.fdopen(fd, "wb") as f:
            if isinstance(data, (bytes, bytearray, memoryview)):
                f.write(data)
            else:
                data(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)

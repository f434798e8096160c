"""Keep freed memory in the process for reuse (glibc's allocator), so a training process's tasks stop page-faulting.

glibc hands blocks above its mmap threshold (128 KiB, rising with what is freed) straight back to the kernel on
``free`` and trims the heap's free top above its trim threshold: every task's fresh multi-megabyte tensors (the
model copy, the update, gradients, the saved client state) then come back as zero-filled pages, one minor fault
per 4 KiB. A training step of the main job's model faulted about 1,500 times; with blocks up to 32 MiB served
from the heap and the heap never trimmed, none (docs/results.md). The process keeps its peak heap instead.
Called once per process that trains: each simulation process (``simulations.runner.drive``) and a node's warm
worker (``clients.worker``).

    >>> keep_freed_memory()   # before the work; False where the C library is not glibc
    True
"""

from __future__ import annotations

import ctypes
import ctypes.util
from functools import cache

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc's malloc.h
MMAP_THRESHOLD = 32 << 20  # glibc's largest accepted value on 64-bit
TRIM_THRESHOLD = (1 << 31) - 1  # mallopt takes a C int


@cache  # once per process: each simulated method's run calls it, the settings stay
def keep_freed_memory() -> bool:
    """Serve blocks up to 32 MiB from the heap and never trim it; ``True`` when glibc took both settings."""
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError, TypeError):  # not glibc (musl, macOS): its allocator stays as it is
        return False
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    return bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD))

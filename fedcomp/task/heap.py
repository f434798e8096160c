"""Keep freed memory in the process for reuse (glibc's allocator), so a training process's tasks stop page-faulting.

glibc hands blocks above its mmap threshold (128 KiB, rising with what is freed; 32 MiB at most) straight back
to the kernel on ``free`` and trims the heap's free top above its trim threshold: every task's fresh
multi-megabyte tensors (the model copy, the update, gradients, the saved client state) then come back as
zero-filled pages, one minor fault per 4 KiB. A training step of the main job's model faulted about 1,500 times;
with every block served from the heap (no mmap'd blocks at all: the client state of the main job is 25-35 MB,
over the largest threshold) and the heap never trimmed, none (docs/results.md). The process keeps its peak heap
instead.
Called once per process that trains: each simulation process (``simulations.runner.drive``) and a node's warm
worker (``clients.worker``).

    >>> keep_freed_memory()   # before the work; False where the C library is not glibc
    True
"""

from __future__ import annotations

import ctypes
import ctypes.util
from functools import cache

M_TRIM_THRESHOLD, M_MMAP_MAX = -1, -4  # glibc's malloc.h
TRIM_THRESHOLD = (1 << 31) - 1  # mallopt takes a C int


@cache  # once per process: each simulated method's run calls it, the settings stay
def keep_freed_memory() -> bool:
    """Serve every block from the heap (no mmap'd blocks) and never trim it; ``True`` when glibc took both
    settings."""
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError, TypeError):  # not glibc (musl, macOS): its allocator stays as it is
        return False
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    return bool(mallopt(M_MMAP_MAX, 0)) and bool(mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD))

"""The session this process saved last, per state dir: a warm node's next task takes it from memory instead of
reading and deserializing the file it wrote (``ClientSession.load`` / ``save`` with a ``state_dir``).

The file stays the truth. An entry is the object saved, the ``FileIdentity`` of the file that save wrote and
what the session was made for (``fits``: compression, model spec, kernels, run key). ``take`` hands the object
out only while the file at the path is still that very file (no other process, no other writer replaced it
since) and the task asks for the same ``fits``; otherwise the caller reads the file as it would without a
cache. Either way the entry is gone once taken: a task that fails after loading (an exception, a hostile
record) never saves, so the next task reads the file again and never sees the failed task's changes. ``keep``
is called only after a successful save. One entry per state dir, at most ``MAX_DIRS`` dirs (the one used least
recently goes first), so a process holds at most one model-sized session per folder. The entry is the session of
the folder's current file only: a task of another run (another key in ``fits``) misses, its entry is dropped, and
``ClientSession.load`` reads that run's own file (``StateDir.take_back``). A warm process serving two runs in turn
thus reads a file at each switch of run, and never hands one run's session to another.

>>> cache = SessionCache()
>>> folder = StateDir(tmp_path)                                  # doctest: +SKIP
>>> cache.keep(folder, folder.write(b"state"), ("run", 1), "the session")   # doctest: +SKIP
>>> cache.take(folder, ("run", 1))                              # doctest: +SKIP
'the session'
>>> cache.take(folder, ("run", 1)) is None                      # doctest: +SKIP
True
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Hashable
from dataclasses import dataclass
from pathlib import Path
from typing import Generic, TypeVar

from fedcomp.flower.statedir import FileIdentity, StateDir

T = TypeVar("T")
MAX_DIRS = 4  # state dirs a process keeps a session for (a node has one; tests and benchmarks may use more)


@dataclass(frozen=True)
class _Entry(Generic[T]):
    identity: FileIdentity
    fits: Hashable
    value: T


class SessionCache(Generic[T]):
    """What ``keep`` was given last per state dir, handed out once by ``take`` while the file is unchanged."""

    def __init__(self, max_dirs: int = MAX_DIRS) -> None:
        self.max_dirs = max_dirs
        self._entries: OrderedDict[Path, _Entry[T]] = OrderedDict()
        self._lock = threading.Lock()
        self.hits = self.misses = 0

    def __len__(self) -> int:
        return len(self._entries)

    def take(self, folder: StateDir, fits: Hashable) -> T | None:
        """The value kept for ``folder`` if its file is still the one saved with it and ``fits`` is the same;
        ``None`` otherwise (read the file). The entry is removed in both cases."""
        with self._lock:
            entry = self._entries.pop(_key(folder), None)
        if entry is not None and entry.fits == fits and folder.identity() == entry.identity:
            self.hits += 1
            return entry.value
        self.misses += 1
        return None

    def keep(self, folder: StateDir, identity: FileIdentity | None, fits: Hashable, value: T) -> None:
        """After a successful save of ``value`` into ``folder`` (``identity``: what ``StateDir.write`` returned;
        ``None`` keeps nothing, the next task reads the file)."""
        key = _key(folder)
        with self._lock:
            self._entries.pop(key, None)
            if identity is None or self.max_dirs < 1:
                return
            self._entries[key] = _Entry(identity, fits, value)
            while len(self._entries) > self.max_dirs:
                self._entries.popitem(last=False)

    def drop(self, folder: StateDir | None = None) -> None:
        """Forget ``folder``'s entry (every entry without one)."""
        with self._lock:
            if folder is None:
                self._entries.clear()
            else:
                self._entries.pop(_key(folder), None)


def _key(folder: StateDir) -> Path:
    return Path(folder.path).resolve()

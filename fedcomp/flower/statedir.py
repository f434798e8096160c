"""A client's state folder (``flower-client --state-dir``): the sessions of the server runs it serves, owner-only,
one node at a time.

The session in it is the client's own data (its residual and pending updates hold its gradients), so::

    DIR/                              0700, whoever made it (an existing folder is narrowed to 0700; refused
                                      with an entry not the user's own file or folder, with a symlink of another
                                      user's on the way, or under a folder another user owns or may write
                                      without the sticky bit: ``_check_path``)
    DIR/client-state.pt               the session of the run whose task came last (0600), replaced atomically;
                                      the process that wrote it last keeps it in memory while the file is that
                                      one (``FileIdentity``, ``fedcomp.flower.sessioncache``)
    DIR/client-state.run-<key>.pt     the sessions of the other runs (``<key>``: the run key in hex, ``0`` for
                                      a server that sends none), set aside when a task of another run came
    DIR/.node.lock                    held by the node using the folder for its whole life (``claim``): a second
                                      node given the same folder stops at start with ``StateDirInUse``
    DIR/.session.lock                 held by the process running a task from loading the session to saving it
                                      (``session_lock``): the warm worker and a task run beside it never
                                      interleave

A run never mixes with another's state, and none loses its own: a task of run K continues K's session wherever it
is (``ClientSession.load``): the current file, else K's set-aside file, which becomes the current one
(``take_back``) while the current one is set aside under its own run's key. Two runs served in turn by one node
each continue their own residual and pending updates. The folder keeps at most ``KEEP_ASIDE`` set-aside sessions
(each holds a residual the size of the model): setting one more aside removes those whose run sent a task least
recently (oldest file), each with a warning that names its run key, for that run's residual and pending updates are
gone; a task of that run later starts a fresh session.

>>> folder = StateDir(tmp_path / "state").prepare()          # doctest: +SKIP
>>> with folder.session_lock():                               # doctest: +SKIP
...     folder.write(session.to_bytes())
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import grp
import os
import pwd
import stat
import time
from collections.abc import Iterator
from logging import WARNING
from pathlib import Path
from typing import IO, BinaryIO, NamedTuple

from flwr.common.logger import log

from fedcomp.server.checkpoint import atomic_write

STATE_FILE = "client-state.pt"
ASIDE_PREFIX, ASIDE_SUFFIX = "client-state.run-", ".pt"  # client-state.run-<key in hex>.pt
NODE_LOCK, SESSION_LOCK = ".node.lock", ".session.lock"
KEEP_ASIDE = 3  # set-aside sessions a folder keeps (other runs'); one more removes the oldest, with a warning
LOCK_WAIT = 120.0  # seconds a task waits for another process's task on the same folder (a hung one is restarted)


class FileIdentity(NamedTuple):
    """Which file is at a path: device, inode, size, modification and change times (ns). Every fedcomp write
    is a new file renamed into place: another writer's file has another inode while this process's is in place,
    and its own change time (the rename's) if it reuses a freed one; a file changed in place has a new change
    time."""

    dev: int
    ino: int
    size: int
    mtime_ns: int
    ctime_ns: int

    @staticmethod
    def of(st: os.stat_result) -> FileIdentity:
        return FileIdentity(st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


class StateDirInUse(RuntimeError):
    """Another node (or another process's task, past the wait) holds the folder."""


class StateDir:
    """The folder at ``path`` (see the module docstring for its layout and rules)."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)

    @property
    def file(self) -> Path:
        return self.path / STATE_FILE

    def prepare(self) -> StateDir:
        """Make the folder (0700) or narrow an existing one of this user's to 0700 and its files to 0600.
        ``PermissionError``, before anything in it is read or written (``_check_path``, ``_check_entry``): a
        folder of another user's, or a symlink of another user's in its place; a folder another user could move
        away (an ancestor writable by others without the sticky bit: the next task would make a fresh one); an
        entry that is not this user's file or folder (planted while the folder was open to others: a session the
        node would load, a lock held for good, a symlink a write would follow)."""
        _check_path(self.path)
        self.path.mkdir(mode=0o700, parents=True, exist_ok=True)
        _check_path(self.path)  # again: a folder on the way another user made in between
        st = self.path.stat()
        if st.st_uid != os.getuid():
            raise PermissionError(f"state dir {self.path} belongs to uid {st.st_uid}, not to this user")
        if stat.S_IMODE(st.st_mode) != 0o700:
            os.chmod(self.path, 0o700)
        for entry in self.path.iterdir():
            est = _check_entry(entry)
            if stat.S_ISREG(est.st_mode) and est.st_mode & 0o077:
                os.chmod(entry, 0o600)
        return self

    def read(self) -> bytes | None:
        """The session file's bytes, or ``None`` when there is none."""
        return _read(self.file)

    def identity(self) -> FileIdentity | None:
        """The session file's ``FileIdentity`` now, or ``None`` when there is none."""
        try:
            return FileIdentity.of(self.file.stat())
        except FileNotFoundError:
            return None

    def write(self, data: bytes) -> FileIdentity | None:
        """Replace the session file atomically (a unique temporary name, 0600, fsync, rename); the folder is made
        0700 if missing (``session_lock`` and ``claim`` narrow an existing one). Returns the identity of the file
        this call wrote, as it stands at the path after the rename (``None``: another writer replaced it already)."""
        self.path.mkdir(mode=0o700, parents=True, exist_ok=True)
        written: list[os.stat_result] = []

        def put(f: BinaryIO) -> None:
            f.write(data)
            f.flush()
            written.append(os.fstat(f.fileno()))  # the temporary file's inode: the rename keeps it

        atomic_write(self.file, put, mode=0o600)
        now = self.identity()
        if now is None or (now.dev, now.ino) != (written[0].st_dev, written[0].st_ino):
            return None
        return now

    def aside(self, run_key: int) -> Path:
        """Where the session of run ``run_key`` lies while another run's is the current one."""
        return self.path / f"{ASIDE_PREFIX}{run_key:x}{ASIDE_SUFFIX}"

    def read_aside(self, run_key: int) -> bytes | None:
        """The bytes of run ``run_key``'s set-aside session, or ``None`` when there is none."""
        return _read(self.aside(run_key))

    def set_aside(self, run_key: int) -> Path | None:
        """Move the current session (of run ``run_key``) out of the way, to ``aside(run_key)``; beyond
        ``KEEP_ASIDE`` set-aside sessions the oldest are removed, each with a warning. Returns where it went
        (``None``: there was none)."""
        if not self.file.exists():
            return None
        aside = self._put_aside(run_key)
        self._bound()
        return aside

    def take_back(self, run_key: int, current_run: int | None) -> None:
        """Make run ``run_key``'s set-aside session the current one; the current one, of run ``current_run``
        (``None``: there is none), is set aside first. A crash between the two renames leaves both set aside and
        no current file: each run's next task still finds its own."""
        if current_run is not None and self.file.exists():
            self._put_aside(current_run)
        os.replace(self.aside(run_key), self.file)
        self._bound()

    def _put_aside(self, run_key: int) -> Path:
        aside = self.aside(run_key)
        if aside.exists():  # not made by fedcomp (one run's session is in one place), but never dropped unseen
            log(WARNING, "[fedcomp] state dir %s: the set-aside session of run %x is replaced by the current "
                "session of the same run key", self.path, run_key)
        os.replace(self.file, aside)
        return aside

    def _bound(self) -> None:
        """Remove the set-aside sessions beyond the newest ``KEEP_ASIDE``, naming each one's run in a warning."""
        kept = sorted(self.path.glob(f"{ASIDE_PREFIX}*{ASIDE_SUFFIX}"), key=lambda p: p.stat().st_mtime_ns,
                      reverse=True)
        for old in kept[KEEP_ASIDE:]:
            key = old.name[len(ASIDE_PREFIX):-len(ASIDE_SUFFIX)]
            log(WARNING, "[fedcomp] state dir %s keeps %d sessions of other runs: the client state of run %s "
                "(%s, its residual and pending updates) is removed; a later task of that run starts afresh",
                self.path, KEEP_ASIDE, key, old.name)
            old.unlink(missing_ok=True)

    @contextlib.contextmanager
    def session_lock(self, wait: float | None = None) -> Iterator[None]:
        """Hold the folder's session lock (waiting up to ``wait`` seconds, default ``LOCK_WAIT``, for another
        process's task)."""
        wait = LOCK_WAIT if wait is None else wait
        self.prepare()
        with _lock_file(self.path / SESSION_LOCK) as f:
            end = time.monotonic() + wait
            while not _try_lock(f):
                if time.monotonic() >= end:
                    raise StateDirInUse(f"state dir {self.path}: another task held it for {wait:g} s")
                time.sleep(0.05)
            yield

    def claim(self) -> NodeClaim:
        """Take the folder for this node for as long as the returned claim is open; ``StateDirInUse`` (naming the
        holder's pid) when another node has it."""
        self.prepare()
        f = _open_private(self.path / NODE_LOCK)  # held for the node's life
        if not _try_lock(f):
            f.seek(0)
            holder = f.read().strip() or "unknown"
            f.close()
            raise StateDirInUse(
                f"state dir {self.path} is in use by another node (pid {holder}); give each node its own --state-dir"
            )
        f.seek(0)
        f.truncate()
        f.write(str(os.getpid()))
        f.flush()
        return NodeClaim(f)


class NodeClaim:
    """An open, locked ``.node.lock``; ``release()`` (or the process's end) frees the folder."""

    def __init__(self, f: IO[str]) -> None:
        self.f: IO[str] | None = f

    def release(self) -> None:
        if self.f is not None:
            self.f.close()
            self.f = None


def _check_path(path: Path) -> None:
    """``PermissionError`` when another user could swap or move the folder at ``path``, as OpenSSH's StrictModes
    refuses: a symlink on the way (``_links_on_the_way``) that is not this user's or root's (its owner could point it
    elsewhere), or an existing folder above the real path that another user owns or that group or others may write
    (others with the sticky bit are fine, as in /tmp: only an entry's owner may move it there). Missing folders
    are skipped: ``prepare`` checks again once it has made them.

    >>> _check_path(Path(tmp_path) / "node0" / "state")                        # doctest: +SKIP
    """
    trusted = (0, os.getuid())
    _links_on_the_way(path, trusted)
    for folder in Path(os.path.realpath(path)).parents:
        try:
            st = os.stat(folder)
        except FileNotFoundError:
            continue
        mode = stat.S_IMODE(st.st_mode)
        if st.st_uid not in trusted:
            raise PermissionError(f"state dir {path}: {folder} belongs to uid {st.st_uid}, who could move the state "
                                  "away or swap it with another; use a folder under one of this user's")
        group = mode & stat.S_IWGRP and not _private_group(st.st_gid)
        if (mode & stat.S_IWOTH or group) and not mode & stat.S_ISVTX:
            who = "every user" if mode & stat.S_IWOTH else "its group"
            raise PermissionError(f"state dir {path}: {folder} is writable by {who} (mode {mode:o}, no sticky bit), so "
                                  "another user could move the state away; use a folder under a private one")


def _private_group(gid: int) -> bool:
    """Whether group ``gid`` is this user's own (its primary group, with no other member listed and no other
    account's primary group, as OpenSSH checks): a user-private group, where umask 002 makes folders
    group-writable that no one else can write. (``nogroup`` lists no member but is ``nobody``'s and others'.)"""
    try:
        members = set(grp.getgrgid(gid).gr_mem)
        me = pwd.getpwuid(os.getuid()).pw_name
    except KeyError:
        return False
    if gid != os.getgid() or not members <= {me}:
        return False
    return not _another_accounts_group(gid, os.getuid())


@functools.lru_cache(maxsize=8)
def _another_accounts_group(gid: int, uid: int) -> bool:
    """Whether ``gid`` is the primary group of an account other than ``uid`` (every account listed once per
    process: a directory service may take seconds, and each task checks its state dir's folders)."""
    return any(user.pw_gid == gid and user.pw_uid != uid for user in pwd.getpwall())


def _links_on_the_way(path: Path, trusted: tuple[int, ...]) -> None:
    """Follow ``path`` one component at a time as the kernel does (``..`` after a link goes up from its target):
    ``PermissionError`` for a symlink whose owner is not in ``trusted``, or for more than 40 of them (a loop)."""
    todo = list(Path(os.path.join(os.getcwd(), path)).parts)
    here, hops = Path(todo.pop(0)), 0
    while todo:
        step = here / todo.pop(0)
        try:
            st = os.lstat(step)
        except FileNotFoundError:
            return
        if not stat.S_ISLNK(st.st_mode):
            here = Path(os.path.realpath(step))
            continue
        if st.st_uid not in trusted:
            raise PermissionError(f"state dir {path}: {step} is a symlink of uid {st.st_uid}, not of this user")
        hops += 1
        if hops > 40:
            raise PermissionError(f"state dir {path}: too many symlinks on the way")
        target = Path(os.readlink(step))
        if target.is_absolute():
            here, todo = Path(target.anchor), [*target.parts[1:], *todo]
        else:
            todo = [*target.parts, *todo]


def _check_entry(entry: Path) -> os.stat_result:
    """``entry``'s ``lstat``, or ``PermissionError`` unless it is this user's regular file or folder."""
    est = entry.lstat()
    if est.st_uid != os.getuid() or not (stat.S_ISREG(est.st_mode) or stat.S_ISDIR(est.st_mode)):
        kind = "symlink" if stat.S_ISLNK(est.st_mode) else "file" if stat.S_ISREG(est.st_mode) else "special file"
        raise PermissionError(f"state dir {entry.parent} holds {entry.name}, a {kind} of uid {est.st_uid} that this "
                              "node did not make: remove it (another user may have planted it)")
    return est


def _read(path: Path) -> bytes | None:
    """The bytes of the file at ``path`` (never through a symlink: ``OSError``), or ``None`` when there is none."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except FileNotFoundError:
        return None
    with os.fdopen(fd, "rb") as f:
        return f.read()


def _open_private(path: Path) -> IO[str]:
    """``path`` opened read-write, made 0600 if new; never through a symlink (``OSError``)."""
    return os.fdopen(os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600), "r+")


@contextlib.contextmanager
def _lock_file(path: Path) -> Iterator[IO[str]]:
    with _open_private(path) as f:
        yield f


def _try_lock(f: IO[str]) -> bool:
    try:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False

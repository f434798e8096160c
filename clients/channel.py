"""The private local channel between a node's thin ClientApp and its warm worker (standard library only).

``flower-client --worker warm`` writes a random key into an owner-only (0600) file and tells the ClientApp, in
the node config, where the worker listens and where the key is::

    worker-socket = "<private dir>/worker.sock"   # a Unix socket (0600) in a 0700 folder
    worker-key    = "<private dir>/worker.key"    # the authentication key (0600)
    worker-wait   = 20.0                          # optional: seconds to wait for the worker to accept

``multiprocessing.connection`` authenticates both ends with the key (HMAC challenge both ways) before a single
pickled object crosses, so only a process that can read the key file can talk to the worker.

Nothing waits forever: the worker gives a connection ``AUTH_WAIT`` seconds for the handshake (``accept``); the
ClientApp gives the worker ``wait`` seconds to answer it and the task's own deadline to reply (``request``). The
worker handles one connection at a time and says which it is doing in a status file next to its socket
(``<socket>.status``, 0600): waiting for connections since when, or busy with one until when (the reply deadline
its request named). A worker silent at the handshake is busy, and left alone (the task runs in the ClientApp
process), unless it is known to be hung (``known_hung``: it has been waiting for connections since before ours
arrived, or it is busy past the time it gave); a hung worker, or one that takes a task and sends no reply by the
task's deadline, is killed (its pid read from the socket's peer credentials); ``flower-client`` starts a new
one, which continues from the state dir.

>>> ep = Endpoint.from_node_config({"worker-socket": "/run/n/worker.sock", "worker-key": "/run/n/worker.key"})
>>> ep.wait, node_settings({"partition-id": 0, "worker-socket": "x"})
(20.0, {'partition-id': 0})
"""

from __future__ import annotations

import contextlib
import os
import secrets
import signal
import socket
import stat
import struct
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from multiprocessing import AuthenticationError
from multiprocessing.connection import Connection, Listener, answer_challenge, deliver_challenge
from pathlib import Path
from typing import Any

#: Version of the request/reply dictionaries; a worker with another version is refused (the task runs in-process).
PROTOCOL = 1
SOCKET_KEY, KEY_KEY, WAIT_KEY = "worker-socket", "worker-key", "worker-wait"
WORKER_KEYS = (SOCKET_KEY, KEY_KEY, WAIT_KEY)
DEFAULT_WAIT = 20.0  # covers a worker that is (re)starting: imports, back-off
KEY_BYTES = 32
AUTH_WAIT = 5.0  # seconds the worker gives a connection to finish the handshake
TASK_WAIT = 3600.0  # the reply deadline when the task names none
LONGEST_WAIT = 2_000_000.0  # seconds (23 days): a longer task deadline waits this long (Connection.poll's limit)
REPLY_WITHIN = "reply_within"  # the request's key: the seconds the forwarder waits for the reply
IDLE, BUSY = "idle", "busy"  # a worker's status: waiting for connections since, or busy with one until (time.time())


class Unreachable(RuntimeError):
    """The worker did not take the task (absent, dead, busy past the wait, refused, or it died mid-task)."""


class Restarting(Unreachable):
    """The worker refused the task because it runs other code than the task's app, and restarts on that code."""


class WorkerHung(RuntimeError):
    """The worker took the task but sent no reply by its deadline; it was killed (the task fails, nothing is lost:
    the server nacks it, and the session in the state dir is the one before the task or holds its update)."""


def node_settings(node_config: Mapping[str, Any]) -> dict[str, Any]:
    """``node_config`` without the worker's keys (what ``NodeConfig`` validates)."""
    return {k: v for k, v in node_config.items() if k not in WORKER_KEYS}


@dataclass(frozen=True)
class Endpoint:
    """Where a worker listens (``socket``) and the file holding its key (``key_file``)."""

    socket: str
    key_file: str
    wait: float = DEFAULT_WAIT

    @staticmethod
    def from_node_config(node_config: Mapping[str, Any]) -> Endpoint | None:
        """The endpoint the node config names, or ``None`` (no worker: the task runs in-process)."""
        if not node_config.get(SOCKET_KEY):
            return None
        return Endpoint(str(node_config[SOCKET_KEY]), str(node_config.get(KEY_KEY, "")),
                        float(node_config.get(WAIT_KEY, DEFAULT_WAIT)))

    def key(self) -> bytes:
        return read_key(Path(self.key_file))


def owner_only(path: Path) -> bool:
    """True when ``path`` belongs to this user and no one else may read, write or enter it."""
    st = path.stat()
    return st.st_uid == os.getuid() and not st.st_mode & 0o077


def private_dir(path: Path) -> Path:
    """``path`` as a folder only this user can enter (made with mode 0700); ``PermissionError`` if it exists and
    others can reach it."""
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    if not owner_only(path):
        raise PermissionError(f"{path} must be owner-only (mode 0700), is {stat.filemode(path.stat().st_mode)}")
    return path


def write_key(path: Path) -> bytes:
    """A fresh random key in a new owner-only (0600) file at ``path``."""
    key = secrets.token_bytes(KEY_BYTES)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(key)
    return key


def read_key(path: Path) -> bytes:
    """The key in ``path``; ``PermissionError`` unless the file is owner-only."""
    if not owner_only(path):
        raise PermissionError(f"{path} must be owner-only (mode 0600), is {stat.filemode(path.stat().st_mode)}")
    key = path.read_bytes()
    if len(key) < 16:
        raise PermissionError(f"{path} holds no usable key")
    return key


def status_file(socket_path: str) -> Path:
    """Where the worker listening at ``socket_path`` keeps its status (``WorkerListener``)."""
    return Path(f"{socket_path}.status")


def worker_status(socket_path: str) -> tuple[int, str, float] | None:
    """The status the worker at ``socket_path`` last wrote: its pid, ``IDLE`` (waiting for connections since the
    time) or ``BUSY`` (with a connection until the time); None when there is none or it cannot be read."""
    try:
        pid, word, at = status_file(socket_path).read_text().split()
        return int(pid), word, float(at)
    except (OSError, ValueError):
        return None


def known_hung(socket_path: str, pid: int | None, since: float) -> bool:
    """True when the worker ``pid`` that has not answered a handshake started at ``since`` (``time.time()``) is
    hung rather than busy: its status says it has been waiting for connections since before ``since`` (ours was in
    its queue all along), or that it is busy past the time it gave. False (busy, for all we know) when the status
    is another process's or missing, or when the worker went back to waiting only after ``since``."""
    status = worker_status(socket_path)
    if pid is None or status is None or status[0] != pid:
        return False
    _, word, at = status
    return at < since if word == IDLE else at < time.time()


class WorkerListener:
    """The worker's end: a Unix socket (0600) in an owner-only folder (a socket file left by a dead worker is
    replaced); ``accept`` authenticates each connection by the key within ``auth_wait`` seconds. The listener
    keeps the worker's status file (``status_file``): ``IDLE`` while ``accept`` waits, ``BUSY`` from the moment it
    takes a connection until the next ``accept`` (for ``auth_wait`` + ``TASK_WAIT`` seconds, or as ``busy`` says
    once the request names its deadline). A status that cannot be written is skipped (forwarders then go by the
    last one written, or take the worker for busy when there is none)."""

    def __init__(self, endpoint: Endpoint, auth_wait: float = AUTH_WAIT) -> None:
        path = Path(endpoint.socket)
        private_dir(path.parent)
        if path.is_socket():
            path.unlink()
        self.key, self.auth_wait = endpoint.key(), auth_wait
        self.status = status_file(str(path))
        self.listener = Listener(str(path), family="AF_UNIX")  # no authkey: the handshake is ours, bounded
        os.chmod(path, 0o600)

    def accept(self) -> Connection:
        """The next authenticated connection; ``AuthenticationError`` for a wrong key, ``TimeoutError`` for a
        peer that did not finish the handshake in time (both closed)."""
        self._write_status(IDLE, time.time())
        conn = self.listener.accept()
        self.busy(self.auth_wait + TASK_WAIT)
        try:
            with deadline(self.auth_wait, "the handshake"):
                deliver_challenge(conn, self.key)
                answer_challenge(conn, self.key)
        except BaseException:
            conn.close()
            raise
        return conn

    def busy(self, seconds: float) -> None:
        """Say that the connection taken holds this worker for up to ``seconds`` more."""
        self._write_status(BUSY, time.time() + seconds)

    def _write_status(self, word: str, at: float) -> None:
        tmp = self.status.with_name(self.status.name + ".tmp")
        with contextlib.suppress(OSError):
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "w") as f:
                f.write(f"{os.getpid()} {word} {at:.6f}\n")
            os.replace(tmp, self.status)  # whole, never half-written

    def close(self) -> None:
        self.listener.close()

    def __enter__(self) -> WorkerListener:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def listen(endpoint: Endpoint) -> WorkerListener:
    return WorkerListener(endpoint)


@contextlib.contextmanager
def deadline(seconds: float, what: str) -> Iterator[None]:
    """Raise ``TimeoutError`` in this (main) thread if the block takes more than ``seconds`` (a blocking read
    included): SIGALRM, so only for single-threaded processes such as the worker."""

    def expired(signum: int, frame: Any) -> None:
        raise TimeoutError(f"{what} took more than {seconds:g} s")

    old = signal.signal(signal.SIGALRM, expired)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def peer_pid(conn: Connection) -> int | None:
    """The pid of the process at the other end of a Unix-socket connection (``SO_PEERCRED``), or None."""
    try:
        with socket.socket(fileno=os.dup(conn.fileno())) as sock:
            pid, _, _ = struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))
        return pid or None
    except (OSError, AttributeError):
        return None


def kill_worker(pid: int | None, why: str) -> None:
    """SIGKILL a worker that stopped answering (its launcher restarts it); says so on stderr."""
    if pid is None or pid == os.getpid():
        return
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.kill(pid, signal.SIGKILL)
        print(f"fedcomp: killed worker pid {pid}: {why}", flush=True)


def connect(endpoint: Endpoint) -> Connection:
    """An authenticated connection to the worker, trying until ``endpoint.wait`` seconds have passed (a worker
    may be starting or restarting); ``Unreachable`` after that or when the keys differ."""
    try:
        key = endpoint.key()
    except OSError as exc:
        raise Unreachable(f"worker key: {exc}") from exc
    end = time.monotonic() + endpoint.wait
    while True:
        left, since = end - time.monotonic(), time.time()
        try:
            return _handshake(endpoint.socket, key, max(left, 0.1))
        except WorkerSilent as exc:  # its socket took the connection, the worker said nothing: busy, or hung
            if not known_hung(endpoint.socket, exc.pid, since):
                raise Unreachable(f"the worker at {endpoint.socket} is busy with another task (no handshake "
                                  f"within {endpoint.wait:g}s)") from exc
            kill_worker(exc.pid, f"no handshake within {endpoint.wait:g} s")
            raise Unreachable(f"the worker at {endpoint.socket} did not answer within {endpoint.wait:g}s") from exc
        except (OSError, EOFError) as exc:  # no socket yet, refused (dead)
            if left <= 0:
                raise Unreachable(f"no worker at {endpoint.socket} within {endpoint.wait:g}s: {exc}") from exc
        time.sleep(min(0.2, max(left, 0)))


def _handshake(path: str, key: bytes, timeout: float) -> Connection:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.settimeout(timeout)
        sock.connect(path)
        sock.setblocking(True)
        conn = Connection(sock.detach())
    finally:
        sock.close()
    try:
        if not conn.poll(timeout):  # accepted by the kernel, not answered by the worker: busy past wait, or hung
            raise WorkerSilent(peer_pid(conn))
        answer_challenge(conn, key)
        deliver_challenge(conn, key)
    except AuthenticationError as exc:  # the two ends hold different keys
        conn.close()
        raise Unreachable(f"worker at {path} refused the key: {exc}") from exc
    except BaseException:
        conn.close()
        raise
    return conn


class WorkerSilent(TimeoutError):
    """A connection the worker's socket accepted but the worker never answered."""

    def __init__(self, pid: int | None) -> None:
        super().__init__(f"the worker (pid {pid}) did not answer the handshake")
        self.pid = pid


def adopt_reply(reply: Mapping[str, Any], state: Any) -> Mapping[str, Any]:
    """A worker's ``reply`` taken on by the forwarding process: the error the task raised there is raised here,
    else ``state`` (the message's ``context.state``) becomes the worker's. Returns ``reply``."""
    error = reply.get("error")
    if error is not None:
        raise error if isinstance(error, Exception) else RuntimeError(str(error))
    for key in list(state):
        del state[key]
    for key, record in reply["state"].items():
        state[key] = record
    return reply


def request(endpoint: Endpoint, payload: dict[str, Any], timeout: float = TASK_WAIT) -> dict[str, Any]:
    """Send ``payload`` to the worker and wait up to ``timeout`` seconds (sent as ``REPLY_WITHIN``) for its reply.
    ``Unreachable`` when no worker takes it (busy with another task included), or when the worker dies before
    replying; ``WorkerHung`` (the worker killed) when it takes the task and sends nothing by then."""
    timeout = min(timeout, LONGEST_WAIT)  # a server's TTL of months is legal; poll() refuses over 2**31 ms
    conn = connect(endpoint)
    try:
        conn.send({"protocol": PROTOCOL, REPLY_WITHIN: timeout, **payload})
        if not conn.poll(timeout):
            kill_worker(peer_pid(conn), f"no reply within {timeout:g} s")
            raise WorkerHung(f"the worker at {endpoint.socket} sent no reply within {timeout:g} s; it was killed")
        reply = conn.recv()
    except (OSError, EOFError) as exc:
        raise Unreachable(f"the worker at {endpoint.socket} went away during the task: {exc!r}") from exc
    finally:
        conn.close()
    if "refused" in reply:
        kind = Restarting if reply.get("restarting") else Unreachable
        raise kind(f"the worker refused the task: {reply['refused']}")
    return reply

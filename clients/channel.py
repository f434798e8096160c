"""The private local channel between a node's thin ClientApp and its warm worker (standard library only).

``flower-client --worker warm`` writes a random key into an owner-only (0600) file and tells the ClientApp, in
the node config, where the worker listens and where the key is::

    worker-socket = "<private dir>/worker.sock"   # a Unix socket (0600) in a 0700 folder
    worker-key    = "<private dir>/worker.key"    # the authentication key (0600)
    worker-wait   = 20.0                          # optional: seconds to wait for the worker to accept

``multiprocessing.connection`` authenticates both ends with the key (HMAC challenge both ways) before a single
pickled object crosses, so only a process that can read the key file can talk to the worker.

>>> ep = Endpoint.from_node_config({"worker-socket": "/run/n/worker.sock", "worker-key": "/run/n/worker.key"})
>>> ep.wait, node_settings({"partition-id": 0, "worker-socket": "x"})
(20.0, {'partition-id': 0})
"""

from __future__ import annotations

import os
import secrets
import socket
import stat
import time
from collections.abc import Mapping
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


class Unreachable(RuntimeError):
    """The worker did not take the task (absent, dead, busy past the wait, refused, or it died mid-task)."""


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


def listen(endpoint: Endpoint) -> Listener:
    """The worker's listener: a Unix socket (0600) in an owner-only folder, authenticated by the key. A socket
    file left by a dead worker is replaced."""
    path = Path(endpoint.socket)
    private_dir(path.parent)
    if path.is_socket():
        path.unlink()
    listener = Listener(str(path), family="AF_UNIX", authkey=endpoint.key())
    os.chmod(path, 0o600)
    return listener


def connect(endpoint: Endpoint) -> Connection:
    """An authenticated connection to the worker, trying until ``endpoint.wait`` seconds have passed (a worker
    may be starting or restarting); ``Unreachable`` after that or when the keys differ."""
    try:
        key = endpoint.key()
    except OSError as exc:
        raise Unreachable(f"worker key: {exc}") from exc
    end = time.monotonic() + endpoint.wait
    while True:
        left = end - time.monotonic()
        try:
            return _handshake(endpoint.socket, key, max(left, 0.1))
        except (OSError, EOFError) as exc:  # no socket yet, refused (dead), handshake timed out
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
        if not conn.poll(timeout):  # a live worker busy with another task, or hung
            raise TimeoutError("the worker did not answer the handshake")
        answer_challenge(conn, key)
        deliver_challenge(conn, key)
    except AuthenticationError as exc:  # the two ends hold different keys
        conn.close()
        raise Unreachable(f"worker at {path} refused the key: {exc}") from exc
    except BaseException:
        conn.close()
        raise
    return conn


def request(endpoint: Endpoint, payload: dict[str, Any]) -> dict[str, Any]:
    """Send ``payload`` to the worker and wait for its reply (as long as the task takes). ``Unreachable`` when no
    worker takes it, or when the worker dies before replying."""
    conn = connect(endpoint)
    try:
        conn.send({"protocol": PROTOCOL, **payload})
        reply = conn.recv()
    except (OSError, EOFError) as exc:
        raise Unreachable(f"the worker at {endpoint.socket} went away during the task: {exc!r}") from exc
    finally:
        conn.close()
    if "refused" in reply:
        raise Unreachable(f"the worker refused the task: {reply['refused']}")
    return reply

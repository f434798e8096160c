"""A fork server for Flower's per-task ``flwr-clientapp`` process: Flower's own code, without its start-up.

Flower 1.41's SuperExec starts ``flwr-clientapp --clientappio-api-address A --token T ...`` (by name, from
``PATH``) for every message and forgets it (``flwr/supercore/superexec/executor/subprocess_executor.py``).
Python and Flower's imports are about 0.7 s of that on an idle core, before the task's first line.
``flower-client --worker warm`` therefore puts a ``flwr-clientapp`` shim first on its SuperNode's ``PATH``
(``write_shim``) and keeps one server (``serve``) that has imported Flower once:

* the shim (this file run with ``python -I -S``: standard library only, no site-packages) sends its argv,
  environment, working folder and its stdin/stdout/stderr over a Unix socket in the node's private folder (0700;
  the socket 0600) and exits once the server answers with the child's pid;
* the server forks; the child takes those, and runs Flower's own ``flwr_clientapp()`` entry point, which talks to
  the SuperNode over Flower's runtime API exactly as a fresh process would; the server reaps it;
* no server, a refused or broken hand-over: the shim ``exec``s Flower's real ``flwr-clientapp`` with the same
  argv, so a task never depends on the server, only its start-up time does.

The server holds no threads (a fork copies only the calling thread) and never runs a task itself; a child's
crash is the child's. Contract of ``entry``: a ``module:function`` that reads ``sys.argv`` and ends by returning
or raising ``SystemExit`` (its code becomes the child's exit status).

>>> shim = write_shim(Path("/run/node/bin"), Path("/run/node/clientapp.sock"), "/venv/bin/flwr-clientapp")
... # doctest: +SKIP
"""

from __future__ import annotations

import argparse
import atexit
import importlib
import json
import os
import signal
import socket
import sys
import threading
import traceback
from pathlib import Path

ENTRY = "flwr.supernode.cli:flwr_clientapp"
#: Imported by the server before its first fork: what every ``flwr-clientapp`` and the thin ClientApp import.
PRELOAD = (
    "flwr.supernode.runtime.run_clientapp", "flwr.clientapp.utils", "flwr.app", "flwr.clientapp",
    "flwr.common.logger", "multiprocessing.connection", "secrets", "zipfile", "tempfile",
)
MAX_REQUEST = 1 << 20  # argv + environment; a larger request is refused (the shim then starts cold)
STDIO = (0, 1, 2)


def write_shim(folder: Path, sock: Path, real: str, python: str = sys.executable) -> Path:
    """An executable ``folder/flwr-clientapp`` (owner-only) that hands its task to the server at ``sock`` or,
    failing that, runs ``real``. Put ``folder`` first on the SuperNode's ``PATH``."""
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    shim = folder / "flwr-clientapp"
    args = " ".join(_sh_quote(a) for a in (python, "-I", "-S", str(Path(__file__).resolve()), str(sock), real))
    shim.write_text(f'#!/bin/sh\nexec {args} "$@"\n')
    shim.chmod(0o700)
    return shim


def _sh_quote(text: str) -> str:
    return "'" + text.replace("'", "'\"'\"'") + "'"


def hand_over(sock: str, argv: list[str], timeout: float = 10.0) -> int:
    """Ask the server at ``sock`` to run ``argv`` with this process's environment, folder and stdio; the child's
    pid. ``OSError``/``ValueError`` when the server is absent, refuses or breaks off."""
    request = json.dumps({"argv": argv, "env": dict(os.environ), "cwd": os.getcwd()}).encode()
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
        conn.settimeout(timeout)
        conn.connect(sock)
        socket.send_fds(conn, [request[:1]], list(STDIO))
        conn.sendall(request[1:])
        conn.shutdown(socket.SHUT_WR)
        answer = _read_all(conn, 64)
    return int(answer.decode())  # ValueError on a refusal ("refused: ...") or nothing


def shim_main(argv: list[str]) -> None:
    """``<this file> SOCK REAL [flwr-clientapp args]``: hand over, or ``exec`` ``REAL`` with the same args."""
    sock, real, args = argv[0], argv[1], argv[2:]
    try:
        hand_over(sock, ["flwr-clientapp", *args])
    except (OSError, ValueError) as exc:
        print(f"fedcomp prestart: {exc!r}; starting {real} cold", file=sys.stderr, flush=True)
        os.execv(real, [real, *args])


def _read_all(conn: socket.socket, limit: int) -> bytes:
    data = b""
    while chunk := conn.recv(65536):
        data += chunk
        if len(data) > limit:
            raise ValueError(f"more than {limit} bytes")
    return data


class ForkServer:
    """Accepts hand-overs on ``sock`` and forks one child per request that runs ``entry``. ``served`` and
    ``refused`` count requests (a refused request gets ``refused: why`` and its shim starts cold)."""

    def __init__(
        self, sock: Path, entry: str = ENTRY, preload: tuple[str, ...] = PRELOAD, warm_app: str = ""
    ) -> None:
        if warm_app:  # serve the FAB's ClientApp from the node's worker (clients.forward)
            preload = (*preload, "clients.forward")
        for name in preload:
            importlib.import_module(name)
        module, _, function = entry.partition(":")
        self.entry = getattr(importlib.import_module(module), function)
        self.fab_finder = importlib.import_module("clients.forward").FabFinder(warm_app) if warm_app else None
        if threading.active_count() != 1:  # a fork would copy a process whose other threads are gone
            raise RuntimeError(f"the fork server must hold one thread, holds {threading.active_count()}")
        if sock.is_socket():
            sock.unlink()
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.listener.bind(str(sock))
        os.chmod(sock, 0o600)
        self.listener.listen(64)
        self.served = self.refused = 0

    def serve_forever(self) -> None:
        signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # children are reaped by the kernel
        while True:
            conn, _ = self.listener.accept()
            with conn:
                self.serve_one(conn)

    def serve_one(self, conn: socket.socket) -> None:
        fds: list[int] = []
        try:
            conn.settimeout(10.0)
            first, fds, _, _ = socket.recv_fds(conn, 1, len(STDIO))
            request = json.loads(first + _read_all(conn, MAX_REQUEST))
            argv, env, cwd = list(map(str, request["argv"])), dict(request["env"]), str(request["cwd"])
            if len(fds) != len(STDIO) or not argv:
                raise ValueError(f"expected argv and {len(STDIO)} descriptors, got {len(fds)}")
        except (OSError, ValueError, KeyError, TypeError, RecursionError) as exc:  # deep JSON: RecursionError
            self.refused += 1
            print(f"prestart: refused a request: {exc!r}", file=sys.stderr, flush=True)
            self._answer(conn, f"refused: {exc!r}")
            return self._close(fds)
        pid = os.fork()
        if pid == 0:
            self._child(conn, argv, env, cwd, fds)
        self._close(fds)
        self.served += 1
        print(f"prestart: task process {pid} ({self.served} served)", flush=True)
        self._answer(conn, str(pid))

    @staticmethod
    def _answer(conn: socket.socket, text: str) -> None:
        try:
            conn.sendall(text.encode())
        except OSError:
            pass  # the shim is gone; the child (if any) runs on

    @staticmethod
    def _close(fds: list[int]) -> None:
        for fd in fds:
            os.close(fd)

    def _child(self, conn: socket.socket, argv: list[str], env: dict, cwd: str, fds: list[int]) -> None:
        code = 1
        try:
            self.listener.close()
            conn.close()
            for sig in (signal.SIGCHLD, signal.SIGTERM):
                signal.signal(sig, signal.SIG_DFL)
            signal.signal(signal.SIGINT, signal.default_int_handler)
            for target, fd in zip(STDIO, fds, strict=True):
                os.dup2(fd, target)
            self._close(fds)
            os.chdir(cwd)
            os.environ.clear()
            os.environ.update(env)
            sys.argv = argv
            forget_own_package()  # the task's app comes from the run's FAB, never from this server's tree
            if self.fab_finder is not None:  # Flower's import of the FAB's clientapp module gets the forwarder
                sys.meta_path.insert(0, self.fab_finder)
            result = self.entry()
            code = result if isinstance(result, int) else 0
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        except BaseException:
            traceback.print_exc()
        finally:
            try:
                atexit._run_exitfuncs()
                sys.stdout.flush()
                sys.stderr.flush()
            finally:
                os._exit(code)


def forget_own_package() -> None:
    """Drop this file's package (``clients``, imported by ``python -m clients.prestart``) from ``sys.modules``:
    Flower's app loader imports only modules not already there, so the child would otherwise run the installed
    ``clients`` instead of the one in the run's FAB."""
    top = (__spec__.name if __spec__ is not None else __name__).split(".")[0]
    if top in ("__main__", ""):
        return
    for name in [n for n in sys.modules if n == top or n.startswith(top + ".")]:
        del sys.modules[name]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m clients.prestart", description="Fork server for flwr-clientapp.")
    p.add_argument("--socket", required=True, type=Path, help="Unix socket to listen on (in a 0700 folder)")
    p.add_argument("--entry", default=ENTRY, help=f"module:function each child runs (default {ENTRY})")
    p.add_argument("--warm-app", default="", metavar="REF",
                   help="serve each run's ClientApp from the node's worker: 'fab' (the FAB's clientapp) or module:attr")
    args = p.parse_args(argv)
    server = ForkServer(args.socket, args.entry, warm_app=args.warm_app)
    print(f"prestart: serving {args.entry} on {args.socket}", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        return 0
    finally:
        server.listener.close()
    return 0


if __name__ == "__main__":
    if len(sys.argv) >= 3 and not sys.argv[1].startswith("-"):
        shim_main(sys.argv[1:])  # run by the shim: standard library only
    else:
        sys.exit(main())

"""A node's warm worker: one long-lived process that runs the node's ClientApp messages for the thin forwarder
in each ``flwr-clientapp`` (``clients.forward.WarmApp``: the product's ``clients.app`` and any Flower app served
with ``flower-client --app``), so torch, the data partition, the model and, on a GPU node, the CUDA context and
compiled kernels are made once per run instead of once per task.

    python -m clients.worker --socket DIR/worker.sock --key-file DIR/worker.key [--gpu]

``flower-client --worker warm`` (the default) starts it next to the SuperNode, restarts it when it dies and
stops it with the SuperNode. It listens on the private channel of ``clients.channel`` (a 0600 Unix socket in
a 0700 folder, authenticated with the key in the 0600 key file) and handles one message at a time. A request
(``clients.forward.message_request``) carries a message for the ``ClientApp`` at ``app`` (``module:attr``): the
worker loads it once from the run's code and keeps it (``clients.host.AppHost``), calls it with the message and
the node's context, and answers ``{"content"}`` or ``{"error_reply": (code, reason)}`` with the new ``state``, or
``{"error": the exception}`` when the app raised (the forwarder raises it, so the server sees the error reply
it would see in-process), or ``{"refused": why}`` for another protocol version (the forwarder then runs the
message itself). Connections with a wrong key are refused before anything is read, and so are peers that do not
finish the handshake within ``channel.AUTH_WAIT`` seconds or their request within ``REQUEST_WAIT``. While it
serves one, its status file says it is busy until the request's reply deadline, so a forwarder that finds it
silent meanwhile runs its task in its own process and leaves the worker alone (``channel.known_hung``).

The worker runs the code of the run it serves: every request names the root of the ClientApp's code (``code``:
the run's FAB, installed by the SuperNode). A worker started on other code refuses the message (the forwarder
runs it in its own process, from the FAB) and restarts itself on that code (``exec``, same pid, the FAB's folder
first on its path, ``--code`` naming it); the forwarder then sends the message once more, to the restarted
worker, so even the first task of a run runs warm, on the run's code. A root without ``pyproject.toml`` is
refused without a restart. ``compression_mod`` writes the session to the node's state dir before each reply
leaves (and keeps it in memory for the next task while that file is unchanged), so a worker killed between
tasks loses nothing: its successor continues from the state dir (and the session is then left out of the
``context.state`` that goes back to the SuperNode: the state dir holds it). It exits when its parent (the
launcher) is gone.
"""

from __future__ import annotations

import argparse
import os
import pickle
import sys
import threading
import time
import traceback
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from clients import channel
from fedcomp.task.heap import keep_freed_memory

REQUEST_WAIT = 30.0  # seconds an authenticated client may take to send its request


class Worker:
    """Handles one request at a time with the ClientApps it keeps (``clients.host.AppHost``).

    >>> Worker().handle({"protocol": 0})["refused"]  # doctest: +ELLIPSIS
    'protocol 0, this worker speaks 1'
    """

    def __init__(self, root: str | None = None) -> None:
        import torch  # noqa: F401  (torch and fedcomp once, at start-up, not at the first task)

        import fedcomp.flower.mod  # noqa: F401
        from clients.host import AppHost

        self.tasks = 0
        self.root = str(Path(root).resolve()) if root else code_root()
        self.host = AppHost(self.root)  # the ClientApps served (clients.forward), kept across messages
        self.switch_to: str | None = None  # the code root to restart on after answering

    def handle(self, req: dict[str, Any]) -> dict[str, Any]:
        if req.get("protocol") != channel.PROTOCOL:
            return {"refused": f"protocol {req.get('protocol')}, this worker speaks {channel.PROTOCOL}"}
        code = str(req.get("code") or self.root)
        if Path(code).resolve() != Path(self.root):
            if not (Path(code) / "pyproject.toml").is_file():
                return {"refused": f"the run's code at {code} has no pyproject.toml; running the task in-process"}
            self.switch_to = code
            why = f"this worker runs the code at {self.root}, the run's is at {code}: restarting on it"
            return {"refused": why, "restarting": True}
        if req.get("kind") != "app":
            return {"error": ValueError(f"request of kind {req.get('kind')!r}: this worker serves ClientApps")}
        return self.run_app(req)

    def run_app(self, req: dict[str, Any]) -> dict[str, Any]:
        """One message for a ClientApp (``clients.host.AppHost``): its RNGs and module state are the app's own
        and live on between messages, as in any long-lived process."""
        from fedcomp.flower.session import STATE_KEY

        t0 = time.perf_counter()
        try:
            reply = self.host.run(req)
        except Exception as exc:
            print(f"fedcomp worker: the ClientApp {req.get('app')} raised:\n{traceback.format_exc()}",
                  file=sys.stderr, flush=True)
            return {"error": _picklable(exc)}
        self.tasks += 1
        state = reply.get("state")
        if req.get("node_config", {}).get("state-dir") and state is not None and STATE_KEY in state:
            del state[STATE_KEY]  # the state dir holds the session; context.state would only go stale
        kind = req.get("metadata", {}).get("message_type")
        print(f"fedcomp worker: {kind} message {self.tasks} served in {time.perf_counter() - t0:.3f} s", flush=True)
        return reply


def _picklable(exc: Exception) -> Exception:
    try:
        pickle.loads(pickle.dumps(exc))
        return exc
    except Exception:
        return RuntimeError(f"{type(exc).__name__}: {exc}")


def serve_one(listener: channel.WorkerListener, worker: Worker) -> None:
    """Accept one connection and answer its request; a wrong key, a peer silent past the handshake's deadline or
    one that went away is skipped."""
    try:
        conn = listener.accept()
    except (OSError, EOFError, channel.AuthenticationError) as exc:  # TimeoutError is an OSError
        print(f"fedcomp worker: connection refused: {exc!r}", file=sys.stderr, flush=True)
        return
    with conn:
        req = _receive(conn)
        if req is None:
            return
        listener.busy(reply_within(req))  # past this, a forwarder that finds this worker silent kills it as hung
        reply = worker.handle(req)
        try:
            conn.send(reply)
        except (OSError, EOFError):  # the ClientApp is gone; the session is saved already
            print("fedcomp worker: the ClientApp left before the reply", file=sys.stderr, flush=True)


def _receive(conn: Connection) -> dict[str, Any] | None:
    try:
        with channel.deadline(REQUEST_WAIT, "the request"):  # a request that starts and never ends too
            req = conn.recv()
    except (OSError, EOFError, pickle.UnpicklingError):
        return None
    return req if isinstance(req, dict) else None


def reply_within(req: dict[str, Any]) -> float:
    """The seconds the request's forwarder waits for the reply (``channel.REPLY_WITHIN``; else ``TASK_WAIT``)."""
    within = req.get(channel.REPLY_WITHIN)
    if not isinstance(within, (int, float)) or not within > 0:
        return channel.TASK_WAIT
    return min(float(within), channel.LONGEST_WAIT)


def code_root() -> str:
    """The folder this worker's ``clients`` package was imported from."""
    return str(Path(__file__).resolve().parents[1])


def restart_on(root: str, argv: list[str]) -> None:
    """Replace this process with a worker running the code under ``root`` (same pid, same arguments but
    ``--code root``): the ``clients`` package found there, else the installed one with ``root`` first on the path."""
    if "--code" in argv:
        at = argv.index("--code")
        argv = argv[:at] + argv[at + 2 :]
    argv = [*argv, "--code", root]
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([root, *filter(None, [env.get("PYTHONPATH")])])
    print(f"fedcomp worker pid {os.getpid()}: restarting on the run's code at {root}", flush=True)
    os.chdir(root)  # `-m` puts the working folder first on the path
    os.execve(sys.executable, [sys.executable, "-m", "clients.worker", *argv], env)


def watch_parent() -> None:
    """Exit this process when its parent is gone (a launcher killed without stopping its worker)."""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(1.0)
        os._exit(0)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m clients.worker", description=__doc__.split("\n\n")[0])
    p.add_argument("--socket", required=True, help="Unix socket to listen on (its folder: owner-only)")
    p.add_argument("--key-file", required=True, help="owner-only file holding the channel's key")
    p.add_argument("--gpu", action="store_true", help="make the CUDA context at start-up (fails without CUDA)")
    p.add_argument("--code", help="the root of the code this worker serves (default: where its clients package is)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    watch_parent()
    keep_freed_memory()  # every task's fresh tensors come from the kept heap, not new zero-filled pages
    worker = Worker(args.code)
    if args.gpu:
        import torch

        torch.cuda.init()  # raises without a usable CUDA device
        torch.zeros(1, device="cuda")
    with channel.listen(channel.Endpoint(args.socket, args.key_file)) as listener:
        print(f"fedcomp worker pid {os.getpid()} ready on {args.socket} (code: {worker.root})", flush=True)
        while worker.switch_to is None:
            serve_one(listener, worker)
    restart_on(worker.switch_to, list(argv if argv is not None else sys.argv[1:]))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Warm nodes for any ClientApp: the per-task ``flwr-clientapp`` forwards the message to the node's worker.

``flower-client --app fab`` (the run's FAB's ``clientapp`` component) or ``--app module:attr`` serves a Flower
user's own ``ClientApp`` from the node's long-lived worker (``clients.worker``): the app object, and with it
its module-level state (model, data loaders, CUDA context), lives in the worker across tasks. In each forked
``flwr-clientapp`` (``clients.prestart``) a ``FabFinder`` first on ``sys.meta_path`` answers Flower's import of the
FAB's ``clientapp`` module (the module named in ``[tool.flwr.app.components]`` of the folder Flower has just put
first on ``sys.path``) with a module whose attribute is a ``WarmApp``: a ``ClientApp`` that imports neither torch
nor the user's code and hands each message to the worker over the node's private channel (``clients.channel``):
its content and metadata, the run and node config, node and run id, and ``context.state``; the worker runs the
user's app on them with Flower's ``Message`` / ``Context`` semantics and answers with the reply's content (or its
error) and the new ``context.state``.

The worker always runs the code of the run it serves: every request names the FAB's folder, and a worker that
runs other code restarts on it (``clients.worker``; a new FAB means a new worker, never the installed tree in
its place). No worker, or one that cannot be reached: the task runs here, on the user's real module, loaded
from the FAB as Flower would, with a warning; a task that raised in the worker raises here.

>>> sys.meta_path.insert(0, FabFinder("fab"))  # in the forked flwr-clientapp, before Flower loads the app
... # doctest: +SKIP
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
import time
from logging import WARNING
from pathlib import Path
from typing import Any

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib  # type: ignore[no-redef]

from flwr.app import Context, Message
from flwr.app.error import Error
from flwr.clientapp import ClientApp
from flwr.common.logger import log

from clients import channel

#: ``--app`` value: serve the run's FAB's own ``clientapp`` component.
FAB = "fab"
METADATA = ("run_id", "message_id", "src_node_id", "dst_node_id", "reply_to_message_id", "group_id",
            "created_at", "ttl", "message_type")


def time_left(msg: Message) -> float:
    """Seconds until ``msg`` expires (its TTL from its creation; at least 1), or the channel's default."""
    ttl = float(msg.metadata.ttl or 0.0)
    if ttl <= 0:
        return channel.TASK_WAIT
    return max(1.0, float(msg.metadata.created_at) + ttl - time.time())


def clientapp_ref(folder: Path) -> str | None:
    """The ``clientapp`` component of the Flower app in ``folder`` (its ``pyproject.toml``), or None."""
    try:
        config = tomllib.loads((folder / "pyproject.toml").read_text())
        ref = config["tool"]["flwr"]["app"]["components"]["clientapp"]
    except (OSError, KeyError, TypeError, tomllib.TOMLDecodeError):
        return None
    return ref if isinstance(ref, str) else None


def message_request(code: str, ref: str, msg: Message, context: Context) -> dict[str, Any]:
    """The worker's request for one message to the app ``ref`` of the code at ``code``."""
    return {
        "code": code,
        "kind": "app",
        "app": ref,
        "content": msg.content,
        "metadata": {k: getattr(msg.metadata, k) for k in METADATA},
        "run_id": context.run_id,
        "node_id": context.node_id,
        "node_config": channel.node_settings(context.node_config),  # the app runs there: no way back to the worker
        "run_config": dict(context.run_config),
        "state": context.state,
    }


class WarmApp(ClientApp):
    """The stand-in for the app ``ref`` of the FAB at ``code`` in a forked ``flwr-clientapp``: every message
    goes to the node's worker (the module docstring); ``finder`` lets it load the real module when none answers."""

    def __init__(self, code: str, ref: str, finder: FabFinder | None = None) -> None:
        super().__init__()
        self.code, self.ref, self.finder = code, ref, finder
        self.real: ClientApp | None = None

    def __call__(self, message: Message, context: Context) -> Message:
        endpoint = channel.Endpoint.from_node_config(context.node_config)
        if endpoint is not None:
            try:
                try:
                    return self.forward(endpoint, message, context)
                except channel.Restarting:  # the worker restarts on this run's code: once more, to the new one
                    return self.forward(endpoint, message, context)
            except channel.Unreachable as exc:
                log(WARNING, "fedcomp: %s; running this %s message in the ClientApp process", exc,
                    message.metadata.message_type)
        return self.load_real()(message, context)

    def forward(self, endpoint: channel.Endpoint, message: Message, context: Context) -> Message:
        """The worker's reply to ``message``; ``context.state`` becomes the worker's. Raises what the app raised
        there, ``channel.Unreachable`` if no worker ran it."""
        request = message_request(self.code, self.ref, message, context)
        reply = channel.adopt_reply(channel.request(endpoint, request, time_left(message)), context.state)
        if "error_reply" in reply:
            code, reason = reply["error_reply"]
            return Message(Error(int(code), str(reason)), reply_to=message)
        return Message(reply["content"], reply_to=message)

    def load_real(self) -> ClientApp:
        """The user's own app, loaded from the FAB as Flower loads it (this stand-in's module set aside)."""
        if self.real is None:
            module, _, attrs = self.ref.partition(":")
            if isinstance(sys.modules.get(module), _Standin):
                del sys.modules[module]
            if self.finder is not None:
                self.finder.bypass = True
            if self.code not in sys.path:
                sys.path.insert(0, self.code)
            app: Any = importlib.import_module(module)
            for attr in attrs.split("."):
                app = getattr(app, attr)
            self.real = app
        return self.real


class _Standin(type(sys)):  # type: ignore[misc]
    """The module a ``FabFinder`` gives Flower in place of the FAB's ``clientapp`` module."""


class _Loader(importlib.abc.Loader):
    def __init__(self, attr: str, app: WarmApp) -> None:
        self.attr, self.app = attr, app

    def create_module(self, spec: Any) -> _Standin:
        return _Standin(spec.name)

    def exec_module(self, module: Any) -> None:
        setattr(module, self.attr, self.app)


class FabFinder(importlib.abc.MetaPathFinder):
    """Answers the import of the FAB's ``clientapp`` module (the FAB's folder first on ``sys.path``, as Flower's
    loader puts it) with a ``WarmApp`` serving ``serve`` (``FAB``: that component; else a ``module:attr``);
    every other import, and a component whose attribute is dotted, goes the usual way."""

    def __init__(self, serve: str = FAB) -> None:
        self.serve, self.bypass = serve, False

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        if self.bypass or not sys.path:
            return None
        folder = Path(sys.path[0] or ".").resolve()
        ref = clientapp_ref(folder)
        if ref is None or ref.partition(":")[0] != fullname:
            return None
        attr = ref.partition(":")[2]
        if not attr.isidentifier():
            return None
        served = ref if self.serve == FAB else self.serve
        return importlib.util.spec_from_loader(fullname, _Loader(attr, WarmApp(str(folder), served, self)))

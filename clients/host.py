"""The worker's half of a warm node for any ClientApp: the app objects it keeps, and one message run on them.

``AppHost(root)`` loads a ``ClientApp`` by reference (``module:attr``) from the code at ``root`` (the run's FAB
folder, first on ``sys.path``, as Flower's own loader does) once, and keeps it: the module-level state of the
user's app (its model, data loaders, CUDA context, counters) lives as long as the worker. ``run`` rebuilds the
message and the node's context the forwarder sent (``clients.forward.message_request``) and calls the app on
them, as Flower's ``flwr-clientapp`` does: ``Message(content, metadata)``, ``Context(run_id, node_id,
node_config, state, run_config)``; what the app leaves in ``context.state`` goes back to the SuperNode.

>>> host = AppHost("/apps/digits")  # doctest: +SKIP
>>> host.run(request)["content"]  # doctest: +SKIP
"""

from __future__ import annotations

from typing import Any

from flwr.app import Context, Message, Metadata
from flwr.clientapp import ClientApp
from flwr.clientapp.client_app import LoadClientAppError
from flwr.supercore.object_ref import load_app


class AppHost:
    """Keeps the ClientApps of the code at ``root`` by reference and runs one message on one of them."""

    def __init__(self, root: str) -> None:
        self.root = root
        self.apps: dict[str, ClientApp] = {}

    def app(self, ref: str) -> ClientApp:
        """The ``ClientApp`` at ``ref`` (loaded once; ``LoadClientAppError`` when it is none)."""
        if ref not in self.apps:
            app = load_app(ref, LoadClientAppError, self.root)
            if not isinstance(app, ClientApp):
                raise LoadClientAppError(f"{ref} is a {type(app).__name__}, not a ClientApp")
            self.apps[ref] = app
        return self.apps[ref]

    def run(self, req: dict[str, Any]) -> dict[str, Any]:
        """``{"content": the reply's RecordDict}`` or ``{"error_reply": (code, reason)}`` (the app replied with an
        error), each with ``"state"``: the node's ``context.state`` after the message. What the app raises, raises."""
        msg = Message(content=req["content"], metadata=Metadata(**req["metadata"]))
        context = Context(req["run_id"], req["node_id"], req["node_config"], req["state"], req["run_config"])
        reply = self.app(str(req["app"]))(msg, context)
        if reply.has_error():
            return {"error_reply": (int(reply.error.code), str(reply.error.reason)), "state": context.state}
        return {"content": reply.content, "state": context.state}

"""An in-process Flower federation for tests: a ``Grid`` that runs each node's ``ClientApp`` right away.

Every message crosses a protobuf round trip (what Flower's transport does to it), message ids are assigned, and
a ClientApp that raises becomes a ``CLIENT_APP_RAISED_EXCEPTION`` error reply whose source is the SuperLink
(node id 1), as Flower makes them. ``drop`` decides per (node, message) whether a reply is lost on the way
back (the node's state has changed, the server sees nothing). A node's ``context.state`` is serialized after
every message, as the SuperNode keeps it between ClientApp processes. No Ray, no SuperLink: strategies run their own
``start`` loop over it in a fraction of a second per round.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable

from flwr.app import Context, Error, Message, RecordDict
from flwr.common.constant import ErrorCode
from flwr.common.serde import message_from_proto, message_to_proto, recorddict_from_proto, recorddict_to_proto
from flwr.serverapp import Grid

from fedcomp.flower import identity

RUN_ID = 7


def wire(msg: Message) -> Message:
    """``msg`` after serialization and back (a fresh object, like a message that crossed the network)."""
    return message_from_proto(message_to_proto(msg))


class LocalGrid(Grid):
    """``nodes``: node id -> (ClientApp, node config). ``drop(node_id, reply) -> bool`` loses replies. A message to
    a node no longer in ``apps`` gets a NODE_UNAVAILABLE error reply, as from the SuperLink."""

    def __init__(
        self,
        apps: dict[int, tuple[Callable[[Message, Context], Message], dict]],
        run_config: dict | None = None,
        drop: Callable[[int, Message], bool] | None = None,
    ) -> None:
        self.apps = apps
        self.contexts = {
            nid: Context(RUN_ID, nid, dict(cfg), RecordDict(), dict(run_config or {})) for nid, (_, cfg) in apps.items()
        }
        self.drop = drop or (lambda node, reply: False)
        self.ids = itertools.count(1)
        self.outbox: dict[str, Message] = {}
        self.sent: list[Message] = []  # every instruction as it left the server
        self.replies: list[Message] = []  # every reply as the server received it

    # Grid API ----------------------------------------------------------------------------------------------
    def set_run(self, run_id: int) -> None:  # pragma: no cover - not used by strategies
        del run_id

    @property
    def run(self):  # pragma: no cover
        raise NotImplementedError

    def create_message(self, content, message_type, dst_node_id, group_id, ttl=None):  # pragma: no cover
        return Message(content, dst_node_id, message_type, ttl=ttl, group_id=group_id)

    def get_node_ids(self) -> Iterable[int]:
        return list(self.apps)

    def push_messages(self, messages: Iterable[Message]) -> Iterable[str]:
        ids = []
        for msg in messages:
            mid = f"m{next(self.ids)}"
            msg.metadata.__dict__["_message_id"] = mid
            node = msg.metadata.dst_node_id
            received = wire(msg)
            self.sent.append(wire(msg))
            if node not in self.apps:  # a node that left: the SuperLink answers for it
                reply = received.create_error_reply(Error(ErrorCode.NODE_UNAVAILABLE, f"node {node} is gone"))
                reply.metadata.__dict__["_src_node_id"] = 1
                self.outbox[mid] = wire(reply)
                ids.append(mid)
                continue
            app, _ = self.apps[node]
            ctx = self.contexts[node]
            try:
                reply = app(received, ctx)
            except Exception as exc:  # noqa: BLE001 - Flower turns any ClientApp exception into an error reply
                reply = received.create_error_reply(Error(ErrorCode.CLIENT_APP_RAISED_EXCEPTION, repr(exc)))
                reply.metadata.__dict__["_src_node_id"] = 1
            ctx.state = recorddict_from_proto(recorddict_to_proto(ctx.state))  # kept by the SuperNode, not the app
            if not self.drop(node, reply):
                self.outbox[mid] = wire(reply)
            ids.append(mid)
        return ids

    def pull_messages(self, message_ids: Iterable[str]) -> Iterable[Message]:
        out = [self.outbox.pop(m) for m in list(message_ids) if m in self.outbox]
        self.replies.extend(wire(m) for m in out)  # as received, before the strategy rewrites them
        return out

    def send_and_receive(self, messages: Iterable[Message], *, timeout: float | None = None) -> Iterable[Message]:
        return list(self.pull_messages(self.push_messages(messages)))


def server_identity():
    """Flower sets the running task's identity before a ServerApp runs; strategies need it to build messages."""
    return identity.server_identity(RUN_ID)

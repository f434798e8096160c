"""The server side of the update protocol, by job (no Flower here):

* ``coordinator``: ``ServerProtocol``, the short class the transports call (dispatch, on_reply, fail_task, ...);
* ``ledger``: per-client state and the life of every task (dispatch, resolve, expire, commit, restart, and who
  hears what after a client restarted under a new node id);
* ``checks``: judging a reply, a list of small named checks each returning a ``Decision``;
* ``buffer``: the accepted updates' weighted sum and the optimizer step (one count);
* ``counters``: ``VersionStats``, one JSONL row per version (``fedcomp.counters``: one merge/roll);
* ``checkpoint``: ``atomic_write`` (fsync, then replace) for every state that must survive a crash;
* ``selection``: sync-round client selection.

The vocabulary both sides share (``Outcome``, ``Resolution``, ``Task``, ``ReplyMeta``, ``Decision``,
``ProtocolConfig``) is ``fedcomp.protocol``.
"""

from fedcomp.server.buffer import ServerOptimizer, UpdateBuffer
from fedcomp.server.checkpoint import atomic_write
from fedcomp.server.checks import CHECKS, GATES, update_norm, wire_reason
from fedcomp.server.coordinator import ServerProtocol
from fedcomp.server.ledger import ClientLedger, Ledger
from fedcomp.server.selection import ClientSelection
from fedcomp.server.stats import VersionStats

__all__ = [
    "CHECKS",
    "GATES",
    "ClientLedger",
    "Ledger",
    "ClientSelection",
    "ServerOptimizer",
    "ServerProtocol",
    "UpdateBuffer",
    "VersionStats",
    "atomic_write",
    "update_norm",
    "wire_reason",
]

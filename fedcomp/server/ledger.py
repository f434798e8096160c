"""The ledger: per-client protocol state and the life of every task (dispatch, resolve, expire, commit, restart).

It decides who hears what: each resolution (ack or nack) goes to the outbox of the node that holds the client's
state now, and leaves with that node's next task. It counts nothing and judges nothing (``fedcomp.server.checks``
judges replies; ``ServerProtocol`` counts).

>>> book = Ledger(ProtocolConfig(task_timeout=10.0))
>>> task = book.dispatch(5, now=0.0, version=0, round_=0)
>>> book.resolve(task, seq=1, outcome=Outcome.STALE, reason="staleness 5 > 4")
>>> [r.outcome.value for r in book.get(5).outbox]
['stale']
"""

from __future__ import annotations

import secrets
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from fedcomp.protocol import TASK_ID_BITS, Outcome, ProtocolConfig, ReplyMeta, Resolution, Task

#: How many recent seqs a client's ledger remembers: replies out of order by fewer than this are judged.
SEEN_WINDOW = 64


@dataclass
class ClientLedger:
    """Per-client protocol state: sequence numbers seen, the open tasks (oldest first: the node runs them in that
    order; more than one only with ``prefetch``), the ack/nack outbox, health."""

    incarnation: int = 0
    last_seq: int = 0
    seen: list[int] = field(default_factory=list)  # the last SEEN_WINDOW seqs judged (replies may come out of order)
    open_tasks: list[int] = field(default_factory=list)
    outbox: list[Resolution] = field(default_factory=list)
    failures: int = 0  # consecutive failed tasks (error replies, timeouts)
    unavailable_until: float = 0.0
    applied: int = 0
    nacked: int = 0
    resync: bool = False  # the server restarted and this client has not had an update applied since
    moved_to: int | None = None  # the node that holds this ledger's incarnation now (restarted under a new id)

    def seen_before(self, seq: int) -> bool:
        """Whether ``seq`` was judged already, or is too old to tell (more than ``SEEN_WINDOW`` below the highest
        seen). A node's replies may arrive out of order (with prefetch it holds several tasks, and a reply whose
        read backs off is overtaken by the next one), so a seq below the highest is judged if it is new.

        >>> led = ClientLedger(); led.saw(5); led.saw(7)
        >>> led.seen_before(7), led.seen_before(6), led.last_seq
        (True, False, 7)
        """
        return seq in self.seen or seq <= self.last_seq - SEEN_WINDOW

    def saw(self, seq: int) -> None:
        """``seq`` is being judged: remember it (and the highest)."""
        self.seen = [*self.seen, int(seq)][-SEEN_WINDOW:]
        self.last_seq = max(self.last_seq, int(seq))

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["outbox"] = [r.to_dict() for r in self.outbox]
        return d

    @staticmethod
    def from_dict(d: Mapping[str, Any]) -> ClientLedger:
        led = ClientLedger(**{k: v for k, v in d.items() if k not in ("outbox", "open_task", "open_tasks")})
        led.outbox = [Resolution.from_dict(r) for r in d["outbox"]]
        return led


class NodeIdentities:
    """Who is who among the ledger's clients: each client's ``ClientLedger`` and, when a client state restarts
    under a new node id (docs/protocol.md), which node holds it now (``owner``), so the resolutions owed to the
    old node reach it and nothing it sent before the restart is stranded. ``Ledger``'s base, over its state."""

    clients: dict[int, ClientLedger]
    tasks: dict[int, Task]
    held: dict[int, list[Resolution]]
    watchers: dict[int, set[int]]  # open task id -> nodes that listed it and could not adopt its node
    restarts: int

    def get(self, client: int) -> ClientLedger:
        """The client's ledger; a client first seen after a restart starts in resync (it may hold updates the
        dead server acknowledged to nobody)."""
        led = self.clients.get(int(client))
        if led is None:
            led = self.clients[int(client)] = ClientLedger(resync=self.restarts > 0)
        return led

    def mean_applied(self) -> float:
        """Updates applied per client, averaged over the clients the ledger knows (those that moved to another
        node id left out: their successor counts); 0 with none."""
        live = [led.applied for led in self.clients.values() if led.moved_to is None]
        return sum(live) / len(live) if live else 0.0

    def owner(self, client: int) -> int:
        """The node that holds ``client``'s state now: ``client`` itself, unless that client restarted under a new
        node id and replied from there (``adopt``); resolutions owed to ``client`` go to it."""
        node, seen = int(client), set()
        while (led := self.clients.get(node)) is not None and led.moved_to is not None and node not in seen:
            seen.add(node)
            node = led.moved_to
        return node

    def outbox(self, client: int) -> list[Resolution]:
        """Where resolutions owed to ``client`` wait: the outbox of its ``owner``."""
        return self.get(self.owner(client)).outbox

    # ---- a client restarted under a new node id (docs/protocol.md) --------------------------------------------
    def recognise(self, client: int, meta: ReplyMeta) -> None:
        """A reply to the open task names the client state (``meta.incarnation``): a new one on this node starts
        its seqs again; a saved one that ran on other nodes is continued here (``adopt_incarnation``)."""
        led = self.clients.get(int(client))
        if led is not None and meta.incarnation != led.incarnation and meta.task_id in led.open_tasks:
            led.incarnation, led.last_seq, led.seen = meta.incarnation, 0, []
            self.adopt_incarnation(client, meta.incarnation, meta.seq)

    def adopt(self, client: int, node: int) -> None:
        """``client`` holds the client state that ran as ``node`` before (a restart under a new node id): ``node``
        now forwards to ``client``. Its undelivered resolutions (and acks held for ``commit()``) move here and
        resolutions of its tasks still open follow when they resolve, so an update saved before the restart is
        acked or nacked, never stranded. The seq ledger continues (``last_seq``: the highest seen).

        >>> book.adopt(12, 2)  # doctest: +SKIP
        """
        led, old = self.get(client), self.get(node)
        old.moved_to = int(client)
        led.last_seq = max(led.last_seq, old.last_seq)
        led.seen = sorted(set(led.seen) | set(old.seen))[-SEEN_WINDOW:]
        led.resync = led.resync or old.resync
        led.outbox.extend(old.outbox)
        old.outbox = []
        if int(node) in self.held:
            self.held.setdefault(int(client), []).extend(self.held.pop(int(node)))

    def adopt_incarnation(self, client: int, incarnation: int, seq: int) -> int:
        """Adopt every other node that replied as ``incarnation`` with seqs below ``seq`` (a client state's seqs
        only grow, so only those can be the same state before a restart). Returns how many."""
        self.get(client).moved_to = None
        if not incarnation:
            return 0
        olds = [
            cid
            for cid, other in self.clients.items()
            if cid != int(client)
            and other.incarnation == incarnation
            and other.last_seq < seq
            and other.moved_to != int(client)
        ]
        for cid in olds:
            self.adopt(client, cid)
        return len(olds)

    def resync_pending(self, client: int, meta: ReplyMeta) -> list[Resolution]:
        """Answer the client's ``meta.pending`` task ids (other than the one it answers now): a task still open
        on another node waits (its resolution will follow here), a resolution queued for another node moves
        here, and a task the ledger holds nothing about is nacked ``lost`` (the client restores that update).
        Another node is adopted (it held this client's state before a restart under a new node id) only if it
        replied as this reply's incarnation: task ids can be guessed, incarnations cannot. Otherwise the
        resolution is copied here (``watchers``: when it leaves): a node that never replied may be this
        client's state before its restart, or a victim whose ids a hostile node lists, and each node acts only
        on the ids it holds, each once. Returns the nacks issued.

        >>> book.resync_pending(12, ReplyMeta(9, 4, incarnation=1002, pending=(5,)))  # doctest: +SKIP
        []
        """
        led, nacks = self.get(client), []
        here = {r.task_id for r in led.outbox} | {r.task_id for r in self.held.get(int(client), [])}
        holders: dict[int, tuple[int, Resolution | None]] | None = None  # built at the first id no open task has
        for task_id in meta.pending:
            if task_id == meta.task_id or task_id in here:
                continue
            task = self.tasks.get(int(task_id))
            if task is None and holders is None:
                holders = self._holders()
            holder, queued = (task.client, None) if task is not None else holders.get(int(task_id), (None, None))
            if holder is None:
                nacks.append(Resolution(int(task_id), 0, Outcome.LOST, "lost: unknown to the server"))
                led.outbox.append(nacks[-1])
            elif self.owner(holder) == int(client):
                continue
            elif meta.incarnation and self.clients[holder].incarnation == meta.incarnation:
                self.adopt(client, holder)
            elif task is not None or queued is None:  # open, or an ack held for commit(): a copy when released
                self.watchers.setdefault(int(task_id), set()).add(int(client))
            else:
                led.outbox.append(queued)
                here.add(queued.task_id)
        return nacks

    def copy_to_watchers(self, resolution: Resolution, owner: int) -> None:
        """``resolution`` left for ``owner``'s outbox: a copy for each node that listed its task while it was open
        or held (``resync_pending``), unless that node's state is ``owner``'s.

        >>> book.copy_to_watchers(Resolution(5, 1, Outcome.LOST, "lost"), owner=2)  # doctest: +SKIP
        """
        for node in sorted(self.watchers.pop(resolution.task_id, ())):
            if self.owner(node) != self.owner(owner):
                self.outbox(node).append(resolution)

    def _holders(self) -> dict[int, tuple[int, Resolution | None]]:
        """Task id -> the node whose open task's resolutions, outbox or held acks hold its resolution, and that
        resolution (``None`` for an ack held for ``commit()``): one pass over them all, however many ids a reply
        lists (an open task's own id: ``self.tasks``)."""
        out: dict[int, tuple[int, Resolution | None]] = {}
        for t in self.tasks.values():  # the first holder found wins: open tasks, then outboxes and held acks
            for r in t.resolutions:
                out.setdefault(r.task_id, (t.client, r))
        for cid, led in self.clients.items():
            for r in led.outbox:
                out.setdefault(r.task_id, (cid, r))
            for r in self.held.get(cid, []):
                out.setdefault(r.task_id, (cid, None))
        return out


def new_run_key() -> int:
    """A random run id of fixed width (2^61 <= key < 2^62: every task's control record keeps one size)."""
    return (1 << 61) | secrets.randbits(61)


class Ledger(NodeIdentities):
    """Every client's ``ClientLedger`` (by node id), the open tasks (by id) and the acks held for ``commit()``."""

    def __init__(self, config: ProtocolConfig) -> None:
        self.config = config
        self.clients: dict[int, ClientLedger] = {}
        self.tasks: dict[int, Task] = {}  # open tasks by id
        self.held: dict[int, list[Resolution]] = {}  # durable_acks: acks waiting for commit(), by node
        self.watchers: dict[int, set[int]] = {}  # not saved: after a restart the nodes list their ids again
        self.next_task_id = 1
        self.restarts = 0
        self.run_key = new_run_key()

    # ---- clients ---------------------------------------------------------------------------------------------
    def busy(self, client: int) -> bool:
        led = self.clients.get(int(client))
        return led is not None and bool(led.open_tasks)

    def available(self, client: int, now: float) -> bool:
        """Not busy and not backing off after a failure."""
        led = self.clients.get(int(client))
        return led is None or (not led.open_tasks and now >= led.unavailable_until)

    def can_queue(self, client: int, now: float) -> bool:
        """Busy, with room for one more queued task (``prefetch``), not backing off after a failure, and not in
        resync: after a server restart a node's tasks go one at a time until an update of its resync task is
        applied (a resync nacks every update pending on the client, so it must not run after a task whose update
        the server may still apply)."""
        led = self.clients.get(int(client))
        if led is None or led.resync or now < led.unavailable_until:
            return False
        return 0 < len(led.open_tasks) <= self.config.prefetch

    # ---- tasks -----------------------------------------------------------------------------------------------
    def dispatch(self, client: int, now: float, version: int, round_: int, timeout: float | None = None) -> Task:
        """Open a task for ``client`` at ``version``; it carries (and clears) the client's outbox. A client with
        open tasks gets a queued one (at most ``prefetch``): it runs after them, so its deadline is a full timeout
        after the last one's. A client in resync gets no queued task (``can_queue``): it would run after the task ahead
        of it, whose update the server may apply, and a resync there would nack that update on the client (the
        mass would count twice)."""
        led = self.get(client)
        if len(led.open_tasks) > self.config.prefetch:
            limit = self.config.prefetch
            raise RuntimeError(f"client {client} already has open tasks {led.open_tasks} (prefetch {limit})")
        if led.open_tasks and led.resync:
            raise RuntimeError(f"client {client} is in resync: no task queued behind {led.open_tasks}")
        start = max([now] + [self.tasks[t].deadline for t in led.open_tasks if t in self.tasks])
        task = Task(
            task_id=self.next_task_id,
            client=int(client),
            base_version=version,
            sent_at=now,
            deadline=start + (self.config.task_timeout if timeout is None else timeout),
            round=round_,
            resolutions=led.outbox,
            resync=led.resync,
            queued=bool(led.open_tasks),
            run_key=self.run_key,
        )
        self.next_task_id += 1
        led.outbox = []
        led.open_tasks.append(task.task_id)
        self.tasks[task.task_id] = task
        return task

    def undo_dispatch(self, task: Task) -> None:
        """The task could not be sent at all (transport refused it): forget it, give the outbox back."""
        self.tasks.pop(task.task_id, None)
        led = self.get(task.client)
        if task.task_id in led.open_tasks:
            led.open_tasks.remove(task.task_id)
        led.outbox = task.resolutions + led.outbox

    def overtakes(self, client: int, task_id: int) -> bool:
        """Whether a reply to ``task_id``, read now, comes before that of a task sent to ``client`` earlier and
        still open (queued tasks' replies may be read out of order): when ``task_id`` started is then not known."""
        led = self.clients.get(int(client))
        return led is not None and task_id in led.open_tasks and led.open_tasks[0] != task_id

    def open_task(self, client: int, task_id: int) -> Task | None:
        """``task_id`` if it is open and was sent to ``client``."""
        task = self.tasks.get(task_id)
        return task if task is not None and task.client == int(client) else None

    def resolve(self, task: Task, seq: int, outcome: Outcome, reason: str) -> None:
        """Close ``task`` with ``outcome``: its resolution waits in the owner's outbox (an ack with durable acks:
        in ``held`` until ``commit()``)."""
        led = self.get(task.client)
        if task.task_id in led.open_tasks:
            led.open_tasks.remove(task.task_id)
        self.tasks.pop(task.task_id, None)
        resolution = Resolution(task.task_id, seq, outcome, reason)
        owner = self.owner(task.client)
        if outcome is Outcome.APPLIED:
            led.applied += 1
            if task.resync:
                led.resync = False  # the client nacked its old updates before sending this one
            if self.config.durable_acks:
                self.held.setdefault(owner, []).append(resolution)
                return
        else:
            led.nacked += 1
        self.get(owner).outbox.append(resolution)
        self.copy_to_watchers(resolution, owner)

    def fail(self, task: Task, outcome: Outcome, reason: str, now: float) -> None:
        """``task`` will not be applied (timeout / lost): nack it, queue its own resolutions again (they may
        never have reached the client; applying one twice is a no-op there) and back the node off."""
        self.resolve(task, 0, outcome, reason)
        self.outbox(task.client)[:0] = task.resolutions
        led = self.get(task.client)
        led.failures += 1
        led.unavailable_until = now + self.config.backoff * min(16, 2 ** (led.failures - 1))

    def due(self, now: float) -> list[Task]:
        """The open tasks whose deadline has passed."""
        return [t for t in self.tasks.values() if t.deadline <= now]

    def close(self, round_: int, reason: str) -> list[Task]:
        """Time out ``round_``'s open tasks without penalising the nodes; returns them."""
        closing = [t for t in self.tasks.values() if t.round == round_]
        for t in closing:
            self.resolve(t, 0, Outcome.TIMEOUT, reason)
            self.outbox(t.client)[:0] = t.resolutions
        return closing

    # ---- durable acks and restarts ---------------------------------------------------------------------------
    def commit(self) -> int:
        """The model holding every accepted update is durable (checkpointed): release the held acks to the
        clients' outboxes. Returns how many were released."""
        n = 0
        for cid, acks in self.held.items():
            self.outbox(cid).extend(acks)
            for ack in acks:
                self.copy_to_watchers(ack, cid)
            n += len(acks)
        self.held = {}
        return n

    def revoke(self, reason: str) -> list[Resolution]:
        """The acks held for ``commit()`` will never be true (the aggregation that was to hold their updates
        failed): turn them into nacks (``rejected``) so the clients restore those updates. Returns the nacks."""
        nacks = []
        for cid, acks in self.held.items():
            led = self.get(self.owner(cid))
            for ack in acks:
                led.applied -= 1
                led.nacked += 1
                nacks.append(Resolution(ack.task_id, ack.seq, Outcome.REJECTED, reason))
                led.outbox.append(nacks[-1])
                self.copy_to_watchers(nacks[-1], cid)
        self.held = {}
        return nacks

    def restart(self) -> None:
        """Continue after a crash (see ``ServerProtocol.restart``): a fresh task-id range, every client resyncs."""
        self.restarts += 1
        self.next_task_id = max(self.next_task_id, (self.restarts << TASK_ID_BITS) + 1)
        for led in self.clients.values():
            led.resync = True

    def state_dict(self) -> dict[str, Any]:
        """The ledgers as plain types. Open tasks (queued ones too) are saved as nacks "lost: server restarted"
        (to the node holding the client's state now), acks held for ``commit()`` as acks (their updates are in the
        saved model)."""
        clients = {}
        for cid, led in self.clients.items():
            d = led.to_dict()
            d["outbox"] += [r.to_dict() for r in self.held.get(cid, [])]
            d["open_tasks"] = []
            clients[str(cid)] = d
        for cid, led in self.clients.items():
            outbox = clients[str(self.owner(cid))]["outbox"]
            clients[str(cid)]["nacked"] += len(led.open_tasks)
            for task_id in led.open_tasks:
                carried = self.tasks[task_id].resolutions if task_id in self.tasks else []
                outbox[:0] = [r.to_dict() for r in carried]
                outbox.append(Resolution(task_id, 0, Outcome.LOST, "lost: server restarted").to_dict())
        return {"next_task_id": self.next_task_id, "clients": clients, "restarts": self.restarts,
                "run_key": self.run_key}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.next_task_id = int(state["next_task_id"])
        self.clients = {int(k): ClientLedger.from_dict(v) for k, v in state["clients"].items()}
        self.tasks, self.held, self.watchers = {}, {}, {}
        self.restarts = int(state.get("restarts", 0))
        # a checkpoint from before run keys stays keyless (0: its tasks carry no key), so its clients continue the
        # keyless sessions they saved then instead of setting them aside for a new key
        self.run_key = int(state.get("run_key", 0))

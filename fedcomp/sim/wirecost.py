"""Wire bytes: what Flower's transport puts on the TCP connection around the Flower object bytes.

Three byte figures, never mixed: *payload bytes* (the compressed update), *Flower object bytes* (the serialized
Flower objects of a message: payload + records + metadata) and *wire bytes* (TCP payload bytes between a SuperNode
and the SuperLink: Flower object bytes + the HTTP requests and responses the transport makes for them, the idle
polls and heartbeats, and the app bundle). :class:`WireCost` turns Flower object bytes and counts into wire bytes;
it is a pure function of counts, so the simulation can charge links with it and a deployment can report it.

Directions are the client's: *up* is SuperNode -> SuperLink, *down* is SuperLink -> SuperNode.

Example:
    >>> from fedcomp.sim.wirecost import FLOWER_1_41
    >>> up, down = FLOWER_1_41.reply(10_000, objects=3)
    >>> up > 10_000 and down > 0
    True
    >>> FLOWER_1_41.idle(0.0)
    (0, 0)
"""

from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import dataclass, field
from typing import Any

from fedcomp.server.loops import COMPUTE_METRIC, Event, ReplyEvent, SendReceipt, Transport

__all__ = [
    "FLOWER_1_41", "MeteredTransport", "RunCounts", "TaskClock", "WireCost", "protocol_wire_bytes", "run_wire_bytes",
]


@dataclass(frozen=True)
class WireCost:
    """Wire (TCP payload) bytes Flower's transport adds around Flower object bytes, per direction (client's view).

    Fetching a task is ``task_round_trips`` fixed requests (the poll that returns it, the receipt confirmation:
    ``task_up`` / ``task_down`` bytes together) plus one pull request per Flower object (``pull_object_up`` /
    ``pull_object_down`` on top of the object's own bytes). Pushing a reply is ``reply_round_trips`` fixed
    requests (``reply_up`` / ``reply_down``) plus one push request per object (``push_object_up`` /
    ``push_object_down``). While a node has no task it polls every ``poll_interval_s`` (``poll_up`` /
    ``poll_down``), and right after every reply it polls ``polls_per_reply`` more times; it sends a heartbeat
    every ``heartbeat_interval_s`` while connected. The app bundle and the run record (``bundle_up`` /
    ``bundle_down``) are fetched once per client per run. Object pulls and pushes run ``object_streams`` at a
    time (Flower's object transfer pool: 2), so the sequential round trips of a task or reply (``task_trips``,
    ``reply_trips``: what its latency pays) are the fixed requests plus ``ceil(objects / object_streams)``.

    Contract: every method returns non-negative ``(up, down)`` integers, monotone in its arguments; ``task`` and
    ``reply`` of ``messages`` messages with totals ``flower_bytes`` and ``objects`` equal the sum of the
    per-message figures.

    Example:
        >>> cost = WireCost(task_up=1000, task_down=500, pull_object_up=300, pull_object_down=100)
        >>> cost.task(1000, objects=3)  # 2 fixed requests + 3 object pulls
        (1900, 1800)
        >>> cost.task_requests(3), cost.task_trips(3)  # 5 requests; the 3 pulls take 2 round trips
        (5, 4)
    """

    task_up: int = 0
    task_down: int = 0
    pull_object_up: int = 0
    pull_object_down: int = 0
    reply_up: int = 0
    reply_down: int = 0
    push_object_up: int = 0
    push_object_down: int = 0
    task_round_trips: int = 2
    reply_round_trips: int = 1
    poll_up: int = 0
    poll_down: int = 0
    poll_interval_s: float = 3.0
    polls_per_reply: float = 1.0
    heartbeat_up: int = 0
    heartbeat_down: int = 0
    heartbeat_interval_s: float = 20.0
    bundle_up: int = 0
    bundle_down: int = 0
    object_streams: int = 2

    def __post_init__(self) -> None:
        for name in ("poll_interval_s", "heartbeat_interval_s", "object_streams"):
            if not getattr(self, name) > 0:
                raise ValueError(f"WireCost.{name} must be > 0")
        for name, value in vars(self).items():
            if value < 0:
                raise ValueError(f"WireCost.{name} must be >= 0, got {value}")

    def task_requests(self, objects: int, messages: int = 1) -> int:
        """HTTP round trips to fetch ``messages`` task messages of ``objects`` Flower objects in all."""
        return self.task_round_trips * max(0, int(messages)) + max(0, int(objects))

    def reply_requests(self, objects: int, messages: int = 1) -> int:
        """HTTP round trips to push ``messages`` replies of ``objects`` Flower objects in all."""
        return self.reply_round_trips * max(0, int(messages)) + max(0, int(objects))

    def task_trips(self, objects: int) -> int:
        """Sequential round trips to fetch one task message of ``objects`` Flower objects (``object_streams`` pulls
        at a time)."""
        return self.task_round_trips + -(-max(0, int(objects)) // int(self.object_streams))

    def reply_trips(self, objects: int) -> int:
        """Sequential round trips to push one reply of ``objects`` Flower objects (``object_streams`` at a time)."""
        return self.reply_round_trips + -(-max(0, int(objects)) // int(self.object_streams))

    def task(self, flower_bytes: int, objects: int, messages: int = 1) -> tuple[int, int]:
        """``(up, down)`` wire bytes to fetch ``messages`` task messages (``flower_bytes`` travel down)."""
        n, k = max(0, int(messages)), max(0, int(objects))
        return (
            n * self.task_up + k * self.pull_object_up,
            max(0, int(flower_bytes)) + n * self.task_down + k * self.pull_object_down,
        )

    def reply(self, flower_bytes: int, objects: int, messages: int = 1) -> tuple[int, int]:
        """``(up, down)`` wire bytes to push ``messages`` replies (``flower_bytes`` travel up)."""
        n, k = max(0, int(messages)), max(0, int(objects))
        return (
            max(0, int(flower_bytes)) + n * self.reply_up + k * self.push_object_up,
            n * self.reply_down + k * self.push_object_down,
        )

    def polls(self, waiting_s: float, replies: int = 0) -> tuple[int, int]:
        """``(up, down)`` wire bytes of the empty polls of ``waiting_s`` node-seconds without a task, plus the
        ``polls_per_reply`` poll(s) a node makes right after each of ``replies`` replies."""
        n = max(0.0, float(waiting_s)) / self.poll_interval_s + max(0, int(replies)) * self.polls_per_reply
        return round(n * self.poll_up), round(n * self.poll_down)

    def heartbeats(self, connected_s: float) -> tuple[int, int]:
        """``(up, down)`` wire bytes of heartbeats over ``connected_s`` node-seconds."""
        n = max(0.0, float(connected_s)) / self.heartbeat_interval_s
        return round(n * self.heartbeat_up), round(n * self.heartbeat_down)

    def idle(self, seconds: float) -> tuple[int, int]:
        """``(up, down)`` wire bytes of polls and heartbeats while a node is connected without a task."""
        p, h = self.polls(seconds), self.heartbeats(seconds)
        return p[0] + h[0], p[1] + h[1]

    def bundle(self) -> tuple[int, int]:
        """``(up, down)`` wire bytes of fetching the app bundle and run record, once per client per run."""
        return self.bundle_up, self.bundle_down


@dataclass(frozen=True)
class RunCounts:
    """What a deployment's server knows of a run: task and reply totals (Flower object bytes and objects), the
    clients that took part, their connected and task-less (waiting) node-seconds."""

    tasks: int = 0
    task_flower_bytes: int = 0
    task_objects: int = 0
    replies: int = 0
    reply_flower_bytes: int = 0
    reply_objects: int = 0
    clients: int = 0
    connected_s: float = 0.0
    waiting_s: float = 0.0
    unfetched_tasks: float = 0.0  # expected number of the counted tasks no node fetched before the run ended
    repolls: int | None = None  # replies after which the node's next poll found no task queued (None: every one)
    unfetched_flower_bytes: float = 0.0
    unfetched_objects: float = 0.0


#: The run totals ``TaskClock.counts`` reads (a resumed run's clock counts those beyond the checkpoint's).
TOTALS = ("messages_down", "flower_bytes_down", "flower_objects_down", "messages_up", "flower_bytes_up",
          "flower_objects_up")


def add_counts(a: RunCounts, b: RunCounts) -> RunCounts:
    """The counts of two stretches of one run (before and after a resume): every figure summed (``repolls``:
    None when either stretch did not count them)."""
    out = {f.name: getattr(a, f.name) + getattr(b, f.name) for f in dataclasses.fields(RunCounts)
           if f.name != "repolls"}
    return RunCounts(**out, repolls=None if a.repolls is None or b.repolls is None else a.repolls + b.repolls)


def saved_counts(saved: Any) -> RunCounts:
    """``RunCounts`` from a checkpoint's ``dataclasses.asdict`` of them (a figure it lacks: 0, as a later fedcomp's
    checkpoint may hold more or fewer); ``ValueError`` for anything else (an unknown figure, a count that is no
    whole number >= 0, seconds that are not finite and >= 0).

    >>> saved_counts({"replies": 3, "waiting_s": 1.5}).replies, saved_counts({}).repolls
    (3, None)
    """
    fields = {f.name: f for f in dataclasses.fields(RunCounts)}
    if not isinstance(saved, dict) or set(saved) - set(fields):
        raise ValueError("not the wire counts of a run")
    for k, v in saved.items():
        if k == "repolls" and v is None:
            continue
        kinds = (int, float) if isinstance(fields[k].default, float) else (int,)  # seconds, else counts
        if isinstance(v, bool) or not isinstance(v, kinds) or not math.isfinite(v) or v < 0:
            raise ValueError(f"wire count {k!r} is {v!r}")
    return RunCounts(**saved)


def run_wire_bytes(cost: WireCost, c: RunCounts) -> dict[str, tuple[int, int]]:
    """``(up, down)`` wire bytes of a run by part (``tasks``, ``replies``, ``polls``, ``heartbeats``, ``bundle``)
    and their sum (``total``).

    Example:
        >>> parts = run_wire_bytes(FLOWER_1_41, RunCounts(tasks=1, task_flower_bytes=500, task_objects=3, clients=1))
        >>> parts["total"][1] > 500
        True
    """
    n, k = c.unfetched_tasks, c.unfetched_objects
    unfetched_up = n * cost.task_up + k * cost.pull_object_up
    unfetched_down = c.unfetched_flower_bytes + n * cost.task_down + k * cost.pull_object_down
    sent = cost.task(c.task_flower_bytes, c.task_objects, c.tasks)
    parts = {
        "tasks": (max(0, round(sent[0] - unfetched_up)), max(0, round(sent[1] - unfetched_down))),
        "replies": cost.reply(c.reply_flower_bytes, c.reply_objects, c.replies),
        "polls": cost.polls(c.waiting_s, c.replies if c.repolls is None else c.repolls),
        "heartbeats": cost.heartbeats(c.connected_s),
        "bundle": (cost.bundle_up * c.clients, cost.bundle_down * c.clients),
    }
    parts["total"] = (sum(p[0] for p in parts.values()), sum(p[1] for p in parts.values()))
    return parts


def protocol_wire_bytes(c: RunCounts, parts: dict[str, tuple[int, int]]) -> int:
    """Wire bytes of a run that are not Flower object bytes: request and response headers, polls, heartbeats
    (the app bundle excluded). The object bytes subtracted are those the wire carried: a task no node fetched
    before the run ended moved none (docs/protocol.md, "Wire bytes"). Never negative.

    Example:
        >>> c = RunCounts(tasks=2, task_flower_bytes=1000, task_objects=6, unfetched_tasks=1,
        ...               unfetched_flower_bytes=500, unfetched_objects=3, clients=1)
        >>> 0 < protocol_wire_bytes(c, run_wire_bytes(FLOWER_1_41, c)) < 10_000
        True
    """
    fetched = max(0.0, c.task_flower_bytes - c.unfetched_flower_bytes)
    tasks = max(0.0, sum(parts["tasks"]) - fetched)
    replies = max(0.0, sum(parts["replies"]) - c.reply_flower_bytes)
    return round(tasks + replies + sum(parts["polls"]) + sum(parts["heartbeats"]))


@dataclass
class TaskClock:
    """Per client, the time it held a task (from the task's dispatch to its reply's arrival) during a run, so
    the rest of its connected time is waiting (polling), and the replies that crossed the wire. Times are the
    caller's clock (seconds).

    A SuperNode fetches one task at a time: right after pushing a reply it polls again, and that poll returns
    its next task if one is queued (then no empty poll follows the reply); otherwise it polls every 3 s. So at
    the run's end a node's oldest open task was fetched if it was queued before the node's last reply (by the
    poll right after that push) or, sent later, with probability ``min(1, age / poll interval)``; the tasks
    queued behind it were not (the node fetches the next only after pushing the oldest one's reply).

    Example:
        >>> clock = TaskClock(start=0.0)
        >>> clock.sent(client=1, task_id=7, now=1.0)
        >>> clock.replied(task_id=7, now=5.0)
        >>> clock.waiting_s(now=10.0), clock.connected_s(now=10.0), clock.repolls
        (6.0, 10.0, 1)
    """

    start: float
    busy: dict[int, float] = field(default_factory=dict)
    open: dict[int, tuple[int, float]] = field(default_factory=dict)
    nodes: set[int] = field(default_factory=set)
    sizes: dict[int, tuple[int, int]] = field(default_factory=dict)  # open task -> (Flower object bytes, objects)
    last_reply: dict[int, float] = field(default_factory=dict)  # node -> time of its last reply
    replies: int = 0  # replies read (handled by the loop or not), with their Flower object bytes and objects
    reply_flower_bytes: int = 0
    reply_objects: int = 0
    repolls: int = 0  # replies after which the node's next poll found no queued task (an empty poll)
    cycles: list[float] = field(default_factory=list)  # per reply, the seconds its node held the task
    earlier: RunCounts | None = None  # a resumed run's counts up to its checkpoint (``resumed``)
    base: dict[str, int] = field(default_factory=dict)  # the run's ``TOTALS`` when this clock started counting

    def resumed(self, earlier: RunCounts, totals: dict[str, int]) -> None:
        """Go on counting a resumed run: ``earlier``, the counts its checkpoint holds, are added to this clock's,
        whose tasks and replies are those of the run's ``totals`` beyond these (the checkpoint's)."""
        self.earlier = earlier
        self.base = {k: int(totals.get(k, 0)) for k in TOTALS}

    def seen(self, nodes: list[int]) -> None:
        """Nodes found connected (they poll and send heartbeats whether or not they get a task)."""
        self.nodes.update(int(n) for n in nodes)

    def sent(self, client: int, task_id: int, now: float, flower_bytes: int = 0, objects: int = 0) -> None:
        self.busy.setdefault(client, 0.0)
        self.nodes.add(client)
        self.open[task_id] = (client, now)
        self.sizes[task_id] = (int(flower_bytes), int(objects))

    def unfetched(self, now: float, poll_interval_s: float) -> tuple[float, float, float]:
        """Expected ``(tasks, Flower object bytes, objects)`` of the open tasks not yet fetched at ``now`` (the
        class docstring: per node, the oldest open task by its queueing or age, the ones behind it not)."""
        n = b = k = 0.0
        per_node: dict[int, list[tuple[float, int]]] = {}
        for task_id, (client, t) in self.open.items():
            per_node.setdefault(client, []).append((t, task_id))
        for client, tasks in per_node.items():
            last = self.last_reply.get(client)
            for i, (t, task_id) in enumerate(sorted(tasks)):
                if i > 0:  # behind an open task: fetched only after that one's reply is pushed
                    miss = 1.0
                elif last is not None and t < last:  # queued before the last reply: the poll after that push
                    miss = 0.0
                else:
                    miss = 1.0 - min(1.0, max(0.0, now - t) / poll_interval_s)
                size, objs = self.sizes.get(task_id, (0, 0))
                n, b, k = n + miss, b + miss * size, k + miss * objs
        return n, b, k

    def replied(self, task_id: int, now: float, flower_bytes: int = 0, objects: int = 0) -> None:
        """A reply to ``task_id`` at ``now`` (``flower_bytes`` in ``objects`` Flower objects; 0 for an error the
        SuperLink made): the node held it from its dispatch, or, when it was queued behind the node's previous
        task (prefetch), from that task's reply, so overlapping tasks count once."""
        self.sizes.pop(task_id, None)
        if (entry := self.open.pop(task_id, None)) is not None:
            client, t = entry
            start = max(t, self.last_reply.get(client, t))
            self.cycles.append(max(0.0, now - start))
            self.busy[client] = self.busy.get(client, 0.0) + max(0.0, now - start)
            self.last_reply[client] = max(now, self.last_reply.get(client, now))
            queued = any(c == client and sent < now for c, sent in self.open.values())
            self.repolls += int(not queued)
            if flower_bytes > 0:
                self.replies += 1
                self.reply_flower_bytes += int(flower_bytes)
                self.reply_objects += int(objects)

    @property
    def clients(self) -> int:
        """Clients that got at least one task (each fetched the app bundle)."""
        return len(self.busy)

    def connected_s(self, now: float) -> float:
        """Node-seconds of the nodes seen connected (the run's length each)."""
        return len(self.nodes) * max(0.0, now - self.start)

    def counts(self, totals: dict[str, int], now: float, poll_interval_s: float = 3.0) -> RunCounts:
        """``RunCounts`` from a run's totals (``messages_down/up``, ``flower_bytes_down/up``,
        ``flower_objects_down/up``) and this clock. Replies: those this clock saw cross the wire when it was told
        their sizes (every reply read, also one the loop never handled), else the totals'."""
        n, b, k = self.unfetched(now, poll_interval_s)
        own = self.reply_flower_bytes > 0
        t = {key: int(totals.get(key, 0)) - self.base.get(key, 0) for key in TOTALS}  # this clock's stretch
        here = RunCounts(
            unfetched_tasks=n,
            unfetched_flower_bytes=b,
            unfetched_objects=k,
            tasks=t["messages_down"],
            task_flower_bytes=t["flower_bytes_down"],
            task_objects=t["flower_objects_down"],
            replies=self.replies if own else t["messages_up"],
            reply_flower_bytes=self.reply_flower_bytes if own else t["flower_bytes_up"],
            reply_objects=self.reply_objects if own else t["flower_objects_up"],
            repolls=self.repolls,
            clients=self.clients,
            connected_s=self.connected_s(now),
            waiting_s=self.waiting_s(now),
        )
        return here if self.earlier is None else add_counts(self.earlier, here)

    def waiting_s(self, now: float) -> float:
        """Node-seconds without a task (a task still open at ``now`` counts as held)."""
        held = sum(self.busy.values()) + sum(max(0.0, now - t) for _, t in self.open.values())
        return max(0.0, self.connected_s(now) - held)


# Flower 1.41 over HTTP (the product's default transport), measured on loopback with a counting TCP proxy
# (benchmarks/wire_calibration.py; figures in docs/results.md, "Wire calibration"; each constant in
# docs/protocol.md, "Wire bytes").
FLOWER_1_41 = WireCost(
    task_up=1792,  # the poll that returns a task (853) + confirm-message-received (939)
    task_down=599,  # its answer (message + object tree of 3 ids, 471) + the confirmation's (128)
    pull_object_up=926,
    pull_object_down=138,  # beyond the object's own bytes
    reply_up=1271,  # push-messages: message metadata + object tree
    reply_down=440,  # its answer: the ids of the objects to push
    push_object_up=969,  # beyond the object's own bytes
    push_object_down=130,
    task_round_trips=2,
    reply_round_trips=1,
    poll_up=853,  # 841 B of HTTP request headers, 530 B of them the node's signed identity
    poll_down=128,  # HTTP response headers, empty body
    poll_interval_s=3.0,
    polls_per_reply=1.0,  # the SuperNode polls again right after pushing a reply
    heartbeat_up=868,
    heartbeat_down=130,
    heartbeat_interval_s=20.0,  # (30 s - 5 s call timeout) x 0.8, +-10% jitter
    bundle_up=1780,  # get-run + get-fab
    bundle_down=65_000,  # get-fab's answer (the FAB of clients/ and server_app/: it grows with their code) + get-run's
    object_streams=2,  # Flower pulls and pushes a message's objects two at a time (inflatable_utils thread pool)
)


class MeteredTransport(Transport):
    """A transport that tells a ``TaskClock`` which node holds which task when, for the wire model's polls, and
    keeps each reply's own train-seconds metric (decode, train, compress)."""

    def __init__(self, inner: Transport, clock: TaskClock) -> None:
        self.inner, self.clock = inner, clock
        self.train_seconds: list[float] = []

    def clients(self) -> list[int]:
        nodes = self.inner.clients()
        self.clock.seen(nodes)
        return nodes

    def send(self, task: Any, model: bytes) -> SendReceipt:
        receipt = self.inner.send(task, model)
        self.clock.sent(task.client, task.task_id, time.monotonic(), receipt.flower_bytes, receipt.flower_objects)
        return receipt

    def poll(self, wait: float) -> list[Event]:
        events = self.inner.poll(wait)
        now = time.monotonic()
        for event in events:
            size = (event.flower_bytes, event.flower_objects) if isinstance(event, ReplyEvent) else (0, 0)
            self.clock.replied(event.task_id, now, *size)
            if isinstance(event, ReplyEvent) and COMPUTE_METRIC in event.metrics:
                self.train_seconds.append(float(event.metrics[COMPUTE_METRIC]))
        return events

    def drain(self, wait: float | None = None) -> int:
        """After the loop: read the replies of the tasks still open (pushed by nodes that were still working when
        the run reached its last version) for the wire figures only, until none is open or ``wait`` seconds have
        passed (default: twice the median task cycle the clock saw, from a task's dispatch to its reply's read,
        plus 1 s, at least 0.5 s; without cycles the clients' median compute stands in). The cycle holds the
        transport's latency as well as the compute, and both grow on a loaded machine. A node that died leaves
        its task open, so the wait is bounded. They crossed the wire, so the wire model counts them; the protocol
        never sees them. Returns how many."""
        if wait is None:
            seconds = sorted(self.clock.cycles or self.train_seconds)
            wait = max(0.5, 2 * seconds[len(seconds) // 2] + 1.0) if seconds else 0.5
        end, n = time.monotonic() + wait, 0
        while self.clock.open and (left := end - time.monotonic()) > 0:
            n += len(self.poll(min(left, 0.5)))
        return n

    def evaluate(self, clients: list[int], model: bytes, version: int, timeout: float) -> list[dict[str, float]]:
        return self.inner.evaluate(clients, model, version, timeout)

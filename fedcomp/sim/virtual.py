"""Virtual time for one-machine simulations: a clock and a ``Transport`` that orders task completions by it.

Flower-free. An ``Engine`` runs each task on its client for real (the fedcomp ClientApp, in-process or on
Flower's simulation engine) and returns the reply; ``VirtualTransport`` decides *when* that reply reaches the
server. With ``count_bytes="wire"`` (the default) the clock charges what Flower 1.41 does per task
(``fedcomp.sim.wirecost``: wire bytes, request round trips, polls; ``TimingConfig``: the SuperExec, the ClientApp
process, the server's reply pull). A node runs its tasks one at a time, first dispatched first (the SuperLink
hands out one message per pull, oldest first). A task dispatched at virtual time ``t`` to a node with link ``L``
and device ``D``, whose previous task (if any) finished its push at ``f``::

    pickup  = f                                  if t < f (queued: the pull right after that push finds it; a task
                                                 sent at f or later answers that reply, after the pull)
            = the node's next poll at or after t otherwise (every P = wire.poll_interval_s: f + P, f + 2P, ...;
                                                 before its first task on a fixed phase of its own)
    fetched = pickup + task_trips(objects) * L.rtt + task wire bytes down / L.down_bw + up / L.up_bw
              (objects move ``object_streams`` = 2 at a time, as Flower pulls them; the node's first task also
              fetches the app bundle)
    start   = max(fetched + superexec_wait_s + process_start_s, device free)
              (superexec_wait_s = superexec_poll_s / 2; process_start_s = cold_start_s or warm_start_s, and a warm
              node's first task also starts its worker: worker_start_s)
    done    = start + codec + D.compute(samples)
              (codec = the client's downlink decode + compress and encode of its update, calibrated on one CPU and
              scaled by the device as training is: ``fedcomp.sim.codeccost``; at the task's density)
    pushed  = fetched + reply_check_s * ceil((done - fetched) / reply_check_s)   (the SuperNode checks for the
              ClientApp's reply every 0.5 s)
    finish  = pushed + reply_trips(objects) * L.rtt + reply wire bytes up / L.up_bw + down / L.down_bw
    visible = pushed + L.rtt                     (the SuperLink stores the reply before its objects arrive)
    seen    = visible + phase * server_pull_s, and while that read comes before ``finish`` (objects incomplete)
              it backs off 1, 2, 4 ... 10 s as Flower's reader does (``server_seen``); ``phase`` is uniform in
              [0, 1) per reply (``read_phase="random"``, the default) or 1/2 (``"half"``)

with the **real** encoded sizes (the Flower message bytes and object counts the engine reports) and ``samples``
the example count the client reports. ``seen`` is when the event reaches the server loop: the server reads each
reply on its own (``fedcomp.flower.grid.ReplyReader``), so a read that comes early costs that reply Flower's
backoff and no other. Each delivered task's ``seen - t``
is split into poll wait, round trips, transfer (bytes over bandwidth), SuperExec wait, process start, compute,
queue (a queued task's wait for its pickup, or for the device), codec, reply check and server wait (``NodeStats``); idle
polls and heartbeats are charged as wire bytes for the time a node is connected without a task (``idle_wire``).
With ``count_bytes="flower"`` or ``"payload"`` there is no transport model and no per-task charge: ``finish =
seen = t + L.rtt + down_bytes / L.down_bw + codec + D.compute(samples) + up_bytes / L.up_bw`` with that byte
figure (a node's tasks then queue for its device).

A node's tasks are scheduled in dispatch order: a task's pickup is known only once the one before it is, so a
reply the engine returns early waits for its predecessors. An error reply (the ClientApp raised) follows the same
path with no compute and no reply bytes.

Ordering (same seed -> same timeline -> same numbers): ``poll`` releases the known event with the smallest
virtual time (ties by task id) only once no in-flight task whose reply is still unknown could finish earlier:
it gathers replies from the engine (blocking on real time for a parallel engine) until the earliest known event
is at or below the lower bound of every unknown one (its ``fetched`` time, or earlier when the node is fated
to vanish; a task queued behind an unknown one is bounded by that one's bound). With every reply gathered this is
"wait for all, release the smallest"; the bound only lets a parallel engine keep working while early events go
out. It advances the clock to the released event, or to the end of the wait when nothing can happen before it.
The server loops of ``fedcomp.server.loops`` run unchanged on top: the async loop dispatches the next task at
that virtual time (or queues it behind the running one: prefetch), sync rounds close at their virtual deadline.

Faults, drawn per task from the node's own seeded stream (``fedcomp.sim.links.draw_fate``), become what they are in
deployment: a task lost on the downlink is never run (and never holds up the node's next one) and a lost reply is
never delivered (the server's deadline times them out -> nack); a node that vanishes mid-task (``disconnect``, at
the drawn fraction of the time from ``max(t, f)`` to ``finish``) or whose availability window closes fails every
task it holds, each reported ``detect_s`` after it left as a ``LOST`` failure (Flower's ``NODE_UNAVAILABLE``
after missed heartbeats), and stays away ``rejoin_s`` (or until its window reopens). A client whose update was
lost learns it from the nack in its next task and restores the update into its error-feedback residual.
"""

from __future__ import annotations

import heapq
import math
import random
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field, replace

from fedcomp.protocol import Outcome, Task
from fedcomp.registry import ConfigError
from fedcomp.server.loops import COMPUTE_METRIC, Event, FailureEvent, ReplyEvent, SendReceipt, Transport
from fedcomp.sim.codeccost import NO_CODEC, CodecCost
from fedcomp.sim.links import Availability, DeviceProfile, Fate, LinkProfile, draw_fate
from fedcomp.sim.wirecost import FLOWER_1_41, WireCost


class VirtualClock:
    """Simulated seconds; only ``VirtualTransport`` moves it, and only forward."""

    def __init__(self, start: float = 0.0) -> None:
        self._t = float(start)

    def now(self) -> float:
        return self._t

    def advance_to(self, t: float) -> None:
        if t < self._t:
            raise ValueError(f"virtual clock cannot go back from {self._t} to {t}")
        self._t = float(t)


@dataclass(frozen=True)
class NodeProfile:
    """One simulated client: its stable ``index`` (partition id; orders the nodes and seeds its fault stream),
    its link, its device class and when it is online."""

    index: int
    link: LinkProfile
    device: DeviceProfile
    availability: Availability = field(default_factory=Availability)


class Engine(ABC):
    """Runs tasks on clients for real; never decides about time.

    Contract: a node's tasks run on its client in ``submit`` order, one at a time (the client state sees them in
    dispatch order, as a SuperNode runs them); ``gather`` may return them in any order.
    """

    @abstractmethod
    def submit(self, task: Task, model: bytes) -> SendReceipt:
        """Start ``task`` on its client with the model blob; the receipt holds the task message's size."""

    @abstractmethod
    def gather(self, task_ids: Collection[int]) -> list[Event]:
        """Block until every task in ``task_ids`` has its reply (or error); return those events."""

    def gather_any(self, task_ids: Collection[int]) -> list[Event]:
        """Block until at least one task of ``task_ids`` has its event; return the events there are (default:
        all of them). Parallel engines override it so the transport can release early events sooner."""
        return self.gather(task_ids)

    def measure(self, task: Task, model: bytes) -> SendReceipt:
        """The size of ``task``'s Flower message, without running it (a task lost on its way down crossed the
        link all the same); default: not known (an empty receipt)."""
        del task, model
        return SendReceipt()

    def close(self) -> None:
        """Release what the engine holds (processes, actors)."""


#: Fixed spread of the nodes' poll phases before their first task (node ``i`` polls at ``P * frac(i * PHI)``).
PHI = 0.6180339887498949
COUNT_BYTES = ("wire", "flower", "payload")
#: How a SuperNode runs a task: ``cold`` starts a fresh ``flwr-clientapp`` process per task (it imports torch and
#: rebuilds the client), ``warm`` a forked thin forwarder process that hands the task to a long-lived worker.
WORKERS = ("warm", "cold")

# Flower 1.41's per-task charges, calibrated on loopback (2-core VM; benchmarks/latency_calibration.py, the `mlp`
# model, docs/results.md): the SuperNode log's "process start" + "ClientApp" segments less the task's compute.
#: A cold ``flwr-clientapp``: process start (about 1 s) + Python, torch and fedcomp imports and the model/data
#: rebuild (about 4.1 s).
COLD_START_S = 5.1
#: A warm node (``flower-client --worker warm``): ``flwr-clientapp`` forked from a process that imported Flower
#: (about 0.04 s), then Flower's task set-up and the thin forwarder's hand-over to the long-lived worker (0.12 s).
WARM_START_S = 0.16
#: A warm node's worker, on its first task: data, model and session built once (what a cold task pays every time
#: besides its process: 2.4 s measured, docs/flower.md, "Warm worker").
WORKER_START_S = 2.4
#: The SuperExec's task poll interval as the launchers set it (``fedcomp.tools.processes``).
SUPEREXEC_POLL_S = 0.2
#: Flower 1.41's own SuperExec task poll interval (``FLWR_SUPEREXEC_TASK_POLL_INTERVAL`` unset).
FLOWER_SUPEREXEC_POLL_S = 1.0
#: The server loop's reply pull interval (the Grid transport's ``pull_interval``).
SERVER_PULL_S = 0.25
#: Flower 1.41's object reader: the first back-off after an incomplete read, and its cap (``PULL_INITIAL_BACKOFF``,
#: ``PULL_BACKOFF_CAP`` in ``flwr.supercore.constant``; the random factor 0.8-1.2 is taken at its mean).
READ_BACKOFF_S, READ_BACKOFF_CAP_S = 1.0, 10.0
#: Where in its pull interval the server's first read of a reply lands: ``random`` (uniform, drawn per reply from
#: the node's own stream: the server's reads are not in step with the nodes, so a read lands inside a short upload
#: with probability upload / interval) or ``half`` (always half an interval: the expected wait, no chance).
READ_PHASES = ("random", "half")


def server_seen(visible: float, finish: float, pull_s: float, phase: float = 0.5) -> float:
    """When the server holds a reply that became visible on the SuperLink at ``visible`` and whose objects were
    all uploaded at ``finish``: its first read comes ``phase`` (in [0, 1)) of a pull interval later; a read before
    ``finish`` finds the objects incomplete and backs off 1, 2, 4 ... 10 s before it tries again.

    >>> server_seen(0.0, 0.1, 0.25), server_seen(0.0, 10.0, 0.25)   # fast: no back-off; 10 s upload: 1+2+4+8
    (0.125, 15.125)
    >>> server_seen(0.0, 0.02, 0.25, phase=0.04)   # a read that lands inside a 20 ms upload: 1 s later
    1.01
    """
    t, delay = visible + phase * pull_s, READ_BACKOFF_S
    while t < finish:
        t += delay
        delay = min(2 * delay, READ_BACKOFF_CAP_S)
    return t


#: The largest per-task charge (a day) and the shortest reply check: beyond them the clock's sums overflow.
MAX_CHARGE_S, MIN_REPLY_CHECK_S = 86_400.0, 1e-3
_CHARGES = ("detect_s", "rejoin_s", "reply_check_s", "cold_start_s", "warm_start_s", "worker_start_s",
            "superexec_poll_s", "server_pull_s", "codec_density")


@dataclass(frozen=True)
class TimingConfig:
    """How the clock charges a task (formulas in the module docstring).

    ``seed``: fault streams (node ``i`` draws from ``Random(seed * 1_000_003 + i)``). ``count_bytes``:
    ``"wire"`` (the default: Flower object bytes turned into wire bytes by ``wire``, plus Flower's transport
    latency: poll wait, one link round trip per request, the SuperNode's ``reply_check_s`` reply check; the app
    bundle on each node's first task; and the per-task charges below), ``"flower"`` (serialized Flower message
    bytes, falls back to payload when unknown; one RTT per task) or ``"payload"`` (the fedcomp blob; one RTT per
    task). ``detect_s``: delay before the server learns that a node vanished. ``rejoin_s``: how long a vanished
    node stays away.

    Per-task charges (seconds; only with ``count_bytes="wire"``): ``worker`` (``WORKERS``) picks the process start,
    ``cold_start_s`` (a fresh ``flwr-clientapp`` per task) or ``warm_start_s`` (a forwarder to a long-lived worker),
    and a warm node's first task also ``worker_start_s`` (its worker builds data, model and session);
    ``superexec_poll_s``: the SuperExec polls for tasks on this interval, a task waits half of it;
    ``server_pull_s``: the server pulls replies on this interval (``simulations.scenario.Scenario.timing`` lengthens
    it, as a deployment's server does, when more replies are awaited than ``max-reads-per-s`` allows), a reply's
    first read comes within one interval (half of it on average) after the reply is visible, and a read before its
    objects are complete backs off as Flower's reader does (``server_seen``). Each must be finite and >= 0
    (``ConfigError`` otherwise); 0 turns a charge off (with ``server_pull_s = 0`` the first read comes at once, so
    it backs off whenever the upload is not done). ``read_phase``: where in the pull interval the first read lands
    (``READ_PHASES``).

    ``codec``: the client's decode + compress + encode seconds per task on the calibration CPU (``CodecCost``,
    scaled per node by its device; charged in every ``count_bytes`` mode: it is compute), at the task's density
    (``Task.density``, else ``codec_density``). Default: none.

    Example:
        >>> t = TimingConfig(worker="cold")
        >>> t.count_bytes, t.wire.poll_interval_s, t.process_start_s, t.superexec_wait_s, t.server_wait_s
        ('wire', 3.0, 5.1, 0.1, 0.125)
        >>> TimingConfig(count_bytes="payload").process_start_s
        0.0
    """

    seed: int = 0
    count_bytes: str = "wire"
    detect_s: float = 60.0
    rejoin_s: float = 300.0
    wire: WireCost = FLOWER_1_41
    reply_check_s: float = 0.5
    worker: str = "warm"
    cold_start_s: float = COLD_START_S
    warm_start_s: float = WARM_START_S
    superexec_poll_s: float = SUPEREXEC_POLL_S
    server_pull_s: float = SERVER_PULL_S
    read_phase: str = "random"
    worker_start_s: float = WORKER_START_S
    codec: CodecCost = NO_CODEC
    codec_density: float = 0.0

    def __post_init__(self) -> None:
        if self.read_phase not in READ_PHASES:
            raise ConfigError(f"read_phase must be one of {READ_PHASES}, got {self.read_phase!r}")
        if self.count_bytes not in COUNT_BYTES:
            raise ConfigError(f"count_bytes must be one of {COUNT_BYTES}, got {self.count_bytes!r}")
        if self.worker not in WORKERS:
            raise ConfigError(f"worker must be one of {WORKERS}, got {self.worker!r}")
        for name in _CHARGES:
            v = getattr(self, name)
            top = MAX_CHARGE_S if name.endswith("_s") else math.inf
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not (0 <= v < top):
                raise ConfigError(f"{name} must be a number in [0, {top:g}), got {v!r}")
        if 0 < self.reply_check_s < MIN_REPLY_CHECK_S:  # the clock divides by it
            raise ConfigError(f"reply_check_s must be 0 or >= {MIN_REPLY_CHECK_S:g}, got {self.reply_check_s!r}")

    @property
    def transport(self) -> bool:
        """Whether Flower's transport (wire bytes, polls, request round trips, per-task charges) is on the clock."""
        return self.count_bytes == "wire"

    @property
    def process_start_s(self) -> float:
        """Seconds to start the task's ClientApp process (``cold_start_s`` or ``warm_start_s`` by ``worker``)."""
        if not self.transport:
            return 0.0
        return self.cold_start_s if self.worker == "cold" else self.warm_start_s

    @property
    def first_task_s(self) -> float:
        """Seconds a node's first task pays on top of ``process_start_s``: a warm node starts its worker."""
        return self.worker_start_s if self.transport and self.worker == "warm" else 0.0

    @property
    def superexec_wait_s(self) -> float:
        """Seconds a fetched task waits for the SuperExec's next poll: half its interval."""
        return self.superexec_poll_s / 2 if self.transport else 0.0

    @property
    def server_wait_s(self) -> float:
        """Seconds from a reply becoming visible to the server's first read of it: half the pull interval (the
        reply's whole wait, ``NodeStats.server_wait_s``, adds the read back-off of ``server_seen``)."""
        return self.server_pull_s / 2 if self.transport else 0.0


@dataclass
class NodeStats:
    """Per-node totals. Bytes are what crossed the link, lost messages included, in three figures: ``payload_*``
    (fedcomp blobs), ``flower_*`` (serialized Flower messages; 0 where the engine does not know them) and
    ``wire_*`` (messages on the wire: Flower object bytes + the requests Flower's transport makes for them, and the
    app bundle; idle polls and heartbeats are ``VirtualTransport.idle_wire``; 0 unless ``count_bytes="wire"``).
    Seconds: the split of the delivered tasks' time from dispatch to the server seeing the reply
    (``poll_wait_s``, ``round_trip_s``, ``reply_check_s``, ``superexec_wait_s``, ``process_start_s`` and
    ``server_wait_s`` are Flower's latency, ``transfer_s`` bytes over bandwidth, ``compute_s`` the device's
    training, ``codec_s`` its downlink decode and its update's compress + encode,
    ``queue_s`` waiting behind the node's earlier tasks: queued on the node (prefetch) or for the device); they
    add up to that time, task by task."""

    tasks: int = 0
    delivered: int = 0
    lost_down: int = 0
    lost_up: int = 0
    disconnects: int = 0
    payload_down: int = 0
    payload_up: int = 0
    flower_down: int = 0
    flower_up: int = 0
    wire_down: int = 0
    wire_up: int = 0
    bundle_down: int = 0
    busy_s: float = 0.0
    pushed: int = 0  # replies the node pushed (delivered or lost on the way)
    in_task_s: float = 0.0
    away_s: float = 0.0
    timed: int = 0
    poll_wait_s: float = 0.0
    round_trip_s: float = 0.0
    transfer_s: float = 0.0
    compute_s: float = 0.0
    reply_check_s: float = 0.0
    queue_s: float = 0.0
    superexec_wait_s: float = 0.0
    process_start_s: float = 0.0
    server_wait_s: float = 0.0
    codec_s: float = 0.0


@dataclass
class _Flight:
    """A task on its node, from dispatch until it is scheduled. ``pickup`` (and with it ``fetched``) is known
    once the node's previous task is scheduled; ``held_from`` = ``max(dispatch, previous push finish)``, where the
    node's exposure to a disconnect starts; ``event``: the engine's reply, once gathered."""

    task: Task
    dispatch: float
    fate: Fate
    fetch_rtt_s: float
    fetch_transfer_s: float
    pickup: float | None = None
    held_from: float = 0.0
    queued: bool = False  # picked up by the pull right after the previous task's push
    event: Event | None = None

    @property
    def fetched(self) -> float:
        """When the task (and the bundle, the first time) is on the node."""
        assert self.pickup is not None, "the pickup is known once the previous task of the node is scheduled"
        return self.pickup + self.fetch_rtt_s + self.fetch_transfer_s


@dataclass(frozen=True)
class _Run:
    """What scheduling found for one task: its times and the reply's link charges."""

    superexec: float  # waiting for the SuperExec's poll
    process: float  # starting the ClientApp process
    ready: float  # fetched + superexec + process
    start: float
    compute: float  # training
    codec: float  # decode + compress + encode
    pushed: float
    finish: float
    rtt: float
    transfer: float
    up: int
    down: int
    event: Event


class WireFigures:
    """``VirtualTransport``'s byte figures (payload, Flower object and wire bytes, per node and summed) and the
    wire charge of a message, over its state."""

    config: TimingConfig
    clock: VirtualClock
    nodes: dict[int, NodeProfile]
    stats: dict[int, NodeStats]
    has_bundle: set[int]

    def idle_wire(self, nid: int, now: float | None = None) -> tuple[int, int]:
        """``(up, down)`` wire bytes of node ``nid``'s polls and heartbeats while it was connected without a task,
        up to ``now`` (default: the clock); 0 unless Flower's transport is on the clock."""
        if not self.config.transport:
            return 0, 0
        now = self.clock.now() if now is None else now
        st = self.stats[nid]
        connected = self.nodes[nid].availability.online_time(0.0, now) - st.away_s
        return self.config.wire.idle(max(0.0, connected - st.in_task_s))

    def totals(self, now: float | None = None) -> dict[str, int]:
        """Every node's bytes summed, three figures per direction: ``payload_bytes_*``, ``flower_bytes_*`` and
        ``wire_bytes_*`` (messages + bundle + idle polls and heartbeats up to ``now``), ``wire_bytes_total``."""
        idle = [self.idle_wire(nid, now) for nid in self.nodes]
        st = self.stats.values()
        out = {
            "payload_bytes_up": sum(s.payload_up for s in st),
            "payload_bytes_down": sum(s.payload_down for s in st),
            "flower_bytes_up": sum(s.flower_up for s in st),
            "flower_bytes_down": sum(s.flower_down for s in st),
            "wire_bytes_up": sum(s.wire_up for s in st) + sum(i[0] for i in idle),
            "wire_bytes_down": sum(s.wire_down for s in st) + sum(i[1] for i in idle),
        }
        out["wire_bytes_total"] = out["wire_bytes_up"] + out["wire_bytes_down"]
        return out

    def _bytes(self, flower: int, payload: int) -> int:
        return flower if (self.config.count_bytes == "flower" and flower > 0) else payload

    def _task_wire(self, nid: int, flower: int, objects: int) -> tuple[int, int]:
        """Wire bytes of fetching one task (and the app bundle with the node's first one)."""
        up, down = self.config.wire.task(flower, objects)
        if nid not in self.has_bundle:
            self.has_bundle.add(nid)
            b_up, b_down = self.config.wire.bundle()
            up, down = up + b_up, down + b_down
            self.stats[nid].bundle_down += b_down
        return up, down


class Schedule(WireFigures):
    """``VirtualTransport``'s scheduling of a node's tasks, in dispatch order (the module docstring's formulas)."""

    queues: dict[int, deque[_Flight]]
    poll_anchor: dict[int, float]
    compute_free: dict[int, float]
    away_until: dict[int, float]
    gone_at: dict[int, float]
    ready: list[tuple[float, int, Event]]
    crossing: list[tuple[float, int, int, _Run, bool]]
    worker_started: set[int]

    def _set_pickup(self, flight: _Flight) -> None:
        """Set the pickup of the node's oldest unscheduled task (every earlier one is scheduled)."""
        nid = flight.task.client
        f_prev = self.poll_anchor.get(nid, -math.inf)
        flight.held_from = max(flight.dispatch, f_prev)
        if not self.config.transport:
            flight.pickup = flight.dispatch
        elif flight.dispatch < f_prev:  # queued behind the previous task: the pull right after its push finds it
            flight.pickup, flight.queued = f_prev, True
        else:
            flight.pickup = self._next_poll(nid, flight.dispatch)

    def _next_poll(self, nid: int, t: float) -> float:
        """The node's first poll at or after ``t``: every ``P`` seconds after its last reply push (the pull right
        after the push comes too early for the server's next task), or on its own phase before its first one."""
        p = self.config.wire.poll_interval_s
        anchor = self.poll_anchor.get(nid)
        if anchor is None:
            anchor = p * ((self.nodes[nid].index * PHI) % 1.0) - p
        back = self.away_until.get(nid)
        if back is not None and back > anchor:  # a node that rejoined polls from its return
            anchor = back - p
        k = max(1, math.ceil((t - anchor) / p - 1e-9))
        return anchor + k * p

    def _held_by_gone(self, flight: _Flight) -> float | None:
        """When the node left while holding ``flight`` (dispatched before an earlier task's departure), or None."""
        gone = self.gone_at.get(flight.task.client)
        return gone if gone is not None and flight.dispatch < gone else None

    def _lower_bound(self, flight: _Flight) -> float:
        """The earliest virtual time at which ``flight`` can produce an event, before its reply is known. A flight
        queued behind an unscheduled one is bounded by the node's oldest unscheduled flight: its pickup, its
        departure and those of the tasks queued behind it all come at or after that one's bound."""
        if flight.pickup is None:
            return self._lower_bound(self.queues[flight.task.client][0])
        gone = self._held_by_gone(flight)
        if gone is not None:
            return gone + self.config.detect_s
        avail = self.nodes[flight.task.client].availability
        lb = flight.fetched
        if flight.fate.disconnect_at is not None:
            lb = min(lb, flight.held_from + self.config.detect_s)
        off = avail.offline_at(flight.held_from, lb)
        return lb if off is None else min(lb, off + self.config.detect_s)

    def _advance(self, nid: int) -> None:
        """Schedule the node's tasks in dispatch order while the oldest one's reply is known."""
        queue = self.queues[nid]
        while queue and queue[0].event is not None:
            flight = queue.popleft()
            assert flight.event is not None
            self._schedule(flight, flight.event)
            if queue:
                self._set_pickup(queue[0])

    def _run(self, flight: _Flight, event: Event) -> _Run:
        """The times of ``flight`` on its node (fetched -> SuperExec wait -> process start -> compute -> reply
        check -> push) and its reply's link charges."""
        nid = flight.task.client
        prof, cfg = self.nodes[nid], self.config
        link = prof.link
        superexec, process = cfg.superexec_wait_s, cfg.process_start_s
        if nid not in self.worker_started:
            process += cfg.first_task_s
        ready = flight.fetched + superexec + process
        start = max(ready, self.compute_free.get(nid, -math.inf))
        codec = 0.0
        if isinstance(event, ReplyEvent):
            compute = prof.device.compute_s(max(int(event.meta.num_examples), 0))
            if cfg.codec.charged:
                cost = cfg.codec.scaled(prof.device.s_per_sample)
                codec = cost.downlink_s + cost.uplink_s(flight.task.density or cfg.codec_density)
            # the client reports its compute seconds (train-seconds: decode, train, compress): the virtual ones
            event = replace(event, metrics={**event.metrics, COMPUTE_METRIC: compute + codec})
            if cfg.transport:
                up, down = cfg.wire.reply(event.flower_bytes or len(event.blob), event.flower_objects or 1)
                rtt = cfg.wire.reply_trips(event.flower_objects or 1) * link.rtt_s
            else:
                up, down = self._bytes(event.flower_bytes, len(event.blob)), 0
                rtt = link.rtt_s / 2
        else:  # the ClientApp failed: the error reply comes back after the download
            compute, up, down = 0.0, 0, 0
            rtt = (cfg.wire.reply_round_trips if cfg.transport else 0.5) * link.rtt_s
        done = start + codec + compute
        pushed = done
        if cfg.transport and cfg.reply_check_s > 0:  # the SuperNode looks for the reply every reply_check_s
            pushed = flight.fetched + cfg.reply_check_s * math.ceil((done - flight.fetched) / cfg.reply_check_s - 1e-9)
        transfer = up / link.up_Bps + down / link.down_Bps
        finish = pushed + rtt + transfer
        return _Run(superexec, process, ready, start, compute, codec, pushed, finish, rtt, transfer, up, down, event)

    def _schedule(self, flight: _Flight, event: Event) -> None:
        nid = flight.task.client
        prof, st, cfg = self.nodes[nid], self.stats[nid], self.config
        gone = self._held_by_gone(flight)
        if gone is not None:  # the node left holding this task too: never run there
            self._push(gone + cfg.detect_s, _unavailable(flight, "node left before the task ran"))
            return
        run, pickup = self._run(flight, event), flight.pickup
        assert pickup is not None
        self.worker_started.add(nid)
        self.compute_free[nid] = run.start + run.codec + run.compute
        st.busy_s += run.codec + run.compute
        gone = _departure(flight, prof, st, cfg.rejoin_s, self.away_until, run.finish)
        if gone is not None:
            self.gone_at[nid] = gone
            st.in_task_s += max(0.0, gone - pickup)
            if gone > run.pushed:  # it left while its reply was on the way: those bytes crossed
                self._crossing(gone, nid, run, lost=False)
            self._push(gone + cfg.detect_s, _unavailable(flight, "node left during the task"))
            return
        st.in_task_s += run.finish - pickup
        st.pushed += 1
        self.poll_anchor[nid] = run.finish
        if flight.fate.lost_up:
            self._crossing(run.finish, nid, run, lost=True)
            return  # never delivered: the server's deadline times the task out
        seen = run.finish
        if cfg.transport:  # the reply is visible once its push request landed, before its objects
            phase = self.read_rngs[nid].random() if cfg.read_phase == "random" else 0.5
            seen = server_seen(run.pushed + prof.link.rtt_s, run.finish, cfg.server_pull_s, phase)
        self.unseen[run.event.task_id] = (flight, run, seen - run.finish)
        self._push(seen, run.event)

    def _crossing(self, t: float, nid: int, run: _Run, *, lost: bool) -> None:
        """A reply that never reaches the server (lost on the link, ``lost``; its node left as it crossed) has
        crossed at ``t``: counted once the clock passes ``t`` (``_crossed``), as a delivered reply is once read."""
        heapq.heappush(self.crossing, (t, run.event.task_id, nid, run, lost))

    def _crossed(self, now: float) -> None:
        """Count the replies of ``_crossing`` that have crossed by ``now``: their bytes, and a loss."""
        while self.crossing and self.crossing[0][0] <= now:
            _, _, nid, run, lost = heapq.heappop(self.crossing)
            self.stats[nid].lost_up += lost
            self._charge_reply(self.stats[nid], run)

    def _charge_reply(self, st: NodeStats, run: _Run) -> None:
        """Count a reply's payload, Flower object and wire bytes in ``st``."""
        if isinstance(run.event, ReplyEvent):
            st.payload_up += len(run.event.blob)
            st.flower_up += run.event.flower_bytes
        if self.config.transport:
            st.wire_up += run.up
            st.wire_down += run.down

    def _seen(self, event: Event) -> None:
        """The server reads ``event``: its reply's bytes and, for a reply, its time split count from now on (a
        reply still on its way when the run ends is in no total)."""
        if (unseen := self.unseen.pop(event.task_id, None)) is None:
            return
        flight, run, server_wait = unseen
        st = self.stats[event.client]
        self._charge_reply(st, run)
        if isinstance(run.event, ReplyEvent):
            _count(st, flight, run, server_wait)

    def _push(self, t: float, event: Event) -> None:
        heapq.heappush(self.ready, (t, event.task_id, event))


def _count(st: NodeStats, flight: _Flight, run: _Run, server_wait: float) -> None:
    """Add a delivered task's time split to ``st``."""
    assert flight.pickup is not None
    st.delivered += 1
    st.timed += 1
    if flight.queued:  # waiting behind the node's earlier tasks, not for a poll
        st.queue_s += flight.pickup - flight.dispatch
    else:
        st.poll_wait_s += flight.pickup - flight.dispatch
    st.round_trip_s += flight.fetch_rtt_s + run.rtt
    st.transfer_s += flight.fetch_transfer_s + run.transfer
    st.superexec_wait_s += run.superexec
    st.process_start_s += run.process
    st.compute_s += run.compute
    st.codec_s += run.codec
    st.reply_check_s += run.pushed - (run.start + run.codec + run.compute)
    st.queue_s += run.start - run.ready
    st.server_wait_s += server_wait


class VirtualTransport(Schedule, Transport):
    """A ``Transport`` over an ``Engine`` whose events come in virtual-time order (see the module docstring).

    A node may hold several tasks (the server's prefetch): they run one after another in dispatch order.
    """

    def __init__(
        self,
        engine: Engine,
        nodes: Mapping[int, NodeProfile],
        clock: VirtualClock,
        config: TimingConfig | None = None,
    ) -> None:
        if not nodes:
            raise ConfigError("a simulation needs at least one node")
        self.engine, self.clock, self.config = engine, clock, config or TimingConfig()
        self.nodes = dict(sorted(nodes.items(), key=lambda kv: kv[1].index))
        self.rngs = {nid: random.Random(self.config.seed * 1_000_003 + p.index) for nid, p in self.nodes.items()}
        self.read_rngs = {nid: random.Random(f"server-read/{self.config.seed}/{p.index}")
                          for nid, p in self.nodes.items()}
        self.stats = {nid: NodeStats() for nid in self.nodes}
        self.away_until: dict[int, float] = {}  # a vanished node is away from gone_at until then
        self.gone_at: dict[int, float] = {}  # when the node last left during a task
        self.compute_free: dict[int, float] = {}
        self.poll_anchor: dict[int, float] = {}  # time of the node's last reply push (its polls follow it)
        self.has_bundle: set[int] = set()
        self.worker_started: set[int] = set()  # warm nodes whose worker is up (after their first task)
        self.waiting: dict[int, _Flight] = {}  # submitted, reply not gathered yet
        self.queues: dict[int, deque[_Flight]] = {nid: deque() for nid in self.nodes}  # not scheduled, FIFO
        self.ready: list[tuple[float, int, Event]] = []  # heap of (virtual time, task id, event)
        self.unseen: dict[int, tuple[_Flight, _Run, float]] = {}  # pushed, not read yet: counted when read (_seen)
        self.crossing: list[tuple[float, int, int, _Run, bool]] = []  # heap: replies the server never gets (_crossing)
        self.released = 0

    # ---- Transport --------------------------------------------------------------------------------------
    def clients(self) -> list[int]:
        now = self.clock.now()
        return [nid for nid in self.nodes if self.online(nid, now)]

    def online(self, nid: int, t: float) -> bool:
        away = self.gone_at.get(nid, math.inf) <= t < self.away_until.get(nid, -math.inf)
        return not away and self.nodes[nid].availability.online(t)

    def send(self, task: Task, model: bytes) -> SendReceipt:
        nid, now = task.client, self.clock.now()
        if nid not in self.nodes:
            raise OSError(f"no simulated node {nid}")
        if not self.online(nid, now):
            raise OSError(f"node {nid} is offline at t={now:.3f}")
        fate = draw_fate(self.nodes[nid].link, self.rngs[nid])
        st = self.stats[nid]
        st.tasks += 1
        if fate.lost_down:
            st.lost_down += 1
            # nothing ran, but the task's message crossed the link: its payload, Flower object and wire bytes
            lost = self.engine.measure(task, model)
            st.payload_down += len(model)
            st.flower_down += lost.flower_bytes
            if self.config.transport:
                up, down = self._task_wire(nid, lost.flower_bytes or len(model), lost.flower_objects or 1)
                st.wire_up += up
                st.wire_down += down
            return lost  # the server's per-version rows count the Flower bytes it sent, as for any task
        receipt = self.engine.submit(task, model)
        st.payload_down += len(model)
        st.flower_down += receipt.flower_bytes
        link = self.nodes[nid].link
        if self.config.transport:
            up, down = self._task_wire(nid, receipt.flower_bytes or len(model), receipt.flower_objects or 1)
            st.wire_up += up
            st.wire_down += down
            rtt = self.config.wire.task_trips(receipt.flower_objects or 1) * link.rtt_s
        else:  # no transport model: the counted bytes, half a round trip each way
            up, down = 0, self._bytes(receipt.flower_bytes, len(model))
            rtt = link.rtt_s / 2
        flight = _Flight(task, now, fate, rtt, down / link.down_Bps + up / link.up_Bps)
        self.waiting[task.task_id] = flight
        self.queues[nid].append(flight)
        if len(self.queues[nid]) == 1:
            self._set_pickup(flight)
        return receipt

    def poll(self, wait: float) -> list[Event]:
        now = self.clock.now()
        horizon = now + max(0.0, wait)
        wake = min(horizon, self._next_change(now))
        if wake <= now:
            wake = horizon
        while True:
            bound = min((self._lower_bound(q[0]) for q in self.queues.values() if q), default=math.inf)
            head = self.ready[0][0] if self.ready else math.inf
            if head <= wake and head <= bound:
                t, _, event = heapq.heappop(self.ready)
                self.clock.advance_to(max(now, t))
                self._crossed(self.clock.now())
                self.released += 1
                self._seen(event)
                return [event]
            if bound > wake and head > wake:  # nothing can happen before the wake-up time
                self.clock.advance_to(wake)
                self._crossed(self.clock.now())
                return []
            self._gather()

    # ---- internals --------------------------------------------------------------------------------------
    def _next_change(self, now: float) -> float:
        """Earliest future time at which some node comes online or goes offline."""
        t = math.inf
        for nid, prof in self.nodes.items():
            back = self.away_until.get(nid, -math.inf)
            if back > now:
                t = min(t, back)
            t = min(t, prof.availability.next_change(now))
        return t

    def _gather(self) -> None:
        """Gather at least one pending reply from the engine and schedule what it unblocks."""
        if not self.waiting:
            return
        events = self.engine.gather_any(list(self.waiting))
        if not events:
            raise RuntimeError(f"engine returned no event for tasks {sorted(self.waiting)}")
        for event in events:
            flight = self.waiting.pop(event.task_id, None)
            if flight is not None:  # held until the node's earlier tasks are scheduled
                flight.event = event
                self._advance(flight.task.client)

    def close(self) -> None:
        self.engine.close()


def _unavailable(flight: _Flight, why: str) -> FailureEvent:
    return FailureEvent(flight.task.task_id, flight.task.client, Outcome.LOST, f"NODE_UNAVAILABLE: {why}")


def _departure(
    flight: _Flight, prof: NodeProfile, st: NodeStats, rejoin_s: float, away_until: dict[int, float], finish: float
) -> float | None:
    """When the node leaves during ``flight`` (its drawn disconnect, at that fraction of ``held_from`` ->
    ``finish``, or its availability window closing before ``finish``), counted in ``st``; a disconnected node
    stays away ``rejoin_s`` (``away_until``). ``None``: it stays."""
    nid = flight.task.client
    if flight.fate.disconnect_at is not None:
        gone = flight.held_from + flight.fate.disconnect_at * (finish - flight.held_from)
        away_until[nid] = max(away_until.get(nid, -math.inf), gone + rejoin_s)
        st.away_s += rejoin_s
        st.disconnects += 1
        return gone
    off = prof.availability.offline_at(flight.held_from, finish)
    if off is not None:
        st.disconnects += 1
    return off

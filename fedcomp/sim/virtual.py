"""Virtual time for one-machine simulations: a clock and a ``Transport`` that orders task completions by it.

Flower-free. An ``Engine`` runs each task on its client for real (the fedcomp ClientApp, in-process or on
Flower's simulation engine) and returns the reply; ``VirtualTransport`` decides *when* that reply reaches the
server. With ``count_bytes="wire"`` (the default) the clock charges what Flower 1.41's transport does
(``fedcomp.sim.wirecost``: wire bytes, request round trips, polls). A task dispatched at virtual time ``t`` to a node
with link ``L`` and device ``D``::

    pickup  = the node's next poll at or after t     (every P = wire.poll_interval_s while idle; right after a
              reply push at f the node pulls at once, too early for the server's next task, so its polls are
              f + P, f + 2P, ...; before its first task they are on a fixed phase of its own)
    fetched = pickup + task_requests(objects) * L.rtt + task wire bytes down / L.down_bw + up / L.up_bw
              (the node's first task also fetches the app bundle)
    done    = max(fetched, device free) + D.compute(samples)
    pushed  = fetched + reply_check_s * ceil((done - fetched) / reply_check_s)   (the SuperNode checks for the
              ClientApp's reply every 0.5 s)
    finish  = pushed + reply_requests(objects) * L.rtt + reply wire bytes up / L.up_bw + down / L.down_bw

with the **real** encoded sizes (the Flower message bytes and object counts the engine reports) and ``samples``
the example count the client reports. Each delivered task's time is split into transport latency (poll wait,
round trips, reply check), transfer (bytes over bandwidth), compute and queue (``NodeStats``); idle polls and
heartbeats are charged as wire bytes for the time a node is connected without a task (``idle_wire``). With
``count_bytes="flower"`` or ``"payload"`` there is no transport model: ``finish = t + L.rtt + down_bytes /
L.down_bw + D.compute(samples) + up_bytes / L.up_bw`` with that byte figure. A node computes one task at a time.

Ordering (same seed -> same timeline -> same numbers): ``poll`` releases the known event with the smallest
virtual time (ties by task id) only once no in-flight task whose reply is still unknown could finish earlier:
it gathers replies from the engine (blocking on real time for a parallel engine) until the earliest known event
is at or below the lower bound of every unknown one (its ``fetched`` time, or earlier when the node is fated
to vanish). With every reply gathered this is "wait for all, release the smallest"; the bound
only lets a parallel engine keep working while early events go out. It advances the clock to the released
event, or to the end of the wait when nothing can happen before it. The server loops of ``fedcomp.server.loops``
run unchanged on top: the async loop dispatches the next task at that virtual time, sync rounds close at their
virtual deadline.

Faults, drawn per task from the node's own seeded stream (``fedcomp.sim.links.draw_fate``), become what they are in
deployment: a task lost on the downlink is never run and a lost reply is never delivered (the server's
deadline times them out -> nack); a node that vanishes mid-task (``disconnect``) or whose availability window
closes is reported ``detect_s`` later as a ``LOST`` failure (Flower's ``NODE_UNAVAILABLE`` after missed
heartbeats) and stays away ``rejoin_s`` (or until its window reopens). A client whose update was lost learns it
from the nack in its next task and restores the update into its error-feedback residual.
"""

from __future__ import annotations

import heapq
import math
import random
from abc import ABC, abstractmethod
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field, replace

from fedcomp.protocol import Outcome, Task
from fedcomp.registry import ConfigError
from fedcomp.server.loops import COMPUTE_METRIC, Event, FailureEvent, ReplyEvent, SendReceipt, Transport
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
    """Runs tasks on clients for real; never decides about time."""

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

    def close(self) -> None:
        """Release what the engine holds (processes, actors)."""


#: Fixed spread of the nodes' poll phases before their first task (node ``i`` polls at ``P * frac(i * PHI)``).
PHI = 0.6180339887498949
COUNT_BYTES = ("wire", "flower", "payload")


@dataclass(frozen=True)
class TimingConfig:
    """How the clock charges a task.

    ``seed``: fault streams (node ``i`` draws from ``Random(seed * 1_000_003 + i)``). ``count_bytes``:
    ``"wire"`` (the default: Flower object bytes turned into wire bytes by ``wire``, plus Flower's transport
    latency: poll wait, one link round trip per request, the SuperNode's ``reply_check_s`` reply check; the app
    bundle on each node's first task), ``"flower"`` (serialized Flower message bytes, falls back to payload when
    unknown; one RTT per task) or ``"payload"`` (the fedcomp blob; one RTT per task). ``detect_s``: delay before
    the server learns that a node vanished. ``rejoin_s``: how long a vanished node stays away.

    Example:
        >>> TimingConfig().count_bytes, TimingConfig().wire.poll_interval_s
        ('wire', 3.0)
    """

    seed: int = 0
    count_bytes: str = "wire"
    detect_s: float = 60.0
    rejoin_s: float = 300.0
    wire: WireCost = FLOWER_1_41
    reply_check_s: float = 0.5

    def __post_init__(self) -> None:
        if self.count_bytes not in COUNT_BYTES:
            raise ConfigError(f"count_bytes must be one of {COUNT_BYTES}, got {self.count_bytes!r}")
        if not (self.detect_s >= 0 and self.rejoin_s >= 0 and self.reply_check_s >= 0):
            raise ConfigError("detect_s, rejoin_s and reply_check_s must be >= 0")

    @property
    def transport(self) -> bool:
        """Whether Flower's transport (wire bytes, polls, request round trips) is on the clock."""
        return self.count_bytes == "wire"


@dataclass
class NodeStats:
    """Per-node totals. Bytes are what crossed the link, lost messages included, in three figures: ``payload_*``
    (fedcomp blobs), ``flower_*`` (serialized Flower messages; 0 where the engine does not know them) and
    ``wire_*`` (messages on the wire: Flower object bytes + the requests Flower's transport makes for them, and the
    app bundle; idle polls and heartbeats are ``VirtualTransport.idle_wire``; 0 unless ``count_bytes="wire"``).
    Seconds: the split of the delivered tasks' time (``poll_wait_s``, ``round_trip_s`` and ``reply_check_s`` are
    Flower's transport latency, ``transfer_s`` bytes over bandwidth, ``compute_s`` the device, ``queue_s`` waiting
    for the device)."""

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


@dataclass
class _Flight:
    task: Task
    dispatch: float
    pickup: float  # when the node fetches the task (its next poll)
    fetched: float  # when the task (and the bundle, the first time) is on the node
    fetch_rtt_s: float
    fetch_transfer_s: float
    fate: Fate


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


class VirtualTransport(WireFigures, Transport):
    """A ``Transport`` over an ``Engine`` whose events come in virtual-time order (see the module docstring)."""

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
        self.stats = {nid: NodeStats() for nid in self.nodes}
        self.away_until: dict[int, float] = {}
        self.compute_free: dict[int, float] = {}
        self.poll_anchor: dict[int, float] = {}  # time of the node's last reply push (its polls follow it)
        self.has_bundle: set[int] = set()
        self.flights: dict[int, _Flight] = {}  # submitted, reply not gathered yet
        self.ready: list[tuple[float, int, Event]] = []  # heap of (virtual time, task id, event)
        self.released = 0

    # ---- Transport --------------------------------------------------------------------------------------
    def clients(self) -> list[int]:
        now = self.clock.now()
        return [nid for nid in self.nodes if self.online(nid, now)]

    def online(self, nid: int, t: float) -> bool:
        return t >= self.away_until.get(nid, -math.inf) and self.nodes[nid].availability.online(t)

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
            # nothing ran; count the blob as what crossed the link (as a one-object Flower message on the wire)
            st.payload_down += len(model)
            if self.config.transport:
                up, down = self._task_wire(nid, len(model), 1)
                st.wire_up += up
                st.wire_down += down
            return SendReceipt()
        receipt = self.engine.submit(task, model)
        st.payload_down += len(model)
        st.flower_down += receipt.flower_bytes
        link = self.nodes[nid].link
        if self.config.transport:
            up, down = self._task_wire(nid, receipt.flower_bytes or len(model), receipt.flower_objects or 1)
            st.wire_up += up
            st.wire_down += down
            pickup = self._next_poll(nid, now)
            rtt = self.config.wire.task_requests(receipt.flower_objects or 1) * link.rtt_s
        else:  # no transport model: the counted bytes, half a round trip each way
            up, down = 0, self._bytes(receipt.flower_bytes, len(model))
            pickup, rtt = now, link.rtt_s / 2
        transfer = down / link.down_Bps + up / link.up_Bps
        fetched = pickup + rtt + transfer
        self.flights[task.task_id] = _Flight(task, now, pickup, fetched, rtt, transfer, fate)
        return receipt

    def poll(self, wait: float) -> list[Event]:
        now = self.clock.now()
        horizon = now + max(0.0, wait)
        wake = min(horizon, self._next_change(now))
        if wake <= now:
            wake = horizon
        while True:
            bound = min((self._lower_bound(f) for f in self.flights.values()), default=math.inf)
            head = self.ready[0][0] if self.ready else math.inf
            if head <= wake and head <= bound:
                t, _, event = heapq.heappop(self.ready)
                self.clock.advance_to(max(now, t))
                self.released += 1
                return [event]
            if bound > wake and head > wake:  # nothing can happen before the wake-up time
                self.clock.advance_to(wake)
                return []
            self._gather()

    # ---- internals --------------------------------------------------------------------------------------
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

    def _next_change(self, now: float) -> float:
        """Earliest future time at which some node comes online or goes offline."""
        t = math.inf
        for nid, prof in self.nodes.items():
            back = self.away_until.get(nid, -math.inf)
            if back > now:
                t = min(t, back)
            t = min(t, prof.availability.next_change(now))
        return t

    def _lower_bound(self, flight: _Flight) -> float:
        """The earliest virtual time at which ``flight`` can produce an event, before its reply is known."""
        avail = self.nodes[flight.task.client].availability
        lb = flight.fetched
        if flight.fate.disconnect_at is not None:
            lb = min(lb, flight.dispatch + self.config.detect_s)
        off = avail.offline_at(flight.dispatch, lb)
        return lb if off is None else min(lb, off + self.config.detect_s)

    def _gather(self) -> None:
        """Gather at least one pending reply from the engine and schedule it."""
        if not self.flights:
            return
        events = self.engine.gather_any(list(self.flights))
        if not events:
            raise RuntimeError(f"engine returned no event for tasks {sorted(self.flights)}")
        for event in events:
            flight = self.flights.pop(event.task_id, None)
            if flight is not None:
                self._schedule(flight, event)

    def _schedule(self, flight: _Flight, event: Event) -> None:
        nid = flight.task.client
        prof, st, cfg = self.nodes[nid], self.stats[nid], self.config
        link, dev = prof.link, prof.device
        start = max(flight.fetched, self.compute_free.get(nid, -math.inf))
        if isinstance(event, ReplyEvent):
            compute = dev.compute_s(max(int(event.meta.num_examples), 0))
            # the client reports its compute seconds: on this virtual device, the virtual ones
            event = replace(event, metrics={**event.metrics, COMPUTE_METRIC: compute})
            st.payload_up += len(event.blob)
            st.flower_up += event.flower_bytes
            if cfg.transport:
                up, down = cfg.wire.reply(event.flower_bytes or len(event.blob), event.flower_objects or 1)
                rtt = cfg.wire.reply_requests(event.flower_objects or 1) * link.rtt_s
            else:
                up, down = self._bytes(event.flower_bytes, len(event.blob)), 0
                rtt = link.rtt_s / 2
        else:  # the ClientApp failed: the error reply comes back after the download
            compute, up, down = 0.0, 0, 0
            rtt = (cfg.wire.reply_round_trips if cfg.transport else 0.5) * link.rtt_s
        done = start + compute
        pushed = done
        if cfg.transport and cfg.reply_check_s > 0:  # the SuperNode looks for the reply every reply_check_s
            pushed = flight.fetched + cfg.reply_check_s * math.ceil((done - flight.fetched) / cfg.reply_check_s - 1e-9)
        transfer = up / link.up_Bps + down / link.down_Bps
        finish = pushed + rtt + transfer
        if cfg.transport:
            st.wire_up += up
            st.wire_down += down
        self.compute_free[nid] = done
        st.busy_s += compute
        gone = _departure(flight, prof, st, cfg.rejoin_s, self.away_until, finish)
        if gone is not None:
            st.in_task_s += max(0.0, gone - flight.pickup)
            event = FailureEvent(flight.task.task_id, nid, Outcome.LOST, "NODE_UNAVAILABLE: node left during the task")
            self._push(gone + cfg.detect_s, event)
            return
        st.in_task_s += finish - flight.pickup
        st.pushed += 1
        self.poll_anchor[nid] = finish
        if flight.fate.lost_up:
            st.lost_up += 1
            return  # never delivered: the server's deadline times the task out
        if isinstance(event, ReplyEvent):
            st.delivered += 1
            st.timed += 1
            st.poll_wait_s += flight.pickup - flight.dispatch
            st.round_trip_s += flight.fetch_rtt_s + rtt
            st.transfer_s += flight.fetch_transfer_s + transfer
            st.compute_s += compute
            st.reply_check_s += pushed - done
            st.queue_s += start - flight.fetched
        self._push(finish, event)

    def _push(self, t: float, event: Event) -> None:
        heapq.heappush(self.ready, (t, event.task_id, event))

    def close(self) -> None:
        self.engine.close()


def _departure(
    flight: _Flight, prof: NodeProfile, st: NodeStats, rejoin_s: float, away_until: dict[int, float], finish: float
) -> float | None:
    """When the node leaves during ``flight`` (its drawn disconnect, or its availability window closing before
    ``finish``), counted in ``st``; a disconnected node stays away ``rejoin_s`` (``away_until``). ``None``: it
    stays."""
    nid = flight.task.client
    if flight.fate.disconnect_at is not None:
        gone = flight.dispatch + flight.fate.disconnect_at * (finish - flight.dispatch)
        away_until[nid] = max(away_until.get(nid, -math.inf), gone + rejoin_s)
        st.away_s += rejoin_s
        st.disconnects += 1
        return gone
    off = prof.availability.offline_at(flight.dispatch, finish)
    if off is not None:
        st.disconnects += 1
    return off

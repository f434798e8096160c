"""Virtual time for one-machine simulations: a clock and a ``Transport`` that orders task completions by it.

Flower-free. An ``Engine`` runs each task on its client for real (the fedcomp ClientApp, in-process or on
Flower's simulation engine) and returns the reply; ``VirtualTransport`` decides *when* that reply reaches the
server. A task dispatched at virtual time ``t`` to a node with link ``L`` and device ``D`` finishes at::

    t + L.rtt + down_bytes / L.down_bw + D.compute(samples) + up_bytes / L.up_bw

with the **real** encoded sizes (the Flower message bytes, or the fedcomp blob bytes with
``count_bytes="payload"``) and ``samples`` the example count the client reports. A node computes one task at
a time: a task that reaches a node still busy with an earlier one starts computing when that one ends.

Ordering (same seed -> same timeline -> same numbers): ``poll`` releases the known event with the smallest
virtual time (ties by task id) only once no in-flight task whose reply is still unknown could finish earlier:
it gathers replies from the engine (blocking on real time for a parallel engine) until the earliest known event
is at or below the lower bound of every unknown one (``dispatch + rtt + down_bytes / down_bw``, or earlier when
the node is fated to vanish). With every reply gathered this is "wait for all, release the smallest"; the bound
only lets a parallel engine keep working while early events go out. It advances the clock to the released
event, or to the end of the wait when nothing can happen before it. The server loops of ``fedcomp.server_loop``
run unchanged on top: the async loop dispatches the next task at that virtual time, sync rounds close at their
virtual deadline.

Faults, drawn per task from the node's own seeded stream (``fedcomp.links.draw_fate``), become what they are in
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
from dataclasses import dataclass, field

from fedcomp.links import Availability, DeviceProfile, Fate, LinkProfile, draw_fate
from fedcomp.protocol import Outcome, Task
from fedcomp.registry import ConfigError
from fedcomp.server_loop import Event, FailureEvent, ReplyEvent, SendReceipt, Transport


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


@dataclass(frozen=True)
class TimingConfig:
    """``seed``: fault streams (node ``i`` draws from ``Random(seed * 1_000_003 + i)``). ``count_bytes``:
    ``"flower"`` (serialized Flower message, falls back to payload when unknown) or ``"payload"`` (the fedcomp
    blob). ``detect_s``: delay before the server learns that a node vanished. ``rejoin_s``: how long a vanished
    node stays away."""

    seed: int = 0
    count_bytes: str = "flower"
    detect_s: float = 60.0
    rejoin_s: float = 300.0

    def __post_init__(self) -> None:
        if self.count_bytes not in ("flower", "payload"):
            raise ConfigError(f"count_bytes must be 'flower' or 'payload', got {self.count_bytes!r}")
        if not (self.detect_s >= 0 and self.rejoin_s >= 0):
            raise ConfigError("detect_s and rejoin_s must be >= 0")


@dataclass
class NodeStats:
    """Per-node totals (bytes are what crossed the link, lost messages included)."""

    tasks: int = 0
    delivered: int = 0
    lost_down: int = 0
    lost_up: int = 0
    disconnects: int = 0
    bytes_down: int = 0
    bytes_up: int = 0
    payload_down: int = 0
    payload_up: int = 0
    busy_s: float = 0.0


@dataclass
class _Flight:
    task: Task
    dispatch: float
    down_bytes: int
    fate: Fate


class VirtualTransport(Transport):
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
            receipt = SendReceipt()  # nothing ran; count the blob as what crossed the link
            st.bytes_down += len(model)
            st.payload_down += len(model)
            return receipt
        receipt = self.engine.submit(task, model)
        down = self._bytes(receipt.flower_bytes, len(model))
        st.bytes_down += down
        st.payload_down += len(model)
        self.flights[task.task_id] = _Flight(task, now, down, fate)
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
    def _bytes(self, flower: int, payload: int) -> int:
        return flower if (self.config.count_bytes == "flower" and flower > 0) else payload

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
        link, avail = self.nodes[flight.task.client].link, self.nodes[flight.task.client].availability
        lb = flight.dispatch + link.rtt_s + flight.down_bytes / link.down_Bps
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
        prof, st = self.nodes[nid], self.stats[nid]
        link, dev = prof.link, prof.device
        arrive = flight.dispatch + link.rtt_s / 2 + flight.down_bytes / link.down_Bps
        start = max(arrive, self.compute_free.get(nid, -math.inf))
        if isinstance(event, ReplyEvent):
            up = self._bytes(event.flower_bytes, len(event.blob))
            compute = dev.compute_s(max(int(event.meta.num_examples), 0))
            done = start + compute
            finish = done + up / link.up_Bps + link.rtt_s / 2
            st.bytes_up += up
            st.payload_up += len(event.blob)
        else:  # the ClientApp failed: the error reply comes back after the download
            compute, done = 0.0, start
            finish = done + link.rtt_s / 2
        self.compute_free[nid] = done
        st.busy_s += compute
        # the node vanishes during the task, or its availability window closes before the reply is out
        gone: float | None = None
        if flight.fate.disconnect_at is not None:
            gone = flight.dispatch + flight.fate.disconnect_at * (finish - flight.dispatch)
            self.away_until[nid] = max(self.away_until.get(nid, -math.inf), gone + self.config.rejoin_s)
            st.disconnects += 1
        else:
            off = prof.availability.offline_at(flight.dispatch, finish)
            if off is not None:
                gone = off
                st.disconnects += 1
        if gone is not None:
            event = FailureEvent(flight.task.task_id, nid, Outcome.LOST, "NODE_UNAVAILABLE: node left during the task")
            self._push(gone + self.config.detect_s, event)
            return
        if flight.fate.lost_up:
            st.lost_up += 1
            return  # never delivered: the server's deadline times the task out
        st.delivered += int(isinstance(event, ReplyEvent))
        self._push(finish, event)

    def _push(self, t: float, event: Event) -> None:
        heapq.heappush(self.ready, (t, event.task_id, event))

    def close(self) -> None:
        self.engine.close()

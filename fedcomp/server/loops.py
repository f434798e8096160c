"""Server loops over a ``Transport`` and a ``Clock``: sync rounds and staleness-bounded async (FedBuff).

Flower-free. ``server_app`` supplies a Grid-backed transport and the wall clock; a simulator can supply a
virtual clock and a transport that orders task completions by simulated time. The loops only consume events
(``ReplyEvent``, ``FailureEvent``) and deadlines; every decision about an update is ``ServerProtocol``'s.

Modes are registered in ``LOOPS`` (``"sync"``, ``"async"``).
"""

from __future__ import annotations

import json
import math
import os
import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch

from fedcomp.downlink import Broadcaster, build_broadcaster, encode_dense
from fedcomp.protocol import Decision, Outcome, ReplyMeta, Task
from fedcomp.registry import ConfigError, Registry, check_ranges
from fedcomp.server import ClientSelection, ServerProtocol, atomic_write
from fedcomp.server.linkaware import AutoDensity, AutoDensityConfig
from fedcomp.server.prefetch import PrefetchTimer


class Clock(Protocol):
    """Seconds as a float; only differences matter."""

    def now(self) -> float: ...


class WallClock:
    def now(self) -> float:
        return time.monotonic()


@dataclass(frozen=True)
class ReplyEvent:
    """A reply with a payload. ``flower_bytes``/``flower_objects``: the serialized Flower objects received."""

    task_id: int
    client: int
    blob: bytes
    meta: ReplyMeta
    metrics: dict[str, float] = field(default_factory=dict)
    flower_bytes: int = 0
    flower_objects: int = 0
    error: str = ""  # set when the reply could not be read; it is then rejected with this reason


@dataclass(frozen=True)
class FailureEvent:
    """A task that will never be answered: an error reply (node unavailable, ClientApp raised, TTL), or a send
    that failed."""

    task_id: int
    client: int
    outcome: Outcome
    reason: str


Event = ReplyEvent | FailureEvent


@dataclass(frozen=True)
class SendReceipt:
    flower_bytes: int = 0
    flower_objects: int = 0


class Transport(ABC):
    """Moves tasks to clients and replies back."""

    @abstractmethod
    def clients(self) -> list[int]:
        """Client (node) ids that can receive tasks now."""

    @abstractmethod
    def send(self, task: Task, model: bytes) -> SendReceipt:
        """Deliver ``task`` with the model blob; raise ``OSError`` (or ``RuntimeError``) if it cannot be sent."""

    @abstractmethod
    def poll(self, wait: float) -> list[Event]:
        """Events that happened, waiting up to ``wait`` seconds (of the transport's clock) for the first one."""

    def evaluate(self, clients: list[int], model: bytes, version: int, timeout: float) -> list[dict[str, float]]:
        """Federated evaluation: metrics from the clients that answered within ``timeout`` (optional)."""
        del clients, model, version, timeout
        return []


#: The reply metric holding the client's compute seconds for its task (what ``AutoDensity`` subtracts).
COMPUTE_METRIC = "train-seconds"

#: The downlink blob of the ``dense`` mode: the model as dense fp32 records, seq 0, base = version (one encoder,
#: ``fedcomp.downlink.encode_dense``; this name is kept for callers).
encode_model = encode_dense


class Reporter:
    """Per-version metrics (JSONL), periodic server-side evaluation and checkpoints.

    ``evaluate(params) -> {"accuracy": .., "loss": ..}`` runs every ``eval_every`` versions (and at the end).
    Checkpoints go to ``out_dir/checkpoint.pt`` every ``checkpoint_every`` versions (written to a temporary
    file, fsynced, then ``os.replace``d: a crash leaves the old or the new checkpoint, never a torn one); once
    it is on disk the protocol's held acks are released (``ServerProtocol.commit``).
    """

    def __init__(
        self,
        out_dir: str | os.PathLike[str] | None,
        evaluate: Callable[[dict[str, torch.Tensor]], dict[str, float]] | None = None,
        eval_every: int = 1,
        checkpoint_every: int = 0,
        clock: Clock | None = None,
        progress: Callable[[dict[str, Any]], None] | None = None,
        extra_state: Callable[[], dict[str, Any]] | None = None,
    ) -> None:
        self.out_dir = Path(out_dir) if out_dir else None
        if self.out_dir:
            self.out_dir.mkdir(parents=True, exist_ok=True)
        self.evaluate, self.eval_every, self.checkpoint_every = evaluate, eval_every, checkpoint_every
        self.clock = clock or WallClock()
        self.t0 = self.clock.now()
        self.progress = progress
        self.extra_state = extra_state
        self.rows: list[dict[str, Any]] = []
        self.row_hooks: list[Callable[[], dict[str, Any]]] = []  # extra counters for each row (downlink)
        self.last_eval: dict[str, float] = {}
        self.initial_eval: dict[str, float] = {}

    @property
    def metrics_path(self) -> Path | None:
        return self.out_dir / "metrics.jsonl" if self.out_dir else None

    @property
    def checkpoint_path(self) -> Path | None:
        return self.out_dir / "checkpoint.pt" if self.out_dir else None

    def start(self, proto: ServerProtocol) -> None:
        """Evaluate the starting model (``initial_eval``), so a run can show that accuracy rose."""
        if self.evaluate:
            self.initial_eval = {k: float(x) for k, x in self.evaluate(proto.params).items()}

    def on_version(self, proto: ServerProtocol, final: bool = False) -> dict[str, Any]:
        v = proto.version
        row: dict[str, Any] = {"version": v, "time": round(self.clock.now() - self.t0, 3)}
        if self.evaluate and (final or (self.eval_every and v % self.eval_every == 0)):
            self.last_eval = {k: float(x) for k, x in self.evaluate(proto.params).items()}
            row.update(self.last_eval)
        row.update(proto.roll_stats())
        for hook in self.row_hooks:
            row.update(hook())
        self.rows.append(row)
        if self.metrics_path:
            with open(self.metrics_path, "a", encoding="utf-8") as f:
                f.write(json.dumps(row) + "\n")
        if self.checkpoint_path and self.checkpoint_every and v % self.checkpoint_every == 0 and not proto.buffered:
            self.save_checkpoint(proto)
        if self.progress:
            self.progress(row)
        return row

    def save_checkpoint(self, proto: ServerProtocol) -> None:
        assert self.checkpoint_path is not None
        state = {
            "protocol": proto.state_dict(),
            "extra": self.extra_state() if self.extra_state else {},
            "time": self.clock.now() - self.t0,  # run time so far: a resumed run's rows go on from here
        }
        atomic_write(self.checkpoint_path, lambda f: torch.save(state, f))
        proto.commit()

    def resume_time(self, path: str | os.PathLike[str]) -> float:
        """Continue the run time of the checkpoint at ``path`` (rows of a resumed run do not restart at 0);
        returns it (0 for a checkpoint written before the time was saved); ``ConfigError`` for a time that is
        not a finite number >= 0."""
        state = torch.load(path, weights_only=True, mmap=True)
        elapsed = state.get("time", 0.0) if isinstance(state, dict) else 0.0
        if isinstance(elapsed, bool) or not isinstance(elapsed, (int, float)) or not 0 <= elapsed < math.inf:
            raise ConfigError(f"resume: {path} holds a run time that is not a finite number >= 0: {elapsed!r}")
        self.t0 = self.clock.now() - elapsed
        return float(elapsed)

    @staticmethod
    def load_checkpoint(path: str | os.PathLike[str], proto: ServerProtocol) -> dict[str, Any]:
        """Restore ``proto`` from a checkpoint file; returns its ``extra`` dict."""
        state = torch.load(path, weights_only=True)
        proto.load_state_dict(state["protocol"])
        return state.get("extra", {})


def mend_tail(path: Path) -> None:
    """Cut the last line of the JSON-lines file at ``path`` if a crash tore it (no newline at the end), so that
    rows appended next start on a line of their own; nothing if the file is whole or missing.

        mend_tail(out / "metrics.jsonl")   # before a resumed run appends its rows
    """
    try:
        with open(path, "rb+") as f:
            size = f.seek(0, os.SEEK_END)
            if size == 0:
                return
            f.seek(size - 1)
            if f.read(1) == b"\n":
                return
            cut, pos = 0, size
            while pos > 0 and not cut:  # the last newline, read backwards in blocks
                step = min(pos, 65536)
                f.seek(pos - step)
                block = f.read(step)
                pos -= step
                if (i := block.rfind(b"\n")) >= 0:
                    cut = pos + i + 1
            f.truncate(cut)
    except FileNotFoundError:
        return


@dataclass(frozen=True)
class LoopConfig:
    """Loop options shared by the modes.

    ``num_versions``: stop at this model version (sync: rounds that produced a version). ``concurrency``:
    async C, clients kept busy (0 = every client). ``round_timeout``: sync round deadline in seconds.
    ``run_timeout``: give up after this many seconds (0 = never). ``min_clients``: wait for this many clients
    before the first task; ``node_wait``: how long to wait for them. ``poll_interval``: longest single wait.
    ``fed_eval_timeout``: > 0 runs a federated evaluation at the end (and every ``fed_eval_every`` versions
    in sync mode). ``max_failures``: stop after this many failed tasks (error replies, timeouts, rejected replies)
    in a row with no update accepted in between (e.g. every node misconfigured); 0 = never. ``downlink``,
    ``downlink_options``: the ``fedcomp.downlink.DOWNLINKS`` mode of the model sent with each task.
    ``auto_density``: set, each task carries the density ``fedcomp.server.linkaware.AutoDensity`` picks for its
    node (``density=auto``). ``prefetch_lead``: with ``ProtocolConfig.prefetch``, a node's next task is queued
    this many seconds before its running task is expected to end (``fedcomp.server.prefetch``).
    """

    num_versions: int = 10
    concurrency: int = 0
    selection: ClientSelection = field(default_factory=ClientSelection)
    round_timeout: float = 120.0
    run_timeout: float = 0.0
    min_clients: int = 1
    node_wait: float = 300.0
    poll_interval: float = 1.0
    fed_eval_every: int = 0
    fed_eval_timeout: float = 0.0
    max_failures: int = 50
    downlink: str = "dense"
    downlink_options: dict[str, Any] = field(default_factory=dict)
    auto_density: AutoDensityConfig | None = None
    prefetch_lead: float = 2.0

    def __post_init__(self) -> None:
        if not self.prefetch_lead >= 0:
            raise ConfigError(f"prefetch_lead must be >= 0, got {self.prefetch_lead}")
        if self.num_versions < 1:
            raise ConfigError(f"num_versions must be >= 1, got {self.num_versions}")
        check_ranges(("concurrency", self.concurrency, ">= 0", self.concurrency >= 0),
                     ("min_clients", self.min_clients, ">= 1", self.min_clients >= 1),
                     ("round_timeout", self.round_timeout, "> 0", self.round_timeout > 0),
                     ("poll_interval", self.poll_interval, "> 0", self.poll_interval > 0),
                     ("run_timeout", self.run_timeout, ">= 0", self.run_timeout >= 0))


class Loop(ABC):
    """Drives a ``ServerProtocol`` over a ``Transport`` until ``num_versions`` versions exist."""

    def __init__(
        self,
        proto: ServerProtocol,
        transport: Transport,
        config: LoopConfig,
        reporter: Reporter,
        clock: Clock | None = None,
        log: Callable[[str], None] = lambda s: None,
    ) -> None:
        self.proto, self.transport, self.config, self.reporter = proto, transport, config, reporter
        self.clock = clock or WallClock()
        self.log = log
        self._model: tuple[int, bytes] | None = None
        self.downlink: Broadcaster = build_broadcaster(config.downlink, proto.spec, **config.downlink_options)
        reporter.row_hooks.append(self.downlink.roll_stats)
        self.last_dispatch: dict[int, float] = {}
        self.fed_eval: list[dict[str, Any]] = []
        self.stopped_reason = ""
        self.failures_in_a_row = 0
        self.last_failure = ""
        self.auto = AutoDensity(config.auto_density) if config.auto_density is not None else None
        self.prefetch = PrefetchTimer(config.prefetch_lead)

    @property
    def completed(self) -> bool:
        """True when the run reached ``num_versions``; otherwise ``stopped_reason`` says why not."""
        return self.proto.version >= self.config.num_versions

    def past_deadline(self, now: float, run_deadline: float) -> bool:
        """True (and ``stopped_reason`` set) when the run deadline has passed."""
        if now >= run_deadline:
            self.stopped_reason = f"run timeout ({self.config.run_timeout:g}s) at version {self.proto.version}"
            return True
        return False

    def stuck(self) -> bool:
        """True (and ``stopped_reason`` set) when ``max_failures`` tasks failed in a row."""
        limit = self.config.max_failures
        if limit and self.failures_in_a_row >= limit:
            self.stopped_reason = f"{self.failures_in_a_row} failed tasks in a row; last: {self.last_failure}"
            self.log(f"giving up: {self.stopped_reason}")
            return True
        return False

    def expire(self, now: float) -> None:
        for t in self.proto.expire(now):
            self.failures_in_a_row += 1
            self.last_failure = f"task {t.task_id} of client {t.client} timed out"
            self.forget(t)

    def forget(self, task: Task) -> None:
        """``task`` was resolved without a reply (deadline passed, round closed): it leaves the prefetch timer and
        the in-flight trackers (downlink, link-aware density); a reply that still comes is judged late and
        teaches them nothing."""
        self.downlink.forget(task.task_id)
        self.prefetch.failed(task.task_id)
        if self.auto is not None:
            self.auto.failed(task.task_id)

    def model_blob(self) -> bytes:
        if self._model is None or self._model[0] != self.proto.version:
            self._model = (self.proto.version, encode_model(self.proto.params, self.proto.spec, self.proto.version))
        return self._model[1]

    def dispatch(self, client: int, now: float, timeout: float | None = None) -> Task | None:
        task = self.proto.dispatch(client, now, timeout)
        if self.auto is not None:
            task.density = self.auto.choose(client)
        blob = self.downlink.message(client, task.task_id, self.proto.params, self.proto.version)
        try:
            receipt = self.transport.send(task, blob)
        except (OSError, RuntimeError) as exc:
            self.proto.undo_dispatch(task)
            self.proto.ledger(client).unavailable_until = now + self.proto.config.backoff
            self.log(f"send to {client} failed: {exc}")
            return None
        if self.auto is not None:
            self.auto.dispatched(task.task_id, client, now, task.density, len(blob))
        s = self.proto.stats
        s.payload_bytes_down += len(blob)
        s.flower_bytes_down += receipt.flower_bytes
        s.flower_objects_down += receipt.flower_objects
        s.messages_down += 1
        s.prefetched += int(task.queued)
        self.last_dispatch[client] = now
        self.prefetch.dispatched(task.task_id, client, now)
        return task

    def handle(self, event: Event, now: float) -> Decision | None:
        timed = not self.proto.overtakes(event.client, event.task_id)  # else when it started is not known
        if isinstance(event, FailureEvent) or event.error:
            self.downlink.on_failure(event.client, event.task_id)  # it may have restarted: a full copy next
            self.prefetch.failed(event.task_id)
            if self.auto is not None:
                self.auto.failed(event.task_id)
        else:
            self.downlink.on_reply(event.client, event.task_id)  # it applied that task's model
            self.prefetch.replied(event.task_id, now, timed)
        if isinstance(event, FailureEvent):
            if self.proto.fail_task(event.client, event.task_id, event.outcome, event.reason, now):
                self.failures_in_a_row += 1
                self.last_failure = event.reason
                self.log(f"task {event.task_id} of client {event.client}: {event.outcome.value} ({event.reason})")
            return None
        s = self.proto.stats
        s.flower_bytes_up += event.flower_bytes
        s.flower_objects_up += event.flower_objects
        s.messages_up += 1
        if event.error:
            decision = self.proto.reject(event.client, event.task_id, event.error)
        else:
            decision = self.proto.on_reply(event.client, event.blob, event.meta, now)
        if self.auto is not None:  # the link estimate learns from a reply's timing and size, not a rejected one's
            if decision.outcome is Outcome.REJECTED:
                self.auto.failed(event.task_id)
            else:
                self.auto.replied(event.task_id, now, len(event.blob), event.metrics.get(COMPUTE_METRIC, 0.0), timed)
        if decision.stepped:
            self.prefetch.stepped(now)
        if decision.outcome is Outcome.APPLIED:
            self.failures_in_a_row = 0
        else:
            if decision.outcome is Outcome.REJECTED:  # a node that can only send rejected replies fails its tasks
                self.failures_in_a_row += 1
                self.last_failure = f"reply of client {event.client} rejected: {decision.reason}"
            self.log(f"reply of client {event.client} seq {event.meta.seq}: {decision.outcome.value} {decision.reason}")
        return decision

    def wait_for_clients(self, deadline: float) -> bool:
        while len(self.transport.clients()) < self.config.min_clients:
            if self.clock.now() >= deadline:
                return False
            self.transport.poll(min(self.config.poll_interval, 1.0))
        return True

    def run(self) -> ServerProtocol:
        self.reporter.start(self.proto)
        start = self.clock.now()
        run_deadline = start + self.config.run_timeout if self.config.run_timeout else math.inf
        node_deadline = start + self.config.node_wait
        if not self.wait_for_clients(min(run_deadline, node_deadline)):
            have = f"{len(self.transport.clients())} of {self.config.min_clients} clients connected"
            if run_deadline <= node_deadline:
                self.stopped_reason = f"run timeout ({self.config.run_timeout:g}s) while waiting for clients: {have}"
            else:
                self.stopped_reason = f"node-wait ({self.config.node_wait:g}s) passed with {have}"
            self.log(self.stopped_reason)
            return self.proto
        self.loop(run_deadline)
        done = self.fed_eval and self.fed_eval[-1]["version"] == self.proto.version
        if self.config.fed_eval_timeout > 0 and not done:
            self.federated_evaluate()
        return self.proto

    def federated_evaluate(self) -> None:
        clients = self.transport.clients()
        res = self.transport.evaluate(clients, self.model_blob(), self.proto.version, self.config.fed_eval_timeout)
        if res:
            n = sum(r.get("num_examples", 0) for r in res) or len(res)
            row = {"version": self.proto.version, "clients": len(res)}
            for key in ("accuracy", "loss"):
                vals = [(r[key], r.get("num_examples", 1)) for r in res if key in r]
                if vals:
                    row[f"fed_{key}"] = sum(v * w for v, w in vals) / n
            self.fed_eval.append(row)
            self.log(f"federated evaluation: {row}")

    @abstractmethod
    def loop(self, run_deadline: float) -> None:
        """Run until ``num_versions`` or ``run_deadline``; set ``stopped_reason`` if cut short."""


LOOPS: Registry[Loop] = Registry("server mode")


@LOOPS.register("async")
class AsyncLoop(Loop):
    """FedBuff: keep up to C clients busy; every reply is judged as it arrives; K accepted -> one step.

    A client whose reply arrived gets its next task in the same iteration (with the newest model). With
    ``ProtocolConfig.prefetch`` = p > 0 every busy client also gets up to p tasks queued behind the one it runs,
    each ``prefetch_lead`` seconds before the node is expected to need it (``fedcomp.server.prefetch``; each with
    the newest model at its dispatch), so its next task is already waiting when it pushes a reply.
    """

    def queue_at(self, client: int, now: float) -> float:
        """When ``client`` should get one more queued task (``inf``: no room, its cycle is not known yet, or the
        task would come back more than ``max_staleness`` versions stale: then its next task leaves when its reply
        lands, with the newest model; ``fedcomp.server.prefetch``)."""
        if not self.proto.can_queue(client, now):
            return math.inf
        open_tasks = self.proto.ledger(client).open_tasks
        due = self.prefetch.due(client, open_tasks, now)
        if due < math.inf:
            expected = self.prefetch.staleness_at_reply(client, open_tasks, max(due, now), now)
            if expected > self.proto.config.max_staleness:
                return math.inf
        return due

    def fill(self, now: float) -> None:
        clients = self.transport.clients()
        limit = self.config.concurrency or 1 << 30
        free = limit - len({t.client for t in self.proto.tasks.values()})
        idle = [c for c in clients if self.proto.available(c, now)]
        idle.sort(key=lambda c: self.last_dispatch.get(c, -math.inf))
        for c in idle[: max(free, 0)]:
            self.dispatch(c, now)
        for c in clients:  # queue behind the running task (prefetch); a failed send stops this client's round
            while self.queue_at(c, now) <= now and self.dispatch(c, now) is not None:
                pass

    def loop(self, run_deadline: float) -> None:
        target = self.config.num_versions
        while self.proto.version < target:
            now = self.clock.now()
            if self.past_deadline(now, run_deadline):
                break
            self.expire(now)
            if self.stuck():
                break
            self.fill(now)
            next_deadline = min((t.deadline for t in self.proto.tasks.values()), default=math.inf)
            if self.proto.config.prefetch:  # wake up when a node's next task is due to be queued (in the future:
                busy = {t.client for t in self.proto.tasks.values()}  # one due now that fill could not send waits)
                due = [q for c in busy if (q := self.queue_at(c, now)) > now]
                next_deadline = min([next_deadline, *due])
            wait = max(0.0, min(self.config.poll_interval, next_deadline - now, run_deadline - now))
            for event in self.transport.poll(wait):
                now = self.clock.now()
                decision = self.handle(event, now)
                if decision is not None and decision.stepped:
                    self.reporter.on_version(self.proto, final=self.proto.version >= target)
                    if self.proto.version >= target:
                        break
                self.fill(now)


@LOOPS.register("sync")
class SyncLoop(Loop):
    """Rounds: select (fraction / minimum, over-selection), send the same model, wait until ``target`` replies
    were accepted or the deadline; aggregate what arrived (weighted by examples); the rest is nacked."""

    def loop(self, run_deadline: float) -> None:
        target_versions = self.config.num_versions
        while self.proto.version < target_versions:
            now = self.clock.now()
            if self.past_deadline(now, run_deadline) or self.stuck():
                break
            available = [c for c in self.transport.clients() if self.proto.available(c, now)]
            if len(available) < self.config.min_clients:
                self.transport.poll(self.config.poll_interval)
                continue
            selected, target = self.config.selection.choose(available, self.proto.rng)
            deadline = min(now + self.config.round_timeout, run_deadline)
            round_id = self.proto.round
            sent = [t for c in selected if (t := self.dispatch(c, now, timeout=deadline - now)) is not None]
            accepted = 0
            if not sent:
                self.transport.poll(self.config.poll_interval)
            while sent:
                now = self.clock.now()
                open_tasks = [t for t in self.proto.tasks.values() if t.round == round_id]
                if accepted >= target or not open_tasks or now >= deadline:
                    break
                for event in self.transport.poll(max(0.0, min(self.config.poll_interval, deadline - now))):
                    decision = self.handle(event, self.clock.now())
                    accepted += int(decision is not None and decision.outcome is Outcome.APPLIED)
            before = self.proto.version
            for task in self.proto.close_round(self.clock.now(), "round closed before this reply"):
                self.forget(task)
            if self.proto.version > before:
                self.reporter.on_version(self.proto, final=self.proto.version >= target_versions)
                every = self.config.fed_eval_every
                if every and self.config.fed_eval_timeout > 0 and self.proto.version % every == 0:
                    self.federated_evaluate()
            else:
                self.log(f"round {round_id}: no update accepted")

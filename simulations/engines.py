"""Engines that run the fedcomp ClientApp for ``fedcomp.sim.virtual.VirtualTransport``.

* ``InProcessEngine``: calls the ClientApp object (``clients.app.app``) in this process with real Flower
  ``Message``/``Context`` objects, one ``Context`` per node kept between tasks exactly like a SuperNode keeps
  ``context.state``; the product's train function keeps each node's data and model in this process between tasks
  (``clients.task``), as a warm worker does (a cold node's process start is the virtual clock's charge). No
  Ray: the main job's default. The tasks are ``compression_mod``'s layout, so they take the one client path
  (``compression_mod`` -> ``clients.task`` -> ``compression_mod``): the product loops' (``records.TaskFormat``), or
  a ``Compressed`` run's when its ``ModTransport`` is the engine's ``messages``. It runs each task in
  ``submit``, so a node's tasks run in dispatch order, one at a time.
* ``GridEngine``: pushes tasks through ``fedcomp.flower.transport.GridTransport`` on the ``Grid`` of Flower's
  simulation engine (Ray runs the ClientApps, see ``simulations.ray_backend``) and waits for their replies.
  Flower's simulation runtime does not keep a node's messages in order: every 0.1 s it moves one undelivered
  message per node into a queue that all its workers share, so two messages to one node can run at once, each
  on the node's context as it was, the last to finish overwriting the other's state. ``GridEngine`` therefore
  keeps at most one task per node in Flower and holds the others, in submit order, until the node's reply is in.

Both count where the wall time goes: ``flower_s`` (Flower objects, serialization, Ray) and ``fedcomp_s`` (what
the ClientApp reports as ``train-seconds``: local training, compression, state).
"""

from __future__ import annotations

import random
import time
from collections import deque
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, replace
from typing import Any

from flwr.app import Context, Message, Metadata, RecordDict
from flwr.clientapp import ClientApp

from fedcomp.flower import records
from fedcomp.flower.transport import GridTransport, TaskMessages
from fedcomp.protocol import Outcome, Task
from fedcomp.server.loops import Event, FailureEvent, ReplyEvent, SendReceipt
from fedcomp.sim.virtual import Engine
from fedcomp.spec import ModelSpec


class SimulationError(Exception):
    """The simulation cannot go on (e.g. every ClientApp call fails: a configuration error). Not a
    ``RuntimeError``: the server loop takes those from a transport as a node it cannot reach, and backs off."""


SERVER_NODE_ID = 1  # Flower's SuperLink node id (src of instruction messages)
RUN_ID = 1


@dataclass
class EngineTimes:
    """Wall seconds by where they went, and the number of client updates they cover."""

    updates: int = 0
    flower_s: float = 0.0
    fedcomp_s: float = 0.0
    wait_s: float = 0.0
    engine_wall_s: float = 0.0

    def add_reply(self, event: Event) -> None:
        self.updates += 1
        if isinstance(event, ReplyEvent):
            self.fedcomp_s += float(event.metrics.get("train-seconds", 0.0))

    def to_dict(self) -> dict[str, float]:
        n = max(self.updates, 1)
        return {
            "updates": self.updates,
            "flower_s": round(self.flower_s, 3),
            "fedcomp_s": round(self.fedcomp_s, 3),
            "engine_wall_s": round(self.engine_wall_s, 3),
            "flower_ms_per_update": round(1e3 * self.flower_s / n, 3),
            "fedcomp_ms_per_update": round(1e3 * self.fedcomp_s / n, 3),
        }


def node_config(index: int, num_nodes: int, run_config: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """A simulated node's config: its partition and what it allows of the scenario (``scenario_trust``)."""
    return {"partition-id": index, "num-partitions": num_nodes, **scenario_trust(run_config or {})}


def scenario_trust(run_config: Mapping[str, Any]) -> dict[str, Any]:
    """What a simulated node allows of its own user's scenario (a deployed node allows only what its operator
    names): the plug-in modules ``run_config``'s model, dataset and loss import, any dataset (its files, the
    network), and no cap on a task's examples, model size or dataset size."""
    from fedcomp.task.plugins import import_module_of

    modules = sorted({import_module_of(str(run_config.get(k, ""))) for k in ("model", "dataset", "loss")} - {""})
    uncapped = {"max-task-examples": 0, "max-parameters": 0, "max-dataset-values": 0, "allow-datasets": "*"}
    return {**uncapped, **({"allow-plugins": " ".join(modules)} if modules else {})}


def task_format(run_config: Mapping[str, Any]) -> tuple[records.TaskFormat, ModelSpec]:
    """How the run's tasks are written (its compression, its model's layout) and the model's spec."""
    from fedcomp.task.config import RunConfig
    from fedcomp.task.plugins import TRUSTED
    from fedcomp.task.training import datasets, make_model

    run = RunConfig.from_flower(run_config, plugins=TRUSTED)
    train, _ = datasets(run)
    spec = ModelSpec.from_module(make_model(run, train))
    layout = records.ArrayLayout.of_spec(spec)
    return records.TaskFormat(run.compression.to_flat(), layout, max_norm=run.max_update_norm), spec


def seed_client_states(contexts: Mapping[int, Context], run_config: Mapping[str, Any]) -> None:
    """Give every node a fresh client state whose incarnation id is drawn from the run's seed, not the system RNG.

    The id travels in every reply; a random one changes the reply's encoded size by a byte now and then, and with
    it the virtual timeline. Fixed-width ids (2^61 <= id < 2^62) keep the sizes equal; same seed -> same bytes.
    """
    from fedcomp.flower.session import ClientSession
    from fedcomp.task.config import RunConfig
    from fedcomp.task.plugins import TRUSTED

    run = RunConfig.from_flower(run_config, plugins=TRUSTED)
    _, spec = task_format(run_config)
    for ctx in contexts.values():
        session = ClientSession.fresh(run.compression, spec)
        rng = random.Random(f"{run.seed}/{ctx.node_config['partition-id']}")
        session.incarnation = (1 << 61) | rng.getrandbits(61)
        session.save(ctx)


def task_message(task: Task, model: bytes, messages: TaskMessages) -> Message:
    """The Flower task message of ``task`` as the server sends it (metadata set here: no running app needed)."""
    meta = Metadata(
        run_id=RUN_ID,
        message_id=f"task-{task.task_id}",
        src_node_id=SERVER_NODE_ID,
        dst_node_id=task.client,
        reply_to_message_id="",
        group_id=str(task.round),
        created_at=time.time(),
        ttl=max(1.0, task.deadline - task.sent_at),
        message_type=records.TRAIN,
    )
    return Message(content=messages.content(task, model), metadata=meta)


def task_size(task: Task, model: bytes, messages: TaskMessages) -> SendReceipt:
    """Flower object bytes and objects of ``task``'s message (``records.flower_size``)."""
    return SendReceipt(*records.flower_size(task_message(task, model, messages)))


class InProcessEngine(Engine):
    """Runs ``app`` (a ``ClientApp``) synchronously in ``submit``; ``nodes`` maps node id -> partition index."""

    def __init__(
        self, app: ClientApp, run_config: Mapping[str, Any], nodes: Mapping[int, int]) -> None:
        self.app = app
        n = len(nodes)
        self.contexts = {
            nid: Context(RUN_ID, nid, node_config(idx, n, run_config), RecordDict(), dict(run_config))
            for nid, idx in nodes.items()
        }
        seed_client_states(self.contexts, run_config)
        self.messages = TaskMessages(task_format(run_config)[0])  # a Compressed run's: its ModTransport
        self.done: dict[int, Event] = {}
        self.times = EngineTimes()
        self.succeeded = 0
        self.failed = 0

    def submit(self, task: Task, model: bytes) -> SendReceipt:
        t0 = time.perf_counter()
        msg = task_message(task, model, self.messages)
        size, objects = records.flower_size(msg)
        try:
            reply = self.app(msg, self.contexts[task.client])
        except Exception as exc:  # a raising ClientApp is an error reply in Flower, never a crash
            reason = f"CLIENT_APP_RAISED_EXCEPTION: {type(exc).__name__}: {exc}"
            self.failed += 1
            if not self.succeeded and self.failed >= len(self.contexts):
                raise SimulationError(f"every ClientApp call failed so far; the last: {reason}") from exc
            event: Event = FailureEvent(task.task_id, task.client, Outcome.LOST, reason)
        else:
            self.succeeded += 1
            event = self.messages.to_event(task, reply)
        self.done[task.task_id] = event
        self.times.add_reply(event)
        fed = float(event.metrics.get("train-seconds", 0.0)) if isinstance(event, ReplyEvent) else 0.0
        wall = time.perf_counter() - t0
        self.times.flower_s += max(0.0, wall - fed)
        self.times.engine_wall_s += wall
        return SendReceipt(size, objects)

    def gather(self, task_ids: Collection[int]) -> list[Event]:
        return [self.done.pop(t) for t in task_ids]

    def measure(self, task: Task, model: bytes) -> SendReceipt:
        return task_size(task, model, self.messages)


class GridEngine(Engine):
    """Tasks through a ``GridTransport`` (Flower's simulation engine behind the Grid); ``gather`` waits for
    every requested reply, up to ``reply_timeout`` real seconds each round (then the task counts as lost).

    A node has at most one task in Flower at a time; a task submitted while its node has one is held here and
    pushed once that one's reply is in (the module docstring says why). A held task's receipt is the size of its
    message as ``task_size`` builds it (``measure``), which may differ from the pushed one by a few metadata bytes.
    """

    def __init__(
        self,
        transport: GridTransport,
        reply_timeout: float = 600.0,
        measure: Callable[[Task, bytes], SendReceipt] | None = None,
    ) -> None:
        self.inner = transport
        self.reply_timeout = reply_timeout
        self.measure = measure or (lambda task, model: task_size(task, model, transport))
        self.done: dict[int, Event] = {}
        self.client_of: dict[int, int] = {}
        self.running: dict[int, int] = {}  # node -> the task id it has in Flower
        self.held: dict[int, deque[tuple[Task, bytes]]] = {}  # node -> tasks waiting for it, in submit order
        self.times = EngineTimes()

    def submit(self, task: Task, model: bytes) -> SendReceipt:
        t0 = time.perf_counter()
        self.client_of[task.task_id] = task.client
        if task.client in self.running:
            self.held.setdefault(task.client, deque()).append((task, model))
            receipt = self.measure(task, model)
        else:
            receipt = self._push(task, model)
        self.times.flower_s += time.perf_counter() - t0
        return receipt

    def _push(self, task: Task, model: bytes) -> SendReceipt:
        self.running[task.client] = task.task_id
        # the Flower TTL is real time: give the message room whatever the virtual deadline says
        return self.inner.send(replace(task, deadline=task.sent_at + self.reply_timeout), model)

    def _settle(self, task_id: int, event: Event) -> None:
        """Record ``event`` and push the node's next held task if ``task_id`` was the one it had in Flower."""
        if task_id not in self.client_of:  # a late reply of a task already given up
            return
        self.done[task_id] = event
        node = self.client_of[task_id]
        if self.running.get(node) == task_id:
            del self.running[node]
            held = self.held.get(node)
            if held:
                self._push(*held.popleft())

    def _collect(self, until: Callable[[], bool]) -> None:
        """Poll Flower until ``until()`` or ``reply_timeout`` real seconds have passed."""
        t0 = time.perf_counter()
        end = time.monotonic() + self.reply_timeout
        while not until() and time.monotonic() < end:
            for event in self.inner.poll(0.5):
                self.times.add_reply(event)
                self._settle(event.task_id, event)
        self.times.wait_s += time.perf_counter() - t0

    def _give_up(self, task_ids: Collection[int], reason: str) -> None:
        """Count ``task_ids`` as lost: held ones are dropped first, so only a node's later tasks are pushed."""
        gone = set(task_ids)
        for node, held in self.held.items():
            self.held[node] = deque(item for item in held if item[0].task_id not in gone)
        for tid in task_ids:
            node = self.client_of[tid]
            if self.running.get(node) == tid:
                self._settle(tid, FailureEvent(tid, node, Outcome.LOST, reason))
            else:
                self.done[tid] = FailureEvent(tid, node, Outcome.LOST, reason)

    def _take(self, task_ids: Collection[int]) -> list[Event]:
        for t in task_ids:
            self.client_of.pop(t, None)
        return [self.done.pop(t) for t in task_ids]

    def gather(self, task_ids: Collection[int]) -> list[Event]:
        want = set(task_ids)
        self._collect(lambda: not want - self.done.keys())
        self._give_up([t for t in task_ids if t not in self.done], "no reply from the simulation engine")
        return self._take(task_ids)

    def gather_any(self, task_ids: Collection[int]) -> list[Event]:
        want = set(task_ids)
        self._collect(lambda: bool(want & self.done.keys()))
        if not want & self.done.keys():
            self._give_up(list(task_ids), "no reply from the engine")
        return self._take([t for t in task_ids if t in self.done])

    def finish_times(self, workers: int = 1) -> None:
        """Flower/Ray time: the engine's wall time (pushing + waiting for replies) times the ``workers`` ClientApps
        that run in parallel, minus the ClientApps' own work (``train-seconds``), i.e. the worker time that did
        not go into fedcomp."""
        engine_wall = self.times.flower_s + self.times.wait_s
        self.times.engine_wall_s = engine_wall
        self.times.flower_s = max(0.0, engine_wall * workers - self.times.fedcomp_s)
        self.times.wait_s = 0.0

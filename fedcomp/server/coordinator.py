"""``ServerProtocol``: the server side of the update protocol, without Flower, tying its parts together.

The transport (Flower's Grid in ``server_app``, ``Compressed``, a virtual-clock simulator) calls ``dispatch``,
``on_reply`` (or ``admit``) and ``fail_task``; nothing else decides what is applied. The parts, by job:
``Ledger`` (tasks and who hears what), ``checks`` (judging a reply), ``UpdateBuffer`` (sum and optimizer step),
``VersionStats`` (counters). Rules and the normalisation: docs/protocol.md.

>>> proto = ServerProtocol(spec, params, SERVER_OPTIMIZERS.build("sgd"), STALENESS.build("constant"),
...                        ProtocolConfig(buffer_size=2))  # doctest: +SKIP
>>> task = proto.dispatch(client=5, now=0.0)  # doctest: +SKIP
>>> proto.on_reply(5, blob, ReplyMeta(task.task_id, seq=1), now=1.0).outcome  # doctest: +SKIP
<Outcome.APPLIED: 'applied'>
"""

from __future__ import annotations

import ast
import dataclasses
import random
from collections.abc import Callable, Mapping
from typing import Any

import torch

from fedcomp.payload import Update
from fedcomp.protocol import Decision, Outcome, ProtocolConfig, ReplyMeta, Task
from fedcomp.registry import ConfigError
from fedcomp.server.buffer import ServerOptimizer, UpdateBuffer
from fedcomp.server.checks import CHECKS, GATES, Reply, decode_reply, judge
from fedcomp.server.ledger import ClientLedger, Ledger
from fedcomp.server.stats import VersionStats
from fedcomp.spec import ModelSpec


class LedgerView:
    """What ``ServerProtocol`` passes through to its ledger (``book``) and buffer unchanged: their state as
    attributes and the task bookkeeping that needs no judgement. Kept out of the protocol, as Flower's strategy
    wrappers keep their pass-through methods in a base class."""

    book: Ledger
    buffer: UpdateBuffer
    version: int
    round: int

    clients = property(lambda self: self.book.clients)
    tasks = property(lambda self: self.book.tasks)
    held = property(lambda self: self.book.held)
    restarts = property(lambda self: self.book.restarts)
    accumulator = property(lambda self: self.buffer.accumulator)
    buffered = property(lambda self: self.buffer.count)
    buffered_weight = property(lambda self: self.buffer.accumulator.total_weight)

    @property
    def next_task_id(self) -> int:
        return self.book.next_task_id

    @next_task_id.setter
    def next_task_id(self, value: int) -> None:
        self.book.next_task_id = int(value)

    def ledger(self, client: int) -> ClientLedger:
        return self.book.get(client)

    def busy(self, client: int) -> bool:
        return self.book.busy(client)

    def overtakes(self, client: int, task_id: int) -> bool:
        return self.book.overtakes(client, task_id)

    def available(self, client: int, now: float) -> bool:
        return self.book.available(client, now)

    def can_queue(self, client: int, now: float) -> bool:
        return self.book.can_queue(client, now)

    def dispatch(self, client: int, now: float, timeout: float | None = None) -> Task:
        """Open a task for ``client`` at the current version; it carries (and clears) the client's outbox."""
        return self.book.dispatch(client, now, self.version, self.round, timeout)

    def undo_dispatch(self, task: Task) -> None:
        self.book.undo_dispatch(task)


class ServerProtocol(LedgerView):
    """Ledger + checks + buffer + counters over one model. Not thread-safe; one event at a time, in clock order.

    ``params`` (name -> float32 tensor, the spec's tensors) are updated in place by the optimizer.
    ``staleness`` maps ``tau`` to a weight (``fedcomp.server.staleness.STALENESS`` instances fit).
    """

    def __init__(
        self,
        spec: ModelSpec,
        params: dict[str, torch.Tensor],
        optimizer: ServerOptimizer,
        staleness: Callable[[int], float],
        config: ProtocolConfig,
    ) -> None:
        missing = set(spec.names) - set(params)
        if missing:
            raise ConfigError(f"params lack spec tensors {sorted(missing)}")
        self.spec, self.params, self.optimizer, self.staleness, self.config = spec, params, optimizer, staleness, config
        self.version = 0
        self.round = 0
        self.book = Ledger(config)
        self.buffer = UpdateBuffer(spec, params, optimizer, config)
        self.stats = VersionStats()  # since the last version
        self.totals = VersionStats()  # whole run (merged at every version)
        self.rng = random.Random(0)

    def fail_task(self, client: int, task_id: int, outcome: Outcome, reason: str, now: float) -> bool:
        """Resolve an open task that will not be applied (timeout / lost). False if it was not open."""
        if not outcome.is_nack:
            raise ValueError(f"fail_task needs a nack outcome, got {outcome}")
        task = self.book.open_task(client, task_id)
        if task is None:
            return False
        self.book.fail(task, outcome, reason, now)
        self.stats.count(outcome, reason)
        return True

    def reject(self, client: int, task_id: int, reason: str) -> Decision:
        """A reply to an open task that could not even be read (malformed records): nack it as rejected."""
        task = self.book.open_task(client, task_id)
        if task is None:
            return self._ignore(Decision(Outcome.LATE, f"task {task_id} is not open for this client"))
        return self._nack(task, Decision(Outcome.REJECTED, reason))

    def expire(self, now: float) -> list[Task]:
        """Time out every open task whose deadline has passed; returns them."""
        due = self.book.due(now)
        for t in due:
            self.fail_task(t.client, t.task_id, Outcome.TIMEOUT, f"no reply within {t.deadline - t.sent_at:.0f}s", now)
        return due

    def close_round(self, now: float, reason: str = "round closed") -> list[Task]:
        """Sync mode: time out the round's open tasks without penalising the nodes; then step if anything came."""
        closing = self.book.close(self.round, reason)
        for _ in closing:
            self.stats.count(Outcome.TIMEOUT, reason)
        if self.buffered:
            self.step()
        self.round += 1
        return closing

    # ---- replies -----------------------------------------------------------------------------------------
    def on_reply(self, client: int, blob: bytes, meta: ReplyMeta, now: float) -> Decision:
        """Judge one reply and buffer it if accepted; never raises on bad input (the reason says what was wrong)."""
        decision, update = self.admit(client, blob, meta, now)
        if update is None:
            return decision
        self.buffer.add(update, decision.weight)
        stepped = bool(self.config.buffer_size) and self.buffered >= self.config.buffer_size
        if stepped:
            self.step()
        return dataclasses.replace(decision, stepped=stepped)

    def admit(
        self, client: int, blob: bytes, meta: ReplyMeta, now: float, *, weight: float | None = None
    ) -> tuple[Decision, Update | None]:
        """Judge one reply without buffering it: ``(decision, decoded update)``, the update only when accepted.

        An accepted update is resolved as applied (its ack goes out, or waits for ``commit()`` with durable
        acks): the caller must aggregate it (``on_reply`` does) or take the ack back with ``revoke()``. A caller
        that aggregates with its own ``weight`` (>= 0) passes it: the checks then bound ``weight × norm`` instead
        of the staleness weight's, so the update can be added with ``trusted=True``."""
        self.stats.payload_bytes_up += len(blob)
        self.book.recognise(client, meta)
        reply = Reply(int(client), blob, meta, self.book.clients.get(int(client)), given_weight=weight)
        reply.task = self.book.open_task(client, meta.task_id)
        ignored = judge(self, reply, GATES)
        if ignored is not None:
            return self._ignore(ignored), None
        assert reply.ledger is not None and reply.task is not None
        overtaken = meta.seq < reply.ledger.last_seq  # a newer reply was read first: its pending list is newer
        reply.ledger.saw(meta.seq)
        reply.ledger.failures = 0
        failed = decode_reply(self, reply)  # decode once; a reply that is no update says nothing of other tasks
        for nack in () if overtaken or failed else self.book.resync_pending(client, meta):  # tasks not seen sent
            self.stats.count(nack.outcome, nack.reason)
            self.stats.unknown_tasks += 1
        failed = failed or judge(self, reply, CHECKS)  # then check the update
        if failed is not None:
            return self._nack(reply.task, failed), None
        self.book.resolve(reply.task, meta.seq, Outcome.APPLIED, f"in version {self.version + 1}")
        self.stats.count(Outcome.APPLIED, staleness=reply.tau)
        if reply.task.queued:
            self.stats.prefetched_applied += 1
            self.stats.prefetched_staleness += int(reply.tau or 0)
        return Decision(Outcome.APPLIED, "", reply.tau, reply.weight, False, meta.seq), reply.update

    def _ignore(self, decision: Decision) -> Decision:
        self.stats.count(decision.outcome, decision.reason)
        return decision

    def _nack(self, task: Task, decision: Decision) -> Decision:
        self.book.resolve(task, decision.seq, decision.outcome, decision.reason)
        self.stats.prefetched_stale += int(task.queued and decision.outcome is Outcome.STALE)
        return self._ignore(decision)

    # ---- the server step and the counters ----------------------------------------------------------------
    def step(self) -> None:
        """Apply the buffer: ``params -= lr * direction(Σ w Δ / Z)``; version += 1."""
        self.buffer.step()
        self.version += 1

    def roll_stats(self) -> dict[str, Any]:
        """The counters since the last call (one JSONL row); they are merged into ``totals`` and reset."""
        done = self.stats.roll()
        self.totals.merge(done)
        return done.to_dict()

    # ---- durable acks, restarts, checkpoints -------------------------------------------------------------
    def commit(self) -> int:
        """The model holding every accepted update is durable (checkpointed): release the held acks to the
        clients' outboxes. Returns how many were released."""
        return self.book.commit()

    def revoke(self, reason: str) -> int:
        """The acks held for ``commit()`` will never be true (the aggregation that was to hold their updates
        failed): turn them into nacks (``rejected``) so the clients restore those updates. Returns how many."""
        nacks = self.book.revoke(reason)
        for nack in nacks:
            self.stats.accepted -= 1
            self.stats.count(Outcome.REJECTED, nack.reason)
        return len(nacks)

    def restart(self) -> None:
        """Continue after a crash, right after ``load_state_dict`` of the last checkpoint.

        Task ids jump to a fresh range (``restarts << TASK_ID_BITS``) so no reply to a task the dead server
        issued after its checkpoint can match a new task, and every client (also one first seen later) gets
        ``resync`` tasks until an update of it is applied: the client first applies the task's resolutions
        (acks of what the checkpointed model holds, "lost: server restarted" nacks), then nacks every update
        still pending, since the resumed server cannot apply or acknowledge it. Checkpoint right after this
        call so the new range is durable before any task is sent.
        """
        self.book.restart()

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to resume, as plain types and tensors (``torch.load(weights_only=True)``-safe).

        Take it right after a step (the buffer is then empty; a non-empty buffer is refused). Open tasks are
        saved as nacks "lost: server restarted" so their clients restore those updates after a resume, and the
        saved counters (``totals``, with the counts since the last version) count them ``lost``: a resumed run
        counts every task it knows once sent and once answered. Acks held for ``commit()`` are saved as acks
        (their updates are in the saved model).
        """
        if self.buffered:
            raise RuntimeError("checkpoint with a non-empty buffer; take it right after step()")
        book = self.book.state_dict()
        totals = VersionStats()
        totals.merge(self.totals)
        totals.merge(self.stats)
        for _ in range(sum(len(led.open_tasks) for led in self.book.clients.values())):
            totals.count(Outcome.LOST, "lost: server restarted")
        return {
            "version": self.version,
            "round": self.round,
            "next_task_id": book["next_task_id"],
            "clients": book["clients"],
            "totals": totals.to_dict(),
            "params": {n: t.detach().clone() for n, t in self.params.items()},
            "optimizer": self.optimizer.state_dict(),
            "rng": repr(self.rng.getstate()),
            "fingerprint": self.spec.fingerprint.hex(),
            "restarts": book["restarts"],
            "run_key": book["run_key"],
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if state["fingerprint"] != self.spec.fingerprint.hex():
            raise ConfigError("checkpoint was made for another model (fingerprint differs)")
        _check_state(state, self.params)
        self.version, self.round = int(state["version"]), int(state["round"])
        self.book.load_state_dict(state)
        self.totals = VersionStats.from_dict(state["totals"])
        with torch.no_grad():
            for n, t in state["params"].items():
                self.params[n].copy_(t)
        self.optimizer.load_state_dict(state["optimizer"])
        self.rng.setstate(ast.literal_eval(state["rng"]))


def _check_state(state: Mapping[str, Any], params: Mapping[str, torch.Tensor]) -> None:
    """``ValueError`` unless ``state`` (``ServerProtocol.state_dict``'s) holds a version and round >= 0 and exactly
    the model's arrays (``params``), each a finite tensor of its shape: a checkpoint is never half the model."""
    if int(state["version"]) < 0 or int(state["round"]) < 0:
        raise ValueError(f"version {state['version']} and round {state['round']} must be >= 0")
    saved = state["params"]
    if not isinstance(saved, Mapping):
        raise ValueError(f"params are a {type(saved).__name__}")
    if set(saved) != set(params):
        raise ValueError(f"params lack {sorted(set(params) - set(saved))} and hold "
                         f"{sorted(set(saved) - set(params))} the model does not")
    for n, t in saved.items():
        if not isinstance(t, torch.Tensor) or t.shape != params[n].shape or not torch.isfinite(t).all():
            raise ValueError(f"params[{n!r}] is not a finite tensor of shape {tuple(params[n].shape)}")

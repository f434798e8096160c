"""The client session: everything a node keeps between tasks, kept in Flower's ``context.state``.

One ``ClientSession`` per (node, run): its send pipeline (error-feedback memory, compressor RNG and schedule,
next sequence number, the encoded updates still pending), which task each pending ``seq`` answered, its
incarnation id, the local steps done (the DGC warm-up reads epochs from it) and its replica of the public model
(compressed downlink). Both ways in use it: ``compression_mod`` and the product's own ClientApp.

The contract a task follows, in this order::

    session = ClientSession.load(context, compression, spec)   # or a fresh one
    session.resolve(resolutions)                  # acks forget, nacks restore into the residual
    model = session.receive_model(context, blob)  # the public model the server meant (compressed downlink)
    ...train...
    blob, seq = session.send(task_id, pseudo_grad, base_version, client_id)
    session.save(context)                         # before the reply leaves

``save`` writes ``context.state`` (and ``state_dir/client-state.pt`` atomically when a folder is given:
``fedcomp.flower.statedir``), so a ClientApp process that restarts, or a run resumed against the same state
folder, continues where it was: nothing in the residual or in a pending update is forgotten. The process keeps
the object it saved to a folder too: its next ``load`` takes it instead of reading and deserializing the file
while the file is the one it wrote (``fedcomp.flower.sessioncache``). A session belongs to
one server run (``run_key``, which the server keeps across resumes and sends with every task): a task continues
its own run's session wherever the folder holds it, the current file or the one set aside for its run (which then
becomes current while the other run's is set aside), else starts a fresh one; never a mix of two runs. A task
without a key (a server from before run keys) is a run of its own, key 0: it never continues a keyed run's
session, nor a keyed task one that served keyless tasks (``_continues``).
"""

from __future__ import annotations

import random
from collections.abc import Mapping
from typing import Any

import torch
from flwr.app import Array, ArrayRecord, Context

from fedcomp import tensortree
from fedcomp.client.acks import ClientSide
from fedcomp.client.pipeline import Pipeline
from fedcomp.downlink import Replica, receive
from fedcomp.flower.sessioncache import SessionCache
from fedcomp.flower.statedir import StateDir
from fedcomp.protocol import ReplyMeta, Resolution
from fedcomp.registry import ConfigError
from fedcomp.spec import ModelSpec
from fedcomp.task.config import Compression

STATE_KEY = "fedcomp"
STATE_STYPE = "fedcomp/client-state"
REPLICA_KEY = "fedcomp-replica"
REPLICA_STYPE = "fedcomp/replica"
#: The session each state dir's file holds, as the object this process saved (``fedcomp.flower.sessioncache``).
KEPT: SessionCache[ClientSession] = SessionCache()


class OtherRun(Exception):
    """A saved session belongs to another server run (``run_key``)."""

    def __init__(self, run_key: int) -> None:
        super().__init__(f"client state of run {run_key:x}")
        self.run_key = run_key


class ClientSession(ClientSide):
    """A node's compression state for one run, one object (see the module docstring for the order of calls): the
    ack half it inherits (``ClientSide``: which task each pending ``seq`` answered, ``apply``, ``resync``,
    ``send``) over its ``pipeline``, plus the incarnation, the compression it was made for and the steps done.

    ``fresh`` and ``load`` put the pipeline's memory on the training ``device`` and send with kernel
    ``backend``; ``to_bytes`` saves every tensor through the CPU, so a state loads on any node.
    """

    def __init__(
        self,
        pipeline: Pipeline,
        incarnation: int,
        compression: Compression,
        steps_done: int = 0,
        task_seqs: Mapping[int, int] | None = None,
        run_key: int = 0,
    ) -> None:
        super().__init__(pipeline, task_seqs)  # the ack half: task -> seq, apply, resync, send
        self.incarnation, self.compression, self.steps_done = incarnation, compression, steps_done
        self.run_key = run_key  # the server run this session serves (0: none seen yet)
        self._replica: tuple[ArrayRecord, Replica] | None = None  # the replica record last saved, as an object

    # ---- life cycle ----------------------------------------------------------------------------------------
    @staticmethod
    def fresh(
        compression: Compression,
        spec: ModelSpec,
        *,
        device: torch.device | str = "cpu",
        backend: str | None = None,
        run_key: int = 0,
    ) -> ClientSession:
        pipe = compression.pipeline(spec, backend).to(device)
        return ClientSession(pipe, random.SystemRandom().getrandbits(62) or 1, compression, run_key=run_key)

    @staticmethod
    def load(
        context: Context,
        compression: Compression,
        spec: ModelSpec,
        state_dir: str = "",
        *,
        device: torch.device | str = "cpu",
        backend: str | None = None,
        run_key: int | None = None,
        dir_first: bool = False,
    ) -> ClientSession:
        """``context.state``, else the folder ``state_dir`` (the other way round with ``dir_first``), else a fresh
        session. ``run_key`` is the task's (0: a server that sends none; ``None``: any run's session, to inspect
        one): a saved session of another run is passed over, and the fresh session serves ``run_key``. In the
        folder, run ``run_key``'s session wherever it is (``_from_folder``): in the current file's place, the
        session this process saved there last, if the file is still the one it wrote and it was made for this
        compression, spec, ``backend`` and ``run_key`` (``KEPT``); what that file would give, without reading it."""
        folder = StateDir(state_dir) if state_dir else None
        sources = [None, folder]  # context.state, the folder
        for where in sources[::-1] if dir_first else sources:
            if where is not None:
                found = _from_folder(where, compression, spec, device, backend, run_key)
            elif (data := _held(context)) is None:
                continue
            else:
                try:
                    found = ClientSession.from_bytes(data, compression, spec, device=device, backend=backend,
                                                     run_key=run_key)
                except OtherRun:
                    continue
            if found is not None:
                return found
        return ClientSession.fresh(compression, spec, device=device, backend=backend, run_key=run_key or 0)

    def continued(self, compression: Compression, spec: ModelSpec, device: torch.device | str,
                  backend: str | None) -> ClientSession:
        """This session (the one this process saved last) as ``from_bytes`` of what it saved would give it: its
        state objects kept as they are, in a fresh pipeline (``Pipeline.take_state``: per-task settings such as
        ``set_density`` are not state), on ``device``."""
        pipe = compression.pipeline(spec, backend)
        pipe.take_state(self.pipeline)
        self.pipeline = pipe.to(device)
        return self

    def save(self, context: Context, state_dir: str = "") -> None:
        """Into ``context.state`` (and ``state_dir``, fsynced then renamed): call before the reply leaves."""
        data = self.to_bytes()
        context.state[STATE_KEY] = ArrayRecord(
            {"state": Array(dtype="uint8", shape=(len(data),), stype=STATE_STYPE, data=data)}
        )
        if state_dir:  # the next task of this process takes this object, while the file is this one (KEPT)
            folder = StateDir(state_dir)
            fits = (self.compression, self.pipeline.spec, self.pipeline.backend, self.run_key)
            self._replica = None  # a model's worth; a session read from the file has none either
            KEPT.keep(folder, folder.write(data), fits, self)

    def to_bytes(self) -> bytes:
        """The session as a ``fedcomp.tensortree`` byte string, every tensor through the CPU."""
        return tensortree.dumps(
            {
                "pipeline": self.pipeline.state_dict(),
                "task_seqs": dict(self.task_seqs),
                "incarnation": self.incarnation,
                "steps_done": self.steps_done,
                "compression": self.compression.to_flat(),
                "run_key": self.run_key,
            }
        )

    @staticmethod
    def from_bytes(
        data: bytes,
        compression: Compression,
        spec: ModelSpec,
        *,
        device: torch.device | str = "cpu",
        backend: str | None = None,
        run_key: int | None = None,
    ) -> ClientSession:
        """The saved session; ``OtherRun`` if it serves another run than ``run_key`` (``_continues``; ``None``:
        any run); else ``ConfigError`` if it is corrupt or was made with other compression settings (its residual
        would be silently dropped otherwise)."""
        state = _parse(data)
        if run_key is not None and not _continues(state, run_key):
            raise OtherRun(int(state.get("run_key", 0)))
        return ClientSession._of(state, compression, spec, device, backend, run_key)

    @staticmethod
    def _of(state: Mapping[str, Any], compression: Compression, spec: ModelSpec, device: torch.device | str,
            backend: str | None, run_key: int | None) -> ClientSession:
        """The session a parsed state holds, serving its saved run (``run_key`` if it was saved without one);
        ``ConfigError`` if it was made with other compression settings."""
        saved = state.get("compression")
        if saved is not None and Compression.from_flat(saved).client_part() != compression.client_part():
            raise ConfigError(f"client state was made for {saved}, this run asks for {compression.to_flat()}")
        pipe = compression.pipeline(spec, backend)
        try:
            pipe.load_state_dict(state["pipeline"])
        except (KeyError, TypeError, ValueError, AttributeError, RuntimeError, IndexError, OverflowError) as exc:
            # a state of the right shape whose tables lie (a residual or pending update that does not fit the
            # model, an RNG state that is not one): refused here, before any of it is used
            raise ConfigError(f"client state cannot be loaded: {tensortree.first_line(exc)}") from None
        pipe.to(device)
        return ClientSession(pipe, state["incarnation"], compression, state.get("steps_done", 0), state["task_seqs"],
                             int(state.get("run_key", 0)) or run_key or 0)

    # ---- one task ------------------------------------------------------------------------------------------
    def resolve(self, resolutions: list[Resolution]) -> dict[str, int]:
        """Apply the task's acks and nacks (a nack restores that update into the residual). Returns counts by
        outcome. Nothing is nacked blind, not after a server restart either (a ``resync`` task): an update still
        in flight may yet be applied. The resumed server answers every task id the reply lists as pending
        (``reply_meta``; ``Ledger.resync_pending``), and those answers arrive with a later task."""
        return self.apply(resolutions)

    def receive_model(self, context: Context, spec: ModelSpec, blob: bytes) -> Replica:
        """The public model a downlink blob gives this node (``fedcomp.downlink.receive``), verified; the replica
        is kept in ``context.state`` when the downlink sends deltas. Raises ``DownlinkError`` (the server then
        sends a full copy) rather than train from a wrong model. A session that saved the replica record it finds
        there (the same object: a node that keeps its session in memory) uses its replica without decoding it."""
        rec = context.state.array_records.get(REPLICA_KEY)
        held: Replica | None = None
        if rec is not None and self._replica is not None and rec is self._replica[0]:
            held = self._replica[1]  # what this session saved there, unchanged (a replica is a value)
        elif rec is not None and "replica" in rec:
            held = Replica.from_bytes(bytes(rec["replica"].data), spec)
        replica = receive(blob, spec, held)
        if self.compression.downlink != "dense":
            data = replica.to_bytes(spec)
            arr = Array(dtype="uint8", shape=(len(data),), stype=REPLICA_STYPE, data=data)
            context.state[REPLICA_KEY] = saved = ArrayRecord({"replica": arr})
            self._replica = (saved, replica)
        return replica

    def reply_meta(self, task_id: int, seq: int, num_examples: int = 1) -> ReplyMeta:
        """The control part of the reply to ``task_id``: this state's incarnation and the task ids of its other
        updates still pending, so a server that knows this client under another node id (a restart) answers
        them here."""
        pending = tuple(t for t in self.pending_tasks() if t != int(task_id))
        return ReplyMeta(int(task_id), int(seq), int(num_examples), self.incarnation, pending)


def _parse(data: bytes) -> dict[str, Any]:
    """A saved session's ``fedcomp.tensortree`` state, its top-level fields checked; a corrupt one is a
    ``ConfigError``, not a silent reset (nor a crash later, at a nack)."""
    try:
        state = tensortree.loads(data)
    except tensortree.TreeError as exc:
        raise ConfigError(f"client state cannot be loaded: {exc}") from exc
    why = _bad_fields(state)
    if why:
        raise ConfigError(f"client state cannot be loaded: {why}")
    return state


def _bad_fields(state: Any) -> str:
    """What is wrong with a parsed state's top-level fields ('' if nothing): the ids and counts are ints in range,
    ``task_seqs`` maps task ids to ``seq`` numbers, ``pipeline`` and ``compression`` are tables."""
    if not isinstance(state, dict) or not isinstance(state.get("pipeline"), dict):
        return "not a client session (no pipeline table)"
    pipe = state["pipeline"]
    counts = {"incarnation": state.get("incarnation"), "steps_done": state.get("steps_done", 0),
              "run_key": state.get("run_key", 0), "next_seq": pipe.get("next_seq", 1)}
    for key, v in counts.items():
        if type(v) is not int or not 0 <= v < 2**63:
            return f"{key} is not a count ({str(v)[:40]})"
    seqs = state.get("task_seqs")
    if not isinstance(seqs, dict) or not all(type(k) is int and type(v) is int for k, v in seqs.items()):
        return "task_seqs is not a table of task ids to seq numbers"
    if not isinstance(state.get("compression", {}), (dict, type(None))):
        return "compression is not a table"
    return ""


def _continues(state: Mapping[str, Any], run_key: int) -> bool:
    """Whether a task of run ``run_key`` continues this saved session: one of that very run, or one that has served
    no task yet (a simulator's seeded state: it takes the run). A task without a key (0, a server from before run
    keys) is a run of its own: it never continues a keyed run's session, and a keyed task never continues a
    session that served keyless tasks."""
    saved = int(state.get("run_key", 0))
    return saved == run_key or (saved == 0 and not _served(state))


def _served(state: Mapping[str, Any]) -> bool:
    """Whether a saved session has sent an update or counted a step (a fresh one has neither)."""
    pipe = state.get("pipeline")
    next_seq = pipe.get("next_seq", 1) if isinstance(pipe, Mapping) else 1
    return int(next_seq) > 1 or bool(state.get("task_seqs")) or int(state.get("steps_done", 0)) > 0


def _from_folder(folder: StateDir, compression: Compression, spec: ModelSpec, device: torch.device | str,
                 backend: str | None, run_key: int | None) -> ClientSession | None:
    """Run ``run_key``'s session in ``folder`` (``None``: none there): the current file's (``KEPT``'s object while
    the file is the one this process saved), else its set-aside file, which becomes the current one while the
    current one is set aside (``StateDir.take_back``), else the current file's if it served no task yet. A current
    file of another run is set aside when ``run_key`` has no session there; nothing moves before the session to
    continue was read and fits the compression (else ``ConfigError``)."""
    if (kept := KEPT.take(folder, (compression, spec, backend, run_key))) is not None:
        return kept.continued(compression, spec, device, backend)  # this process saved that very file
    data = folder.read()
    state = None if data is None else _parse(data)
    current = None if state is None else int(state.get("run_key", 0))
    if state is not None and (run_key is None or current == run_key):
        return ClientSession._of(state, compression, spec, device, backend, run_key)
    mine = None if run_key is None else folder.read_aside(run_key)
    if mine is not None:
        session = ClientSession.from_bytes(mine, compression, spec, device=device, backend=backend, run_key=run_key)
        folder.take_back(run_key, current)
        return session
    if current is not None and state is not None and run_key is not None:
        if _continues(state, run_key):
            return ClientSession._of(state, compression, spec, device, backend, run_key)
        folder.set_aside(current)
    return None


def _held(context: Context) -> bytes | None:
    """The session bytes in ``context.state``, if any."""
    rec = context.state.array_records.get(STATE_KEY)
    return bytes(rec["state"].data) if rec is not None and "state" in rec else None

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
one server run (``run_key``, which the server keeps across resumes and sends with every task): a task of another
run sets the folder's session aside and starts a fresh one, never a mix of two runs.
"""

from __future__ import annotations

import random
from collections.abc import Mapping

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
        run_key: int = 0,
        dir_first: bool = False,
    ) -> ClientSession:
        """``context.state``, else ``state_dir/client-state.pt`` (the other way round with ``dir_first``), else a
        fresh session. With ``run_key``, a saved session of another run is passed over (the folder's is set
        aside) and the fresh session serves ``run_key``. In the folder's place: the session this process saved
        there last, if the file is still the one it wrote and it was made for this compression, spec, ``backend``
        and ``run_key`` (``KEPT``); what that file would give, without reading it."""
        folder = StateDir(state_dir) if state_dir else None
        sources = [None, folder]  # context.state, the folder
        for where in sources[::-1] if dir_first else sources:
            if where is not None and (kept := KEPT.take(where, (compression, spec, backend, run_key))) is not None:
                return kept.continued(compression, spec, device, backend)  # this process saved that very file
            data = _held(context) if where is None else where.read()
            if data is None:
                continue
            try:
                return ClientSession.from_bytes(data, compression, spec, device=device, backend=backend,
                                                run_key=run_key)
            except OtherRun as other:
                if where is not None:
                    where.set_aside(other.run_key)
        return ClientSession.fresh(compression, spec, device=device, backend=backend, run_key=run_key)

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
        run_key: int = 0,
    ) -> ClientSession:
        """The saved session; ``OtherRun`` if it serves another run than ``run_key`` (when both are known; a
        session that has served no run yet takes ``run_key``); else ``ConfigError`` if it is corrupt or was made
        with other compression settings (its residual would be silently dropped otherwise)."""
        try:
            state = tensortree.loads(data)
        except tensortree.TreeError as exc:  # a corrupt state is a config problem, not a silent reset
            raise ConfigError(f"client state cannot be loaded: {exc}") from exc
        saved_run = int(state.get("run_key", 0))
        if run_key and saved_run and saved_run != run_key:
            raise OtherRun(saved_run)
        saved = state.get("compression")
        if saved is not None and Compression.from_flat(saved) != compression:
            raise ConfigError(f"client state was made for {saved}, this run asks for {compression.to_flat()}")
        pipe = compression.pipeline(spec, backend)
        pipe.load_state_dict(state["pipeline"])
        pipe.to(device)
        return ClientSession(pipe, int(state["incarnation"]), compression, int(state["steps_done"]), state["task_seqs"],
                             saved_run or run_key)

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


def _held(context: Context) -> bytes | None:
    """The session bytes in ``context.state``, if any."""
    rec = context.state.array_records.get(STATE_KEY)
    return bytes(rec["state"].data) if rec is not None and "state" in rec else None

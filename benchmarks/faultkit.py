"""Helpers for the fault, restart and conservation tests (Flower-free): clients with real pipelines whose state
can be lost like a killed process, a float64 tally of what the server applied, and the conservation check.

Conservation (docs/protocol.md): ``Σ applied + Σ client residuals + Σ pending = Σ computed``. ``computed`` is
every tensor that entered ``Pipeline.send``; ``applied`` is the float64 sum of the decoded updates the
protocol accepted into the model (weight 1: constant staleness, ``normalize="sum"``, SGD lr 1); after the
final acks/nacks have been delivered nothing is pending.
"""

from __future__ import annotations

import copy
import random
from collections.abc import Collection

import torch

from fedcomp.client.acks import ClientSide
from fedcomp.client.pipeline import build
from fedcomp.protocol import Decision, Outcome, ProtocolConfig, ReplyMeta, Task
from fedcomp.server import ServerProtocol
from fedcomp.server.loops import Event, FailureEvent, ReplyEvent, SendReceipt
from fedcomp.server.optimizers import SERVER_OPTIMIZERS
from fedcomp.server.staleness import STALENESS
from fedcomp.sim.virtual import Engine
from fedcomp.spec import ModelSpec
from fedcomp.wire import decode

SPEC = ModelSpec((("w", (24, 16)), ("b", (16,))))


def make_proto(**cfg) -> ServerProtocol:
    """A protocol whose model moves by exactly ``-Σ applied`` (weight 1 per update)."""
    params = {n: torch.zeros(s) for n, s in SPEC.entries}
    config = ProtocolConfig(**{"normalize": "sum", "backoff": 0.5, **cfg})
    return ServerProtocol(SPEC, params, SERVER_OPTIMIZERS.build("sgd", lr=1.0), STALENESS.build("constant"), config)


class Tally:
    """Float64 sum of the updates the protocol applied, keyed by (client, incarnation, seq): never twice."""

    def __init__(self) -> None:
        self.updates: dict[tuple[int, int, int], dict[str, torch.Tensor]] = {}

    def watch(self, proto: ServerProtocol) -> None:
        """Wrap ``proto.on_reply`` to record every accepted update."""
        inner = proto.on_reply

        def on_reply(client: int, blob: bytes, meta: ReplyMeta, now: float) -> Decision:
            d = inner(client, blob, meta, now)
            if d.outcome is Outcome.APPLIED:
                key = (int(client), int(meta.incarnation), int(meta.seq))
                assert key not in self.updates, f"update {key} applied twice"
                self.updates[key] = {n: t.to_dense().double() for n, t in decode(blob, SPEC).tensors.items()}
            return d

        proto.on_reply = on_reply  # type: ignore[method-assign]

    def total(self, name: str) -> torch.Tensor:
        return sum((u[name] for u in self.updates.values()), torch.zeros(SPEC.shape(name), dtype=torch.float64))

    def snapshot(self) -> dict[tuple[int, int, int], dict[str, torch.Tensor]]:
        return dict(self.updates)


class Client:
    """One client: a ``ClientSide`` (topk+int8 with the residual memory) that can lose its unsaved state.

    ``run(task)`` is one ClientApp call: apply the resolutions, compute a random delta, send it, and list the
    task ids of its other pending updates in the reply (the server answers those after a restart).
    ``kill_mid_train`` restores the state saved at the end of the previous task, as a SIGKILLed ClientApp does:
    the task's resolutions are forgotten (the server re-sends them) and nothing new was computed.
    """

    def __init__(self, cid: int, seed: int) -> None:
        self.cid, self.incarnation = cid, 1000 + cid
        self.side = ClientSide(build("topk+int8", SPEC, memory="residual", density=0.2))
        self.gen = torch.Generator().manual_seed(seed)
        self.computed = {n: torch.zeros(s, dtype=torch.float64) for n, s in SPEC.entries}
        self.saved = self._state()

    def _state(self):
        return copy.deepcopy((self.side.pipeline.state_dict(), dict(self.side.task_seqs), self.computed))

    def kill_mid_train(self, task: Task) -> None:
        self.side.apply(task.resolutions)  # happened in the dead process only
        pipe, seqs, computed = copy.deepcopy(self.saved)
        self.side.pipeline.load_state_dict(pipe)
        self.side.task_seqs, self.computed = seqs, computed

    def run(self, task: Task) -> tuple[bytes, ReplyMeta]:
        self.side.apply(task.resolutions)
        delta = {n: torch.randn(s, generator=self.gen) for n, s in SPEC.entries}
        for n in delta:
            self.computed[n] += delta[n].double()
        blob = self.side.pipeline.send(delta, base_version=task.base_version, client_id=self.cid)
        seq = self.side.pipeline.last_seq
        self.side.sent(task.task_id, seq)
        self.saved = self._state()  # the ClientApp saves its state before the reply leaves
        pending = tuple(t for t in self.side.pending_tasks() if t != task.task_id)
        return blob, ReplyMeta(task.task_id, seq, 10, self.incarnation, pending)

    def held(self, name: str) -> torch.Tensor:
        """Residual plus every pending (unresolved) update, float64."""
        out = self.side.pipeline.memory.residual(name).double().clone()
        for update in self.side.pipeline.pending.values():
            out += update.tensors[name].to_dense().double()
        return out


class PipelineEngine(Engine):
    """A ``fedcomp.sim.virtual.Engine`` over ``Client``s; ``kill_train`` / ``kill_upload``: per-task probability that
    the ClientApp is SIGKILLed before sending (state lost) or after saving its state (reply lost)."""

    def __init__(self, clients: dict[int, Client], seed: int, kill_train: float = 0.0, kill_upload: float = 0.0):
        self.clients, self.rng = clients, random.Random(seed)
        self.kill_train, self.kill_upload = kill_train, kill_upload
        self.events: dict[int, Event] = {}
        self.kills = 0

    def submit(self, task: Task, model: bytes) -> SendReceipt:
        assert decode(model, SPEC).base_version == task.base_version
        client = self.clients[task.client]
        fate = self.rng.random()
        if fate < self.kill_train:
            client.kill_mid_train(task)
            self.kills += 1
            self.events[task.task_id] = FailureEvent(task.task_id, task.client, Outcome.LOST, "NODE_UNAVAILABLE")
        else:
            blob, meta = client.run(task)
            if fate < self.kill_train + self.kill_upload:
                self.kills += 1
                ev: Event = FailureEvent(task.task_id, task.client, Outcome.LOST, "NODE_UNAVAILABLE")
            else:
                ev = ReplyEvent(task.task_id, task.client, blob, meta)
            self.events[task.task_id] = ev
        return SendReceipt(len(model) + 900, 6)

    def gather(self, task_ids: Collection[int]) -> list[Event]:
        return [self.events.pop(t) for t in task_ids if t in self.events]


def drain(proto: ServerProtocol, clients: dict[int, Client], now: float) -> None:
    """End of run: time out what is open, make the held acks durable, deliver every client's last resolutions."""
    proto.expire(now + 1e9)
    proto.commit()
    for cid, c in clients.items():
        task = proto.dispatch(cid, now + 2e9)
        c.side.apply(task.resolutions)


def conservation_error(proto: ServerProtocol, clients: dict[int, Client], tally: Tally) -> float:
    """max over tensors of ``|Σ applied + Σ held - Σ computed| / |Σ computed|`` (float64 norms); also checks
    that the model moved by exactly the tally (float32 tolerance)."""
    worst = 0.0
    for n in SPEC.names:
        applied = tally.total(n)
        assert torch.allclose(-proto.params[n].double(), applied, rtol=1e-4, atol=1e-4), n
        held = sum(c.held(n) for c in clients.values())
        computed = sum(c.computed[n] for c in clients.values())
        worst = max(worst, float((applied + held - computed).norm() / computed.norm()))
    return worst


#: Compressors (with options) whose real payloads seed the hostile-input corpora.
CORPUS_COMPRESSORS = (
    ("dgc+int8", {"density": 0.05}),
    ("qsgd", {}),
    ("topk+int4", {"density": 0.1}),
    ("sign", {}),
    ("identity", {}),
)


def pipeline_blobs(spec: ModelSpec, client: int, seed: int = 1) -> list[bytes]:
    """Valid update blobs from real pipelines, one per ``CORPUS_COMPRESSORS`` entry (seq 1, base 0, ``client``):
    the seeds that tests/test_hostile_server.py and benchmarks/bench_fuzz.py mutate."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for name, opts in CORPUS_COMPRESSORS:
        pipe = build(name, spec, memory="residual", **opts)
        grads = {n: torch.randn(s, generator=gen) * 0.01 for n, s in spec.entries}
        out.append(pipe.send(grads, base_version=0, client_id=client))
    return out


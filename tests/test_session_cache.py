"""A warm node's session cache (``fedcomp.flower.sessioncache``): the process that saved the session last takes
it from memory instead of reading the state dir's file again, and behaves exactly as if it had read the file.

Each rule is checked against the file path itself: the same tasks run once with the cache and once with it
emptied before every task (what the node did before there was a cache), and the replies, errors and saved states
must be the same. The cache must also have been used (its hits counted), or the comparison would prove nothing.
The mod is called directly, as Flower's ClientApp calls a mod, with a fresh Context per task, as the warm worker
gets it (a copy of the node's state without the session), or one Context kept (an in-process node).
"""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Error, Message, Metadata, MetricRecord, RecordDict

from fedcomp import tensortree
from fedcomp.downlink import build_broadcaster
from fedcomp.flower import records
from fedcomp.flower.mod import compression_mod, hand_update
from fedcomp.flower.session import KEPT, STATE_KEY, ClientSession
from fedcomp.flower.sessioncache import MAX_DIRS, SessionCache
from fedcomp.flower.statedir import STATE_FILE, StateDir
from fedcomp.protocol import Outcome, Resolution
from fedcomp.registry import ConfigError
from fedcomp.server.checkpoint import atomic_write
from fedcomp.task.config import Compression

ROOT = Path(__file__).resolve().parents[1]
SHAPES = {"w": (16, 24), "b": (24,), "v": (40,)}
RNG = np.random.default_rng(5)
MODEL = {n: RNG.standard_normal(s).astype(np.float32) for n, s in SHAPES.items()}
DELTAS = [{n: RNG.standard_normal(s).astype(np.float32) for n, s in SHAPES.items()} for _ in range(4)]
SPEC = records.ArrayLayout.of(ArrayRecord({n: Array(a) for n, a in MODEL.items()})).spec()
COMPRESSIONS = {
    "dgc": Compression("dgc", "dgc", "density=0.1 warmup_epochs=3"),  # RNG, epoch, warm-up, momentum
    "topk+int8": Compression("topk+int8", "residual", "density=0.2"),
    "lowrank": Compression("lowrank", "residual", "rank=2"),  # the compressor's own state (Q)
    "qsgd": Compression("qsgd", "residual", ""),  # stochastic rounding: the RNG
}
RUN_A, RUN_B = 0xA1, 0xB2


@pytest.fixture(autouse=True)
def empty_cache():
    KEPT.drop()
    KEPT.hits = KEPT.misses = 0
    yield
    KEPT.drop()


def message(task_id: int, resolutions=(), *, run_key: int = RUN_A, density: float = 0.0,
            compression: Compression = COMPRESSIONS["dgc"], version: int = 0, model_blob: bytes | None = None,
            model: dict[str, np.ndarray] = MODEL) -> Message:
    content = RecordDict({"arrays": ArrayRecord({n: Array(a) for n, a in model.items()}),
                          "config": ConfigRecord({"lr": 0.1})})
    layout = records.ArrayLayout.of(content.array_records["arrays"]) if model_blob is not None else None
    mod_task = records.ModTask(task_id, version, list(resolutions), False, "arrays", compression.to_flat(),
                               layout=layout, density=density, run_key=run_key)
    meta = Metadata(run_id=1, message_id=f"t{task_id}", src_node_id=1, dst_node_id=9, reply_to_message_id="",
                    group_id="0", created_at=time.time(), ttl=60.0, message_type="train")
    return Message(content=records.add_mod_task(content, mod_task, model_blob), metadata=meta)


def trained(task_id: int):
    """The usual train function: the trained weights in the model's ArrayRecord (a task's own delta)."""
    delta = DELTAS[task_id % len(DELTAS)]

    def fn(msg: Message, context: Context) -> Message:
        got = msg.content.array_records["arrays"]
        out = {n: Array(got[n].numpy() - delta[n]) for n in SHAPES}
        return Message(RecordDict({"arrays": ArrayRecord(out), "metrics": MetricRecord({"num-examples": 5})}),
                       reply_to=msg)

    return fn


def raising(msg: Message, context: Context) -> Message:
    raise RuntimeError("the train function failed")


def without_model(msg: Message, context: Context) -> Message:
    """A reply without the model's arrays: a RecordError after the task's resolutions were applied."""
    return Message(RecordDict({"metrics": MetricRecord({"num-examples": 5})}), reply_to=msg)


def handing_wrong(msg: Message, context: Context) -> Message:
    hand_update({"w": torch.zeros(SHAPES["w"])})  # arrays missing: a RecordError
    return Message(RecordDict({"metrics": MetricRecord({"num-examples": 5})}), reply_to=msg)


def error_reply(msg: Message, context: Context) -> Message:
    """An error reply (no exception): the mod saves the session with the task's resolutions applied."""
    return Message(Error(code=0, reason="the train function gave up"), reply_to=msg)


FAILING = {"raises": raising, "no model in the reply": without_model, "hand_update wrong": handing_wrong}


@dataclass
class Node:
    """One node's tasks on ``state_dir``; ``cached=False`` empties the cache before every task (the file path)."""

    state_dir: Path
    cached: bool = True
    keep_context: bool = False
    outcomes: list = field(default_factory=list)
    _ctx: Context | None = None

    def context(self) -> Context:
        """The kept one, or what the worker gets: a copy of the node's state as the SuperNode sends it (the
        session left out: the state dir holds it)."""
        if self._ctx is not None and self.keep_context:
            return self._ctx
        state = RecordDict()
        if self._ctx is not None:
            for key, rec in self._ctx.state.items():
                if key != STATE_KEY:
                    state[key] = copy.deepcopy(rec)
        self._ctx = Context(1, 9, {"partition-id": 0, "state-dir": str(self.state_dir)}, state, {})
        return self._ctx

    def run(self, msg: Message, fn=None):
        if not self.cached:
            KEPT.drop()
        fn = fn or trained(records.read_mod_task(msg.content).task_id)
        try:
            reply = compression_mod(msg, self.context(), fn)
        except Exception as exc:  # noqa: BLE001 (the outcome compared: which error, with which words)
            self.outcomes.append(("raised", type(exc).__name__, str(exc)))
            return None
        if reply.has_error():
            self.outcomes.append(("error reply", reply.error.reason))
            return None
        blob, meta = records.read_mod_reply(reply.content)
        self.outcomes.append(("reply", blob, meta.task_id, meta.seq, meta.pending))
        return meta

    def files(self) -> dict[str, object]:
        """Every session file in the folder, as its state tree without the incarnation (a random id per fresh
        session, the one thing two nodes never share)."""
        out = {}
        for p in sorted(self.state_dir.glob("client-state*.pt")):
            tree = tensortree.loads(p.read_bytes())
            tree.pop("incarnation")
            out[p.name] = tree
        return out


def same_tree(a: object, b: object) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dtype == b.dtype \
            and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same_tree(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(same_tree(x, y) for x, y in zip(a, b, strict=True))
    return a == b


def scenario(node: Node, compression: Compression) -> None:
    """Acks, nacks, densities chosen per task and not, failed tasks, a task that comes again, another run."""
    ack, nack, lost = Outcome.APPLIED, Outcome.STALE, Outcome.LOST
    run = lambda *a, fn=None, **kw: node.run(message(*a, compression=compression, **kw), fn)  # noqa: E731
    run(1)
    run(2, [Resolution(1, 1, ack)], density=0.3)
    run(3)  # density 0 again: the compression's own, not the last task's
    run(4, [Resolution(2, 2, nack)], fn=raising)  # fails after the nack was applied in memory
    run(5, density=0.05)
    run(5, [Resolution(2, 2, ack)])  # comes again: answered with its first update (seq 5) again
    run(6, [Resolution(3, 3, nack)], fn=error_reply)  # saved with the nack applied
    run(7, [Resolution(4, 4, lost)], fn=without_model)
    run(8, [Resolution(5, 5, nack)])
    run(9, run_key=RUN_B)  # another server run: the folder's session set aside
    run(10, [Resolution(9, 1, ack)], run_key=RUN_B)
    run(11, run_key=RUN_A)  # back to the first run's key: its own session again, run B's set aside
    node.run(message(12, run_key=RUN_A, compression=Compression("topk", "residual", "density=0.5")))  # refused
    run(12, run_key=RUN_A)


@pytest.mark.parametrize("keep_context", [False, True], ids=["worker context", "kept context"])
@pytest.mark.parametrize("name", sorted(COMPRESSIONS))
def test_the_cache_behaves_as_reading_the_file(tmp_path, name, keep_context):
    compression = COMPRESSIONS[name]
    with_cache = Node(tmp_path / "cached", keep_context=keep_context)
    scenario(with_cache, compression)
    hits = KEPT.hits
    file_path = Node(tmp_path / "read", cached=False, keep_context=keep_context)
    scenario(file_path, compression)
    assert KEPT.hits == hits >= 5  # the cached node took its session from memory; the other never did
    kinds = [o[0] for o in with_cache.outcomes]
    assert kinds.count("reply") == 10 and kinds.count("raised") == 3 and kinds.count("error reply") == 1
    assert len(with_cache.outcomes) == len(file_path.outcomes)
    for got, want in zip(with_cache.outcomes, file_path.outcomes, strict=True):
        assert same_tree(got, want), (got[:1], want[:1])
    eleven = next(o for o in with_cache.outcomes if o[0] == "reply" and o[2] == 11)
    assert 8 in eleven[4] and eleven[3] > 1  # run A continued: task 8's update still pending, seq goes on
    cached_files, read_files = with_cache.files(), file_path.files()
    assert sorted(cached_files) == sorted(read_files) == [STATE_FILE, f"client-state.run-{RUN_B:x}.pt"]
    for name_ in cached_files:
        assert same_tree(cached_files[name_], read_files[name_]), name_


def downlink_scenario(node: Node) -> None:
    """A compressed downlink (deltas of the public model): the replica kept in ``context.state`` beside the
    session; one task fails after its model was received."""
    compression = Compression("dgc", "dgc", "density=0.1", downlink="delta", downlink_options="density=0.3")
    server = build_broadcaster("delta", SPEC, density=0.3)
    gen = np.random.default_rng(11)
    for task_id in range(1, 8):
        version = task_id // 2  # some tasks share a version: an empty delta
        model = {n: (a + 0.05 * version * gen.standard_normal(a.shape)).astype(np.float32) for n, a in MODEL.items()}
        blob = server.message(9, task_id, {n: torch.from_numpy(a) for n, a in model.items()}, version)
        acks = [Resolution(task_id - 1, task_id - 1, Outcome.APPLIED)] if task_id > 1 else []
        msg = message(task_id, acks, compression=compression, version=version, model_blob=blob, model=model)
        fn = raising if task_id == 4 else None
        if node.run(msg, fn) is None:
            server.on_failure(9, task_id)
        else:
            server.on_reply(9, task_id)


@pytest.mark.parametrize("keep_context", [False, True], ids=["worker context", "kept context"])
def test_a_compressed_downlink_goes_as_with_the_file(tmp_path, keep_context):
    with_cache = Node(tmp_path / "cached", keep_context=keep_context)
    downlink_scenario(with_cache)
    hits = KEPT.hits
    file_path = Node(tmp_path / "read", cached=False, keep_context=keep_context)
    downlink_scenario(file_path)
    assert KEPT.hits == hits >= 4
    assert [o[0] for o in with_cache.outcomes] == ["reply"] * 3 + ["raised"] + ["reply"] * 3
    for got, want in zip(with_cache.outcomes, file_path.outcomes, strict=True):
        assert same_tree(got, want), (got[:1], want[:1])
    assert same_tree(with_cache.files(), file_path.files())
    kept = KEPT.take(StateDir(file_path.state_dir), next(iter(KEPT._entries.values())).fits)
    assert kept is not None and kept._replica is None  # the replica (a model's worth) is not kept with it


def test_a_session_this_process_saved_is_not_read_again(tmp_path, monkeypatch):
    reads = []
    read = StateDir.read
    monkeypatch.setattr(StateDir, "read", lambda self: reads.append(1) or read(self))
    node = Node(tmp_path)
    node.run(message(1))
    meta = node.run(message(2, [Resolution(1, 1, Outcome.APPLIED)]))
    assert reads == [1] and KEPT.hits == 1  # the first task found no file; the second did not read it
    assert meta.seq == 2 and meta.pending == ()
    saved = ClientSession.from_bytes((tmp_path / STATE_FILE).read_bytes(), COMPRESSIONS["dgc"], SPEC,
                                     run_key=RUN_A)
    assert saved.pipeline.next_seq == 3 and list(saved.task_seqs) == [2]  # and the file was still written


@pytest.mark.parametrize("fn", list(FAILING.values()), ids=list(FAILING))
def test_a_task_that_fails_after_loading_leaves_nothing_for_the_next(tmp_path, fn):
    """Task 2 nacks task 1 in memory, then fails: it saves nothing, so task 3 starts from the file, where task 1
    is still pending (it would not be if task 3 got task 2's session)."""
    node = Node(tmp_path)
    node.run(message(1))
    assert node.run(message(2, [Resolution(1, 1, Outcome.STALE)]), fn) is None
    assert node.outcomes[-1][0] == "raised" and len(KEPT) == 0
    meta = node.run(message(3))
    assert meta.seq == 2 and meta.pending == (1,)


def test_an_error_reply_keeps_the_session_it_saved(tmp_path):
    node = Node(tmp_path)
    node.run(message(1))
    node.run(message(2, [Resolution(1, 1, Outcome.STALE)]), error_reply)  # saved: task 1 nacked
    hits = KEPT.hits
    meta = node.run(message(3))
    assert KEPT.hits == hits + 1 and meta.seq == 2 and meta.pending == ()


def _bumped(path: Path, steps: int) -> bytes:
    session = ClientSession.from_bytes(path.read_bytes(), COMPRESSIONS["dgc"], SPEC, run_key=RUN_A)
    session.pipeline.next_seq += steps
    return session.to_bytes()


def test_a_file_written_by_another_process_is_read(tmp_path):
    """A task run beside the worker (its own process) saved the session after this process did: this process
    must continue from that file, not from the session it holds."""
    node = Node(tmp_path)
    node.run(message(1))
    script = (
        "import json, sys\n"
        "from flwr.app import Context, RecordDict\n"
        "from fedcomp.flower.session import ClientSession\n"
        "from fedcomp.spec import ModelSpec\n"
        "from fedcomp.task.config import Compression\n"
        "spec = ModelSpec(tuple((n, tuple(s)) for n, s in json.loads(sys.argv[2])))\n"
        "ctx = Context(1, 9, {}, RecordDict(), {})\n"
        "s = ClientSession.load(ctx, Compression.from_flat(json.loads(sys.argv[3])), spec, sys.argv[1],\n"
        "                       run_key=int(sys.argv[4]), dir_first=True)\n"
        "s.pipeline.next_seq += 10\n"
        "s.save(ctx, sys.argv[1])\n"
    )
    args = [str(tmp_path), json.dumps(SPEC.entries), json.dumps(COMPRESSIONS["dgc"].to_flat()), str(RUN_A)]
    subprocess.run([sys.executable, "-c", script, *args], cwd=ROOT, check=True, timeout=300)
    meta = node.run(message(2))
    assert meta.seq == 12 and meta.pending == (1,)  # the other process's session: seq 2 + 10, task 1 pending
    assert KEPT.hits == 0


def test_a_replaced_file_of_the_same_size_and_time_is_read(tmp_path):
    """Another writer's file with the size and modification time of this process's (a copy put back with its
    times): only the inode and the change time tell it apart, and they do."""
    node = Node(tmp_path)
    node.run(message(1))
    path = tmp_path / STATE_FILE
    before = path.stat()
    data = _bumped(path, 5)
    assert len(data) == before.st_size  # the same size: the size alone would not tell
    atomic_write(path, data)
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))
    assert path.stat().st_mtime_ns == before.st_mtime_ns
    meta = node.run(message(2))
    assert meta.seq == 7 and KEPT.hits == 0


def test_another_run_or_compression_goes_the_file_way(tmp_path):
    node = Node(tmp_path)
    node.run(message(1))
    meta = node.run(message(1, run_key=RUN_B))
    assert meta.seq == 1 and (tmp_path / f"client-state.run-{RUN_A:x}.pt").exists() and KEPT.hits == 0
    node.run(message(2, compression=COMPRESSIONS["qsgd"], run_key=RUN_B))
    assert node.outcomes[-1][0] == "raised" and node.outcomes[-1][1] == ConfigError.__name__
    assert KEPT.hits == 0 and len(KEPT) == 0  # the refused task took the entry: the next one reads the file
    assert node.run(message(2, run_key=RUN_B)).seq == 2 and KEPT.hits == 0
    assert node.run(message(3, run_key=RUN_B)).seq == 3 and KEPT.hits == 1


def test_without_a_state_dir_nothing_is_cached():
    ctx = Context(1, 9, {"partition-id": 0}, RecordDict(), {})
    for task_id in (1, 2, 3):
        reply = compression_mod(message(task_id), ctx, trained(task_id))
        assert reply.has_content()
    assert len(KEPT) == 0 and KEPT.hits == KEPT.misses == 0
    assert records.read_mod_reply(reply.content)[1].seq == 3 and STATE_KEY in ctx.state.array_records


def test_one_session_per_state_dir(tmp_path):
    for task_id in (1, 2, 3):
        for name in ("a", "b"):
            Node(tmp_path / name).run(message(task_id))
    assert len(KEPT) == 2 and KEPT.hits == 4
    for i in range(MAX_DIRS + 2):
        Node(tmp_path / f"d{i}").run(message(1))
    assert len(KEPT) == MAX_DIRS


def test_the_cache_hands_an_entry_out_once_and_only_for_its_file(tmp_path):
    cache: SessionCache[str] = SessionCache(max_dirs=2)
    folder = StateDir(tmp_path / "s")
    cache.keep(folder, folder.write(b"one"), "fits", "first")
    cache.keep(folder, folder.write(b"two"), "fits", "second")  # one entry per folder: the latest
    (tmp_path / "link").symlink_to(tmp_path / "s")
    assert len(cache) == 1 and cache.take(StateDir(tmp_path / "link"), "fits") == "second"  # the same folder
    assert cache.take(folder, "fits") is None  # taken
    cache.keep(folder, folder.write(b"three"), "fits", "third")
    assert cache.take(folder, "other") is None and cache.take(folder, "fits") is None  # dropped on a miss
    cache.keep(folder, folder.write(b"four"), "fits", "fourth")
    folder.write(b"four")  # another write, the same bytes
    assert cache.take(folder, "fits") is None
    cache.keep(folder, None, "fits", "fifth")  # no identity: nothing kept
    assert len(cache) == 0

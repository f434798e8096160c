"""``compression_mod`` as a node's one client path: ``hand_update`` (the update as torch tensors, no ArrayRecord),
the node's ``state-dir`` (the session kept there too, read first, one server run's), and a task that comes again.

The mod is called directly, as Flower's ClientApp calls a mod, on a task made with ``records.add_mod_task`` (what
``Compressed`` sends); the train function is a plain function of the test.
"""

from __future__ import annotations

import os
import tempfile
import time
from dataclasses import dataclass, field

import numpy as np
import pytest
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Message, Metadata, MetricRecord, RecordDict
from hypothesis import given, settings
from hypothesis import strategies as st

from fedcomp.flower import records
from fedcomp.flower.mod import compression_mod, hand_update
from fedcomp.flower.session import KEPT, STATE_KEY, ClientSession
from fedcomp.flower.statedir import STATE_FILE
from fedcomp.protocol import Outcome, Resolution
from fedcomp.task.config import Compression
from fedcomp.wire import decode

COMPRESSION = Compression("topk", "residual", "density=0.25")
SHAPES = {"w": (4, 8), "b": (8,)}
RNG = np.random.default_rng(3)
MODEL = {n: RNG.standard_normal(s).astype(np.float32) for n, s in SHAPES.items()}
DELTA = {n: RNG.standard_normal(s).astype(np.float32) for n, s in SHAPES.items()}
SPEC = records.ArrayLayout.of(ArrayRecord({n: Array(a) for n, a in MODEL.items()})).spec()


def task(task_id: int, resolutions=(), run_key: int = 0) -> Message:
    content = RecordDict({"arrays": ArrayRecord({n: Array(a) for n, a in MODEL.items()}),
                          "config": ConfigRecord({"lr": 0.1})})
    mod_task = records.ModTask(task_id, 0, list(resolutions), False, "arrays", COMPRESSION.to_flat(),
                               run_key=run_key)
    meta = Metadata(run_id=1, message_id=f"t{task_id}", src_node_id=1, dst_node_id=9, reply_to_message_id="",
                    group_id="0", created_at=time.time(), ttl=60.0, message_type="train")
    return Message(content=records.add_mod_task(content, mod_task, None), metadata=meta)


def replying_trained(msg: Message, context: Context) -> Message:
    """The usual train function: the trained weights in the model's ArrayRecord."""
    got = msg.content.array_records["arrays"]
    trained = {n: Array(got[n].numpy() - DELTA[n]) for n in SHAPES}
    return Message(RecordDict({"arrays": ArrayRecord(trained), "metrics": MetricRecord({"num-examples": 5})}),
                   reply_to=msg)


def handing(msg: Message, context: Context) -> Message:
    """The same training, the update handed as torch tensors; the reply carries metrics only."""
    hand_update({n: torch.from_numpy(DELTA[n].copy()) for n in SHAPES}, steps=3, steps_per_epoch=6.0)
    return Message(RecordDict({"metrics": MetricRecord({"num-examples": 5})}), reply_to=msg)


def context(state_dir=None) -> Context:
    node = {"partition-id": 0} | ({"state-dir": str(state_dir)} if state_dir else {})
    return Context(1, 9, node, RecordDict(), {})


def reply_of(msg: Message, ctx: Context, fn=replying_trained):
    reply = compression_mod(msg, ctx, fn)
    assert reply.has_content(), reply.error
    return records.read_mod_reply(reply.content), reply


def session_in(ctx: Context) -> ClientSession:
    return ClientSession.from_bytes(bytes(ctx.state.array_records[STATE_KEY]["state"].data), COMPRESSION, SPEC)


def test_a_handed_update_sends_what_the_trained_arrays_would():
    plain_ctx, handed_ctx = context(), context()
    for task_id in (1, 2, 3):
        (blob_a, meta_a), _ = reply_of(task(task_id), plain_ctx)
        (blob_b, meta_b), reply = reply_of(task(task_id), handed_ctx, handing)
        a, b = decode(blob_a, SPEC).to_dense(), decode(blob_b, SPEC).to_dense()
        assert meta_a.seq == meta_b.seq == task_id and a.keys() == b.keys() == SHAPES.keys()
        for n in SHAPES:  # the same coordinates kept, the same values but float32 rounding of received - trained
            assert torch.equal(a[n] != 0, b[n] != 0) and torch.allclose(a[n], b[n], rtol=1e-5, atol=1e-6)
        assert "arrays" not in reply.content.array_records and reply.content.metric_records["metrics"]
    assert session_in(handed_ctx).steps_done == 9 and session_in(plain_ctx).steps_done == 3  # steps it was told


def test_hand_update_outside_the_mod_and_with_the_wrong_arrays_is_an_error():
    with pytest.raises(RuntimeError, match="under compression_mod"):
        hand_update({"w": torch.zeros(4, 8)})

    def wrong(msg, ctx):
        hand_update({"w": torch.zeros(4, 8)})
        return Message(RecordDict(), reply_to=msg)

    with pytest.raises(records.RecordError, match=r"hand_update got no arrays \[.b.\] of the model"):
        compression_mod(task(1), context(), wrong)


@pytest.mark.parametrize("case, words", [
    ("transposed", "w of shape (8, 4), the model's is (4, 8)"),
    ("missing", "no arrays ['b'] of the model"),
    ("prefixed", "no arrays ['b', 'w'] of the model"),
    ("extra", "has arrays ['momentum.w'] the server did not send"),  # it would have been dropped from the reply
])
def test_trained_arrays_of_another_shape_or_name_fail_the_task_and_are_never_reshaped(case, words):
    """A reply whose model arrays do not match the model the task sent is an error naming them (a transposed
    matrix of the same size used to be reshaped into the model's and sent); the session is untouched."""
    def wrong(msg, ctx):
        trained = {n: got.numpy() - DELTA[n] for n, got in msg.content.array_records["arrays"].items()}
        trained = {"transposed": {**trained, "w": trained["w"].T.copy()}, "missing": {"w": trained["w"]},
                   "prefixed": {f"module.{n}": a for n, a in trained.items()},
                   "extra": {**trained, "momentum.w": trained["w"] * 0}}[case]
        return Message(RecordDict({"arrays": ArrayRecord({n: Array(a) for n, a in trained.items()}),
                                   "metrics": MetricRecord({"num-examples": 5})}), reply_to=msg)

    ctx = context()
    with pytest.raises(records.RecordError) as info:
        compression_mod(task(1), ctx, wrong)
    assert words in str(info.value)
    (_, meta), _ = reply_of(task(1), ctx)  # the task again, trained as it should be: the first update of the session
    assert meta.seq == 1 and meta.pending == ()


def test_a_handed_update_of_another_shape_is_an_error():
    def wrong(msg, ctx):
        hand_update({"w": torch.zeros(8, 4), "b": torch.zeros(8)})
        return Message(RecordDict(), reply_to=msg)

    with pytest.raises(records.RecordError, match=r"hand_update got w of shape \(8, 4\)"):
        compression_mod(task(1), context(), wrong)


@pytest.mark.parametrize("kwargs, error", [
    ({"steps": -3}, ValueError), ({"steps": 2**63}, ValueError), ({"steps": 2.5}, ValueError),
    ({"steps": True}, ValueError), ({"steps_per_epoch": float("inf")}, ValueError),
    ({"steps_per_epoch": float("nan")}, ValueError), ({"steps_per_epoch": -1.0}, ValueError),
    ({"as_numpy": True}, TypeError),
])
def test_a_bad_hand_update_fails_its_own_call_and_leaves_the_session_whole(kwargs, error):
    """``steps`` went into the saved session unchecked: -3 or 2**63 saved a ``steps_done`` no later task could
    load, so every later task of the node failed and its pending update was never resolved."""
    as_numpy = kwargs.pop("as_numpy", False)

    def bad(msg, ctx):
        update = {n: (DELTA[n] if as_numpy else torch.from_numpy(DELTA[n].copy())) for n in SHAPES}
        hand_update(update, **kwargs)
        return Message(RecordDict({"metrics": MetricRecord({"num-examples": 5})}), reply_to=msg)

    ctx = context()
    reply_of(task(1), ctx, handing)
    with pytest.raises(error, match="hand_update"):
        compression_mod(task(2), ctx, bad)
    (_, meta), _ = reply_of(task(3), ctx, handing)  # the node goes on: its session loads, its seqs continue
    assert meta.seq == 2 and session_in(ctx).steps_done == 6


@pytest.mark.parametrize("bound", [0.5, 2.0])
def test_the_servers_norm_bound_reaches_the_node_and_bounds_what_it_sends(bound):
    """A task carries the server's ``max_update_norm``; the node sends at most that norm and keeps the rest in its
    residual (a rejected update went back into the residual and was over the bound again, task after task)."""
    def bounded(task_id):
        msg = task(task_id)
        cfg = msg.content.config_records[records.CONTROL]
        cfg[records.MAX_NORM] = bound
        assert records.read_mod_task(msg.content).max_norm == bound
        return msg

    ctx, free_ctx = context(), context()
    for task_id in (1, 2, 3):
        (blob, _), _ = reply_of(bounded(task_id), ctx)
        (free, _), _ = reply_of(task(task_id), free_ctx)
        norm = torch.linalg.vector_norm(torch.cat([t.reshape(-1) for t in decode(blob, SPEC).to_dense().values()]))
        free_norm = torch.linalg.vector_norm(torch.cat([t.reshape(-1) for t in decode(free, SPEC).to_dense().values()]))
        assert float(norm) <= bound and float(free_norm) > bound  # the bound did the work
    pipe = session_in(ctx).pipeline
    assert pipe.totals is not None and all(torch.isfinite(t).all() for t in pipe.totals.outstanding.values())


@pytest.mark.parametrize("value", [-1.0, float("inf"), float("nan"), "2", True])
def test_a_bad_norm_bound_in_a_task_is_a_record_error(value):
    msg = task(1)
    msg.content.config_records[records.CONTROL][records.MAX_NORM] = value
    with pytest.raises(records.RecordError, match="max-norm"):
        records.read_mod_task(msg.content)


def test_the_state_dir_keeps_the_session_when_the_context_is_lost(tmp_path):
    reply_of(task(1), context(tmp_path))
    assert (tmp_path / STATE_FILE).stat().st_mode & 0o077 == 0  # owner-only
    (_, meta), _ = reply_of(task(2, [Resolution(1, 1, Outcome.APPLIED)]), context(tmp_path))  # empty state
    assert meta.seq == 2 and meta.pending == ()  # continued from the folder; task 1's update acked


def test_a_task_that_comes_again_is_answered_with_its_first_update(tmp_path):
    """Task 1 again (its first reply lost, or the task delivered twice) = task 1's update again, the same bytes and
    seq, still pending: the server applies seq 1 once, whichever reply it reads, and its ack reaches it. (Restoring
    it and sending a new one applied its mass twice when the first reply had reached the server: the ack of seq 1
    no longer matched, the task was nacked, and the new update, holding the first's mass, came back.)"""
    ctx = context(tmp_path / "a")
    (first, meta_first), _ = reply_of(task(1), ctx)
    (again, meta), _ = reply_of(task(1), ctx)
    assert again == first and meta.seq == meta_first.seq == 1 and meta.pending == ()
    pipe = session_in(ctx).pipeline
    assert sorted(pipe.pending) == [1] and pipe.next_seq == 2
    (_, meta_next), _ = reply_of(task(2, [Resolution(1, 1, Outcome.APPLIED)]), ctx)  # the ack of seq 1 counts
    assert meta_next.seq == 2 and meta_next.pending == () and sorted(session_in(ctx).pipeline.pending) == [2]


def test_a_task_of_another_server_run_sets_the_folders_session_aside(tmp_path):
    reply_of(task(1, run_key=0xA), context(tmp_path))
    reply_of(task(2, run_key=0xA), context(tmp_path))
    (_, meta), _ = reply_of(task(1, run_key=0xB), context(tmp_path))
    assert meta.seq == 1  # a fresh session for run B
    assert (tmp_path / "client-state.run-a.pt").exists()


def files(folder) -> list[str]:
    return sorted(p.name for p in folder.glob("client-state*"))


@pytest.mark.parametrize("cached", [True, False], ids=["warm", "cold"])
def test_runs_served_in_turn_each_continue_their_own_session(tmp_path, cached):
    """Runs A and B on one node, one task at a time in turn: each continues its own session (seq, incarnation,
    pending updates), whether the process kept the session it saved (warm) or reads the files (cold). Run A's
    session used to stay set aside: A started afresh and its pending update could never be restored."""
    def run(*args, **kw):
        if not cached:
            KEPT.drop()
        return reply_of(task(*args, **kw), context(tmp_path))[0][1]

    a1, a2 = run(1, run_key=0xA), run(2, run_key=0xA)
    b1 = run(1, run_key=0xB)
    assert (b1.seq, b1.pending) == (1, ()) and b1.incarnation != a1.incarnation
    assert files(tmp_path) == [STATE_FILE, "client-state.run-a.pt"]
    a3 = run(3, [Resolution(1, 1, Outcome.LOST)], run_key=0xA)  # task 1's nack reaches run A's update
    assert (a3.seq, a3.pending, a3.incarnation) == (3, (2,), a2.incarnation)
    assert files(tmp_path) == [STATE_FILE, "client-state.run-b.pt"]
    b2 = run(2, run_key=0xB)
    assert (b2.seq, b2.pending, b2.incarnation) == (2, (1,), b1.incarnation)
    a4 = run(4, [Resolution(2, 2, Outcome.APPLIED), Resolution(3, 3, Outcome.APPLIED)], run_key=0xA)
    assert (a4.seq, a4.pending, a4.incarnation) == (4, (), a1.incarnation)
    assert files(tmp_path) == [STATE_FILE, "client-state.run-b.pt"]


def test_a_task_without_a_run_key_never_continues_a_keyed_runs_session(tmp_path):
    """A task without a run key (a server from before run keys) is a run of its own: it sets run A's session aside
    and starts its own, and neither takes the other's pending update (it used to continue A's session, and its
    task 1 handed A's pending update 1 back to the residual as its own)."""
    (_, a1), _ = reply_of(task(1, run_key=0xA), context(tmp_path))
    (_, z1), _ = reply_of(task(1), context(tmp_path))
    assert (z1.seq, z1.pending) == (1, ()) and z1.incarnation != a1.incarnation
    assert files(tmp_path) == [STATE_FILE, "client-state.run-a.pt"]
    (_, a2), _ = reply_of(task(2, [Resolution(1, 1, Outcome.LOST)], run_key=0xA), context(tmp_path))
    assert (a2.seq, a2.pending, a2.incarnation) == (2, (), a1.incarnation)  # A's update 1 was still there to nack
    (_, z2), _ = reply_of(task(2), context(tmp_path))
    assert (z2.seq, z2.pending, z2.incarnation) == (2, (1,), z1.incarnation)
    assert files(tmp_path) == [STATE_FILE, "client-state.run-a.pt"]


def test_a_keyed_run_never_continues_a_session_that_served_keyless_tasks(tmp_path):
    (_, z1), _ = reply_of(task(1), context(tmp_path))
    (_, a1), _ = reply_of(task(1, run_key=0xA), context(tmp_path))
    assert (a1.seq, a1.pending) == (1, ()) and a1.incarnation != z1.incarnation
    assert files(tmp_path) == [STATE_FILE, "client-state.run-0.pt"]
    (_, z2), _ = reply_of(task(2), context(tmp_path))
    assert (z2.seq, z2.pending, z2.incarnation) == (2, (1,), z1.incarnation)


def test_with_no_current_file_each_run_takes_its_own_set_aside_session(tmp_path):
    """What a crash between ``StateDir.take_back``'s two renames leaves (both sessions set aside, none current):
    each run's next task still continues its own."""
    (_, a1), _ = reply_of(task(1, run_key=0xA), context(tmp_path))
    (_, b1), _ = reply_of(task(1, run_key=0xB), context(tmp_path))
    os.replace(tmp_path / STATE_FILE, tmp_path / "client-state.run-b.pt")
    (_, a2), _ = reply_of(task(2, run_key=0xA), context(tmp_path))
    (_, b2), _ = reply_of(task(2, run_key=0xB), context(tmp_path))
    assert (a2.seq, a2.pending, a2.incarnation) == (2, (1,), a1.incarnation)
    assert (b2.seq, b2.pending, b2.incarnation) == (2, (1,), b1.incarnation)


@dataclass
class ServerRun:
    """What one server run knows of this node: its tasks' updates still unresolved, those it applied."""

    tasks: int = 0
    pending: dict[int, int] = field(default_factory=dict)  # task id -> seq
    updates: dict[int, dict[str, torch.Tensor]] = field(default_factory=dict)  # task id -> the update (dense)
    applied: dict[str, torch.Tensor] = field(default_factory=lambda: {n: torch.zeros(s) for n, s in SHAPES.items()})
    incarnation: int = 0


RUNS = (0xA, 0xB, 0)  # two keyed runs and one without a key


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(RUNS), st.sampled_from(["none", "ack", "nack"]), st.booleans()),
                min_size=1, max_size=12))
def test_interleaved_runs_on_one_state_dir_keep_their_pending_updates_and_mass(steps):
    """Tasks of 2-3 server runs in any order on one state dir, each resolving its run's oldest pending update or
    not, the process's kept session dropped before some: every run continues its own session (incarnation, seq,
    the pending task ids its replies list), and at the end Σ applied + residual + Σ pending = Σ computed per run."""
    servers = {key: ServerRun() for key in RUNS}
    with tempfile.TemporaryDirectory() as folder:
        for key, outcome, cold in steps:
            if cold:
                KEPT.drop()
            run = servers[key]
            resolutions = []
            if outcome != "none" and run.pending:
                task_id, seq = min(run.pending.items())
                del run.pending[task_id]
                resolutions = [Resolution(task_id, seq, Outcome.APPLIED if outcome == "ack" else Outcome.LOST)]
                if outcome == "ack":
                    run.applied = {n: run.applied[n] + run.updates[task_id][n] for n in SHAPES}
            run.tasks += 1
            (blob, meta), _ = reply_of(task(run.tasks, resolutions, run_key=key), context(folder))
            assert meta.pending == tuple(sorted(run.pending)) and meta.seq == run.tasks
            assert run.incarnation in (0, meta.incarnation)
            run.incarnation, run.pending[run.tasks] = meta.incarnation, meta.seq
            run.updates[run.tasks] = decode(blob, SPEC).to_dense()
        for key, run in servers.items():
            if run.tasks:
                _check_conserved(run, ClientSession.load(Context(1, 9, {}, RecordDict(), {}), COMPRESSION, SPEC,
                                                         folder, run_key=key, dir_first=True))


def _check_conserved(run: ServerRun, session: ClientSession) -> None:
    assert session.incarnation == run.incarnation and session.pending_tasks() == tuple(sorted(run.pending))
    for n in SHAPES:
        pending = sum((session.pipeline.pending[seq].tensors[n].to_dense() for seq in run.pending.values()),
                      torch.zeros(SHAPES[n]))
        held = run.applied[n] + session.pipeline.memory.residual(n) + pending
        assert torch.allclose(held, run.tasks * torch.from_numpy(DELTA[n]), atol=1e-5), n


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA device"))])
def test_handed_tensors_reach_the_send_step_as_they_are(device, monkeypatch):
    """The very tensors the train function handed (no copy through an ArrayRecord, on their device) are what the
    session sends, and the pipeline's error-feedback state is on that device after it did."""
    seen = {}
    send = ClientSession.send

    def spy(self, task_id, tensors, *args, **kw):
        out = send(self, task_id, tensors, *args, **kw)
        seen.update(tensors=dict(tensors), memory=[t.device.type for t in _tensors(self.pipeline.memory)])
        return out

    monkeypatch.setattr(ClientSession, "send", spy)
    handed = {n: torch.from_numpy(DELTA[n].copy()).to(device) for n in SHAPES}

    def train_on_device(msg, ctx):
        hand_update(handed)
        return Message(RecordDict({"metrics": MetricRecord({"num-examples": 5})}), reply_to=msg)

    reply_of(task(1), context(), train_on_device)
    assert all(seen["tensors"][n] is handed[n] for n in SHAPES)
    assert set(seen["memory"]) <= {device} and seen["memory"]


def _tensors(memory) -> list[torch.Tensor]:
    out, stack = [], [memory.state_dict()]
    while stack:
        x = stack.pop()
        if isinstance(x, torch.Tensor):
            out.append(x)
        elif isinstance(x, dict):
            stack.extend(x.values())
        elif isinstance(x, (list, tuple)):
            stack.extend(x)
    return out


def test_a_nack_of_another_seq_leaves_the_update_pending_and_the_right_one_restores_it():
    """A resolution naming task 1 with a seq it never sent is ignored: task 1's update stays pending and listed in
    the resync request; the nack with its seq then puts it back into the residual."""
    ctx = context()
    reply_of(task(1), ctx)
    (_, m2), _ = reply_of(task(2, [Resolution(1, 99, Outcome.LOST)]), ctx)
    s = session_in(ctx)
    assert m2.pending == (1,) and s.task_seqs == {1: 1, 2: 2} and sorted(s.pipeline.pending) == [1, 2]
    (_, m3), _ = reply_of(task(3, [Resolution(1, 1, Outcome.LOST)]), ctx)
    s = session_in(ctx)
    assert m3.pending == (2,) and sorted(s.pipeline.pending) == [2, 3] and 1 not in s.task_seqs

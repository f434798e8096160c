"""A node that keeps its ``clients.work.Bench`` in one process (the simulator's warm nodes) answers exactly as a
node that rebuilds everything from ``context.state`` per task, and reloads when ``context.state`` is not the
record it saved."""

from __future__ import annotations

from flwr.app import Array, ArrayRecord, Context, RecordDict

from clients.app import handle
from clients.work import Bench
from fedcomp.flower import records
from fedcomp.flower.session import STATE_KEY, ClientSession
from fedcomp.protocol import Outcome, Resolution
from fedcomp.server.loops import encode_model
from fedcomp.task.config import RunConfig
from tests.clientkit import BASE, NODE_ID, spec_and_model

RUN = {**BASE, "compressor": "dgc+int8", "memory": "dgc", "downlink": "int8", "compressor-options": "density=0.05"}
RESOLUTIONS = [[], [Resolution(1, 1, Outcome.LOST)], [Resolution(2, 2, Outcome.APPLIED)], []]


def _context() -> Context:
    """A node whose state starts as a fresh session with a fixed incarnation (it travels in every reply)."""
    ctx = Context(1, NODE_ID, {"partition-id": 0, "num-partitions": 2}, RecordDict(), dict(RUN))
    run = RunConfig.from_flower(RUN)
    session = ClientSession.fresh(run.compression, spec_and_model(run)[0])
    session.incarnation = 7
    session.save(ctx)
    return ctx


def _tasks():
    run = RunConfig.from_flower(RUN)
    spec, model = spec_and_model(run)
    blob = encode_model(dict(model.named_parameters()), spec, 0)
    for task_id, res in enumerate(RESOLUTIONS, start=1):
        yield task_id, records.task_content(task_id, 0, 0, res, blob)


def _state(ctx: Context) -> bytes:
    return bytes(ctx.state.array_records[STATE_KEY]["state"].data)


def test_a_kept_bench_answers_like_a_fresh_one_and_keeps_its_session():
    fresh_ctx, kept_ctx, bench = _context(), _context(), Bench()
    sessions = []
    for _, content in _tasks():
        a = records.read_reply(handle("train", content, fresh_ctx))
        b = records.read_reply(handle("train", content, kept_ctx, bench))
        assert a[0] == b[0] and a[1] == b[1]  # the same blob and reply meta (seq, pending tasks)
        assert _state(fresh_ctx) == _state(kept_ctx)  # and the same saved state, byte for byte
        sessions.append(bench.session)
    assert all(s is sessions[0] for s in sessions)  # never reloaded: the context held what the bench saved


def test_a_kept_bench_reloads_when_the_context_holds_another_record():
    fresh_ctx, kept_ctx, bench = _context(), _context(), Bench()
    for task_id, content in _tasks():
        if task_id == 3:  # the state as it was, in a record the bench did not write (e.g. restored by a restart)
            data = _state(kept_ctx)
            arr = Array(dtype="uint8", shape=(len(data),), stype="fedcomp/client-state", data=data)
            kept_ctx.state[STATE_KEY] = ArrayRecord({"state": arr})
            before = bench.session
        a = records.read_reply(handle("train", content, fresh_ctx))
        b = records.read_reply(handle("train", content, kept_ctx, bench))
        assert a[0] == b[0] and _state(fresh_ctx) == _state(kept_ctx)
        if task_id == 3:
            assert bench.session is not before
    run = RunConfig.from_flower(RUN)
    spec, _ = spec_and_model(run)
    assert ClientSession.from_bytes(_state(kept_ctx), run.compression, spec).pipeline.next_seq == len(RESOLUTIONS) + 1


def test_the_public_kept_node_answers_like_a_fresh_app_and_keeps_its_session():
    """``clients.app.KeptNode`` (what a simulator's warm node runs) is the kept bench behind a ClientApp call."""
    from flwr.app import Message, Metadata

    from clients.app import KeptNode, app

    fresh_ctx, kept_ctx, node = _context(), _context(), KeptNode()
    sessions = []
    for task_id, content in _tasks():
        meta = Metadata(run_id=1, message_id=f"t{task_id}", src_node_id=1, dst_node_id=NODE_ID,
                        reply_to_message_id="", group_id="0", created_at=0.0, ttl=3600.0, message_type="train")
        a = records.read_reply(app(Message(content=content, metadata=meta), fresh_ctx).content)
        b = records.read_reply(node(Message(content=content, metadata=meta), kept_ctx).content)
        assert a[0] == b[0] and a[1] == b[1] and _state(fresh_ctx) == _state(kept_ctx)
        sessions.append(node.bench.session)
    assert all(s is sessions[0] for s in sessions)

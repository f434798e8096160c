"""A node that keeps its data and model in one process between tasks (``clients.task.BENCHES``: a warm worker,
the simulator) answers exactly as a node that rebuilds them for every task (a cold ``flwr-clientapp``): the
same blob, the same reply meta and the same saved client state, byte for byte."""

from __future__ import annotations

from flwr.app import Context, Message, RecordDict

from clients import task as product_task
from clients.app import app
from fedcomp.flower import records
from fedcomp.flower.session import STATE_KEY, ClientSession
from fedcomp.protocol import Outcome, Resolution
from fedcomp.server.loops import encode_model
from fedcomp.task.config import RunConfig
from tests.clientkit import BASE, NODE_ID, spec_and_model, train_message

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


def _messages():
    run = RunConfig.from_flower(RUN)
    spec, model = spec_and_model(run)
    blob = encode_model(dict(model.named_parameters()), spec, 0)
    for task_id, res in enumerate(RESOLUTIONS, start=1):
        yield lambda task_id=task_id, res=res: train_message(task_id, res, blob, run, spec)


def _state(ctx: Context) -> bytes:
    return bytes(ctx.state.array_records[STATE_KEY]["state"].data)


def test_a_kept_bench_answers_like_a_fresh_one(monkeypatch):
    fresh_ctx, kept_ctx = _context(), _context()
    monkeypatch.setattr(product_task, "BENCHES", {})
    benches = []
    for message in _messages():
        kept = app(message(), kept_ctx)
        benches.append(product_task.BENCHES[NODE_ID])
        product_task.BENCHES.pop(NODE_ID)  # a cold node: data and model made again for this task
        fresh = app(message(), fresh_ctx)
        product_task.BENCHES[NODE_ID] = benches[-1]
        assert isinstance(kept, Message) and kept.has_content() and fresh.has_content()
        assert records.read_mod_reply(kept.content) == records.read_mod_reply(fresh.content)  # blob, seq, pending
        assert _state(fresh_ctx) == _state(kept_ctx)  # and the same saved state, byte for byte
    assert all(b is benches[0] for b in benches)  # the kept node never rebuilt its bench
    assert benches[0].model is not None
    run = RunConfig.from_flower(RUN)
    spec, _ = spec_and_model(run)
    assert ClientSession.from_bytes(_state(kept_ctx), run.compression, spec).pipeline.next_seq == len(RESOLUTIONS) + 1


def test_a_train_function_sees_its_fedcomp_task_and_nothing_outside_it():
    """``current_task()`` inside the train function is the task the server sent (the product's seeds its batches
    with its id); outside a train function, and after it, there is none."""
    import torch
    from flwr.app import MetricRecord
    from flwr.clientapp import ClientApp

    from fedcomp.flower import compression_mod, current_task, hand_update

    seen = []
    app_ = ClientApp(mods=[compression_mod])

    @app_.train()
    def train(msg, context):
        seen.append(current_task())
        hand_update({"net.1.weight": torch.zeros(128, 64), "net.1.bias": torch.zeros(128),
                     "net.3.weight": torch.zeros(10, 128), "net.3.bias": torch.zeros(10)})
        return Message(RecordDict({"metrics": MetricRecord({"num-examples": 1})}), reply_to=msg)

    messages = list(_messages())
    reply = app_(messages[2](), _context())
    assert reply.has_content(), reply.error
    assert [t.task_id for t in seen] == [3] and seen[0].base_version == 0
    assert current_task() is None

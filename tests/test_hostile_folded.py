"""What a server folds into fedcomp's record of a task (``records.FOLDED``) is data, never code or another run's
state: a malformed field, an unknown kind, or a record name the message already has fails the task with a
``RecordError`` before the session is loaded (the client's state is untouched, nothing of the JSON is executed);
and a client that folds garbage into its reply is a counted rejection on the server, whose run goes on."""

from __future__ import annotations

import json

import pytest
from flwr.app import Context, RecordDict

from clients.app import app
from fedcomp.flower import records
from fedcomp.flower.session import STATE_KEY
from fedcomp.server.loops import encode_model
from fedcomp.task.config import RunConfig
from tests.clientkit import BASE, NODE_ID, run_beside_a_hostile_node, spec_and_model, train_message

RUN = {**BASE, "compressor": "dgc", "memory": "residual"}


def _context() -> Context:
    return Context(1, NODE_ID, {"partition-id": 0, "num-partitions": 2}, RecordDict(), dict(RUN))


@pytest.mark.parametrize("folded", [
    "{not json",
    json.dumps({"code": {"config": {"x": "__import__('os').system('true')"}}}),  # an unknown kind
    json.dumps({"config": {records.CONTROL: {"task-id": 99}}}),  # fedcomp's own record: taken
    json.dumps({"config": {"arrays": {"x": 1}}}),  # the model's record, rebuilt from its blob: taken too
    json.dumps({"config": {"config": {"server-round": 1}, "x": "not a record"}}),
    json.dumps({"metric": {"m": {"v": "text"}}}),  # a MetricRecord holds numbers only
])
def test_a_hostile_folded_task_fails_before_the_session_is_touched(folded):
    run = RunConfig.from_flower(RUN)
    spec, model = spec_and_model(run)
    msg = train_message(1, [], encode_model(dict(model.named_parameters()), spec, 0), run, spec)
    msg.content.config_records[records.CONTROL][records.FOLDED] = folded
    ctx = _context()
    with pytest.raises(records.RecordError, match="records"):
        app(msg, ctx)
    assert STATE_KEY not in ctx.state  # no session was made, loaded or saved for this task
    good = train_message(2, [], encode_model(dict(model.named_parameters()), spec, 0), run, spec)
    reply = app(good, ctx)  # the node goes on with the next task
    assert reply.has_content() and records.read_mod_reply(reply.content)[1].seq == 1


@pytest.mark.parametrize("mode", ["async", "sync"])
def test_a_client_that_folds_garbage_is_a_counted_rejection_and_the_run_goes_on(tmp_path, mode):
    def hostile(msg, context):  # node 11 folds a record name its reply already has
        reply = app(msg, context)
        if msg.metadata.message_type == "train" and reply.has_content():
            reply.content.config_records[records.CONTROL][records.FOLDED] = json.dumps(
                {"config": {records.CONTROL: {"x": 1}}})
        return reply

    summary, rows = run_beside_a_hostile_node(tmp_path, hostile, mode)
    assert summary["completed"] and summary["versions"] == 3, summary
    assert sum(r.get("rejected", 0) for r in rows) >= 1, rows

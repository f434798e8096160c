"""Replies that are well-formed updates with hostile or unlucky metrics never stop the server, and a node that can
only send rejected replies cannot keep a run going forever.

* every MetricRecord value must be a finite number within float range (a JSON integer of 400 digits is refused at
  admission, counted ``records``), ``num-examples`` too (``replies.example_weight``);
* metrics that are each valid but disagree between replies (a list where another sends a number) make the
  wrapped strategy's metrics aggregation raise: the round or version gets no metrics (``metrics_failed``), the
  model is aggregated all the same;
* replies that weigh 0 examples in all (an empty partition) make no model: Flower's rounds nack the updates
  (``aggregation``), fedcomp's loop rejects such a reply (``weight``);
* on fedcomp's loop a rejected reply is a failed task: ``max_failures`` of them in a row end the run.

Each test failed on the code before these fixes (a TypeError, OverflowError, ZeroDivisionError or ValueError out
of ``Strategy.start``, or a run that went on until its safety ``run_timeout``).
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from flwr.app import Array, ArrayRecord, Context, Message, MetricRecord, RecordDict
from flwr.serverapp.strategy import FedAvg
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from benchmarks.flowerkit import LocalGrid, server_identity
from fedcomp.flower import Compressed, records, replies
from fedcomp.payload import TensorPayload, Update, Values
from fedcomp.protocol import Outcome, ProtocolConfig, ReplyMeta
from fedcomp.server import ServerProtocol
from fedcomp.server.loops import LOOPS, LoopConfig, ReplyEvent, Reporter
from fedcomp.server.optimizers import SERVER_OPTIMIZERS
from fedcomp.server.staleness import STALENESS
from fedcomp.spec import ModelSpec
from fedcomp.wire import encode
from tests.bnkit import app, net

MODES = {
    "sync": {},
    "sync-dense": {"aggregation": "dense"},
    "async": {"mode": "async", "buffer_size": 2},
    "loop": {"loop": "fedcomp"},
}
#: A safety net for the code before the fix (which ran on): never asserted on.
SAFETY = {"run_timeout": 20.0}
HOSTILE = 100
BIG = "1" + "0" * 400  # a JSON integer far beyond float range


def edit_folded(edit):
    """A node that runs ``app`` and then rewrites the metrics ``compression_mod`` folded into its train reply."""

    def hostile(msg: Message, context: Context) -> Message:
        reply = app(msg, context)
        if msg.metadata.message_type == "train" and reply.has_content():
            control = reply.content.config_records[records.CONTROL]
            control[records.FOLDED] = edit(control[records.FOLDED])
        return reply

    return hostile


def set_metric(key: str, text: str):
    """Folded JSON edit: the reply's metric ``key`` becomes the JSON ``text`` (kept verbatim: a big integer)."""

    def edit(folded: str) -> str:
        metrics = json.loads(folded)["metric"]["metrics"]
        old = f'"{key}":{json.dumps(metrics[key])}'
        assert old in folded, folded
        return folded.replace(old, f'"{key}":{text}')

    return edit


def start(mode: str, nodes: dict[int, object], rounds: int = 2, **kw) -> Compressed:
    """A ``Compressed(FedAvg)`` run over ``nodes`` (node id -> ClientApp) in ``mode``; returns the strategy."""
    n = len(nodes)
    fedavg = FedAvg(fraction_evaluate=0.0, min_train_nodes=n, min_available_nodes=n)
    options = {**MODES[mode], **(kw if mode in ("async", "loop") else {})}
    strategy = Compressed(fedavg, "topk+int8", density=0.5, **options)
    grid = LocalGrid({nid: (fn, {"partition-id": i, "num-partitions": n}) for i, (nid, fn) in enumerate(nodes.items())})
    strategy.grid = grid  # for the assertions
    with server_identity():
        strategy.result = strategy.start(grid, ArrayRecord(net().state_dict()), num_rounds=rounds, timeout=30)
    return strategy


def three_nodes(hostile) -> dict[int, object]:
    return {HOSTILE: hostile, 101: app, 102: app}


# ------------------------------------------------------------------------------------------- metric values


def finite(value: object) -> bool:
    try:
        return float(value) == float(value) and abs(float(value)) != float("inf")
    except OverflowError:
        return False


numbers = st.one_of(
    st.integers(min_value=-(10**400), max_value=10**400),
    st.floats(allow_nan=True, allow_infinity=True),
)


@settings(max_examples=300, derandomize=True, deadline=None, suppress_health_check=list(HealthCheck))
@given(value=st.one_of(numbers, st.lists(st.integers(-(10**400), 10**400), max_size=4),
                       st.lists(st.floats(allow_nan=True, allow_infinity=True), max_size=4)))
def test_a_metric_is_admitted_iff_it_is_finite_within_float_range(value):
    content = RecordDict({"metrics": MetricRecord({"num-examples": 3, "m": value})})
    ok = all(finite(v) for v in (value if isinstance(value, list) else [value]))
    if ok:
        replies.check_metrics(content)
    else:
        with pytest.raises(records.RecordError, match="finite number within float range"):
            replies.check_metrics(content)


@settings(max_examples=300, derandomize=True, deadline=None, suppress_health_check=list(HealthCheck))
@given(value=numbers)
def test_the_example_weight_is_a_finite_float_or_a_record_error(value):
    content = RecordDict({"metrics": MetricRecord({"num-examples": value})})
    if finite(value) and 0 <= value <= 2**53:
        assert replies.example_weight(content, "num-examples") == float(value)
    else:
        with pytest.raises(records.RecordError, match="num-examples"):
            replies.example_weight(content, "num-examples")


@pytest.mark.parametrize("key", ["num-examples", "train-loss"])
@pytest.mark.parametrize("mode", ["sync", "async", "loop"])
def test_a_metric_beyond_float_range_is_a_counted_rejection_and_the_run_goes_on(mode, key):
    strategy = start(mode, three_nodes(edit_folded(set_metric(key, BIG))), **SAFETY)
    totals = strategy.totals
    assert strategy.proto.version == 2
    assert totals.reject_reasons == {"records": totals.rejected} and totals.rejected >= 1
    hostile = [r for r in strategy.grid.replies if r.metadata.src_node_id == HOSTILE and not r.has_error()]
    if mode == "sync":
        assert totals.rejected == len(hostile)  # each of the hostile node's replies, and only those
    else:  # the loop stops at its last version: a reply may still be on the wire, unread
        assert strategy.loop.completed and totals.rejected <= len(hostile)


@pytest.mark.parametrize("count", ["1e39", "1e308"])
@pytest.mark.parametrize("mode", list(MODES))
def test_an_example_count_beyond_2_53_is_a_counted_rejection_and_the_model_stays_finite(mode, count):
    """A finite float that no example count reaches: past float32's range (``1e39``) it overflowed a weighted
    update, near float64's (``1e308``) the weights' sum and the running statistics' means went to inf or NaN."""
    strategy = start(mode, three_nodes(edit_folded(set_metric("num-examples", count))), **SAFETY)
    totals = strategy.totals
    assert strategy.proto.version == 2
    assert totals.reject_reasons == {"records": totals.rejected} and totals.rejected >= 1
    model = strategy.result.arrays.to_torch_state_dict()  # the final model, running statistics and counters too
    assert model and all(torch.isfinite(t.double()).all() for t in model.values())


@pytest.mark.parametrize("mode", list(MODES))
def test_metrics_that_disagree_between_replies_are_not_aggregated_but_the_model_is(mode):
    strategy = start(mode, three_nodes(edit_folded(set_metric("train-loss", "[1.0,2.0]"))), **SAFETY)
    totals = strategy.totals
    assert strategy.proto.version == 2 and totals.rejected == 0
    assert totals.metrics_failed >= 1


def extra_array_record(msg: Message, context: Context) -> Message:
    """A node that runs ``app`` and adds a second ArrayRecord to its train reply."""
    reply = app(msg, context)
    if msg.metadata.message_type == "train" and reply.has_content():
        reply.content["extra"] = ArrayRecord({"z": Array(np.zeros(3, "float32"))})
    return reply


def extra_metric_key(folded: str) -> str:
    d = json.loads(folded)
    d["metric"]["metrics"]["extra-key"] = 1.0
    return json.dumps(d)


@pytest.mark.parametrize("mode", list(MODES))
def test_a_second_array_record_or_another_metric_key_never_stops_a_round(mode):
    """Flower's strategies raise ``InconsistentMessageReplies`` on a round whose replies hold two ArrayRecords or
    differ in metric keys. Given one dense reply per client, the reply with two is a counted rejection, and the
    metrics are cut to the keys every reply shares; elsewhere ``Compressed`` builds the one reply itself."""
    strategy = start(mode, three_nodes(extra_array_record), **SAFETY)
    assert strategy.proto.version == 2
    hostile = [r for r in strategy.grid.replies if r.metadata.src_node_id == HOSTILE and not r.has_error()]
    if mode == "sync-dense":
        assert strategy.totals.reject_reasons == {"records": len(hostile)} and hostile
    else:
        assert strategy.totals.rejected == 0
    strategy = start(mode, three_nodes(edit_folded(extra_metric_key)), **SAFETY)
    assert strategy.proto.version == 2 and strategy.totals.rejected == 0
    if mode == "sync-dense":
        assert strategy.totals.metrics_failed == 2  # both rounds: their shared keys only


# ------------------------------------------------------------------------------------------ zero examples


def test_a_round_of_zero_examples_makes_no_model_and_its_updates_are_nacked():
    strategy = start("sync", {HOSTILE: edit_folded(set_metric("num-examples", "0"))})
    assert strategy.proto.version == 0  # no model in either round
    assert strategy.totals.reject_reasons == {"aggregation": 2} and strategy.totals.accepted == 0
    tasks = [records.read_mod_task(m.content) for m in strategy.grid.sent if m.metadata.message_type == "train"]
    nacks = [r for t in tasks for r in t.resolutions]
    assert [r.outcome for r in nacks] == [Outcome.REJECTED] and "weigh 0" in nacks[0].reason


@pytest.mark.parametrize("mode", ["async", "loop"])
def test_replies_of_zero_examples_on_fedcomps_loop_are_rejected_until_max_failures(mode):
    strategy = start(mode, {HOSTILE: edit_folded(set_metric("num-examples", "0"))}, max_failures=3, **SAFETY)
    assert strategy.proto.version == 0 and not strategy.loop.completed
    reason = strategy.loop.stopped_reason
    assert reason.startswith("3 failed tasks in a row") and "rejected: weight: 0 examples" in reason, reason
    assert strategy.totals.reject_reasons == {"weight": 3}


# ------------------------------------------------------------------------------- every reply rejected


def broken_blob(msg: Message, context: Context) -> Message:
    reply = app(msg, context)
    if msg.metadata.message_type == "train" and reply.has_content():
        reply.content.config_records[records.CONTROL][records.UPDATE] = b"FCW\x01" + b"\0" * 40  # CRC broken
    return reply


@pytest.mark.parametrize("mode", ["async", "loop"])
def test_a_run_whose_every_reply_is_rejected_stops_after_max_failures(mode):
    strategy = start(mode, {HOSTILE: broken_blob}, rounds=3, max_failures=4, **SAFETY)
    assert strategy.proto.version == 0 and not strategy.loop.completed
    reason = strategy.loop.stopped_reason
    assert reason.startswith("4 failed tasks in a row; last: reply of client 100 rejected: wire/crc"), reason


SPEC = ModelSpec((("w", (3,)),))


class Clock:
    def now(self) -> float:
        return 0.0


def test_a_rejected_reply_is_a_failure_in_a_row_and_an_applied_one_resets_the_count():
    params = {"w": torch.zeros(3)}
    proto = ServerProtocol(SPEC, params, SERVER_OPTIMIZERS.build("sgd", lr=1.0), STALENESS.build("constant"),
                           ProtocolConfig(buffer_size=1))
    loop = LOOPS.get("async")(proto, None, LoopConfig(num_versions=5, max_failures=2), Reporter(None, clock=Clock()),
                              clock=Clock())  # type: ignore[arg-type]
    for seq in (1, 2):
        task = proto.dispatch(7, 0.0)
        loop.handle(ReplyEvent(task.task_id, 7, b"garbage", ReplyMeta(task.task_id, seq, 1, 5)), 0.0)
        assert loop.failures_in_a_row == seq and "rejected: wire/" in loop.last_failure
    assert loop.stuck() and loop.stopped_reason.startswith("2 failed tasks in a row; last: reply of client 7")
    task = proto.dispatch(7, 0.0)
    update = Update({"w": TensorPayload((3,), Values.f32(torch.ones(3)))}, base_version=0, seq=3, client_id=7)
    decision = loop.handle(ReplyEvent(task.task_id, 7, encode(update, SPEC), ReplyMeta(task.task_id, 3, 1, 5)), 0.0)
    assert decision.outcome is Outcome.APPLIED and loop.failures_in_a_row == 0 and not loop.stuck()

"""A hostile or broken client's Flower records never crash ``Compressed`` or reach the model unchecked.

What the wire codec does not cover: the arrays that travel dense (running statistics, counters, masks) in their
packed form, the records folded into JSON, and the control fields of a reply. Each case here crashed the run in
every mode (sync on Flower's rounds, sync on fedcomp's loop, async), or put NaN into the model's running
statistics with nothing rejected. Now each is one counted ``records`` rejection, the honest clients' updates are
applied, and the model stays finite.
"""

from __future__ import annotations

import io
import json
import struct
import zlib

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord, Message, MetricRecord, RecordDict
from flwr.serverapp.strategy import FedAvg
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from benchmarks.flowerkit import LocalGrid, server_identity
from fedcomp.flower import Compressed, records
from fedcomp.flower.records import DENSE, ArrayLayout, RecordError, npy, pack_arrays, unpack_arrays
from fedcomp.flower.replies import dense_means
from fedcomp.protocol import Task
from tests.bnkit import app, net


def control(reply: Message):
    return reply.content.config_records[records.CONTROL]


def edit_dense(edit):
    def hostile(reply: Message) -> None:
        arrays = dict(unpack_arrays(control(reply)[DENSE]).items())
        edit(arrays)
        control(reply)[DENSE] = pack_arrays(ArrayRecord(arrays))
    return hostile


def npy_claiming(shape: tuple[int, ...], data: bytes) -> Array:
    head = io.BytesIO()
    np.lib.format.write_array_header_1_0(head, {"descr": "<f8", "fortran_order": False, "shape": shape})
    return Array(dtype="float64", shape=shape, stype="numpy.ndarray", data=head.getvalue() + data)


def packed_with_header(header: bytes) -> bytes:
    return struct.pack("<II", zlib.crc32(header), len(header)) + header


DEEP = "[" * 100_000 + "]" * 100_000
CASES = {
    "dense NaN": edit_dense(lambda d: d.update({"1.running_var": Array(np.full(8, np.nan, "float32"))})),
    "dense Inf": edit_dense(lambda d: d.update({"1.running_mean": Array(np.full(8, -np.inf, "float32"))})),
    "dense shape that broadcasts": edit_dense(lambda d: d.update({"1.running_mean": Array(np.ones(1, "float32"))})),
    "dense wrong shape": edit_dense(lambda d: d.update({"1.running_mean": Array(np.zeros(5, "float32"))})),
    "dense name missing": edit_dense(lambda d: d.pop("1.running_var")),
    "dense name added": edit_dense(lambda d: d.update({"extra": Array(np.zeros(2, "float32"))})),
    "npy header claiming 8 TiB": edit_dense(lambda d: d.update({"1.running_mean": npy_claiming((2**40,), b"\0" * 8)})),
    "deep JSON in the dense header": lambda r: control(r).__setitem__(DENSE, packed_with_header(DEEP.encode())),
    "deep JSON in the folded records": lambda r: control(r).__setitem__(records.FOLDED, DEEP),
    "seq infinite": lambda r: control(r).__setitem__(records.SEQ, float("inf")),
    "seq a float": lambda r: control(r).__setitem__(records.SEQ, 2.5),
    "task id negative": lambda r: control(r).__setitem__(records.TASK_ID, -1),
}
MODES = {"sync": {}, "sync on fedcomp's loop": {"loop": "fedcomp"}, "async": {"mode": "async", "buffer_size": 2}}


def run(hostile, hostile_node: int = 101, **options):
    """Two versions of ``Compressed(FedAvg)`` over three in-process nodes; node ``hostile_node`` edits its replies."""
    def apps(nid):
        def edited(msg, ctx):
            reply = app(msg, ctx)
            if nid == hostile_node and msg.metadata.message_type == "train" and reply.has_content():
                hostile(reply)
            return reply
        return edited
    grid = LocalGrid({nid: (apps(nid), {"partition-id": i, "num-partitions": 3})
                      for i, nid in enumerate((100, 101, 102))}, {})
    strategy = Compressed(FedAvg(fraction_evaluate=0.0, min_train_nodes=3, min_available_nodes=3), "topk+int8",
                          density=0.5, **options)
    with server_identity():
        result = strategy.start(grid, ArrayRecord(net().state_dict()), num_rounds=2, timeout=30)
    return strategy.totals.to_dict(), result.arrays


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("case", list(CASES))
def test_each_hostile_record_is_one_counted_rejection_and_the_model_stays_finite(case, mode):
    totals, arrays = run(CASES[case], **MODES[mode])
    assert totals["reject_reasons"] == {"records": totals["rejected"]} and totals["rejected"] >= 1, totals
    assert totals["accepted"] >= 2  # the honest nodes' updates went in
    assert all(np.isfinite(arrays[k].numpy()).all() for k in arrays)
    assert arrays["1.running_mean"].numpy().shape == (8,)


def test_a_reply_without_dense_arrays_leaves_the_others_mean_alone():
    """A node may send no dense arrays at all (a train function that hands its update over); the mean of the
    running statistics is then the others', not a KeyError nor the first reply's names only."""
    plain_totals, plain = run(lambda r: None)
    totals, arrays = run(lambda r: control(r).pop(DENSE), hostile_node=102)
    assert totals["rejected"] == 0 and totals["accepted"] == plain_totals["accepted"]
    assert not np.allclose(arrays["1.running_var"].numpy(), 1.0)  # the honest nodes' statistics, not a reset


def test_dense_means_over_the_replies_that_sent_them():
    def reply(value, with_dense=True):
        content = RecordDict({"metrics": MetricRecord({"num-examples": 1})})
        if with_dense:
            content["arrays"] = ArrayRecord({"v": Array(np.full(2, value, "float32")),
                                             "n": Array(np.array(value, "int64"))})
        return content
    out = dense_means([reply(0, False), reply(2), reply(4)], "arrays", [5.0, 1.0, 3.0])["arrays"]
    assert out["v"].numpy().tolist() == [3.5, 3.5] and int(out["n"].numpy()) == 4  # (2 + 12) / 4
    assert dense_means([reply(2), reply(4)], "arrays", [0.0, 0.0]) == {}  # nothing to weigh by: the model's stay
    assert dense_means([reply(0, False)], "arrays", [1.0]) == {}


@pytest.mark.parametrize("dtype", ["int64", "int32", "uint8"])
def test_dense_means_of_counters_at_their_dtypes_limits_stay_in_range(dtype):
    """Counters near the top of their dtype (one node may send them): the mean is a value of the dtype, never one
    wrapped around (float64 rounds 2**63 - 1 up to 2**63, which a cast to int64 makes -2**63)."""
    info = np.iinfo(dtype)

    def reply(value):
        return RecordDict({"arrays": ArrayRecord({"n": Array(np.array([value, info.min], dtype))})})

    out = dense_means([reply(info.max), reply(info.max)], "arrays", [2.0**53, 1.0])["arrays"]["n"].numpy()
    assert out.dtype == np.dtype(dtype)
    assert out[0] > info.max - 2048 and out[0] <= info.max and out[1] == info.min


LAYOUT = ArrayLayout.of(ArrayRecord(net().state_dict()))


@settings(max_examples=60, deadline=None)
@given(names=st.lists(st.sampled_from(["1.running_mean", "1.running_var", "1.num_batches_tracked", "x"]),
                      unique=True), n=st.integers(0, 9), value=st.sampled_from([0.0, 1.0, np.nan, np.inf, 3e38]))
def test_check_rest_takes_exactly_the_models_dense_arrays(names, n, value):
    record = ArrayRecord({k: Array(np.array(7) if k.endswith("tracked") else np.full(n, value, "float32"))
                          for k in names})
    ok = (set(names) == {"1.running_mean", "1.running_var", "1.num_batches_tracked"} and n == 8
          and np.isfinite(value))
    if ok:
        LAYOUT.check_rest(record)
    else:
        with pytest.raises(RecordError):
            LAYOUT.check_rest(record)


@settings(max_examples=80, deadline=None)
@given(x=hnp.arrays(st.sampled_from(["float32", "float64", "int8", "int64", "uint16", "bool", ">f4", "complex64"]),
                    hnp.array_shapes(min_dims=0, max_dims=3, min_side=0, max_side=5)), fortran=st.booleans())
def test_npy_reads_what_np_save_wrote(x, fortran):
    saved = np.asfortranarray(x) if fortran else x  # (at least 1-D: numpy's asfortranarray)
    out = io.BytesIO()
    np.save(out, saved)
    got = npy(out.getvalue())
    assert got.dtype == saved.dtype and got.shape == saved.shape and np.array_equal(got, saved, equal_nan=True)


@given(shape=st.lists(st.integers(0, 2**20), max_size=3), extra=st.integers(-8, 8))
def test_npy_refuses_a_header_that_does_not_account_for_the_bytes(shape, extra):
    size = 8 * int(np.prod(shape))
    sent = max(0, min(size + extra, 1 << 16))  # the bytes that follow the header: at most 64 KiB
    data = npy_claiming(tuple(shape), b"").data + b"\0" * sent
    if sent == size:
        assert npy(data).shape == tuple(shape)
    else:
        with pytest.raises(ValueError, match="header claims"):
            npy(data)
    with pytest.raises(ValueError, match="not a number"):
        out = io.BytesIO()
        np.save(out, np.array([{}], dtype=object))
        npy(out.getvalue())


@given(value=st.one_of(st.integers(-5, 2**65), st.floats(), st.booleans(), st.text(max_size=5), st.none()))
def test_reply_control_numbers_are_whole_numbers_in_range(value):
    ok = isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 2**64
    if ok:
        assert records.whole({"seq": value}, "seq") == value
    else:
        with pytest.raises(RecordError, match="'seq' must be a whole number"):
            records.whole({"seq": value}, "seq")


def test_a_task_with_a_deep_json_or_infinite_number_is_a_clear_error_on_the_client():
    task = records.TaskFormat({}, LAYOUT).content(Task(3, 9, 0, 0.0, 60.0), b"")
    cfg = task.config_records[records.CONTROL]
    cfg[records.RESOLUTIONS] = DEEP
    with pytest.raises(RecordError, match="malformed fedcomp task"):
        records.read_mod_task(task)
    cfg[records.RESOLUTIONS] = json.dumps([])
    cfg[records.TASK_ID] = float("inf")
    with pytest.raises(RecordError, match="'task-id' must be a whole number"):
        records.read_mod_task(task)


@given(task_id=st.one_of(st.integers(-5, 2**65), st.floats(), st.booleans(), st.text(max_size=3), st.none()),
       seq=st.one_of(st.integers(0, 3), st.floats(0, 3), st.booleans()))
def test_a_resolutions_ids_are_whole_numbers_in_range_or_the_task_is_refused(task_id, seq):
    """A resolution's ``task_id`` and ``seq`` from the task's JSON (``1e400`` reads as inf, ``1.9`` as a float)
    are whole numbers in ``[0, 2**64)``, else the task fails before the train function runs: never truncated to
    an int, never another exception type."""
    task = records.TaskFormat({}, LAYOUT).content(Task(3, 9, 0, 0.0, 60.0), b"")
    text = json.dumps([{"task_id": task_id, "seq": seq, "outcome": "applied"}])
    task.config_records[records.CONTROL][records.RESOLUTIONS] = text
    whole = [isinstance(v, int) and not isinstance(v, bool) and 0 <= v < 2**64 for v in (task_id, seq)]
    if all(whole):
        (res,) = records.read_mod_task(task).resolutions
        assert (res.task_id, res.seq) == (task_id, seq)
    else:
        with pytest.raises(RecordError, match="malformed fedcomp task"):
            records.read_mod_task(task)
    task.config_records[records.CONTROL][records.RESOLUTIONS] = '[{"task_id": 1e400, "seq": 1, "outcome": "applied"}]'
    with pytest.raises(RecordError, match="whole numbers"):
        records.read_mod_task(task)


def test_a_task_whose_packed_arrays_claim_8_tib_is_a_clear_error_on_the_client():
    """The server packs a task's dense arrays too (``compression_mod`` restores them before the train function):
    a header claiming 2^40 elements is refused from the bytes that follow it, nothing allocated from the claim."""
    task = records.TaskFormat({}, LAYOUT).content(Task(3, 9, 0, 0.0, 60.0), b"")
    control = task.config_records[records.CONTROL]
    control[DENSE] = pack_arrays(ArrayRecord({"1.running_mean": npy_claiming((2**40,), b"\0" * 8)}))
    with pytest.raises(RecordError, match="header claims"):
        records.restore_dense(task, "arrays")

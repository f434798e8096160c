"""A checkpoint a crash, a disk or a hand damaged: a resume refuses it in one line (``ConfigError``) instead of going
on from the initial arrays or failing mid-run, ``fedcomp check`` refuses it as input (``CheckInputError``), and a
metrics line a crash tore off is cut before a resumed run appends its rows. ``Compressed(..., mode="async")``
on the in-process federation, BatchNorm model (arrays outside the update, kept under ``extra["dense"]``)."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from flwr.app import ConfigRecord, MetricRecord
from flwr.serverapp.strategy import FedAvg
from hypothesis import given, settings
from hypothesis import strategies as st

from benchmarks import compatkit
from benchmarks.flowerkit import server_identity
from fedcomp.flower import Compressed, compression_mod
from fedcomp.registry import ConfigError
from fedcomp.server.loops import mend_tail
from fedcomp.tools.check import CheckInputError, check

FAMILY = compatkit.FAMILIES["bn-cnn"]


def start(out, versions: int, compressor: str = "topk", **kw) -> None:
    app = compatkit.client_app(FAMILY, [compression_mod])
    grid = compatkit.StagedGrid({100 + i: (app, {"partition-id": i, "num-partitions": 3}) for i in range(3)}, {})
    strategy = Compressed(FedAvg(min_available_nodes=3), compressor, **{"density": 0.1, **kw}, mode="async",
                          buffer_size=2, max_staleness=3, out_dir=str(out), checkpoint_every=1)
    with server_identity():
        strategy.start(grid, FAMILY.record(FAMILY.build()), num_rounds=versions, timeout=30.0,
                       train_config=ConfigRecord({"lr": compatkit.LR}),
                       evaluate_fn=lambda v, arrays: MetricRecord({"accuracy": 0.0}))


@pytest.fixture(scope="module")
def good(tmp_path_factory):
    """A run's checkpoint at version 2."""
    out = tmp_path_factory.mktemp("good")
    start(out, 2)
    return out / "checkpoint.pt"


def _first_param(st):
    return next(iter(st["protocol"]["params"]))


EDITS = {  # each was taken (an array from the initial model) or failed with a bare traceback, at resume or mid-run
    "an update array missing": lambda st: st["protocol"]["params"].pop(_first_param(st)),
    "a dense array missing": lambda st: st["extra"]["dense"].pop(next(iter(st["extra"]["dense"]))),
    "an update array of NaN": lambda st: st["protocol"]["params"][_first_param(st)].fill_(float("nan")),
    "an unreadable random state": lambda st: st["protocol"].__setitem__("rng", "((("),
    "a run time that is text": lambda st: st.__setitem__("time", "abc"),
    "totals that are text": lambda st: st["protocol"].__setitem__("totals", "x"),
    "a negative version": lambda st: st["protocol"].__setitem__("version", -5),
    "a server state that is text": lambda st: st["extra"].__setitem__("strategy", "x"),
    "extra state that is a list": lambda st: st.__setitem__("extra", [1]),
    "wire counts that are text": lambda st: st["extra"].__setitem__("wire", "x"),
    "a negative wire count": lambda st: st["extra"]["wire"].__setitem__("replies", -3),
    "a fractional reply count": lambda st: st["extra"]["wire"].__setitem__("replies", 2.5),
    "an unknown wire figure": lambda st: st["extra"]["wire"].__setitem__("bogus", 1),
}


@pytest.mark.parametrize("edit", list(EDITS))
def test_a_damaged_checkpoint_is_refused_in_one_line(good, tmp_path, edit):
    state = torch.load(good, weights_only=True)
    EDITS[edit](state)
    path = tmp_path / "damaged.pt"
    torch.save(state, path)
    with pytest.raises(ConfigError, match=r"^resume: .*damaged\.pt") as err:
        start(tmp_path / "out", 3, resume=str(path))
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("field, value", [("totals", "x"), ("params", {"a": 1})])
def test_fedcomp_check_refuses_a_malformed_checkpoint_as_input(good, tmp_path, field, value):
    """A crashed run (no summary, no metrics): check reads the checkpoint's counters. Malformed, they were an
    AttributeError (exit 1)."""
    state = torch.load(good, weights_only=True)
    state["protocol"][field] = value
    torch.save(state, tmp_path / "checkpoint.pt")
    with pytest.raises(CheckInputError, match="malformed checkpoint"):
        check(tmp_path, [])


def test_a_resumed_run_starts_its_rows_on_a_line_of_their_own_after_a_torn_one(good, tmp_path):
    """A crash tore the last metrics row; the resumed run's first row was glued onto it (lost), and once the
    torn line was not the last, ``fedcomp check`` refused the folder."""
    out = tmp_path / "out"
    out.mkdir()
    shutil.copy(good, out / "checkpoint.pt")
    rows = [{"version": 1, "time": 1.0, "accepted": 2}, {"version": 2, "time": 2.0, "accepted": 2}]
    torn = json.dumps({"version": 3, "time": 3.0})[:15]
    (out / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows) + torn)
    start(out, 4, resume=str(out / "checkpoint.pt"))
    lines = (out / "metrics.jsonl").read_text().splitlines()
    versions = [json.loads(line)["version"] for line in lines]  # every line parses
    assert versions == [1, 2, 3, 4], versions
    assert check(out, []).exit_code == 0


@settings(max_examples=60, deadline=None)
@given(lines=st.lists(st.binary(min_size=0, max_size=70_000).filter(lambda b: b"\n" not in b), max_size=4),
       torn=st.binary(max_size=70_000).filter(lambda b: b"\n" not in b))
def test_mend_tail_cuts_exactly_a_torn_last_line(tmp_path_factory, lines, torn):
    """Whole lines stay byte for byte; a last line without its newline goes (blocks of 64 KiB are read backwards,
    so lines and tears longer than one block are in the draw)."""
    path = tmp_path_factory.mktemp("mend") / "metrics.jsonl"
    whole = b"".join(line + b"\n" for line in lines)
    path.write_bytes(whole + torn)
    mend_tail(path)
    assert path.read_bytes() == whole
    mend_tail(tmp_path_factory.mktemp("none") / "missing.jsonl")  # nothing there: nothing to do


def test_a_resume_with_other_client_compression_is_refused_and_other_server_options_are_not(good, tmp_path):
    """The checkpoint's run compressed with top-k 10%. Resumed with DGC or another density, every client refused
    every task (its state was made for top-k) until the run gave up, minutes later; the downlink's ``history`` is
    the server's own and changes nothing a client holds."""
    for compressor, kw in (("dgc", {}), ("topk", {"density": 0.2})):
        with pytest.raises(ConfigError, match="every client's state would refuse its tasks"):
            start(tmp_path / f"out-{compressor}", 3, compressor, resume=str(good), **kw)
    out = tmp_path / "out-history"
    start(out, 2, downlink="delta")
    start(out, 3, resume=str(out / "checkpoint.pt"), downlink="delta", downlink_options="history=4")
    assert check(out, []).exit_code == 0


def test_a_resumed_runs_wire_bytes_are_the_whole_runs_as_its_other_bytes_are(good, tmp_path):
    """The checkpoint keeps the run's wire counts; the resumed run adds its own. Its summary counted the replies,
    polls, heartbeats and bundles of the resumed stretch only beside the whole run's tasks and payload bytes
    (a deployment resumed at version 12 of 16: 7 replies on the wire for 16 handled, 35% of the wire bytes up
    missing)."""
    from fedcomp.sim.wirecost import FLOWER_1_41, RunCounts, run_wire_bytes

    earlier = RunCounts(**torch.load(good, weights_only=True)["extra"]["wire"])
    assert earlier.replies >= 4 and earlier.tasks >= earlier.replies  # 2 versions of K = 2 before the checkpoint
    out = tmp_path / "out"
    start(out, 5, resume=str(good))
    summary = json.loads((out / "summary.json").read_text())
    wire = summary["wire"]
    assert wire["replies"] >= summary["replies"], (wire["replies"], summary["replies"])  # every handled reply
    assert wire["replies"] >= earlier.replies + 6  # and the 3 versions of K = 2 after it
    before = run_wire_bytes(FLOWER_1_41, earlier)
    for part in ("tasks", "replies", "heartbeats", "bundle"):
        assert wire["parts"][part]["up"] > before[part][0], part  # the stretch before the checkpoint, and more
    t = summary["totals"]  # the whole run's tasks, counted once: at most their wire bytes (less those not fetched)
    once = run_wire_bytes(FLOWER_1_41, RunCounts(tasks=t["messages_down"], task_flower_bytes=t["flower_bytes_down"],
                                                 task_objects=t["flower_objects_down"]))
    assert before["tasks"][1] < wire["parts"]["tasks"]["down"] <= once["tasks"][1]
    assert check(out, []).exit_code == 0

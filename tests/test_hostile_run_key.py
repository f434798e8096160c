"""A server chooses the run key every task carries; the node compares it with its saved session's. Whatever a
server sends there, the task is refused with one clear error (not a crash) or read as a plain integer, and the
state folder's files stay inside the folder, owner-only."""

from __future__ import annotations

import stat

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord, ConfigRecord, RecordDict
from hypothesis import given, settings
from hypothesis import strategies as st

from fedcomp.flower import records
from fedcomp.flower.records import RecordError
from fedcomp.flower.statedir import StateDir
from fedcomp.task.config import Compression

COMPRESSION = Compression("topk", "residual", "density=0.25")


def content_with_run_key(value) -> RecordDict:
    arrays = ArrayRecord({"w": Array(np.zeros((2, 3), np.float32))})
    task = records.ModTask(1, 0, [], False, "arrays", COMPRESSION.to_flat())
    content = records.add_mod_task(RecordDict({"arrays": arrays, "config": ConfigRecord({})}), task, None)
    content.config_records[records.CONTROL][records.RUN_KEY] = value
    return content


@pytest.mark.parametrize("value", ["../../etc/passwd", "1; rm -rf /", "", "0x10", "nan"])
def test_a_run_key_that_is_no_integer_is_a_malformed_task(value):
    with pytest.raises(RecordError, match="malformed fedcomp task"):
        records.read_mod_task(content_with_run_key(value))


@settings(max_examples=50, deadline=None)
@given(st.integers(min_value=-(2**63), max_value=2**63 - 1))
def test_any_integer_run_key_is_read_as_that_integer(value):
    assert records.read_mod_task(content_with_run_key(value)).run_key == value


@pytest.mark.parametrize("key", [-1, -(2**63), 2**63 - 1, 0])
def test_a_session_set_aside_stays_in_its_folder_and_owner_only(tmp_path, key):
    folder = StateDir(tmp_path / "state")
    folder.write(b"session of another run")
    aside = folder.set_aside(key)
    assert aside is not None and aside.parent == folder.path and aside.read_bytes() == b"session of another run"
    assert stat.S_IMODE(aside.stat().st_mode) == 0o600
    assert sorted(p.name for p in tmp_path.rglob("*") if p.is_file()) == sorted(
        p.name for p in folder.path.iterdir() if p.is_file())

"""Server warnings are visible (issue 14, item 5): the ServerApp writes ``server.log`` in its out-dir (Flower
discards its output) and ``flower-server`` prints its warnings and errors."""

from __future__ import annotations

import pytest
import torch

from benchmarks.flowerkit import LocalGrid, server_identity
from clients.app import app as client_app
from fedcomp.registry import ConfigError


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine where gpu=true clients fail")
def test_serverapp_writes_its_warnings_and_errors_to_server_log(tmp_path):
    from flwr.app import Context, RecordDict

    from server_app.app import main

    run_config = {"num-versions": 2, "max-failures": 2, "node-wait": 30.0, "task-timeout": 60.0,
                  "out-dir": str(tmp_path / "out"), "poll-interval": 0.1}
    grid = LocalGrid({11: (client_app, {"gpu": True})}, run_config)  # every task fails: no CUDA here
    with server_identity(), pytest.raises(RuntimeError, match="stopped at version 0 of 2"):
        main(grid, Context(1, 0, {}, RecordDict(), dict(run_config)))
    text = (tmp_path / "out" / "server.log").read_text()
    warnings = [ln for ln in text.splitlines() if " WARNING " in ln]
    errors = [ln for ln in text.splitlines() if " ERROR " in ln]
    assert any("lost" in ln for ln in warnings), text
    assert len(errors) == 1 and "stopped at version 0 of 2" in errors[0], text
    assert any(" INFO " in ln and "[fedcomp]" in ln for ln in text.splitlines()), text


def test_serverapp_log_handler_is_removed_after_the_run(tmp_path):
    import logging

    from flwr.app import Context, RecordDict
    from flwr.common.logger import LOGGER_NAME

    from server_app.app import main

    before = list(logging.getLogger(LOGGER_NAME).handlers)
    ctx = Context(1, 0, {}, RecordDict(), {"resume": str(tmp_path / "nosuch.pt"), "out-dir": str(tmp_path)})
    with pytest.raises(ConfigError):
        main(None, ctx)
    assert logging.getLogger(LOGGER_NAME).handlers == before


def test_flower_server_prints_the_serverapp_warnings(tmp_path, capsys):
    import server_app.launcher as launcher

    log = tmp_path / "server.log"
    log.write_text(
        "2026-01-01 10:00:00,000 INFO [fedcomp] version 1  acc 0.5\n"
        "2026-01-01 10:00:01,000 WARNING [fedcomp] task 7 of client 3: lost (TTL expired)\n"
        "2026-01-01 10:00:02,000 ERROR [fedcomp] stopped at version 1 of 3: run timeout (60s) at version 1\n"
        "2026-01-01 10:00:02,500 ERROR [fedcomp] RunStoppedShort: stopped at version 1 of 3: said once\n"
        "2026-01-01 10:00:02,600 WARNING [fedcomp] async run stopped at version 1 of 3: said once too\n"
        "2026-01-01 10:00:03,000 WARNING [fedcomp] half a li"
    )
    pos = launcher.follow_log(log, 0)
    err = capsys.readouterr().err.splitlines()
    assert err == ["server warning: task 7 of client 3: lost (TTL expired)",
                   "server error: stopped at version 1 of 3: run timeout (60s) at version 1"], err
    with open(log, "a") as f:
        f.write("ne\n")
    launcher.follow_log(log, pos)
    assert capsys.readouterr().err.splitlines() == ["server warning: half a line"]


@pytest.mark.parametrize("mode, given, said", [
    ("sync", {"buffer-size": 4, "prefetch": 0, "max-staleness": 4}, "buffer-size=4, prefetch=0: read only in async"),
    ("async", {"over-selection": 0.5, "fraction": 0.5, "round-timeout": 9.0}, "fraction=0.5, over-selection=0.5: "
     "read only in sync"),
    ("async", {"buffer-size": 3}, None),
])
def test_the_serverapp_warns_of_the_other_modes_keys_in_its_log(tmp_path, mode, given, said):
    """A run config is layered (the app's defaults, then ``-c``): the other mode's keys set away from their
    defaults are named once in ``server.log`` (``Compressed`` refuses them as keywords); the run goes on."""
    from flwr.app import Context, RecordDict

    from server_app.app import main

    run_config = {"mode": mode, "num-versions": 1, "node-wait": 0.2, "out-dir": str(tmp_path / "out"), **given}
    with server_identity(), pytest.raises(RuntimeError, match="node"):
        main(LocalGrid({}, run_config), Context(1, 0, {}, RecordDict(), dict(run_config)))
    warned = [ln for ln in (tmp_path / "out" / "server.log").read_text().splitlines() if "read only in" in ln]
    assert len(warned) == (said is not None), warned
    if said:
        assert said in warned[0] and " WARNING " in warned[0], warned

"""Flower simulation end to end: ``flwr run`` of this app on a private simulation SuperLink, sync and async.

The SuperLink runs on a free port with a private FLWR_HOME whose config.toml names it; it is stopped by PID
(with its flower-superexec / flwr-serverapp / Ray children) in the fixture's finalizer.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from server_app.processes import (
    ManagedProcess,
    flower_env,
    free_port,
    run_status,
    submit_run,
    superlink_argv,
    wait_http_ready,
    write_flower_config,
    write_overrides,
)

ROOT = Path(__file__).resolve().parents[1]
CONN = "fedcomp-sim"
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def sim_link(tmp_path_factory):
    home = tmp_path_factory.mktemp("flwr-home")
    port = free_port()
    write_flower_config(home, CONN, f"127.0.0.1:{port}")
    env = flower_env(home)
    link = ManagedProcess(
        "superlink", superlink_argv(port, simulation=True, extra=["--insecure"]), home / "superlink.log", env
    )
    try:
        wait_http_ready(f"127.0.0.1:{port}", 60, link)
        yield env, home
    finally:
        link.stop()


def run_app(env, home: Path, name: str, overrides: dict, supernodes: int, timeout: float = 240.0) -> dict:
    out = home / name
    overrides = {"out-dir": str(out), "min-clients": supernodes, "node-wait": 120.0, **overrides}
    run_id = submit_run(
        ROOT,
        CONN,
        env,
        write_overrides(home / f"{name}.toml", overrides),
        f"num-supernodes={supernodes} client-resources-num-cpus=1 init-args-num-cpus=2",
    )
    end = time.monotonic() + timeout
    status = ""
    while time.monotonic() < end:
        status = run_status(CONN, run_id, env)
        if status.startswith("finished"):
            break
        time.sleep(2)
    assert status == "finished:completed", f"run {run_id}: {status}\n{(home / 'superlink.log').read_text()[-3000:]}"
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return {"rows": rows, "summary": json.loads((out / "summary.json").read_text())}


BASE = {"model": "mlp", "local-steps": 10, "local-lr": 0.1, "compressor": "dgc", "compressor-options": "density=0.05"}


def test_async_simulation_learns(sim_link):
    env, home = sim_link
    res = run_app(env, home, "async", {**BASE, "mode": "async", "num-versions": 6, "buffer-size": 2}, supernodes=3)
    rows, summary = res["rows"], res["summary"]
    assert [r["version"] for r in rows] == list(range(1, 7))
    assert rows[-1]["accuracy"] > 0.5 > rows[0]["accuracy"] - 0.2, [r["accuracy"] for r in rows]
    assert rows[-1]["accuracy"] > rows[0]["accuracy"]
    assert summary["payload_bytes_per_update"] < summary["dense_fp32_bytes"] / 4
    assert summary["flower_objects_per_update"] == 7  # Message, RecordDict, 3 records, Array, 1 chunk
    assert all(max(map(int, r["staleness_hist"] or {"0": 0})) <= 4 for r in rows)
    assert summary["totals"]["accepted"] >= 12 and summary["totals"]["rejected"] == 0


def test_sync_simulation_learns(sim_link):
    env, home = sim_link
    res = run_app(env, home, "sync", {**BASE, "mode": "sync", "num-versions": 3, "fraction": 1.0}, supernodes=2)
    rows, summary = res["rows"], res["summary"]
    assert [r["version"] for r in rows] == [1, 2, 3]
    assert all(r["accepted"] == 2 and r["staleness_hist"] == {"0": 2} for r in rows)
    assert rows[-1]["accuracy"] > rows[0]["accuracy"] and rows[-1]["accuracy"] > 0.5
    assert summary["messages_per_applied_update"] == pytest.approx(2.0)

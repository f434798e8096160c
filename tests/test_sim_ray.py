"""The Ray-backed simulation: Flower's simulation engine runs the ClientApps (num_cpus=1 each), the virtual clock
orders the replies. One small run through the CLI; Ray is shut down by ``run_simulation`` afterwards."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from fedcomp.tools.cli import main

pytestmark = pytest.mark.slow


def _ray_descendants() -> list[str]:
    """Command lines of this process's descendants that mention ray (from /proc)."""
    parent: dict[int, int] = {}
    cmd: dict[int, str] = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                stat = (d / "stat").read_text()
                parent[int(d.name)] = int(stat.rsplit(")", 1)[1].split()[1])
                cmd[int(d.name)] = (d / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except (OSError, ValueError, IndexError):
                continue
    mine, me = [], os.getpid()
    for pid in parent:
        p = pid
        while p in parent and p not in (0, 1, me):
            p = parent[p]
        if p == me and pid != me and "ray" in cmd.get(pid, "").lower():
            mine.append(cmd[pid])
    return mine


def test_tiny_scenario_on_flowers_simulation_engine(tmp_path):
    out = tmp_path / "ray"
    argv = ["sim", "tiny", "--quiet", "--no-plot", "--out", str(out), "--set", "sim.engine=ray",
            "--set", "methods=dgc-async", "--set", "method.dgc-async.num_versions=6"]
    assert main(argv) == 0
    [summary] = json.loads((out / "summary.json").read_text())["methods"]
    assert summary["versions"] == 6 and summary["applied"] >= 12
    assert summary["wire_bytes_up"] > summary["flower_bytes_up"] > summary["payload_bytes_up"] > 0
    assert summary["virtual_s"] > 0
    lost_down = sum(n["lost_down"] for n in json.loads((out / "summary.json").read_text())["nodes"]["dgc-async"])
    assert summary["applied"] <= summary["updates"] <= summary["tasks"] - lost_down  # replies the engine returned
    rows = [json.loads(x) for x in (out / "dgc-async.jsonl").read_text().splitlines()]
    assert [r["version"] for r in rows] == list(range(1, 7))
    assert _ray_descendants() == []

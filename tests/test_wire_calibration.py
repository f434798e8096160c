"""The wire model against an independent TCP count on a loopback deployment (benchmarks/wire_calibration.py).

Flower's SuperLink and two SuperNodes (started by ``flower-client``) that connect through a counting TCP proxy;
an idle phase (nodes connected, no run) and a short async run (6 versions: a task sent in a run's last second
and never fetched is ≈39 KB, 6% of the busy phase's downlink; the model charges open tasks by their age). The
product's wire bytes (``summary.json``'s ``wire`` block, from ``fedcomp.sim.wirecost.FLOWER_1_41``) must be within
5% of the proxy's count in both directions and phases, and the replies it charges must be the replies the nodes
pushed (the nodes still work when the run reaches its last version: the server reads what they push after its
loop's last read); a run of the old, wider layout or bundle would miss it by
far (the bundle alone was ≈896 KB per client). Deadlines only bound a hang.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow


def load_benchmark():
    spec = importlib.util.spec_from_file_location("wire_calibration", ROOT / "benchmarks" / "wire_calibration.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["wire_calibration"] = mod
    spec.loader.exec_module(mod)
    return mod


def test_wire_model_is_within_five_percent_of_a_tcp_count(tmp_path):
    bench = load_benchmark()
    args = argparse.Namespace(
        clients=2,
        versions=6,
        idle=60.0,
        mode="async",
        model="mlp",
        model_options="",
        compressor="dgc",
        compressor_options="",
        downlink="",
        local_steps=5,
    )
    res = bench.deployment(args, tmp_path)
    print("\n" + bench.table(res))
    assert res["busy"]["status"] == "finished:completed", res["busy"]["status"]
    summary = res["busy"]["summary"]
    assert summary["flower_objects_up_per_reply"] == 3
    for phase in ("idle", "busy"):
        for d in ("up", "down"):
            proxy, model = res[phase]["proxy"][d], res[phase]["model"][d]
            assert proxy > 0 and abs(model - proxy) <= 0.05 * proxy, (phase, d, model, proxy)
    # the replies the model charges are the replies the nodes pushed, also those in flight when the run ended
    counts = res["busy"]["counts"]
    assert counts["replies pushed"]["model"] == counts["replies pushed"]["proxy"], counts
    # the figures the summary names: totals and per reply / per applied update, beside payload and Flower bytes
    assert summary["totals"]["wire_bytes_up"] == summary["wire"]["wire_bytes_up"]
    for key in (
        "wire_bytes_up_per_reply",
        "wire_bytes_down_per_applied_update",
        "payload_bytes_up_per_reply",
        "flower_bytes_up_per_applied_update",
    ):
        assert summary[key] > 0, key
    # the bundle a node downloads carries only the apps
    assert res["busy"]["by_kind"]["get-fab"]["mean_down"] < 100_000

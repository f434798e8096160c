"""benchmarks/frontier.py: its ``--help`` runs, and its row/summary helpers compute gaps, ratios, the goal and
the target crossing right on hand-made rows (no training)."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "frontier.py"


@pytest.fixture(scope="module")
def fr():
    spec = importlib.util.spec_from_file_location("frontier_under_test", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.modules.pop(spec.name, None)


def _rounds(accs: list[float], payload: int, flower: int) -> list[dict]:
    """Per-round rows with constant per-round bytes."""
    return [{"round": i, "accuracy": a, "cum_payload_up": payload * i, "cum_flower_up": flower * i}
            for i, a in enumerate(accs, start=1)]


def test_help_runs():
    out = subprocess.run([sys.executable, str(SCRIPT), "--help"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    for flag in ("--part", "--json", "--plot", "--quick"):
        assert flag in out.stdout


def test_bad_arguments_exit_2():
    out = subprocess.run([sys.executable, str(SCRIPT), "--rounds", "0"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 2


def test_worst_gap_only_counts_rounds_from_5(fr):
    base = _rounds([0.5, 0.6, 0.7, 0.8, 0.90, 0.91, 0.92], 100, 110)
    row = _rounds([0.1, 0.1, 0.1, 0.1, 0.895, 0.89, 0.925], 5, 6)  # far behind before round 5, -2 points at 6
    gap, at = fr.worst_gap(base, row, first=5)
    assert at == 6
    assert gap == pytest.approx(2.0)
    gap_all, at_all = fr.worst_gap(base, row, first=1)
    assert (gap_all, at_all) == (pytest.approx(70.0), 4)
    assert fr.worst_gap(base, [], first=5) == (None, None)


def test_worst_gap_negative_when_always_better(fr):
    base = _rounds([0.8] * 6, 1, 1)
    row = _rounds([0.82] * 6, 1, 1)
    gap, at = fr.worst_gap(base, row, first=5)
    assert gap == pytest.approx(-2.0) and at == 5


def test_app_summary_ratios_use_the_same_figure_both_sides(fr):
    plain = {"name": "plain FedAvg", "rounds": _rounds([0.8, 0.85, 0.9, 0.9, 0.9, 0.91], 1000, 1100)}
    row = {"name": "x", "rounds": _rounds([0.7, 0.8, 0.9, 0.9, 0.895, 0.905], 40, 50)}
    s = fr.app_summary(plain, row, at=(5, 10))
    assert s["x_payload"] == pytest.approx(1000 / 40)
    assert s["x_flower"] == pytest.approx(1100 / 50)
    assert s["flower_up"] == 50 * 6 and s["payload_up"] == 40 * 6
    assert s["acc@5"] == pytest.approx(89.5) and s["acc@10"] is None
    assert s["worst_gap"] == pytest.approx(0.5) and s["worst_gap_round"] == 5
    assert s["meets_goal"]  # 0.5 points <= 1, 22x >= 20
    assert fr.app_summary(plain, plain)["x_flower"] == pytest.approx(1.0)


@pytest.mark.parametrize(
    ("gap", "x_flower", "x_payload", "met"),
    [(1.0, 20.0, 30.0, True), (1.01, 30.0, 30.0, False), (0.5, 19.9, 40.0, False), (None, 30.0, 30.0, False)],
)
def test_meets_goal_judges_flower_bytes(fr, gap, x_flower, x_payload, met):
    assert fr.meets_goal({"worst_gap": gap, "x_flower": x_flower, "x_payload": x_payload}) is met


def test_goal_miss_and_best_row(fr):
    rows = [
        {"variant": "a", "worst_gap": 1.35, "x_flower": 28.0, "meets_goal": False},
        {"variant": "b", "worst_gap": 1.01, "x_flower": 33.9, "meets_goal": False},
        {"variant": "c", "worst_gap": 0.3, "x_flower": 9.5, "meets_goal": False},
    ]
    miss = fr.goal_miss(rows[1])
    assert miss[0] == pytest.approx(0.01) and miss[1] == 1.0
    assert fr.goal_miss(rows[2])[1] == pytest.approx(20 / 9.5)
    assert fr.best_row(rows)["variant"] == "b"  # meets the byte ratio, misses the accuracy bound by least
    rows.append({"variant": "d", "worst_gap": 0.67, "x_flower": 21.0, "meets_goal": True})
    rows.append({"variant": "e", "worst_gap": 0.9, "x_flower": 25.0, "meets_goal": True})
    assert fr.best_row(rows)["variant"] == "e"  # among those meeting it: most bytes saved
    assert fr.best_row([]) is None


def test_across_seeds(fr):
    by_seed = {
        0: [{"variant": "v", "worst_gap": 0.67, "x_flower": 28.1, "meets_goal": True}],
        1: [{"variant": "v", "worst_gap": 1.35, "x_flower": 28.0, "meets_goal": False}],
    }
    (row,) = fr.across_seeds(by_seed)
    assert row["max_gap"] == pytest.approx(1.35) and row["min_x_flower"] == pytest.approx(28.0)
    assert row["gap@seed0"] == pytest.approx(0.67) and row["seeds"] == 2
    assert row["meets_all"] is False


def test_sim_summary_target_crossing(fr):
    rows = [
        {"version": 1, "time": 10.0, "accuracy": 0.5, "wire_bytes_up": 100},
        {"version": 2, "time": 20.0, "wire_bytes_up": 200},  # not evaluated
        {"version": 5, "time": 50.0, "accuracy": 0.94, "wire_bytes_up": 500},
        {"version": 10, "time": 90.0, "accuracy": 0.951, "wire_bytes_up": 900},
        {"version": 11, "time": 95.0, "accuracy": 0.96, "wire_bytes_up": 950},
        {"version": 12, "time": 99.0, "accuracy": 0.93, "wire_bytes_up": 990},
    ]
    s = fr.sim_summary("m", rows, 0.95)
    assert (s["acc@5"], s["acc@10"], s["acc@20"]) == (pytest.approx(94.0), pytest.approx(95.1), None)
    assert s["versions_to_target"] == 10 and s["time_to_target_s"] == 90.0 and s["wire_up_to_target"] == 900
    assert s["accuracy"] == pytest.approx(0.93) and s["versions"] == 12 and s["wire_up_total"] == 990
    never = fr.sim_summary("m", rows, 0.99)
    assert never["versions_to_target"] is None and never["time_to_target_s"] is None


def test_cumulative_and_ratio(fr):
    assert fr.cumulative([1, 2, 3]) == [1, 3, 6]
    assert fr.byte_ratio(100, 4) == pytest.approx(25.0)
    assert fr.byte_ratio(100, 0) is None and fr.byte_ratio(None, 4) is None


def test_frontier_scenario_methods(fr):
    raw = fr.frontier_raw()
    m = raw["method"]
    assert list(m) == ["fedbuff", "int8-async", "dgc-int8-1", "dgc-int8-3", "dgc-int8-10", "lowrank-async", "auto",
                       "auto-async"]
    assert m["dgc-int8-3"]["compressor"] == "dgc+int8" and m["dgc-int8-3"]["compressor_options"] == "density=0.03"
    assert m["dgc-int8-1"]["downlink"] == "delta" and m["auto"]["compressor_options"] == "density=auto"
    assert m["auto-async"]["downlink"] == "int8"  # the main job's row
    assert m["fedbuff"]["compressor"] == "identity" and raw["clients"] and raw["run"]["model"] == "resnet-1m"

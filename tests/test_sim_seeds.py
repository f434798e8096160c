"""``fedcomp sim --seeds``: each method over several seeds, each figure as mean (min–max) (``simulations.seeds``)."""

from __future__ import annotations

import argparse
import csv
import json

import pytest
import torch

from fedcomp.tools.cli import main
from simulations.cli import seed_list
from simulations.report import seeds_table
from simulations.seeds import aggregate, flat, mean_min_max, split_by_link, stats


def test_stats_are_over_the_seeds_that_have_the_figure():
    s = stats([4.0, None, 2.0])
    assert (s["mean"], s["min"], s["max"], s["n"], s["per_seed"]) == (3.0, 2.0, 4.0, 2, [4.0, None, 2.0])
    assert stats([None, None])["mean"] is None
    assert mean_min_max(s, 1) == "3.0 (2.0–4.0)"
    assert mean_min_max(s, 1, of=3) == "3.0 (2.0–4.0) [2/3]"
    assert mean_min_max(stats([None])) == "-"


def test_aggregate_pairs_each_seeds_ratios_and_keeps_the_method_order():
    per_seed = {
        1: [{"method": "b", "accuracy": 0.90, "speedup": 4.0, "speedup_vs_a": 2.0, "time_to_target_s": 10.0},
            {"method": "a", "accuracy": 0.80, "speedup": 2.0, "speedup_vs_a": 1.0, "time_to_target_s": 20.0}],
        0: [{"method": "b", "accuracy": 0.92, "speedup": 6.0, "speedup_vs_a": 3.0, "time_to_target_s": 5.0},
            {"method": "a", "accuracy": 0.82, "speedup": 2.0, "speedup_vs_a": 1.0, "time_to_target_s": 15.0}],
    }
    rows = aggregate(per_seed)
    assert [r["method"] for r in rows] == ["b", "a"] and rows[0]["seeds"] == [0, 1]
    b = rows[0]
    assert b["speedup_vs_a"]["per_seed"] == [3.0, 2.0]  # seed order
    assert (b["speedup_vs_a"]["mean"], b["speedup_vs_a"]["min"], b["speedup_vs_a"]["max"]) == (2.5, 2.0, 3.0)
    assert b["accuracy"]["mean"] == pytest.approx(0.91) and b["time_to_target_s"]["mean"] == 7.5
    row = flat(b)
    assert row["speedup_vs_a"] == "2.5000 (2.0000–3.0000)" and row["speedup_vs_a_max"] == 3.0
    printed = seeds_table([{**r, "wire_bytes_total": stats([1e6, 3e6])} for r in rows])
    assert "2.50 (2.00–3.00)" in printed and "0.9100 (0.9000–0.9200)" in printed and "speedup_vs_a" in printed


def test_split_by_link_is_the_mean_over_seeds():
    split = split_by_link({0: {"m": {"lte": {"task_codec_s": 0.1}}}, 1: {"m": {"lte": {"task_codec_s": 0.3}}}})
    assert split["m"]["lte"]["task_codec_s"] == pytest.approx(0.2)


def test_a_link_that_delivered_nothing_has_no_mean_and_leaves_the_other_seeds_mean_alone():
    """``split_summary`` gave 0.0 s per task where no task was delivered, and the mean over seeds took those zeros
    in (a 4 s task averaged with nothing read 2 s); the tables printed 0 for a mean that does not exist."""
    from fedcomp.sim.virtual import NodeStats
    from fedcomp.tools.report import table
    from simulations.runner import split_summary

    none = split_summary([NodeStats()])
    assert set(none.values()) == {None} and {"task_total_s", "task_latency_s"} <= set(none)
    assert "-" in table([{"total_s": none["task_total_s"]}]).splitlines()[-1]
    one = split_summary([NodeStats(timed=1, compute_s=4.0)])
    split = split_by_link({0: {"m": {"lte": one}}, 1: {"m": {"lte": none}}, 2: {"m": {"3g": none}}})
    assert split["m"]["lte"]["task_total_s"] == pytest.approx(4.0) and split["m"]["3g"]["task_total_s"] is None
    rows = aggregate({0: [{"method": "m", "task_total_s": 4.0}], 1: [{"method": "m", "task_total_s": None}]})
    assert rows[0]["task_total_s"]["mean"] == pytest.approx(4.0) and rows[0]["task_total_s"]["n"] == 1


def test_seed_list_parses_distinct_integers():
    assert seed_list("0,1,2") == [0, 1, 2]
    for bad in ("", "a,b", "1,1"):
        with pytest.raises(argparse.ArgumentTypeError):
            seed_list(bad)


def test_cli_runs_every_method_over_the_seeds_and_reports_mean_min_max(tmp_path, capsys):
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    out = tmp_path / "tiny"
    try:
        assert main(["sim", "tiny", "--quiet", "--no-plot", "--out", str(out), "--seeds", "0,1",
                     "--set", "method.fedavg.num_versions=3", "--set", "method.dgc-async.num_versions=6"]) == 0
    finally:
        torch.set_num_threads(n)
    printed = capsys.readouterr().out
    assert "seed 0:" in printed and "seed 1:" in printed and "over seeds 0, 1" in printed
    per = {s: {m["method"]: m for m in json.loads((out / f"seed-{s}" / "summary.json").read_text())["methods"]}
           for s in (0, 1)}
    assert per[0]["fedavg"]["seed"] == 0 and per[1]["fedavg"]["seed"] == 1
    doc = json.loads((out / "summary.json").read_text())
    assert doc["seeds"] == [0, 1]
    for m in doc["methods"]:
        accs = [per[s][m["method"]]["accuracy"] for s in (0, 1)]
        assert m["accuracy"]["per_seed"] == accs
        assert m["accuracy"]["mean"] == round(sum(accs) / 2, 4)  # the summary rounds to 4 places
        assert (m["accuracy"]["min"], m["accuracy"]["max"]) == (min(accs), max(accs))
        assert mean_min_max(m["accuracy"], 4) in printed
    with (out / "summary.csv").open() as f:
        rows = list(csv.DictReader(f))
    assert [r["method"] for r in rows] == ["fedavg", "dgc-async"] and "accuracy_mean" in rows[0]
    seed0 = json.loads((out / "seed-0" / "summary.json").read_text())["task_split_by_link"]["dgc-async"]
    mean = doc["task_split_by_link"]["dgc-async"]
    assert set(mean) == set(seed0) and all(mean[link]["task_codec_s"] > 0 for link in mean)

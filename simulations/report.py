"""Simulation outputs: ``summary.json``, ``summary.csv``, ``scenario.json`` and the printed summary table.

Per-version JSONL files are written while the methods run (``simulations.runner.drive``).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from fedcomp.report import table, write_csv, write_json
from simulations.runner import MethodResult
from simulations.scenario import Scenario

#: The columns of the printed table (all of them are in summary.csv / summary.json).
TABLE_COLUMNS = ["method", "mode", "compressor", "versions", "final_acc", "delta_acc", "time_to_target_s",
                 "speedup", "up_bytes", "down_bytes", "virtual_s", "wall_s"]


def summary_table(results: Sequence[MethodResult]) -> str:
    """The printed table; a missing figure (target never reached, no baseline time) shows as ``-``."""
    rows = [{k: ("-" if v is None else v) for k, v in r.summary.items()} for r in results]
    return table(rows, TABLE_COLUMNS)


def write_outputs(scenario: Scenario, results: Sequence[MethodResult], out: Path, wall_s: float,
                  plots: bool = True) -> list[Path]:
    """Write summary.json/csv and scenario.json (and the plots); returns the files written."""
    out.mkdir(parents=True, exist_ok=True)
    doc: dict[str, Any] = {
        "scenario": scenario.name,
        "target_accuracy_pct": round(100 * scenario.target_accuracy, 2),
        "baseline": scenario.baseline,
        "num_clients": scenario.num_clients,
        "wall_s": round(wall_s, 2),
        "methods": [r.summary for r in results],
        "nodes": {r.method: r.nodes for r in results},
        "staleness_hist": {r.method: {str(k): v for k, v in sorted(r.staleness_hist.items())} for r in results},
    }
    write_json(out / "summary.json", doc)
    write_csv(out / "summary.csv", [r.summary for r in results])
    write_json(out / "scenario.json", scenario.raw)
    files = [out / "summary.json", out / "summary.csv", out / "scenario.json"]
    files += [out / f"{r.method}.jsonl" for r in results]
    if plots:
        from simulations.plots import plot_all

        files += plot_all(results, out, scenario.target_accuracy)
    return files

"""Simulation outputs: ``summary.json``, ``summary.csv``, ``scenario.json`` and the printed summary table; over
several seeds, the same as mean (min–max) (``seeds_table``, ``write_seed_outputs``).

Per-version JSONL files are written while the methods run (``simulations.runner.drive``).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from fedcomp.tools.report import table, write_csv, write_json
from simulations.runner import MethodResult
from simulations.scenario import Scenario
from simulations.seeds import flat, mean_min_max

#: The columns of the printed table (all of them are in summary.csv / summary.json).
TABLE_COLUMNS = ["method", "mode", "compressor", "downlink", "versions", "accuracy", "delta_accuracy",
                 "time_to_target_s", "speedup", "wire_bytes_up", "wire_bytes_down", "wire_bytes_total", "virtual_s",
                 "wall_s"]
#: The second printed table: bytes per update (per applied update and per reply) and where a task's time goes.
DETAIL_COLUMNS = ["method", "payload_bytes_up_per_applied_update", "wire_bytes_up_per_applied_update",
                  "wire_bytes_up_per_reply", "task_compute_s", "task_codec_s", "task_transfer_s", "task_latency_s",
                  "task_total_s"]


def summary_table(results: Sequence[MethodResult], columns: Sequence[str] = TABLE_COLUMNS) -> str:
    """The printed table; a missing figure (target never reached, no baseline time) shows as ``-``. Speedup
    columns vs ``compare_to`` methods (``speedup_vs_NAME``) follow ``speedup`` when present."""
    cols = list(columns)
    if "speedup" in cols:
        extra = sorted({k for r in results for k in r.summary if k.startswith("speedup_vs_")})
        cols[cols.index("speedup") + 1:cols.index("speedup") + 1] = extra
    rows = [{k: ("-" if v is None else v) for k, v in r.summary.items()} for r in results]
    return table(rows, cols)


def stop_notes(results: Sequence[MethodResult]) -> list[str]:
    """One line per method that stopped before its last version, with the loop's reason (``[]`` when all
    completed).

    >>> stop_notes([MethodResult("fedavg", [], {"completed": False, "versions": 3, "target_versions": 200,
    ...                                         "stopped_reason": "50 failed tasks in a row; last: ..."})])
    ['fedavg stopped at version 3 of 200: 50 failed tasks in a row; last: ...']
    """
    return [f"{r.method} stopped at version {r.summary.get('versions', 0)} of {r.summary.get('target_versions', '?')}:"
            f" {r.summary.get('stopped_reason') or 'unknown cause'}" for r in results
            if r.summary.get("completed") is False]


def split_table(results: Sequence[MethodResult]) -> str:
    """Mean seconds per delivered task by link: compute (training), codec (decode + compress + encode), transfer
    (bytes / bandwidth) and Flower's transport
    latency (poll wait + request round trips + SuperExec wait + process start + reply check + server wait), one
    row per method and link; ``queue_s``: waiting behind the node's earlier task (prefetch) or for its device."""
    rows = []
    for r in results:
        for link, sp in sorted(r.split.items()):
            rows.append({"method": r.method, "link": link, "compute_s": sp["task_compute_s"],
                         "codec_s": sp["task_codec_s"],
                         "transfer_s": sp["task_transfer_s"], "latency_s": sp["task_latency_s"],
                         "poll_wait_s": sp["task_poll_wait_s"], "round_trips_s": sp["task_round_trip_s"],
                         "superexec_s": sp["task_superexec_wait_s"], "process_start_s": sp["task_process_start_s"],
                         "reply_check_s": sp["task_reply_check_s"], "server_wait_s": sp["task_server_wait_s"],
                         "queue_s": sp["task_queue_s"], "total_s": sp["task_total_s"]})
    return table(rows)


def write_outputs(scenario: Scenario, results: Sequence[MethodResult], out: Path, wall_s: float,
                  plots: bool = True) -> list[Path]:
    """Write summary.json/csv and scenario.json (and the plots); returns the files written."""
    out.mkdir(parents=True, exist_ok=True)
    doc: dict[str, Any] = {
        "scenario": scenario.name,
        "target_accuracy": scenario.target_accuracy,
        "baseline": scenario.baseline,
        "num_clients": scenario.num_clients,
        "wall_s": round(wall_s, 2),
        "methods": [r.summary for r in results],
        "nodes": {r.method: r.nodes for r in results},
        "staleness_hist": {r.method: {str(k): v for k, v in sorted(r.staleness_hist.items())} for r in results},
        "task_split_by_link": {r.method: r.split for r in results},
    }
    write_json(out / "summary.json", doc)
    write_csv(out / "summary.csv", [r.summary for r in results])
    write_json(out / "scenario.json", scenario.raw)
    files = [out / "summary.json", out / "summary.csv", out / "scenario.json"]
    files += [out / f"{r.method}.jsonl" for r in results]
    if plots:
        from simulations.plots import plot_all

        files += plot_all(results, out, scenario.target_accuracy, scenario.name)
    return files


#: The files that describe a finished run (``write_outputs``; a ``--seeds`` folder's top ones too).
RUN_FILES = ("summary.json", "summary.csv", "scenario.json")


def clear_run_files(out: Path) -> None:
    """Remove an earlier simulation's ``RUN_FILES`` from ``out`` before this run writes its rows there: a run that
    does not finish then leaves rows and no summary (``fedcomp check``: did not finish), never rows beside another
    run's summary that the check would take for that run's. ``ValueError`` for a ``summary.json`` that is no
    simulation's (a deployment's: ``out`` is another tool's folder), before anything is removed."""
    summary = out / "summary.json"
    if summary.exists():
        try:
            ours = "methods" in json.loads(summary.read_text())
        except (OSError, ValueError, TypeError):
            ours = False
        if not ours:
            raise ValueError(f"--out {out} holds a summary.json that is no simulation's (a deployment's run?); "
                             "pick another --out")
    for name in RUN_FILES:
        (out / name).unlink(missing_ok=True)


def earlier_files(out: Path, written: Sequence[Path]) -> list[str]:
    """Per-method rows and plots in ``out`` that this run did not write: an earlier run's, left as they were (a
    folder given to ``--out`` is never emptied), so the caller can say they are not this run's."""
    mine = {p.name for p in written}
    return sorted(p.name for p in out.iterdir() if p.suffix in (".jsonl", ".png") and p.name not in mine)


def seeds_table(rows: Sequence[dict[str, Any]]) -> str:
    """The table over seeds (``simulations.seeds.aggregate`` rows): final accuracy, time to target and each
    speed-up as mean (min–max); ``[n/N]`` where only n of the N seeds reached the target; mean wire bytes."""
    if not rows:
        return "(no rows)"
    n = len(rows[0]["seeds"])
    ratios = ["speedup", *sorted(k for k in rows[0] if k.startswith("speedup_vs_"))]
    out = []
    for r in rows:
        line = {"method": r["method"], "accuracy": mean_min_max(r["accuracy"], 4, n),
                "time_to_target_s": mean_min_max(r["time_to_target_s"], 2, n)}
        line.update({k: mean_min_max(r[k], 2, n) for k in ratios})
        total = r["wire_bytes_total"]["mean"]
        line["wire_MB_total"] = "-" if total is None else f"{total / 1e6:.1f}"
        out.append(line)
    return table(out, ["method", "accuracy", "time_to_target_s", *ratios, "wire_MB_total"])


def seeds_split_table(split: dict[str, Any]) -> str:
    """Per method and link, each part of a task's mean time, averaged over the seeds (``seeds.split_by_link``)."""
    rows = [{"method": m, "link": link, "compute_s": sp["task_compute_s"], "codec_s": sp["task_codec_s"],
             "transfer_s": sp["task_transfer_s"], "latency_s": sp["task_latency_s"], "queue_s": sp["task_queue_s"],
             "total_s": sp["task_total_s"]}
            for m, links in split.items() for link, sp in sorted(links.items())]
    return table(rows)


def write_seed_outputs(scenario: Scenario, rows: Sequence[dict[str, Any]], split: dict[str, Any], out: Path,
                       wall_s: float) -> list[Path]:
    """``summary.json`` (every figure as mean, min, max, n and the per-seed values; the split by link) and
    ``summary.csv`` (``seeds.flat`` rows) of a run over seeds; each seed's own outputs are in ``seed-N/``."""
    doc = {"scenario": scenario.name, "seeds": rows[0]["seeds"] if rows else [],
           "target_accuracy": scenario.target_accuracy, "baseline": scenario.baseline,
           "num_clients": scenario.num_clients, "wall_s": round(wall_s, 2),
           "note": "ratios are per seed (paired), then mean (min-max) over the seeds",
           "methods": list(rows), "task_split_by_link": split}
    write_json(out / "summary.json", doc)
    write_csv(out / "summary.csv", [flat(r) for r in rows])
    return [out / "summary.json", out / "summary.csv"]

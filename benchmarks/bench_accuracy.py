"""Accuracy of compressed data-parallel training against dense SGD, same data, epochs and seeds.

4 in-process workers on the shipped digits data (``fedcomp.tools.dataparallel``). Each (method, seed) run is
single-threaded; ``--jobs`` runs that many in parallel. Prints a table (mean and per-seed accuracy,
difference to dense, whole-run and steady-state compression) and writes JSON.

    python benchmarks/bench_accuracy.py --epochs 150 --seeds 0,1,2 --json results/bench_accuracy.json
"""

from __future__ import annotations

import argparse
import statistics
import sys
from concurrent.futures import ProcessPoolExecutor
from dataclasses import replace
from pathlib import Path

from fedcomp.tools.dataparallel import DPConfig, run
from fedcomp.tools.report import table, write_json


def _one(cfg: DPConfig) -> dict:
    import torch

    torch.set_num_threads(1)
    return run(cfg).summary() | {"seed": cfg.seed}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--methods", default="dense,dgc")
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--epochs", type=int, default=150)
    p.add_argument("--warmup-epochs", type=float, default=4.0)
    p.add_argument("--model", default="cnn")
    p.add_argument("--lr", type=float, default=DPConfig.lr)
    p.add_argument("--lr-schedule", default=DPConfig.lr_schedule)
    p.add_argument("--jobs", type=int, default=2)
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)

    base = DPConfig(epochs=args.epochs, warmup_epochs=args.warmup_epochs, model=args.model, lr=args.lr,
                    lr_schedule=args.lr_schedule)
    methods = args.methods.split(",")
    seeds = [int(s) for s in args.seeds.split(",")]
    cfgs = [replace(base, method=m, seed=s) for m in methods for s in seeds]
    with ProcessPoolExecutor(args.jobs) as pool:
        runs = list(pool.map(_one, cfgs))
    rows = []
    for m in methods:
        mine = [r for r in runs if r["method"] == m]
        rows.append({
            "method": m,
            "accuracy_mean": statistics.mean(r["accuracy"] for r in mine),
            "per_seed": " ".join(f"{r['accuracy']:.2f}" for r in mine),
            "steps": mine[0]["steps"],
            "bytes_per_step": statistics.mean(r["bytes_per_step"] for r in mine),
            "compression": statistics.mean(r["compression"] for r in mine),
            "steady_compression": statistics.mean(r["steady_compression"] for r in mine),
        })
    for r in rows:
        r["delta_vs_" + methods[0]] = r["accuracy_mean"] - rows[0]["accuracy_mean"]
    print(f"model {args.model}, digits, 4 workers x batch {base.batch_size}, {args.epochs} epochs, seeds {seeds}")
    print(table(rows))
    if args.json:
        write_json(args.json, {"config": vars(args) | {"json": str(args.json)}, "summary": rows, "runs": runs})
    return 0


if __name__ == "__main__":
    sys.exit(main())

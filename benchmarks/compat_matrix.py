"""The compatibility matrix of docs/flower.md: every model family x every stock strategy, plain vs compressed.

Each cell runs the same ordinary Flower app (tests/compatkit.py: own model, scikit-learn's digits over 4 nodes,
one epoch of SGD per round, central evaluation) twice on the in-process federation of tests/flowerkit.py: as
Flower users run it, and with ``compression_mod`` + ``Compressed(strategy, compressor, density=...)``. It prints,
per cell, accuracy at rounds 5, 10 and 20 (plain / compressed), the uplink ratio as payload bytes (array data vs
fedcomp blob) and as Flower object bytes (every serialized Flower object of the train replies), and the
conservation error (Σ applied + Σ residuals + Σ pending vs Σ computed). A cell that raises is reported, not fatal;
the exit code is 1 if any cell crashed or lost mass.

    python benchmarks/compat_matrix.py [--rounds 20] [--families mlp,bn-cnn] [--strategies FedAvg,FedAdam]
        [--compressor dgc+int8] [--density 0.02] [--downlink dense] [--json results/compat/matrix.json]
        [--workers 2]
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
from flwr.common.logger import FLOWER_LOGGER  # noqa: E402

from tests.compatkit import FAMILIES, STRATEGIES, run_cell  # noqa: E402

CHECKPOINTS = (5, 10, 20)


def _worker() -> None:
    torch.set_num_threads(1)
    FLOWER_LOGGER.setLevel(logging.ERROR)


def cell(family: str, strategy: str, args: argparse.Namespace) -> dict:
    """One row: both runs, or the error that stopped one."""
    started = time.perf_counter()
    row: dict = {"family": family, "strategy": strategy}
    try:
        plain = run_cell(family, strategy, args.rounds, compressed=False)
        comp = run_cell(family, strategy, args.rounds, compressor=args.compressor, density=args.density,
                        downlink=args.downlink)
    except Exception as exc:  # noqa: BLE001 - a crashing cell is a finding, reported in the table
        row.update(ok=False, error=f"{type(exc).__name__}: {exc}")
        return row
    row.update(
        ok=True,
        plain={r: round(plain.accuracy[r], 4) for r in CHECKPOINTS if r in plain.accuracy},
        compressed={r: round(comp.accuracy[r], 4) for r in CHECKPOINTS if r in comp.accuracy},
        payload_ratio=round(plain.payload_bytes / comp.payload_bytes, 1),
        flower_ratio=round(plain.uplink_bytes / comp.uplink_bytes, 1),
        conservation=comp.conservation,
        seconds=round(time.perf_counter() - started, 1),
    )
    return row


def line(row: dict) -> str:
    if not row["ok"]:
        return f"| {row['family']} | {row['strategy']} | **crash**: {row['error'][:80]} | | | | |"
    acc = " | ".join(
        f"{100 * row['plain'][r]:.1f} / {100 * row['compressed'][r]:.1f}" for r in CHECKPOINTS if r in row["plain"]
    )
    return (f"| {row['family']} | {row['strategy']} | {acc} | {row['payload_ratio']}x | {row['flower_ratio']}x | "
            f"{row['conservation']:.0e} |")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--families", default=",".join(FAMILIES), help="comma-separated (default: all)")
    ap.add_argument("--strategies", default=",".join(STRATEGIES), help="comma-separated (default: all)")
    ap.add_argument("--compressor", default="dgc+int8")
    ap.add_argument("--density", type=float, default=0.02)
    ap.add_argument("--downlink", default="dense")
    ap.add_argument("--json", default="", help="write the rows here")
    ap.add_argument("--workers", type=int, default=2, help="cells run in this many processes (one thread each)")
    args = ap.parse_args(argv)
    families, strategies = args.families.split(","), args.strategies.split(",")
    unknown = [f for f in families if f not in FAMILIES] + [s for s in strategies if s not in STRATEGIES]
    if unknown:
        ap.error(f"unknown names: {unknown}; families {list(FAMILIES)}, strategies {list(STRATEGIES)}")
    FLOWER_LOGGER.setLevel(logging.ERROR)
    shown = " | ".join(f"r{r} plain / comp" for r in CHECKPOINTS if r <= args.rounds)
    print(f"{args.compressor}, density {args.density}, downlink {args.downlink}, {args.rounds} rounds")
    print(f"| model | strategy | {shown} | payload up | Flower objects up | conservation |")
    print("|---|---|" + "---|" * (len([r for r in CHECKPOINTS if r <= args.rounds]) + 3))
    cells = [(f, s) for f in families for s in strategies]
    with ProcessPoolExecutor(args.workers, initializer=_worker) as pool:
        futures = [pool.submit(cell, f, s, args) for f, s in cells]
        for done in as_completed(futures):
            print(line(done.result()), flush=True)  # in the order they finish; the JSON keeps the matrix order
    rows = [f.result() for f in futures]
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({"args": vars(args), "rows": rows}, indent=1))
    bad = [r for r in rows if not r["ok"] or r["conservation"] > 1e-5]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())

"""The compatibility matrix of docs/flower.md: every model family x every stock strategy, plain vs compressed.

Each cell runs the same ordinary Flower app (benchmarks/compatkit.py: own model, scikit-learn's digits over 4 nodes,
one epoch of SGD per round, central evaluation) twice on the in-process federation of benchmarks/flowerkit.py: as
Flower users run it, and with ``compression_mod`` + ``Compressed(strategy, compressor, density=...)``. It prints,
per cell, accuracy at rounds 5, 10 and 20 (plain / compressed), the uplink ratio as payload bytes (array data vs
fedcomp blob) and as Flower object bytes (every serialized Flower object of the train replies), and the
conservation error (Σ applied + Σ residuals + Σ pending vs Σ computed). A cell that raises is reported, not fatal;
the exit code is 1 if any cell crashed or lost mass.

    python benchmarks/compat_matrix.py [--rounds 20] [--families mlp,bn-cnn] [--strategies FedAvg,FedAdam]
        [--compressor dgc+int8 --density 0.02] [--downlink dense] [--json results/compat/matrix.json]
        [--options "warmup_epochs=4"] [--strategy-options "eta=0.1"] [--workers 2]
    python benchmarks/compat_matrix.py --table A.json B.json     # one table from several runs
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

from benchmarks.compatkit import FAMILIES, STRATEGIES, run_cell  # noqa: E402

CHECKPOINTS = (5, 10, 20)


def _number(text: str) -> float | str:
    try:
        return float(text)
    except ValueError:
        return text


def _worker() -> None:
    torch.set_num_threads(1)
    FLOWER_LOGGER.setLevel(logging.ERROR)


def cell(family: str, strategy: str, args: argparse.Namespace) -> dict:
    """One row: both runs, or the error that stopped one."""
    started = time.perf_counter()
    row: dict = {"family": family, "strategy": strategy}
    runs = {}
    for side, kw in (("plain", args.plain_options), ("compressed", args.options)):
        try:
            runs[side] = run_cell(family, strategy, args.rounds, **kw)
        except Exception as exc:  # noqa: BLE001 - a crashing run is a finding, reported in the table
            row[f"{side}_error"] = f"{type(exc).__name__}: {exc}"
    plain, comp = runs.get("plain"), runs.get("compressed")
    row["ok"] = comp is not None
    if plain is not None:
        row["plain"] = {r: round(plain.accuracy[r], 4) for r in CHECKPOINTS if r in plain.accuracy}
    if comp is not None:
        row["compressed"] = {r: round(comp.accuracy[r], 4) for r in CHECKPOINTS if r in comp.accuracy}
        row["conservation"] = comp.conservation
        row["payload_up_per_reply"] = round(comp.payload_bytes / comp.replies)
        row["flower_up_per_reply"] = round(comp.uplink_bytes / comp.replies)
    if plain is not None and comp is not None:
        row["payload_ratio"] = round(plain.payload_bytes / comp.payload_bytes, 1)
        row["flower_ratio"] = round(plain.uplink_bytes / comp.uplink_bytes, 1)
    row["seconds"] = round(time.perf_counter() - started, 1)
    return row


def line(row: dict, rounds: int) -> str:
    """One markdown row; a run that raised shows as ``crash`` (the JSON keeps the error)."""
    def acc(side: str, r: int) -> str:
        return f"{100 * row[side][r]:.1f}" if side in row else "crash"

    cells = " | ".join(f"{acc('plain', r)} / {acc('compressed', r)}" for r in CHECKPOINTS if r <= rounds)
    ratios = (f"{row['payload_ratio']}x | {row['flower_ratio']}x" if "payload_ratio" in row else
              f"{row.get('payload_up_per_reply', '-')} B | {row.get('flower_up_per_reply', '-')} B")
    cons = f"{row['conservation']:.0e}" if "conservation" in row else "-"
    return f"| {row['family']} | {row['strategy']} | {cells} | {ratios} | {cons} |"


def table(paths: list[str], gap: float = 0.02, ratio: float = 20.0) -> str:
    """One markdown table from several runs' JSON (same cells, one compressed setting each): accuracy at each
    checkpoint as plain (the first run's) / setting 1 / setting 2 ..., each setting's payload and Flower object
    ratios, and which settings meet the goal at the last round (within ``gap`` of the plain accuracy shown, at
    >= ``ratio``x fewer payload bytes)."""
    runs = [json.loads(Path(p).read_text()) for p in paths]
    names = [r["args"]["compressor"] + (f" {r['args']['density']:g}" if r["args"].get("density") else "")
             for r in runs]
    rounds = [c for c in CHECKPOINTS if c <= runs[0]["args"]["rounds"]]
    settings = " / ".join(names)
    heads = " | ".join(f"r{c}: plain / {settings}" if i == 0 else f"r{c}" for i, c in enumerate(rounds))
    out = [f"| model | strategy | {heads} | payload up ÷ ({settings}) | Flower objects up ÷ | goal at r{rounds[-1]} |",
           "|---|---|" + "---|" * (len(rounds) + 3)]
    by_cell = [{(row["family"], row["strategy"]): row for row in run["rows"]} for run in runs]

    def pct(row: dict, side: str, c: int) -> str:
        return f"{100 * row[side][str(c)]:.1f}" if side in row else "crash"

    for key, first in by_cell[0].items():
        rows = [cells.get(key, {}) for cells in by_cell]
        acc = " | ".join(" / ".join([pct(first, "plain", c)] + [pct(r, "compressed", c) for r in rows]) for c in rounds)
        ratios = " | ".join(" / ".join(f"{r.get(k, '–')}" for r in rows) for k in ("payload_ratio", "flower_ratio"))
        last = str(rounds[-1])
        met = [n for n, r in zip(names, rows, strict=True) if "plain" in first and "payload_ratio" in r
               and r["compressed"][last] >= first["plain"][last] - gap and r["payload_ratio"] >= ratio]
        goal = ", ".join(met) if met else ("plain crashes" if "plain" not in first else "**missed**")
        out.append(f"| {key[0]} | {key[1]} | {acc} | {ratios} | {goal} |")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--families", default=",".join(FAMILIES), help="comma-separated (default: all)")
    ap.add_argument("--strategies", default=",".join(STRATEGIES), help="comma-separated (default: all)")
    ap.add_argument("--compressor", default="dgc+int8")
    ap.add_argument("--density", type=float, default=None, help="for sparsifiers (top-k, DGC): kept fraction")
    ap.add_argument("--downlink", default="dense")
    ap.add_argument("--json", default="", help="write the rows here")
    ap.add_argument("--workers", type=int, default=2, help="cells run in this many processes (one thread each)")
    ap.add_argument("--options", default="", help="more Compressed options, key=value ... (e.g. warmup_epochs=4)")
    ap.add_argument("--strategy-options", default="", help="attributes of the strategy, key=value ... (eta=0.1)")
    ap.add_argument("--table", nargs="+", metavar="JSON", help="only print one table from earlier runs' JSON")
    args = ap.parse_args(argv)
    if args.table:
        print(table(args.table))
        return 0
    extra = dict(kv.split("=", 1) for kv in args.options.split())
    args.options = {"compressor": args.compressor, "downlink": args.downlink}
    args.options.update({k: _number(v) for k, v in extra.items()})
    if args.density is not None:
        args.options["density"] = args.density
    strategy_options = {k: _number(v) for k, v in (kv.split("=", 1) for kv in args.strategy_options.split())}
    args.plain_options = {"compressed": False, "strategy_options": strategy_options}
    args.options["strategy_options"] = strategy_options
    families, strategies = args.families.split(","), args.strategies.split(",")
    unknown = [f for f in families if f not in FAMILIES] + [s for s in strategies if s not in STRATEGIES]
    if unknown:
        ap.error(f"unknown names: {unknown}; families {list(FAMILIES)}, strategies {list(STRATEGIES)}")
    FLOWER_LOGGER.setLevel(logging.ERROR)
    setting = ", ".join(f"{k}={v}" for k, v in args.options.items() if k != "strategy_options")
    print(f"Compressed({setting}), strategy settings {strategy_options or 'as in benchmarks/compatkit.py'}, "
          f"{args.rounds} rounds")
    heads = " | ".join(f"r{r} plain / comp" for r in CHECKPOINTS if r <= args.rounds)
    print(f"| model | strategy | {heads} | payload up | Flower objects up | conservation |")
    print("|---|---|" + "---|" * (len([r for r in CHECKPOINTS if r <= args.rounds]) + 3))
    cells = [(f, s) for f in families for s in strategies]
    with ProcessPoolExecutor(args.workers, initializer=_worker) as pool:
        futures = [pool.submit(cell, f, s, args) for f, s in cells]
        for done in as_completed(futures):
            print(line(done.result(), args.rounds), flush=True)  # as they finish; the JSON keeps the matrix order
    rows = [f.result() for f in futures]
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({"args": vars(args), "rows": rows}, indent=1))
    bad = [r for r in rows if not r["ok"] or r["conservation"] > 1e-5]
    crashed_plain = [f"{r['family']}/{r['strategy']}" for r in rows if "plain_error" in r]
    if crashed_plain:
        print(f"plain Flower raised in: {', '.join(crashed_plain)} (errors in the JSON)")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())

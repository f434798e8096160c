"""DGC step speed on CPU, as ratios measured side by side in one run.

For each size (one 2-D float32 tensor) and the given density:

  (a) dgc     = "dgc" memory compensate + sampled-threshold selection + wire encode (fedcomp.build("dgc", ...))
  (b) topk    = the same memory + exact torch.topk selection + wire encode (fedcomp.build("topk", memory="dgc"))
  (c) add     = one in-place torch add pass over tensors of the same size (x.add_(y))

Goals: (a) at least 5x faster than (b), at most 4x (c). Compress-only times (memory + selection, no encode) are
printed too. Each rep runs (c), (a), (c), (b) back to back after warm-up steps. Reported: the median over reps,
the minimum (on a shared machine, preemption by other processes inflates the longer steps' medians most) and the
median of the per-rep ratios (the sides ran next to each other, so slow drifts in machine load cancel).

    python benchmarks/bench_speed.py [--sizes 1000000 25000000] [--density 0.001] [--reps 7] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time
from collections.abc import Callable

import torch

import fedcomp
from fedcomp.payload import Update


def shape_for(n: int) -> tuple[int, int]:
    """A near-square 2-D shape with exactly n elements."""
    rows = int(math.isqrt(n))
    while n % rows:
        rows -= 1
    return rows, n // rows


class Stepper:
    """One client's send step over one tensor: compress (memory + selection) and encode, timed separately."""

    def __init__(self, name: str, spec: fedcomp.ModelSpec, grads: list[torch.Tensor], **options) -> None:
        self.pipe = fedcomp.build(name, spec, **options)
        self.spec, self.grads, self.i = spec, grads, 0

    def __call__(self) -> tuple[float, float, int]:
        g = self.grads[self.i % len(self.grads)]
        self.i += 1
        t0 = time.perf_counter()
        payloads = self.pipe.compress({"w": g})
        t1 = time.perf_counter()
        blob = fedcomp.encode(Update(payloads, 0, self.i, 0), self.spec)
        t2 = time.perf_counter()
        return t1 - t0, t2 - t0, len(blob)


def timed(fn: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def bench_size(n: int, density: float, reps: int, warmup: int, seed: int) -> dict:
    shape = shape_for(n)
    gen = torch.Generator().manual_seed(seed)
    spec = fedcomp.ModelSpec.from_tensors({"w": torch.empty(shape)})
    grads = [torch.randn(shape, generator=gen) for _ in range(3)]
    dgc = Stepper("dgc", spec, grads, density=density, seed=seed)
    topk = Stepper("topk", spec, grads, memory="dgc", density=density)
    x, y = torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)
    rows: dict[str, list[float]] = {k: [] for k in ("dgc", "dgc_compress", "topk", "topk_compress", "add")}
    nbytes = 0
    for rep in range(warmup + reps):
        # add, dgc, add, topk: each rep's add is the mean of the two passes around its dgc step
        ta1 = timed(lambda: x.add_(y))
        dc, dt, nbytes = dgc()
        ta2 = timed(lambda: x.add_(y))
        tc, tt, _ = topk()
        if rep >= warmup:
            for key, val in zip(rows, (dt, dc, tt, tc, (ta1 + ta2) / 2), strict=True):
                rows[key].append(val)

    def summary(stat: Callable[[list[float]], float]) -> dict:
        ms = {k: stat(v) * 1e3 for k, v in rows.items()}
        return {
            "ms": ms,
            "speedup_vs_topk": ms["topk"] / ms["dgc"],
            "speedup_vs_topk_compress_only": ms["topk_compress"] / ms["dgc_compress"],
            "dgc_over_add": ms["dgc"] / ms["add"],
            "dgc_compress_over_add": ms["dgc_compress"] / ms["add"],
        }

    def paired(num: str, den: str) -> float:
        """Median over reps of the per-rep ratio: the two sides ran back to back, so slow drifts cancel."""
        return statistics.median(a / b for a, b in zip(rows[num], rows[den], strict=True))

    return {
        "numel": n,
        "shape": list(shape),
        "density": density,
        "dgc_bytes": nbytes,
        "median": summary(statistics.median),
        # the fastest rep of each: an estimate without preemption by other processes on a shared machine
        "min": summary(min),
        "paired": {
            "speedup_vs_topk": paired("topk", "dgc"),
            "speedup_vs_topk_compress_only": paired("topk_compress", "dgc_compress"),
            "dgc_over_add": paired("dgc", "add"),
            "dgc_compress_over_add": paired("dgc_compress", "add"),
        },
    }


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=[1_000_000, 25_000_000])
    ap.add_argument("--density", type=float, default=0.001)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    results = [bench_size(n, args.density, args.reps, args.warmup, args.seed) for n in args.sizes]
    out = {
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "reps": args.reps,
        "results": results,
        "goals": {"speedup_vs_topk": ">= 5", "dgc_over_add": "<= 4"},
    }
    head = (
        f"{'numel':>10} {'stat':>6} {'dgc ms':>8} {'(cmp)':>8} {'topk ms':>9} {'(cmp)':>9} {'add ms':>8} "
        f"{'topk/dgc':>9} {'(cmp)':>7} {'dgc/add':>8} {'(cmp)':>7} {'bytes':>8}"
    )
    threads = torch.get_num_threads()
    print(f"torch {torch.__version__}, {threads} threads, density {args.density}, {args.reps} reps")
    print(head)
    for r in results:
        for stat in ("median", "min", "paired"):
            q = r[stat]
            m = q.get("ms")
            times = f"{'':>8} {'':>8} {'':>9} {'':>9} {'':>8}"
            if m:
                times = f"{m['dgc']:>8.2f} {m['dgc_compress']:>8.2f} {m['topk']:>9.2f} {m['topk_compress']:>9.2f} "
                times += f"{m['add']:>8.3f}"
            print(
                f"{r['numel']:>10} {stat:>6} {times} {q['speedup_vs_topk']:>9.1f} "
                f"{q['speedup_vs_topk_compress_only']:>7.1f} {q['dgc_over_add']:>8.2f} "
                f"{q['dgc_compress_over_add']:>7.2f} {r['dgc_bytes']:>8}"
            )
    print("(cmp) = compress only: memory + selection, no wire encode. Goals: topk/dgc >= 5, dgc/add <= 4.")
    print("median / min: of each column's times; paired: median of per-rep ratios (adjacent runs, drift cancels).")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)
    return out


if __name__ == "__main__":
    main()

"""DGC step speed and sampled-threshold selection on CPU, as ratios measured side by side in one run.

For each size (one 2-D float32 tensor) and the given density:

  (a) dgc     = "dgc" memory compensate + sampled-threshold selection + wire encode (fedcomp.build("dgc", ...))
  (b) topk    = the same memory + exact torch.topk selection + wire encode (fedcomp.build("topk", memory="dgc"))
  (c) add     = one in-place torch add pass over tensors of the same size (x.add_(y))

Goals: (a) at least 5x faster than (b), at most 4x (c). Compress-only times (memory + selection, no encode) are
printed too. Each rep runs (c), (a), (c), (b) back to back after warm-up steps. Reported: the median over reps,
the minimum (on a shared machine, preemption by other processes inflates the longer steps' medians most) and the
median of the per-rep ratios (the sides ran next to each other, so slow drifts in machine load cancel).

Selection table (``--parts select``): ``fedcomp.compressors.selection.select`` on tensors with a log-normal scale
per row or
per column of their 2-D view ``(shape[0], -1)``, with the sample stride before the fix (``numel // size``, which
shares factors with row lengths: stride 8 on (512, 64), 99 on 3x3 convs) and after it (``coprime_stride``):
fallback rate (share of calls ending in an exact top-k), mean threshold passes, and the median select time over
the same calls (before/after alternate call by call), next to one exact ``torch.topk``.

    python benchmarks/bench_speed.py [--parts step select] [--sizes 1000000 25000000] [--density 0.001]
        [--reps 7] [--select-shapes 512x64 256x256x3x3 ...] [--select-densities 0.001 0.01]
        [--select-tensors 20] [--select-calls 8] [--json out.json]
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
from fedcomp.compressors.selection import coprime_stride, sample_plan, select
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


# ----------------------------------------------------------------------------------------------- selection


def floor_stride(n: int, size: int) -> int:
    """The sample stride before the fix (benchmark only): ``n // size``."""
    return n // size


STRIDE_RULES = {"before": floor_stride, "after": coprime_stride}


def scaled(shape: tuple[int, ...], kind: str, seed: int) -> torch.Tensor:
    """Flat normal values times a log-normal (sigma 1) scale per row or per column of the 2-D view."""
    gen = torch.Generator().manual_seed(seed)
    rows, cols = shape[0], math.prod(shape[1:])
    scale = torch.randn(rows if kind == "row" else cols, generator=gen).exp()
    x = torch.randn(rows, cols, generator=gen) * (scale[:, None] if kind == "row" else scale)
    return x.view(-1)


def time_topk(x: torch.Tensor, k: int) -> float:
    """Milliseconds of one exact top-k by magnitude."""
    t0 = time.perf_counter()
    torch.topk(x.abs(), k, sorted=False)
    return (time.perf_counter() - t0) * 1e3


def bench_select(shape: tuple[int, ...], kind: str, density: float, tensors: int, calls: int) -> dict:
    """Fallback rate, passes and select time with each stride rule over ``tensors`` draws x ``calls`` sample
    starts (a stride-``s`` sample has only ``s`` distinct starts, so the draws carry most of the variation); the
    rules alternate call by call."""
    stats = {rule: {"exact": 0, "passes": 0, "ms": []} for rule in STRIDE_RULES}
    topk_ms = []
    for t in range(tensors):
        x = scaled(shape, kind, t)
        k = max(1, round(density * x.numel()))
        topk_ms.append(time_topk(x, k))
        for seed in range(calls):
            order = list(STRIDE_RULES) if seed % 2 else list(STRIDE_RULES)[::-1]
            for rule in order:
                gen = torch.Generator().manual_seed(seed)
                t0 = time.perf_counter()
                sel = select(x, k, generator=gen, stride_rule=STRIDE_RULES[rule])
                stats[rule]["ms"].append((time.perf_counter() - t0) * 1e3)
                stats[rule]["exact"] += sel.exact
                stats[rule]["passes"] += sel.passes
    n, total = math.prod(shape), tensors * calls
    out = {"shape": list(shape), "scale": kind, "density": density, "calls": total,
           "topk_ms": statistics.median(topk_ms)}
    for rule, st in stats.items():
        out[rule] = {
            "stride": sample_plan(n, None, 0.01, 4096, stride_rule=STRIDE_RULES[rule])[1],
            "fallback": st["exact"] / total,
            "passes": st["passes"] / total,
            "ms": statistics.median(st["ms"]),
        }
    pairs = zip(stats["before"]["ms"], stats["after"]["ms"], strict=True)
    out["paired_before_over_after"] = statistics.median(b / a for b, a in pairs)
    return out


def print_select(results: list[dict]) -> None:
    print(f"{'shape':>14} {'scale':>6} {'density':>7} {'stride':>7} {'fallback':>13} {'passes':>11} "
          f"{'select ms':>13} {'ratio':>6} {'topk ms':>8}")
    for r in results:
        b, a = r["before"], r["after"]
        print(
            f"{'x'.join(map(str, r['shape'])):>14} {r['scale']:>6} {r['density']:>7} "
            f"{b['stride']:>3}->{a['stride']:<3} {b['fallback']:>6.0%}->{a['fallback']:<5.0%} "
            f"{b['passes']:>5.2f}->{a['passes']:<4.2f} {b['ms']:>6.2f}->{a['ms']:<6.2f} "
            f"{r['paired_before_over_after']:>6.2f} {r['topk_ms']:>8.2f}"
        )
    print("before -> after: sample stride numel // size -> coprime_stride. fallback: share of calls ending in an")
    print("exact top-k; select ms: median per call; ratio: median of per-call before/after times (adjacent calls).")


def parse_shape(text: str) -> tuple[int, ...]:
    return tuple(int(d) for d in text.split("x"))


def run_steps(args: argparse.Namespace) -> dict:
    results = [bench_size(n, args.density, args.reps, args.warmup, args.seed) for n in args.sizes]
    print_steps(results, args)
    return {"results": results, "goals": {"speedup_vs_topk": ">= 5", "dgc_over_add": "<= 4"}}


def run_select(args: argparse.Namespace) -> dict:
    results = [
        bench_select(shape, kind, density, args.select_tensors, args.select_calls)
        for shape in args.select_shapes
        for density in args.select_densities
        for kind in ("row", "column")
    ]
    print(f"sampled-threshold selection, {args.select_tensors} tensors x {args.select_calls} calls per row")
    print_select(results)
    return {"select": results}


PARTS = {"step": run_steps, "select": run_select}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=[1_000_000, 25_000_000])
    ap.add_argument("--density", type=float, default=0.001)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument("--parts", nargs="+", choices=sorted(PARTS), default=["step", "select"])
    ap.add_argument("--select-shapes", type=parse_shape, nargs="+",
                    default=[(512, 64), (64, 64, 3, 3), (256, 256, 3, 3), (512, 512, 3, 3), (1024, 1024)])
    ap.add_argument("--select-densities", type=float, nargs="+", default=[0.001, 0.01])
    ap.add_argument("--select-tensors", type=int, default=20, help="tensor draws per selection row")
    ap.add_argument("--select-calls", type=int, default=8, help="sample starts (generator seeds) per tensor draw")
    ap.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    out = {"torch": torch.__version__, "threads": torch.get_num_threads(), "reps": args.reps}
    for part in args.parts:
        out.update(PARTS[part](args))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)
    return out


def print_steps(results: list[dict], args: argparse.Namespace) -> None:
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


if __name__ == "__main__":
    main()

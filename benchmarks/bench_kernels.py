"""Benchmark of the Triton kernel path (fedcomp.kernels) against the torch reference and an exact torch.topk path.

For each size (fp32 elements) it prints the device name, the device-to-device copy bandwidth measured in the same
run (``dst.copy_(src)``: 8 B/element), and per kernel the median time, the achieved bandwidth (nominal bytes per
element over the median time), the fraction of the copy bandwidth and the speedups. Goals (docs/kernels.md):
fused DGC step >= 70% of the copy bandwidth at 100M elements and >= 5x faster than the torch.topk path.

    python benchmarks/bench_kernels.py                        # 1M, 25M, 100M on the CUDA device
    python benchmarks/bench_kernels.py --sizes 1M,4M --json out.json
    python benchmarks/bench_kernels.py --interpret            # no GPU: tiny sizes under Triton's interpreter
    python benchmarks/bench_kernels.py --sizes 100M --sweep   # also time BLOCK x num_warps of the DGC kernels

Without a CUDA device it says so and exits 0 (``--interpret`` runs tiny sizes on the CPU; the timings then
measure the interpreter, not the kernels).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def parse_size(text: str) -> int:
    mult = {"K": 10**3, "M": 10**6, "G": 10**9}
    text = text.strip().upper()
    return int(float(text[:-1]) * mult[text[-1]]) if text[-1] in mult else int(text)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="1M,25M,100M", help="comma-separated element counts (K/M suffixes)")
    ap.add_argument("--density", type=float, default=0.001, help="DGC density (k = density * n)")
    ap.add_argument("--reps", type=int, default=20, help="timed repetitions per measurement (median reported)")
    ap.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    ap.add_argument("--sweep", action="store_true",
                    help="also time the DGC step for each BLOCK x num_warps in SWEEP at the largest size")
    ap.add_argument("--interpret", action="store_true",
                    help="no GPU: run tiny sizes under TRITON_INTERPRET=1 on the CPU (timings meaningless)")
    args = ap.parse_args(argv)
    if args.interpret:
        os.environ["TRITON_INTERPRET"] = "1"  # before any kernel module (and so triton) is imported
    import torch

    if not torch.cuda.is_available() and not args.interpret:
        print("bench_kernels: no CUDA device here; the Triton kernels need a GPU to be timed. "
              "Correctness runs on the CPU in tests/test_kernels.py (Triton interpreter); "
              "--interpret runs tiny sizes here, with meaningless timings.")
        return 0
    device = torch.device("cuda" if torch.cuda.is_available() and not args.interpret else "cpu")
    sizes = [parse_size(s) for s in args.sizes.split(",")]
    if device.type == "cpu":
        sizes = [min(s, 1 << 16) for s in sizes]
        args.reps = min(args.reps, 3)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU (Triton interpreter)"
    results = {"device": name, "density": args.density, "sizes": []}
    print(f"device: {name}   density: {args.density}   reps: {args.reps} (median)")
    for n in sizes:
        row = bench_size(n, args.density, args.reps, device)
        results["sizes"].append(row)
        print_row(row)
    if args.sweep:
        results["sweep"] = sweep(max(sizes), args.density, args.reps, device)
    if device.type == "cpu":
        print("note: CPU interpreter timings measure numpy, not the kernels; they are not results.")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return 0


def timer(fn, reps: int, device) -> float:
    """Median seconds of ``fn()`` over ``reps`` runs after 3 warm-up runs (CUDA events on a GPU)."""
    import torch

    for _ in range(3):
        fn()
    times = []
    for _ in range(reps):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t)
    return statistics.median(times)


def bench_size(n: int, density: float, reps: int, device) -> dict:
    import torch

    from fedcomp.compressors import selection
    from fedcomp.compressors.blockwise import BlockwiseConfig, Int8Quantizer
    from fedcomp.kernels.dgc import fused_dgc_step
    from fedcomp.kernels.quant import ef_quantize
    from fedcomp.kernels.scatter import scatter_add
    from fedcomp.memory.dgc_math import accumulate_, mask_
    from fedcomp.payload import TensorPayload, Values

    k = max(1, round(density * n))
    gen = torch.Generator(device=device).manual_seed(0)
    g = torch.randn(n, device=device, generator=gen)
    u, v = torch.zeros(n, device=device), torch.zeros(n, device=device)
    src, dst = torch.randn(n, device=device, generator=gen), torch.empty(n, device=device)
    out: dict = {"n": n, "k": k}

    t_copy = timer(lambda: dst.copy_(src), reps, device)
    copy_bw = 8 * n / t_copy
    out["copy"] = {"median_s": t_copy, "GBps": copy_bw / 1e9}
    sample_gen = torch.Generator().manual_seed(0)

    def triton_dgc():
        fused_dgc_step(g, u, v, k=k, generator=sample_gen, backend="triton")

    def triton_pass():  # the fused pass alone: fixed infinite threshold, so it streams without selecting
        fused_dgc_step(g, u, v, k=k, threshold=float("inf"), backend="triton")

    def send(idx):  # DGCMemory.update of an fp32 payload: v emptied and u masked at the sent positions
        vals = v[idx]
        v.index_fill_(0, idx, 0.0)
        mask_(u, idx)
        return vals

    def reference_dgc():  # DGCMemory.compensate -> selection.select -> update, on the same device
        accumulate_(g, u, v, momentum=0.9, nesterov=False)
        return send(selection.select(v, k, generator=sample_gen).indices)

    def topk_dgc():  # exact top-k path
        accumulate_(g, u, v, momentum=0.9, nesterov=False)
        return send(torch.topk(v.abs(), k, sorted=False).indices.sort().values)

    out["dgc_parts"] = step_parts(g, u, v, k, reps, device)
    dgc_bytes = 20 * n  # read g, u, v; write u, v (fp32)
    t = {name: timer(fn, reps, device) for name, fn in
         [("triton", triton_dgc), ("triton_pass", triton_pass), ("reference", reference_dgc), ("topk", topk_dgc)]}
    out["dgc"] = {
        "bytes_per_elem": 20,
        "median_s": t,
        "GBps": dgc_bytes / t["triton"] / 1e9,
        "copy_fraction": dgc_bytes / t["triton"] / copy_bw,
        "pass_copy_fraction": dgc_bytes / t["triton_pass"] / copy_bw,
        "speedup_vs_reference": t["reference"] / t["triton"],
        "speedup_vs_topk": t["topk"] / t["triton"],
    }

    q = Int8Quantizer(BlockwiseConfig())
    e = torch.zeros(n, device=device)
    tq = {be: timer(lambda be=be: ef_quantize(q, g, e, backend=be), reps, device) for be in ("triton", "torch")}
    qbytes = 13 * n + 4 * (n // 256)  # read x, e; write e, codes; scales
    out["int8_ef"] = {"bytes_per_elem": 13, "median_s": tq, "GBps": qbytes / tq["triton"] / 1e9,
                      "copy_fraction": qbytes / tq["triton"] / copy_bw,
                      "speedup_vs_reference": tq["torch"] / tq["triton"]}

    idx = torch.randperm(n, device=device)[:k].sort().values
    p = TensorPayload((n,), Values.f32(torch.randn(k, device=device)), idx)
    target = torch.zeros(n, device=device)
    ts = {be: timer(lambda be=be: scatter_add(target, p, 0.5, backend=be), reps, device) for be in ("triton", "torch")}
    out["scatter_add"] = {"nnz": k, "median_s": ts, "speedup_vs_reference": ts["torch"] / ts["triton"]}
    return out


def step_parts(g, u, v, k: int, reps: int, device) -> dict:
    """Median seconds of the parts of the Triton step around its fused pass: the sample kernel, the threshold
    from the sample (as ``SampleRanks`` takes it, and two other ways to the same value), the placement of the
    selected indices in order (the block counts' cumsum and the place kernel, what replaced a sort; and with the
    mark pass before it: a select-only pass over n, as a retry or the small tensors' selection runs), and, for
    comparison, the sort of k indices the placement replaced. The placement selects about k of ``g``'s values."""
    import math

    import torch

    from fedcomp.kernels._dgc_buffers import capacity
    from fedcomp.kernels._dgc_select import SampleRanks, Selection, velocity_sample
    from fedcomp.kernels.dgc import sample_plan

    n = g.numel()
    start, stride, m = sample_plan(n, torch.Generator().manual_seed(0), 0.01, 4096)
    rank = math.ceil(m * k / n)
    sample = velocity_sample(g, u, v, start=start, stride=stride, momentum=0.9, nesterov=False)
    idx = torch.randperm(n, device=device)[:k]
    chosen = Selection(g, capacity(k))  # select-only over g: the state is not touched
    thr = SampleRanks(g[start::stride].abs(), m, rank).threshold()
    chosen.mark(thr)
    parts = {
        "sample kernel": lambda: velocity_sample(g, u, v, start=start, stride=stride, momentum=0.9, nesterov=False),
        "threshold (sorted top 4 rank)": lambda: SampleRanks(sample, m, rank).threshold(),
        "threshold (topk rank, min)": lambda: torch.topk(sample, rank, sorted=False).values.min(),
        "threshold (kthvalue)": lambda: torch.kthvalue(sample, m - rank + 1).values,
        "placement (cumsum + place)": lambda: chosen.place(thr),
        "mark + placement (pass over n)": lambda: chosen.mark(thr),
        "sort of k indices (replaced)": lambda: torch.sort(idx),
        "sort of k indices (int32 keys)": lambda: idx[torch.sort(idx.to(torch.int32)).indices],
    }
    return {"sample_size": m, "rank": rank, "placed": chosen.readout()[0],
            "median_s": {name: timer(fn, reps, device) for name, fn in parts.items()}}


#: (BLOCK, num_warps) of the DGC kernels tried by --sweep (the default is fedcomp/kernels/_triton_dgc.py's).
SWEEP = [(256, 2), (256, 4), (512, 2), (512, 4), (1024, 2), (1024, 4), (1024, 8), (2048, 4), (2048, 8), (4096, 8)]


def sweep(n: int, density: float, reps: int, device) -> list[dict]:
    """Median time of the DGC step (and of its fused pass alone) for each (BLOCK, num_warps) in SWEEP, with the
    fraction of the copy bandwidth measured at the same size (20 B/element, as in the main table)."""
    import torch

    from fedcomp.kernels import _triton_dgc as K
    from fedcomp.kernels.dgc import fused_dgc_step

    k = max(1, round(density * n))
    gen = torch.Generator(device=device).manual_seed(1)
    g, u, v = (torch.randn(n, device=device, generator=gen) for _ in range(3))
    src, dst = torch.randn(n, device=device, generator=gen), torch.empty(n, device=device)
    copy_bw = 8 * n / timer(lambda: dst.copy_(src), reps, device)
    default = (K.BLOCK, K.NUM_WARPS)
    rows = []
    print(f"\nsweep of the DGC kernels at n = {n:,}: BLOCK x num_warps (default {default[0]} x {default[1]}), "
          f"copy {copy_bw / 1e9:.1f} GB/s")
    print(f"  {'BLOCK':>6} {'warps':>5} {'step':>12} {'of copy':>8} {'pass':>12} {'of copy':>8}")
    try:
        for block, warps in SWEEP if device.type == "cuda" else SWEEP[:2]:
            K.BLOCK, K.NUM_WARPS = block, warps
            sample_gen = torch.Generator().manual_seed(0)
            step = timer(lambda gen=sample_gen: fused_dgc_step(g, u, v, k=k, generator=gen, backend="triton"), reps,
                         device)
            stream = timer(lambda: fused_dgc_step(g, u, v, k=k, threshold=float("inf"), backend="triton"), reps,
                           device)
            row = {"block": block, "num_warps": warps, "step_s": step, "pass_s": stream,
                   "step_copy_fraction": 20 * n / step / copy_bw, "pass_copy_fraction": 20 * n / stream / copy_bw}
            rows.append(row)
            print(f"  {block:>6} {warps:>5} {step * 1e3:9.3f} ms {row['step_copy_fraction']:8.0%} "
                  f"{stream * 1e3:9.3f} ms {row['pass_copy_fraction']:8.0%}")
    finally:
        K.BLOCK, K.NUM_WARPS = default
    best = min(rows, key=lambda r: r["step_s"])
    print(f"  fastest step: BLOCK {best['block']} x {best['num_warps']} warps")
    return rows


def print_row(r: dict) -> None:
    d, q, s = r["dgc"], r["int8_ef"], r["scatter_add"]
    ms = lambda x: f"{x * 1e3:9.3f} ms"
    print(f"\nn = {r['n']:,} (k = {r['k']:,})   copy: {ms(r['copy']['median_s'])}  {r['copy']['GBps']:8.1f} GB/s")
    print(f"  {'kernel':<26}{'median':>12}{'GB/s':>10}{'of copy':>9}{'vs ref':>9}{'vs topk':>9}")
    print(f"  {'dgc step (triton)':<26}{ms(d['median_s']['triton'])}{d['GBps']:10.1f}{d['copy_fraction']:9.0%}"
          f"{d['speedup_vs_reference']:8.1f}x{d['speedup_vs_topk']:8.1f}x")
    print(f"  {'dgc fused pass (stream)':<26}{ms(d['median_s']['triton_pass'])}{'':>10}{d['pass_copy_fraction']:9.0%}")
    print(f"  {'dgc step (torch ref)':<26}{ms(d['median_s']['reference'])}")
    print(f"  {'dgc step (torch.topk)':<26}{ms(d['median_s']['topk'])}")
    parts = r["dgc_parts"]
    print(f"  parts of the step (sample of {parts['sample_size']:,}, rank {parts['rank']:,}; "
          f"{parts['placed']:,} placed):")
    for name, t in parts["median_s"].items():
        print(f"    {name:<30}{ms(t)}")
    print(f"  {'int8 quantize + EF':<26}{ms(q['median_s']['triton'])}{q['GBps']:10.1f}{q['copy_fraction']:9.0%}"
          f"{q['speedup_vs_reference']:8.1f}x")
    print(f"  {'scatter-add (nnz = k)':<26}{ms(s['median_s']['triton'])}{'':>19}{s['speedup_vs_reference']:8.1f}x")


if __name__ == "__main__":
    raise SystemExit(main())

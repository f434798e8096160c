"""A client's whole send step on a CUDA device: the Triton kernels against the torch reference, per model.

For each built-in model and compressor, ``Pipeline.send`` of random gradients that live on the GPU (error feedback,
compression, wire encode; the state on the GPU, as a ``gpu=true`` client keeps it), once with the kernels
(``backend="triton"``) and once with the reference steps (``backend="torch"``), alternating rep by rep. Printed:
median wall seconds per send (CUDA synchronised before and after), the ratio, and the update's payload bytes.
Each sent update is acked, so nothing piles up. Without a CUDA device it says so and exits 0.

    python benchmarks/bench_send_gpu.py                                  # resnet-1m, resnet18, resnet-25m
    python benchmarks/bench_send_gpu.py --models resnet-25m --compressors dgc+int8 --json send.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

BACKENDS = ("triton", "torch")


def timed_sends(model: str, compressor: str, density: float, reps: int, device: str = "cuda") -> dict:
    """Median seconds of one send per backend, and the payload bytes of the last update (``device="cpu"`` with
    ``TRITON_INTERPRET=1``: a smoke test of this script, not a measurement)."""
    import torch

    import fedcomp
    from fedcomp.task.models import build_model

    spec = fedcomp.ModelSpec.from_module(build_model(model, (1, 8, 8), 10, seed=0))
    opts = {} if compressor == "int8" else {"density": density}
    pipes = {be: fedcomp.build(compressor, spec, backend=be, **opts).to(device) for be in BACKENDS}
    gen = torch.Generator(device=device).manual_seed(0)
    grads = {n: torch.randn(s, device=device, generator=gen) for n, s in spec.entries}
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    times: dict[str, list[float]] = {be: [] for be in BACKENDS}
    size = 0
    for rep in range(reps + 2):  # the first two sends of each warm up (kernel compiles, allocator)
        for be in BACKENDS:
            sync()
            t = time.perf_counter()
            blob = pipes[be].send(grads)
            sync()
            if rep >= 2:
                times[be].append(time.perf_counter() - t)
            pipes[be].ack(pipes[be].last_seq)
            size = len(blob)
    med = {be: statistics.median(ts) for be, ts in times.items()}
    return {"model": model, "params": spec.total_numel, "tensors": len(spec.names), "compressor": compressor,
            "median_s": med, "torch_over_triton": med["torch"] / med["triton"], "payload_bytes": size}


def check_names(models: list[str], compressors: list[str]) -> str:
    """The first unknown model or compressor, as an error line ("" when every name is known): checked before any
    GPU work starts."""
    from fedcomp.client.pipeline import build_compressor
    from fedcomp.registry import ConfigError
    from fedcomp.task.models import MODELS

    unknown = [m for m in models if m not in MODELS.names()]
    if unknown:
        return f"unknown model(s) {unknown}; built-in: {', '.join(MODELS.names())}"
    for comp in compressors:
        try:
            build_compressor(comp)
        except (ConfigError, KeyError, ValueError) as exc:
            return f"compressor {comp!r}: {exc}"
    return ""


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="resnet-1m,resnet18,resnet-25m", help="comma-separated built-in models")
    ap.add_argument("--compressors", default="dgc,dgc+int8,int8", help="comma-separated compressor names")
    ap.add_argument("--density", type=float, default=0.01, help="density of the sparsifying compressors")
    ap.add_argument("--reps", type=int, default=10, help="timed sends per backend (median reported)")
    ap.add_argument("--json", metavar="PATH", help="also write the rows as JSON")
    args = ap.parse_args(argv)
    models, compressors = args.models.split(","), args.compressors.split(",")
    bad = check_names(models, compressors)
    if bad:
        ap.error(bad)
    import torch

    if not torch.cuda.is_available():
        print("bench_send_gpu: no CUDA device here; the send step's kernels need a GPU to be timed")
        return 0
    print(f"device: {torch.cuda.get_device_name()}   density: {args.density}   reps: {args.reps} (median)")
    print(f"  {'model':<12}{'params':>12}{'tensors':>9}  {'compressor':<10}{'triton':>11}{'torch':>11}"
          f"{'torch/triton':>14}{'payload B':>12}")
    rows = []
    for model in models:
        for comp in compressors:
            r = timed_sends(model, comp, args.density, args.reps)
            rows.append(r)
            m = r["median_s"]
            print(f"  {model:<12}{r['params']:>12,}{r['tensors']:>9}  {comp:<10}{m['triton'] * 1e3:>8.2f} ms"
                  f"{m['torch'] * 1e3:>8.2f} ms{r['torch_over_triton']:>13.2f}x{r['payload_bytes']:>12,}")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""A client's whole send on a CUDA device: the Triton kernels and the device wire encode, against the torch path on
the same GPU and against the CPU.

For each model size and compressor, ``Pipeline.send`` of random gradients (error feedback, compression, wire
encode; each sent update acked, so nothing piles up) three ways, median wall time per send:

* ``kernels``: gradients and state on the GPU, ``backend="triton"``: the fused send steps and the device encode
  (``fedcomp.kernels.encode``: one flat device buffer, one copy of the finished bytes to the host);
* ``torch``: the same on the GPU with ``backend="torch"``: the torch reference steps and the CPU encoder (one
  device-to-host copy per payload tensor);
* ``cpu``: gradients and state on the CPU (the reference steps, the CPU encoder; fewer reps, ``--cpu-reps``).

Also per row: the encode alone of the kernels' last update, on the device (``device_encode``) and on the host
(``fedcomp.wire.encode``, copies included), the payload bytes, and whether the kernels' bytes equal
``wire.encode`` of the same update (the run exits 1 if any differ). CUDA is synchronised around every timed call.

Sizes: ``1M`` resnet-1m (1,228,970 parameters on 3x32x32), ``11M`` resnet18, ``25M`` resnet-25m, ``100M`` resnet
depth 18 width 192 (100,466,890); the specs are built on the meta device (no weights).

    python benchmarks/bench_send_gpu.py                                   # 1M, 11M, 25M, 100M x dgc, dgc+int8, int8
    python benchmarks/bench_send_gpu.py --sizes 25M --compressors dgc+int8 --json send.json
    python benchmarks/bench_send_gpu.py --interpret                       # no GPU: a tiny model on the CPU
    python benchmarks/bench_send_gpu.py --count --sizes 25M --profile 25  # host reads, launches, ops of one send
    python benchmarks/bench_send_gpu.py --interpret --count               # the same without a GPU (r18-narrow)

``--interpret`` runs a tiny model with the kernels under Triton's interpreter on the CPU (TRITON_INTERPRET=1,
set before triton is imported): it checks that the script and the byte comparison work; its timings measure the
interpreter. Without a CUDA device and without ``--interpret`` it says so and exits 0.

``--count`` times nothing: per size and compressor it counts, for one send on the kernel path, the host reads of
device data (each a synchronisation on a GPU), the Triton launches and the torch ops, with the source lines of the
reads (``send_counts.py``); ``--profile N`` adds the N functions of most own time in a cProfile of one more send.
Under ``--interpret`` its default size is ``r18-narrow``: the 62 tensors of the 11M/25M/100M models (21 large,
41 small) at 3.9M parameters, so the counts are those of the 25M send.
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

#: Size label -> (model, options) of the model whose spec is sent (3x32x32 inputs, 10 classes).
SIZES = {
    "1M": ("resnet-1m", {}),
    "11M": ("resnet18", {}),
    "25M": ("resnet-25m", {}),
    "100M": ("resnet", {"depth": 18, "width": 192}),
    "tiny": ("resnet", {"depth": 10, "width": 4}),
    # the tensors of 11M/25M/100M (62: 21 sent by the fused DGC step, 41 small ones grouped) at 3.9M parameters
    "r18-narrow": ("resnet", {"depth": 18, "width": 38}),
    # the same 62 tensors at 44,622 parameters: with --dense-below 16 the same 21 take the fused DGC step (--host)
    "r18-tiny": ("resnet", {"depth": 18, "width": 4}),
}
PATHS = ("kernels", "torch", "cpu")


def spec_of(size: str):
    """The ``ModelSpec`` of size ``size`` (built on the meta device: shapes only)."""
    import torch

    import fedcomp
    from fedcomp.task.models import build_model

    model, options = SIZES[size]
    with torch.device("meta"):
        return fedcomp.ModelSpec.from_module(build_model(model, (3, 32, 32), 10, **options))


def _median_ms(times: list[float]) -> float:
    return statistics.median(times) * 1e3


def timed_sends(size: str, compressor: str, density: float, reps: int, cpu_reps: int, device: str = "cuda") -> dict:
    """One row: median ms per send of each path, the encode alone, payload bytes, bytes identical."""
    import torch

    import fedcomp
    from fedcomp.kernels.encode import device_encode
    from fedcomp.wire import encode

    spec = spec_of(size)
    opts = {} if compressor in ("int8", "int4", "sign", "qsgd") else {"density": density}
    backends = {"kernels": ("triton", device), "torch": ("torch", device), "cpu": (None, "cpu")}
    pipes = {p: fedcomp.build(compressor, spec, backend=be, **opts).to(dev) for p, (be, dev) in backends.items()}
    gen = torch.Generator(device=device).manual_seed(0)
    grads = {n: torch.randn(s, device=device, generator=gen) for n, s in spec.entries}
    inputs = {"kernels": grads, "torch": grads, "cpu": {n: g.cpu() for n, g in grads.items()}}
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    times: dict[str, list[float]] = {p: [] for p in PATHS}
    identical, last = True, None
    for rep in range(reps + 2):  # the first two sends of each path warm up (kernel compiles, allocator)
        for path in PATHS:
            if path == "cpu" and rep >= cpu_reps + 1:
                continue
            sync()
            t = time.perf_counter()
            blob = pipes[path].send(inputs[path])
            sync()
            if rep >= (1 if path == "cpu" else 2):
                times[path].append(time.perf_counter() - t)
            update = pipes[path].pending[pipes[path].last_seq]
            if path == "kernels":
                identical &= blob == encode(update, spec)
                last = (update, blob)
            pipes[path].ack(pipes[path].last_seq)
    enc = {"device": [], "host": []}
    for _ in range(reps):
        for where, fn in (("device", device_encode), ("host", encode)):
            sync()
            t = time.perf_counter()
            fn(last[0], spec)
            sync()
            enc[where].append(time.perf_counter() - t)
    med = {p: _median_ms(ts) for p, ts in times.items()}
    return {
        "size": size, "params": spec.total_numel, "tensors": len(spec.names), "compressor": compressor,
        "density": opts.get("density"), "median_ms": med, "torch_over_kernels": med["torch"] / med["kernels"],
        "cpu_over_kernels": med["cpu"] / med["kernels"],
        "encode_ms": {w: _median_ms(ts) for w, ts in enc.items()}, "payload_bytes": len(last[1]),
        "identical": bool(identical),
    }


def count_send(size: str, compressor: str, density: float, device: str, profile: int = 0) -> dict:
    """Host reads, Triton launches and torch ops of one ``Pipeline.send`` on the kernel path (after two warm-up
    sends), by ``send_counts.SendCounts``; ``profile`` > 0: also the ``profile`` functions of most own time in
    ``cProfile`` of one more send (CUDA synchronised after it)."""
    import torch
    from send_counts import SendCounts

    import fedcomp

    spec = spec_of(size)
    opts = {} if compressor in ("int8", "int4", "sign", "qsgd") else {"density": density}
    pipe = fedcomp.build(compressor, spec, backend="triton", **opts).to(device)
    gen = torch.Generator(device=device).manual_seed(0)
    grads = {n: torch.randn(s, device=device, generator=gen) for n, s in spec.entries}
    for _ in range(2):
        pipe.send(grads)
        pipe.ack(pipe.last_seq)
    with SendCounts(device) as counts:
        pipe.send(grads)
    pipe.ack(pipe.last_seq)
    summary = counts.summary()
    if profile:
        import cProfile
        import io
        import pstats

        prof = cProfile.Profile()
        prof.enable()
        pipe.send(grads)
        if device == "cuda":
            torch.cuda.synchronize()
        prof.disable()
        pipe.ack(pipe.last_seq)
        text = io.StringIO()
        pstats.Stats(prof, stream=text).strip_dirs().sort_stats("tottime").print_stats(profile)
        summary += "\n" + "\n".join("    " + line for line in text.getvalue().splitlines() if line.strip())
        summary += "\n    " + _busy_line(pipe, grads, device)
    return {"size": size, "tensors": len(spec.names), "compressor": compressor, **counts.totals(),
            "summary": summary}


def host_send(size: str, compressor: str, density: float, device: str, reps: int, dense_below: int | None) -> dict:
    """The host's own milliseconds per send of the kernel path, by hop (``host_time.HostTime``), averaged over
    ``reps`` sends after two warm-up sends; ``dense_below`` overrides the sparsifier's small-tensor bound."""
    import torch
    from host_time import HostTime

    import fedcomp

    spec = spec_of(size)
    opts = {} if compressor in ("int8", "int4", "sign", "qsgd") else {"density": density}
    if dense_below is not None and opts:
        opts["dense_below"] = dense_below
    pipe = fedcomp.build(compressor, spec, backend="triton", **opts).to(device)
    gen = torch.Generator(device=device).manual_seed(0)
    grads = {n: torch.randn(s, device=device, generator=gen) for n, s in spec.entries}
    for rep in range(reps + 2):
        if rep == 2:
            host = HostTime().__enter__()
        pipe.send(grads)
        if device == "cuda":
            torch.cuda.synchronize()
        pipe.ack(pipe.last_seq)
    host.__exit__(None, None, None)
    return {"size": size, "tensors": len(spec.names), "compressor": compressor, "fused": len(spec.names) -
            len(pipe.grouped), "host_ms": host.per_send()}


def _busy_line(pipe, grads: dict, device: str) -> str:
    """One send's wall time (no profiler) against the time the device spent in kernels during another (torch's
    profiler): a send whose device is busy a small part of its wall time waits on the host."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    def send() -> float:
        start = time.perf_counter()
        pipe.send(grads)
        if device == "cuda":
            torch.cuda.synchronize()
        took = time.perf_counter() - start
        pipe.ack(pipe.last_seq)
        return took * 1e3

    wall = send()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    with profile(activities=activities) as traced:
        profiled = send()
    busy = sum(e.self_device_time_total for e in traced.key_averages()) / 1e3  # microseconds -> ms
    return (f"one send: {wall:.2f} ms wall ({profiled:.2f} ms under the profiler), device kernels {busy:.2f} ms"
            f" ({busy / wall:.0%} of the wall time)")


def check_names(sizes: list[str], compressors: list[str]) -> str:
    """The first unknown size or compressor, as an error line ("" when every name is known): checked before any
    GPU work starts."""
    from fedcomp.client.pipeline import build_compressor
    from fedcomp.registry import ConfigError

    unknown = [s for s in sizes if s not in SIZES]
    if unknown:
        return f"unknown size(s) {unknown}; known: {', '.join(SIZES)}"
    for comp in compressors:
        try:
            build_compressor(comp)
        except (ConfigError, KeyError, ValueError) as exc:
            return f"compressor {comp!r}: {exc}"
    return ""


HEADER = (
    f"  {'size':<6}{'params':>13}{'tensors':>8}  {'compressor':<10}{'kernels':>11}{'torch':>11}{'cpu':>11}"
    f"{'torch/k':>9}{'cpu/k':>9}{'enc dev':>10}{'enc host':>10}{'payload B':>12}  same"
)


def format_row(r: dict) -> str:
    m, e = r["median_ms"], r["encode_ms"]
    return (
        f"  {r['size']:<6}{r['params']:>13,}{r['tensors']:>8}  {r['compressor']:<10}{m['kernels']:>8.2f} ms"
        f"{m['torch']:>8.2f} ms{m['cpu']:>8.1f} ms{r['torch_over_kernels']:>8.2f}x{r['cpu_over_kernels']:>8.2f}x"
        f"{e['device']:>7.2f} ms{e['host']:>7.2f} ms{r['payload_bytes']:>12,}  {'yes' if r['identical'] else 'NO'}"
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="1M,11M,25M,100M", help=f"comma-separated, of {', '.join(SIZES)}")
    ap.add_argument("--compressors", default="dgc,dgc+int8,int8", help="comma-separated compressor names")
    ap.add_argument("--density", type=float, default=0.01, help="density of the sparsifying compressors")
    ap.add_argument("--reps", type=int, default=5, help="timed sends per GPU path (median reported)")
    ap.add_argument("--cpu-reps", type=int, default=2, help="timed sends of the CPU path (after one warm-up)")
    ap.add_argument("--interpret", action="store_true", help="no GPU: size 'tiny' on the CPU, Triton interpreter")
    ap.add_argument("--json", metavar="PATH", help="also write the rows as JSON")
    ap.add_argument("--count", action="store_true", help="count host reads, launches and torch ops of one send "
                    "(kernel path; with --interpret the default size is r18-narrow) instead of timing")
    ap.add_argument("--host", action="store_true", help="the host's own ms per send of the kernel path, by hop "
                    "(with --interpret: size r18-tiny, --dense-below 16, interpreted kernels' time taken out)")
    ap.add_argument("--dense-below", type=int, default=None, metavar="N",
                    help="the sparsifier's small-tensor bound (default: the compressor's own; --host --interpret: 16)")
    ap.add_argument("--profile", type=int, default=0, metavar="N",
                    help="with --count: also the N functions of most own time in a cProfile of one send")
    args = ap.parse_args(argv)
    if args.interpret:
        os.environ["TRITON_INTERPRET"] = "1"  # before anything imports triton
        if args.sizes == ap.get_default("sizes"):
            args.sizes = "r18-narrow" if args.count else "r18-tiny" if args.host else "tiny"
        if args.host and args.dense_below is None:
            args.dense_below = 16
    sizes, compressors = args.sizes.split(","), args.compressors.split(",")
    bad = check_names(sizes, compressors)
    if bad:
        ap.error(bad)
    import torch

    if not torch.cuda.is_available() and not args.interpret:
        print("bench_send_gpu: no CUDA device here; the send path's kernels need a GPU to be timed (--interpret: "
              "a tiny run under Triton's interpreter, to check the script)")
        return 0
    device = "cpu" if args.interpret else "cuda"
    name = "CPU (Triton interpreter: timings are not results)" if args.interpret else torch.cuda.get_device_name()
    if args.count:
        print(f"device: {name}   density: {args.density}   per send, kernel path (backend triton)")
        for size in sizes:
            for comp in compressors:
                row = count_send(size, comp, args.density, device, args.profile)
                print(f"  {size} ({row['tensors']} tensors) {comp}: {row['summary']}", flush=True)
        return 0
    if args.host:
        print(f"device: {name}   density: {args.density}   host ms per send, kernel path, mean of {args.reps}")
        for size in sizes:
            for comp in compressors:
                row = host_send(size, comp, args.density, device, args.reps, args.dense_below)
                hops = "  ".join(f"{k} {v:.2f}" for k, v in row["host_ms"].items())
                print(f"  {size} ({row['tensors']} tensors, {row['fused']} fused) {comp}: {hops}", flush=True)
        return 0
    print(f"device: {name}   density: {args.density}   reps: {args.reps} GPU, {args.cpu_reps} CPU (median)")
    print(HEADER)
    rows = []
    for size in sizes:
        for comp in compressors:
            rows.append(timed_sends(size, comp, args.density, args.reps, args.cpu_reps, device))
            print(format_row(rows[-1]), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))
    if not all(r["identical"] for r in rows):
        print("bench_send_gpu: the device encode's bytes differ from wire.encode (rows marked NO)")
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Scale: many virtual clients on one machine. Wall time, peak RSS of the whole process tree (Ray's raylet,
GCS and actors included) and where the time of one client update goes (Flower/Ray vs fedcomp).

    python benchmarks/bench_scale.py                          # 1000 clients on Flower's simulation engine (Ray)
    python benchmarks/bench_scale.py --engine inprocess       # the same without Ray
    python benchmarks/bench_scale.py --clients 200 --versions 20 --json out.json

The scenario is the main job's link mix scaled to ``--clients`` (2% datacenter, 30% WiFi, 40% LTE, 28% 3G), IID
digits (1,437 images: ~1.4 per client at 1000), CNN, DGC 1% async FedBuff (K = ``--buffer``, ``--concurrency``
clients busy). Peak RSS is sampled from /proc every 0.2 s (sum over this process and all its descendants). "fedcomp"
time is what the ClientApps report as ``train-seconds`` (data, model, local training, compression, client state);
"Flower/Ray" is the rest of the engine's time for those updates (messages, serialization, Ray scheduling, and for
Ray, waiting); "server" is everything else in the run (loop, protocol, decoding, evaluation).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

PAGE = os.sysconf("SC_PAGE_SIZE")


def tree_rss(root: int) -> int:
    """Bytes of resident memory of ``root`` and all its descendants (from /proc)."""
    parent: dict[int, int] = {}
    rss: dict[int, int] = {}
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            stat = (d / "stat").read_text()
            fields = stat.rsplit(")", 1)[1].split()
            parent[int(d.name)] = int(fields[1])
            rss[int(d.name)] = int(fields[21]) * PAGE
        except (OSError, ValueError, IndexError):
            continue
    total = 0
    for pid in rss:
        p = pid
        while p != root and p in parent and p > 1:
            p = parent[p]
        if p == root:
            total += rss[pid]
    return total


class PeakRss(threading.Thread):
    def __init__(self, interval: float = 0.2) -> None:
        super().__init__(daemon=True)
        self.interval, self.peak, self.stop = interval, 0, threading.Event()

    def run(self) -> None:
        me = os.getpid()
        while not self.stop.is_set():
            self.peak = max(self.peak, tree_rss(me))
            self.stop.wait(self.interval)


def scenario_dict(args: argparse.Namespace) -> dict:
    n = args.clients
    dc = max(1, round(0.02 * n))
    wifi = round(0.30 * n)
    lte = round(0.40 * n)
    g3 = n - dc - wifi - lte
    return {
        "name": f"scale-{n}",
        "seed": 0,
        "methods": ["dgc-async"],
        "target_accuracy": 0.9,
        "sim": {"engine": args.engine, "threads": 1, "progress": not args.quiet},
        "run": {
            "dataset": "digits", "model": args.model, "partitioner": "iid",
            "local_steps": args.local_steps, "local_lr": 0.05, "batch_size": 32, "memory": "residual",
            "eval_every": 10, "poll_interval": 5.0, "task_timeout": 300.0,
        },
        "method": {"dgc-async": {
            "mode": "async", "compressor": "dgc", "compressor_options": "density=0.01",
            "buffer_size": args.buffer, "concurrency": args.concurrency, "max_staleness": 20,
            "num_versions": args.versions,
        }},
        "clients": [
            {"count": dc, "link": "datacenter", "device": "datacenter_gpu"},
            {"count": wifi, "link": "wifi", "device": "laptop"},
            {"count": lte, "link": "lte", "device": "phone"},
            {"count": g3, "link": "3g", "device": "phone"},
        ],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--clients", type=int, default=1000)
    ap.add_argument("--engine", default="ray", choices=["ray", "inprocess"])
    ap.add_argument("--versions", type=int, default=100)
    ap.add_argument("--buffer", type=int, default=10)
    ap.add_argument("--concurrency", type=int, default=100)
    ap.add_argument("--local-steps", type=int, default=10)
    ap.add_argument("--model", default="cnn")
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--quiet", action="store_true")
    args = ap.parse_args()

    sampler = PeakRss()
    sampler.start()
    t0 = time.perf_counter()
    from simulations import scenario as scenarios
    from simulations.backends import run_scenario

    sc = scenarios.from_dict(scenario_dict(args))
    t_setup = time.perf_counter()
    [res] = run_scenario(sc)
    wall = time.perf_counter() - t0
    sampler.stop.set()
    sampler.join()
    s = res.summary
    updates = max(int(s.get("updates", 0)), 1)
    run_s = float(s["wall_s"])
    engine_s = float(s.get("engine_wall_s", 0.0))
    out = {
        "clients": args.clients,
        "engine": args.engine,
        "model": args.model,
        "versions": s["versions"],
        "updates": updates,
        "tasks": s["tasks"],
        "wall_s": round(wall, 1),
        "import_s": round(t_setup - t0, 1),
        "run_s": run_s,
        "peak_rss_mb": round(sampler.peak / 2**20),
        "flower_ms_per_update": s.get("flower_ms_per_update"),
        "fedcomp_ms_per_update": s.get("fedcomp_ms_per_update"),
        "engine_wall_ms_per_update": round(1e3 * engine_s / updates, 2),
        "server_ms_per_update": round(1e3 * max(run_s - engine_s, 0.0) / updates, 2),
        "accuracy": s["accuracy"],
        "virtual_s": s["virtual_s"],
        "cpus": os.cpu_count(),
    }
    print(json.dumps(out, indent=1))
    if args.json:
        args.json.write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()

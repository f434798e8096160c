"""A Flower user's app on warm nodes: ``examples/compressed-digits`` on a loopback deployment, per-task time.

What runs, per ``--setting``: one ``flower-superlink`` (insecure, loopback) and ``--clients`` ``flower-client``
launchers (Flower's SuperNodes), then ``flwr run examples/compressed-digits`` against that SuperLink with
``mode="async"`` (``--versions`` model versions, buffer K = ``--buffer-size``, ``--run-config`` extra keys).
Settings: ``cold`` (``flower-client --worker cold``: a fresh ``flwr-clientapp`` imports the app, torch and
fedcomp for every message, as Flower runs it) and ``warm`` (``flower-client --app fab``: the forked
``flwr-clientapp`` forwards each message to the node's worker, which keeps the app object; ``clients.forward``).

Reported per setting (wall seconds on this machine), per train message of every client but each client's first
(start-up), medians and ranges, read from the SuperNode logs (``FLWR_LOG_LEVEL=DEBUG``): the task cycle (one
``Receiving: train message`` to the next); with a warm worker, the worker's own seconds per message (``served
in``: the mod and the user's train function, i.e. the client's compute) and **overhead** = cycle - that compute,
per task (cold: the cycle's median less the warm compute's median, the same work). Use ``--run-config
prefetch=1`` to queue each node's next task (else every cycle holds the SuperNode's 3 s empty-poll sleep).

    .venv/bin/python benchmarks/warm_app_deployment.py --setting cold warm --versions 16 --json out.json
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
for extra in (ROOT, ROOT / "benchmarks"):
    if str(extra) not in sys.path:
        sys.path.insert(0, str(extra))

from latency_calibration import START, log_events, with_root  # noqa: E402

from fedcomp.tools.processes import (  # noqa: E402
    ManagedProcess,
    flower_env,
    free_port,
    run_info,
    signal_pids,
    submit_run,
    superlink_argv,
    wait_http_ready,
    write_flower_config,
    write_overrides,
)

APP = ROOT / "examples" / "compressed-digits"
HANG_S = 900  # bounds a hang only
SERVED = re.compile(r"fedcomp worker: train message \d+ served in ([0-9.]+) s")


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog="See the module docstring.")
    p.add_argument("--setting", nargs="+", default=["cold", "warm"], choices=("cold", "warm"))
    p.add_argument("--clients", type=int, default=2)
    p.add_argument("--versions", type=int, default=16, help="model versions (num-server-rounds in async mode)")
    p.add_argument("--buffer-size", type=int, default=2)
    p.add_argument("--run-config", nargs="*", default=[], metavar="KEY=VALUE", help="more run-config overrides")
    p.add_argument("--json", type=Path, help="write the figures here")
    p.add_argument("--keep", type=Path, help="keep the logs here")
    return p


def overrides(args: argparse.Namespace) -> dict[str, Any]:
    values: dict[str, Any] = {"mode": "async", "num-server-rounds": args.versions, "buffer-size": args.buffer_size}
    for item in args.run_config:
        key, _, text = item.partition("=")
        values[key] = json.loads(text) if text[:1] in "0123456789-[{tf" else text
    return values


def deployment(args: argparse.Namespace, setting: str, work: Path) -> dict[str, Any]:
    port = free_port()
    env = with_root(flower_env(work / "server-home"))
    write_flower_config(work / "user-home", "local", f"127.0.0.1:{port}")
    procs: list[ManagedProcess] = []
    t0 = time.monotonic()
    try:
        link = ManagedProcess("flower-superlink", superlink_argv(port, extra=["--insecure"]), work / "link.log", env)
        procs.append(link)
        wait_http_ready(f"127.0.0.1:{port}", 120, link)
        for i in range(args.clients):
            home = work / f"client{i}-home"
            argv = [sys.executable, "-m", "clients.launcher", "--server", f"127.0.0.1:{port}", "--insecure"]
            argv += ["--worker", "cold"] if setting == "cold" else ["--app", "fab"]
            argv += ["--partition-id", str(i), "--num-partitions", str(args.clients), "--flwr-home", str(home)]
            cenv = {**with_root(flower_env(home)), "FLWR_LOG_LEVEL": "DEBUG"}
            procs.append(ManagedProcess(f"client{i}", argv + ["--log", str(work / f"client{i}.log")],
                                        work / f"client{i}.out", cenv, ROOT))
        user = {**env, "FLWR_HOME": str(work / "user-home")}
        run_id = submit_run(APP, "local", user, write_overrides(work / "overrides.toml", overrides(args)))
        status = ""
        while not status.startswith("finished"):
            assert time.monotonic() - t0 < HANG_S, f"run did not finish:\n{link.tail(30)}"
            for p in procs:
                p.remember_children()
            time.sleep(2.0)
            status = run_info("local", run_id, user)["status"]
    finally:
        for p in reversed(procs):
            p.stop()
        signal_pids([pid for p in procs for pid in p.known], 9)
    return {"setting": setting, "status": status, "wall_s": round(time.monotonic() - t0, 1), **figures(args, work)}


def figures(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    """Per client, task n's cycle = its ``Receiving: train message`` line to task n+1's; with a warm worker,
    task n's overhead = that cycle - the worker's ``served in`` seconds of task n. Each client's first task is
    left out (start-up)."""
    cycles, served, overheads = [], [], []
    for i in range(args.clients):
        log = work / f"client{i}.log"
        starts = [t for t, msg in log_events(log) if msg.startswith(START)]
        mine = [b - a for a, b in zip(starts, starts[1:], strict=False)][1:]
        took = [float(x) for x in SERVED.findall(log.read_text(errors="replace"))][1:]
        cycles += mine
        served += took
        overheads += [c - t for c, t in zip(mine, took, strict=False)]
    out: dict[str, Any] = {"cycles": len(cycles)}
    for name, values in (("cycle", cycles), ("worker_served", served), ("overhead", overheads)):
        if values:
            out[f"{name}_median_s"] = round(statistics.median(values), 3)
            out[f"{name}_min_max_s"] = [round(min(values), 3), round(max(values), 3)]
    return out


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    load = os.getloadavg()
    results = []
    for setting in args.setting:
        if args.keep is not None:
            args.keep.mkdir(parents=True, exist_ok=True)
        work = Path(tempfile.mkdtemp(prefix=f"warmapp-{setting}-", dir=args.keep))
        results.append(deployment(args, setting, work))
        print(json.dumps(results[-1]), flush=True)
    compute = next((r["worker_served_median_s"] for r in results if "worker_served_median_s" in r), None)
    for r in results:  # a cold node's compute is not logged: its cycle less the warm compute
        if compute is not None and "cycle_median_s" in r and "overhead_median_s" not in r:
            r["overhead_median_s"] = round(r["cycle_median_s"] - compute, 3)
        print(f"{r['setting']:5} cycle {r.get('cycle_median_s')} s, overhead {r.get('overhead_median_s')} s "
              f"(compute {compute} s), {r['cycles']} cycles, {r['status']}")
    report = {"load_before": load, "load_after": os.getloadavg(), "results": results, "args": vars(args) | {
        "json": str(args.json), "keep": str(args.keep)}}
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))
    return 0 if all(r["status"] == "finished:completed" for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())

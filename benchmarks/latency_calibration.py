"""Per-task latency of a real loopback deployment, cold or warm workers, with or without prefetch, next to the
simulator's prediction for the same setting.

What runs, per setting given with ``--setting WORKER:PREFETCH`` (``cold:0``: a fresh ``flwr-clientapp`` process
per task and no queued task, as Flower runs an app today; ``warm:1``: the defaults, ``flower-client --worker warm``
(worker and fork server) and ``flower-server --prefetch 1``; ``warm-noprestart``: the worker without the fork
server) and per interval given with ``--poll-interval``
(``FLWR_SUPEREXEC_TASK_POLL_INTERVAL``, seconds; Flower 1.41's default 1.0): ``flower-server`` (Flower's
SuperLink, the fedcomp ServerApp) and ``--clients`` ``flower-client``s (Flower's SuperNodes), insecure, on
loopback, exactly as tests/test_deployment.py starts them:
async mode, buffer size K = 1, compressor ``dgc+int8``, model ``mlp``, ``--local-steps`` local steps,
``--versions`` versions. The variable is set in the environment of ``flower-server`` and of every
``flower-client``, which hand it to the SuperLink and the SuperNodes; each of those starts its own
``flower-superexec`` with that environment, and on a SuperNode the SuperExec is the process that, once per poll,
asks for a pending task and launches a fresh ``flwr-clientapp`` process for it.

Reported per run (all wall-clock seconds on this machine):

* **per version**: ``(time[N] - time[1]) / (N - 1)`` from ``--out``'s ``metrics.jsonl`` (``time``: seconds since the
  ServerApp started, written when version v is produced); version 1 is left out (it holds the start-up: FAB
  install, first connection);
* **per task cycle per client**: ``clients * per version``: with K = 1 every version is one applied reply, and the
  clients take turns, so each client finishes one task every ``clients`` versions;
* **the split of one task cycle** on the client, from the SuperNode log (``FLWR_LOG_LEVEL=DEBUG`` gives Flower's
  log lines millisecond timestamps; the SuperNode, its SuperExec and the ``flwr-clientapp`` processes all write
  into the ``flower-client --log`` file). Per train message, median over every client's tasks except each client's
  first: ``download`` (``Receiving`` -> ``Received successfully``), ``superexec wait`` (-> the SuperExec's next
  ``AcquireTask`` poll), ``process start`` (-> ``Start `flwr-clientapp` process``: a new Python process imports
  Flower), ``clientapp`` (-> ``PushMessages``: pull the task input, install the FAB, import ``clients.app`` with
  torch, train, compress), ``reply pickup`` (-> ``Sending``: the SuperNode checks for the reply every 0.5 s),
  ``upload`` (-> ``Sent successfully``), ``next-task wait`` (-> the next ``Receiving``: the SuperNode polls again at
  once; an empty poll sleeps 3 s; meanwhile the server pulls the reply, steps the model and pushes a new task;
  with prefetch the task is already there: this is the push-to-next-task time). The cycle is their sum. With a
  warm worker ``clientapp`` is the thin forwarder's import plus the worker's task.
* **compute vs overhead**: ``compute`` = the ClientApp's own ``train-seconds`` metric, measured by ``--probe``
  fresh Python processes that each import ``clients.app`` and answer one train message the way a
  ``flwr-clientapp`` does: ``cold`` is that call (model build, data, local steps, compression: a cold worker pays
  it on every task), ``warm`` the second task answered in the same process, with the node's data and model kept
  (``clients.bench.Bench``: what a warm worker pays per task, the whole call). ``overhead`` = task cycle - the
  compute of the run's worker mode.
* **the simulator's prediction**: the same run (clients, model, compressor, K = 1, versions, worker, prefetch,
  SuperExec interval) as a ``fedcomp sim`` scenario on a loopback link (1 Gbit/s; round trip = the measured
  upload segment over the wire model's request count for a reply: request handling, 1 ms at least) with a device
  whose compute is the measured one and the run's process start charged (its "process start" + "ClientApp"
  segments less the compute); its per-task cycle, the mean over ``--sim-seeds`` seeds (where the server's reads
  land is drawn per seed), next to the deployment's. A second prediction (``clock``) tells the simulator only the
  device's speed and charges everything else with the clock's own constants and the codec table (``PREDICTIONS``):
  that one tests the clock. With a warm worker the compute is the run's own (``summary.json``'s
  ``train_seconds_median``: the clients' reported seconds per task, under the run's load), else the probe's.
  ``--model``/``--model-options``/``--compressor``/``--compressor-options`` pick the workload (default: the
  9,610-parameter ``mlp``, ``dgc+int8`` at the run config's density).
* **idle CPU**: one bare SuperLink and one ``flower-client`` per interval, all connected at once with no run, the
  CPU seconds (user + system, psutil) of each client's process tree (launcher, SuperNode, SuperExec) over
  ``--idle`` wall seconds, as percent of one core, and of its SuperExec alone.

    .venv/bin/python benchmarks/latency_calibration.py --versions 12 --setting cold:0 warm:1 \\
        --idle 0 --json results/latency_calibration.json
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping
from datetime import datetime
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import psutil  # noqa: E402

from fedcomp.sim.codeccost import codec_cost  # noqa: E402
from fedcomp.sim.virtual import TimingConfig  # noqa: E402
from fedcomp.tools.processes import (  # noqa: E402
    SUPEREXEC_POLL_BOUNDS,
    SUPEREXEC_POLL_ENV,
    ManagedProcess,
    command_line,
    flower_env,
    free_port,
    signal_pids,
    superlink_argv,
    wait_http_ready,
)
from fedcomp.tools.report import write_json  # noqa: E402

HANG_S = 900  # bounds a hang only, never times anything
RUN = {"compressor": "dgc+int8", "model": "mlp"}
RUN_DENSITY, BATCH = 0.02, 32  # the run config's defaults (compressor-options density=0.02, batch-size 32)
LINE = re.compile(r"(DEBUG|INFO|WARNING|ERROR)\s+(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3})\S*:\s+(.*)")
ANSI = re.compile(r"\x1b\[[0-9;]*m")
#: (segment name, the log line that ends it); a segment starts where the one before it ended.
MARKS = [
    ("download", "Received successfully"),
    ("superexec wait", "Runtime.AcquireTask"),
    ("process start", "Start `flwr-clientapp` process"),
    ("clientapp", "Runtime.PushMessages"),
    ("reply pickup", "Sending: train message"),
    ("upload", "Sent successfully"),
]
START = "Receiving: train message"
NEXT = "next-task wait"


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog="See the module docstring.")
    p.add_argument(
        "--poll-interval",
        type=float,
        nargs="+",
        default=[0.2],
        metavar="SECONDS",
        help="SuperExec task-poll intervals to run (default: 0.2, what the launchers set; Flower's default is 1.0)",
    )
    p.add_argument(
        "--setting",
        nargs="+",
        default=["cold:0", "warm:1"],
        metavar="WORKER:PREFETCH",
        help="flower-client --worker and flower-server --prefetch per run (default: cold:0 warm:1)",
    )
    p.add_argument("--versions", type=int, default=12, help="model versions per deployment run (default 12)")
    p.add_argument("--clients", type=int, default=2, help="flower-clients per run (default 2)")
    p.add_argument("--local-steps", type=int, default=2, help="local steps per task (default 2)")
    p.add_argument("--model", default=RUN["model"], help="model (default %(default)s)")
    p.add_argument("--model-options", default="", help='e.g. "hidden=1024,1024" (the 1.13M-parameter mlp)')
    p.add_argument("--compressor", default=RUN["compressor"], help="compressor (default %(default)s)")
    p.add_argument("--compressor-options", default="", help='e.g. "density=0.001" (default: the run config\'s)')
    p.add_argument("--idle", type=float, default=20.0, help="seconds of idle CPU measurement (0: skip; default 20)")
    p.add_argument("--probe", type=int, default=3, help="fresh processes timing one ClientApp call (0: skip)")
    p.add_argument("--sim-seeds", type=int, default=5, help="simulator runs (seeds 0..N-1) averaged per setting")
    p.add_argument("--json", type=Path, help="write every figure here")
    p.add_argument("--keep", type=Path, help="keep the runs' folders (logs, metrics) here")
    p.add_argument("--probe-child", action="store_true", help=argparse.SUPPRESS)
    return p


#: ``flower-client`` modes: ``--worker cold``; ``--worker warm`` (with the fork server, the default); without it.
WORKERS = ("cold", "warm", "warm-noprestart")


def stamp(text: str) -> float:
    return datetime.strptime(text, "%Y-%m-%d %H:%M:%S,%f").timestamp()


def log_events(path: Path) -> list[tuple[float, str]]:
    """(time, message) of every timestamped Flower log line in ``path``, in file order."""
    out = []
    for raw in path.read_text(errors="replace").splitlines():
        m = LINE.search(ANSI.sub("", raw))
        if m:
            out.append((stamp(m.group(2)), m.group(3)))
    return out


def task_cycles(events: list[tuple[float, str]]) -> list[dict[str, float]]:
    """One dict of segment seconds per train message (see the module docstring); the last one has no
    ``next-task wait`` when no message followed it."""
    starts = [i for i, (_, msg) in enumerate(events) if msg.startswith(START)]
    cycles = []
    for n, i in enumerate(starts):
        end = starts[n + 1] if n + 1 < len(starts) else len(events)
        t_prev, j, seg = events[i][0], i, {}
        for name, mark in MARKS:
            j = next((k for k in range(j + 1, end) if events[k][1].startswith(mark)), None)
            if j is None:
                break
            seg[name] = events[j][0] - t_prev
            t_prev = events[j][0]
        else:
            if n + 1 < len(starts):
                seg[NEXT] = events[end][0] - t_prev
            cycles.append(seg)
    return cycles


def rows(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.endswith("}")]


def with_root(env: Mapping[str, str]) -> dict[str, str]:
    """``env`` with this checkout first on ``PYTHONPATH`` (what was there already stays, after it)."""
    return {**env, "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)}


def client_env(interval: float, home: Path) -> dict[str, str]:
    env = flower_env(home)
    env.update({SUPEREXEC_POLL_ENV: f"{interval:g}", "FLWR_LOG_LEVEL": "DEBUG"})
    return with_root(env)


def client_argv(port: int, i: int, clients: int, home: Path, worker: str = "warm") -> list[str]:
    """``worker``: ``cold``, ``warm`` (the defaults: worker and fork server) or ``warm-noprestart``."""
    argv = [sys.executable, "-m", "clients.launcher", "--server", f"127.0.0.1:{port}", "--insecure"]
    argv += ["--worker", worker.split("-")[0]] + (["--no-prestart"] if worker.endswith("-noprestart") else [])
    return argv + ["--partition-id", str(i), "--num-partitions", str(clients), "--flwr-home", str(home)]


def parse_setting(text: str) -> tuple[str, int]:
    """``"warm:1"`` -> ``("warm", 1)``."""
    worker, _, prefetch = text.partition(":")
    if worker not in WORKERS or not prefetch.isdigit():
        raise ValueError(f"--setting {text!r}: WORKER:PREFETCH with WORKER one of {', '.join(WORKERS)}, e.g. warm:1")
    return worker, int(prefetch)


def deployment(args: argparse.Namespace, interval: float, setting: str, work: Path) -> dict[str, Any]:
    """One flower-server run with ``args.clients`` flower-clients, every Flower process at ``interval``."""
    worker, prefetch = parse_setting(setting)
    port, out = free_port(), work / "out"
    env = with_root({**os.environ, SUPEREXEC_POLL_ENV: f"{interval:g}"})
    server_argv = [sys.executable, "-m", "server_app.launcher", "--insecure", "--port", str(port), "--quiet"]
    server_argv += ["--mode", "async", "--buffer-size", "1", "--min-clients", str(args.clients)]
    server_argv += ["--versions", str(args.versions), "--local-steps", str(args.local_steps)]
    server_argv += ["--compressor", args.compressor, "--model", args.model, "--out", str(out)]
    if args.model_options:
        server_argv += ["-c", f"model-options={args.model_options}"]
    if args.compressor_options:
        server_argv += ["--compressor-options", args.compressor_options]
    server_argv += ["--prefetch", str(prefetch), "--flwr-home", str(work / "server-home")]
    server_argv += ["-c", f"run-timeout={HANG_S}", "-c", f"node-wait={HANG_S}"]
    procs: list[ManagedProcess] = []
    t0 = time.monotonic()
    try:
        server = ManagedProcess("flower-server", server_argv, work / "server.log", env, cwd=ROOT)
        procs.append(server)
        for i in range(args.clients):
            home = work / f"client{i}-home"
            argv = client_argv(port, i, args.clients, home, worker) + ["--log", str(work / f"client{i}.log")]
            procs.append(ManagedProcess(f"client{i}", argv, work / f"client{i}.out", client_env(interval, home), ROOT))
        while server.poll() is None:
            assert time.monotonic() - t0 < HANG_S, f"run did not finish:\n{server.tail(30)}"
            for p in procs:
                p.remember_children()
            time.sleep(0.5)
        assert server.poll() == 0, f"flower-server exited {server.poll()}:\n{server.tail(30)}"
    finally:
        for p in reversed(procs):
            p.stop()
        signal_pids([pid for p in procs for pid in p.known], 9)
    res = summarize_run(args, interval, work, out, time.monotonic() - t0)
    return {"setting": setting, "worker": worker, "prefetch": prefetch, **res}


def summarize_run(args: argparse.Namespace, interval: float, work: Path, out: Path, wall: float) -> dict[str, Any]:
    r = rows(out / "metrics.jsonl")
    assert len(r) == args.versions, f"{len(r)} of {args.versions} versions in {out / 'metrics.jsonl'}"
    per_version = (r[-1]["time"] - r[0]["time"]) / (len(r) - 1)
    cycles = []
    for i in range(args.clients):
        cycles += task_cycles(log_events(work / f"client{i}.log"))[1:]  # each client's first task: start-up
    full = [c for c in cycles if NEXT in c]
    segments = (
        {name: statistics.median(c[name] for c in full) for name in [m for m, _ in MARKS] + [NEXT]} if full else {}
    )
    return {
        "poll_interval_s": interval,
        "versions": len(r),
        "wall_s_process": round(wall, 2),
        "run_time_s_v1_to_vN": round(r[-1]["time"] - r[0]["time"], 3),
        "per_version_s": round(per_version, 3),
        "per_task_cycle_per_client_s": round(args.clients * per_version, 3),
        "objects_per_reply": sum(x.get("flower_objects_up", 0) for x in r) / max(1, sum(x.get("messages_up", 0)
                                                                                         for x in r)),
        "log_cycles_measured": len(full),
        "log_cycle_median_s": round(statistics.median(sum(c.values()) for c in full), 3) if full else None,
        "segments_median_s": {k: round(v, 3) for k, v in segments.items()},
        "accuracy": r[-1].get("accuracy"),
        "train_seconds_median": json.loads((out / "summary.json").read_text()).get("train_seconds_median")
        if (out / "summary.json").is_file() else None,
    }


def scenario_toml(
    args: argparse.Namespace, interval: float, setting: str, compute: float, start: float | None,
    s_per_sample: float = 0.0,
) -> str:
    """The run as a ``fedcomp sim`` scenario: loopback link, a device whose compute is ``compute`` seconds per
    task plus ``s_per_sample`` per sample, the worker's process start ``start`` seconds (measured: the run's
    process start + ClientApp segments, less the compute; None: the clock's own charges)."""
    worker, prefetch = parse_setting(setting)
    worker = worker.split("-")[0]
    key = "cold_start_s" if worker == "cold" else "warm_start_s"
    start_line = "" if start is None else f"{key} = {start}"
    return f"""name = "loopback"
description = "latency calibration: loopback deployment as a simulation"
seed = 0
methods = ["run"]
baseline = "run"
target_accuracy = 0.99

[sim]
engine = "inprocess"
superexec_poll_s = {interval}
{start_line}

[run]
dataset = "digits"
model = "{args.model}"
model_options = "{args.model_options}"
compressor = "{args.compressor}"
{f'compressor_options = "{args.compressor_options}"' if args.compressor_options else ""}
mode = "async"
buffer_size = 1
local_steps = {args.local_steps}
num_versions = {args.versions}
prefetch = {prefetch}
worker = "{worker}"

[method.run]

[[clients]]
count = {args.clients}
link = "loopback"
device = "probe"

[links.loopback]
up_mbps = 1000
down_mbps = 1000
rtt_ms = 1

[devices.probe]
s_per_sample = {s_per_sample}
startup_s = {compute}
"""


def loopback_rtt(run: dict[str, Any]) -> float:
    """Seconds per HTTP request on loopback, as the run's SuperNode log measured them: the reply upload segment
    (push of the message and its objects) over the wire model's request count for a reply of that many objects.
    On loopback that is request handling, not distance (the 1 ms floor: a bare round trip)."""
    objects = max(1, round(run.get("objects_per_reply") or 1))
    upload = run["segments_median_s"].get("upload", 0.0)
    return max(0.001, upload / TimingConfig().wire.reply_trips(objects))


#: How the simulator is told the run's costs: ``measured`` (the device's compute and the process start are this
#: run's own, from the probe and the SuperNode log) or ``clock`` (only the device's speed is measured, as every
#: scenario names its devices: the warm probe's task seconds T are split into training and codec at the codec
#: table's ratio, s = T / (samples + codec_ref / s_ref), so that training (s per sample) + the table's codec
#: scaled to that device (``CodecCost.scaled``) add up to T; everything else is the clock's own: ``COLD_START_S``
#: / ``WARM_START_S`` + ``WORKER_START_S``, the reply check, the transport).
PREDICTIONS = ("measured", "clock")


def predict(args: argparse.Namespace, run: dict[str, Any], compute: float, work: Path,
            how: str = "measured") -> dict[str, Any]:
    """The simulator's per-task cycle for the same setting (see the module docstring and ``PREDICTIONS``): the
    mean over ``--sim-seeds`` seeds, since where the server's reads land (``read_phase = "random"``) is drawn
    per seed."""
    seg = run["segments_median_s"]
    start: float | None = max(seg.get("process start", 0.0) + seg.get("clientapp", 0.0) - compute, 0.0)
    s_per_sample = 0.0
    if how == "clock":
        cost = codec_cost(args.model, args.compressor, "dense", options=args.model_options)
        assert cost is not None, f"no codec calibration for {args.model} {args.model_options!r} {args.compressor}"
        density = float(dict(kv.split("=", 1) for kv in args.compressor_options.split() if "=" in kv).get(
            "density", RUN_DENSITY))
        samples = args.local_steps * BATCH
        codec_ref = cost.downlink_s + cost.uplink_s(density)
        start, s_per_sample = None, compute / (samples + codec_ref / cost.train_s_per_sample)
        compute = 0.0
    rtt = loopback_rtt(run)
    cycles = []
    for seed in range(args.sim_seeds):
        path, out = work / f"scenario-{how}-{seed}.toml", work / f"sim-{how}-{seed}"
        toml = scenario_toml(args, run["poll_interval_s"], run["setting"], round(compute, 4),
                             None if start is None else round(start, 4), s_per_sample)
        toml = toml.replace("seed = 0", f"seed = {seed}", 1).replace("rtt_ms = 1", f"rtt_ms = {rtt * 1e3:.3f}")
        path.write_text(toml)
        cmd = [sys.executable, "-m", "simulations.cli", str(path), "--out", str(out), "--quiet", "--no-plot"]
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=HANG_S, cwd=ROOT,
                             env=with_root(os.environ))
        assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
        r = rows(out / "run.jsonl")
        cycles.append(args.clients * (r[-1]["time"] - r[0]["time"]) / (len(r) - 1))
    cycle = statistics.mean(cycles)
    split = json.loads((out / "summary.json").read_text()) if (out / "summary.json").is_file() else {}
    return {"how": how, "process_start_s": None if start is None else round(start, 3), "rtt_s": round(rtt, 4),
            "seeds": len(cycles), "per_task_cycle_per_client_s": round(cycle, 3),
            "per_seed": [round(c, 3) for c in cycles],
            "vs_deployment": round(cycle / run["per_task_cycle_per_client_s"], 3),
            "split_last_seed": {k: v for k, v in split.get("methods", [{}])[0].items() if k.startswith("task_")}
            if isinstance(split.get("methods"), list) else {}}


def tree_cpu(pid: int) -> dict[str, float]:
    """CPU seconds (user + system) of ``pid`` and its live descendants: total and the ``flower-superexec`` part."""
    total = superexec = 0.0
    try:
        procs = [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]
    except psutil.NoSuchProcess:
        return {"total": 0.0, "superexec": 0.0}
    for p in procs:
        try:
            t = p.cpu_times()
        except psutil.NoSuchProcess:
            continue
        total += t.user + t.system
        if "flower-superexec" in command_line(p.pid):
            superexec += t.user + t.system
    return {"total": total, "superexec": superexec}


def idle_cpu(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    """A bare SuperLink and one flower-client per interval, connected together with no run; CPU over args.idle."""
    port = free_port()
    address = f"127.0.0.1:{port}"
    procs: list[ManagedProcess] = []
    try:
        link = ManagedProcess(
            "flower-superlink",
            superlink_argv(port, extra=["--insecure"]),
            work / "superlink.log",
            flower_env(work / "link-home"),
        )
        procs.append(link)
        wait_http_ready(address, 300, link)
        for n, interval in enumerate(args.poll_interval):
            env = {**client_env(interval, work / f"idle{n}-home"), "FLWR_LOG_LEVEL": "INFO"}
            argv = client_argv(port, 0, 1, work / f"idle{n}-home")
            procs.append(ManagedProcess(f"idle{n}", argv, work / f"idle{n}.log", env, ROOT))
        end = time.monotonic() + HANG_S
        while not all(any("flower-superexec" in command_line(c) for c in p.remember_children()) for p in procs[1:]):
            assert time.monotonic() < end, "SuperExecs did not start"
            time.sleep(0.5)
        time.sleep(10.0)  # past start-up: imports, first connection
        before = [tree_cpu(p.pid) for p in procs[1:]]
        t0 = time.monotonic()
        time.sleep(args.idle)
        after = [tree_cpu(p.pid) for p in procs[1:]]
        wall = time.monotonic() - t0
    finally:
        for p in reversed(procs):
            p.stop()
        signal_pids([pid for p in procs for pid in p.known], 9)
    out = {}
    for interval, b, a in zip(args.poll_interval, before, after, strict=True):
        out[f"{interval:g}"] = {
            "wall_s": round(wall, 2),
            "client_cpu_s": round(a["total"] - b["total"], 3),
            "client_cpu_percent_of_one_core": round(100 * (a["total"] - b["total"]) / wall, 2),
            "superexec_cpu_s": round(a["superexec"] - b["superexec"], 3),
            "superexec_cpu_percent_of_one_core": round(100 * (a["superexec"] - b["superexec"]) / wall, 2),
        }
    return out


def probe_child(args: argparse.Namespace) -> None:
    """In a fresh process: import ``clients.app`` and answer one train message, as a ``flwr-clientapp`` does.
    ``import_s``: process start to ``clients.app`` imported (this script's own imports included)."""
    from flwr.app import Context, Message, Metadata, RecordDict

    from clients.app import app
    from fedcomp.flower import records
    from fedcomp.protocol import Task
    from fedcomp.server.loops import encode_model
    from fedcomp.spec import ModelSpec
    from fedcomp.task.config import NodeConfig, RunConfig
    from fedcomp.task.plugins import TRUSTED
    from fedcomp.task.training import make_model, node_partition

    t_import = time.time() - psutil.Process().create_time()  # interpreter start-up and every import
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        import tomli as tomllib  # type: ignore[no-redef]
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["flwr"]["app"]["config"]
    config.update({"model": args.model, "compressor": args.compressor, "mode": "async", "buffer-size": 1,
                   "local-steps": args.local_steps})
    if args.model_options:
        config["model-options"] = args.model_options
    if args.compressor_options:
        config["compressor-options"] = args.compressor_options
    node = {"partition-id": 0, "num-partitions": args.clients, "gpu": False, "device-class": "cpu"}
    run = RunConfig.from_flower(config, plugins=TRUSTED)
    model = make_model(run, node_partition(run, NodeConfig.from_flower(node)))
    spec = ModelSpec.from_module(model)
    blob = encode_model(dict(model.named_parameters()), spec, 0)
    meta = Metadata(
        run_id=1,
        message_id="probe",
        src_node_id=1,
        dst_node_id=17,
        reply_to_message_id="",
        group_id="0",
        created_at=time.time(),
        ttl=60.0,
        message_type=records.TRAIN,
    )
    tasks = records.TaskFormat(run.compression.to_flat(), records.ArrayLayout.of_spec(spec))

    def message(task_id: int) -> Message:
        return Message(content=tasks.content(Task(task_id, 17, 0, 0.0, 60.0), blob), metadata=meta)

    t1 = time.perf_counter()
    reply = app(message(1), Context(1, 17, node, RecordDict(), config))
    t_call = time.perf_counter() - t1
    metrics = {"train-seconds": records.mod_reply_seconds(reply.content)}
    ctx = Context(1, 18, node, RecordDict(), config)  # a warm worker's path: the node's data and model kept
    for task_id in (1, 2):
        t2 = time.perf_counter()
        app(message(task_id), ctx)
        warm = time.perf_counter() - t2
    print(json.dumps({"import_s": t_import, "call_s": t_call, "train_seconds": metrics["train-seconds"],
                      "warm_train_seconds": warm}))


def probe(args: argparse.Namespace) -> dict[str, float]:
    """Median over ``args.probe`` fresh processes of the ClientApp's import, call and ``train-seconds``."""
    runs = []
    for _ in range(args.probe):
        argv = [sys.executable, __file__, "--probe-child", "--clients", str(args.clients)]
        argv += ["--local-steps", str(args.local_steps), "--model", args.model, "--compressor", args.compressor]
        argv += [f"--model-options={args.model_options}", f"--compressor-options={args.compressor_options}"]
        res = subprocess.run(
            argv, capture_output=True, text=True, timeout=HANG_S, cwd=ROOT, env=with_root(os.environ)
        )
        assert res.returncode == 0, res.stderr[-2000:]
        runs.append(json.loads(res.stdout.strip().splitlines()[-1]))
    return {k: round(statistics.median(r[k] for r in runs), 3) for k in runs[0]}


def table(results: dict[str, Any], clients: int) -> str:
    runs, comp, idle = results["runs"], results.get("probe"), results.get("idle_cpu", {})
    head = ["worker:prefetch @ SuperExec poll (s)"] + [f"{r['setting']}@{r['poll_interval_s']:g}" for r in runs]
    lines = [
        ("wall s per version (v1..vN, metrics.jsonl)", [r["per_version_s"] for r in runs]),
        (
            f"wall s per task cycle per client (= {clients} x per version)",
            [r["per_task_cycle_per_client_s"] for r in runs],
        ),
        ("wall s per task cycle, client log (median)", [r["log_cycle_median_s"] for r in runs]),
    ]
    for name in [m for m, _ in MARKS] + [NEXT]:
        lines.append((f"  wall s per task: {name} (median)", [r["segments_median_s"].get(name) for r in runs]))
    if comp:
        lines.append(("wall s per task: compute (train-seconds, probe)", [r.get("compute_s") for r in runs]))
        lines.append(("wall s per task: overhead (cycle - compute)", [r.get("overhead_s") for r in runs]))
    if any("predicted" in r for r in runs):
        pred = [r.get("predicted", {}) for r in runs]
        lines.append(("simulator: compute per task (s; warm: the run's median train-seconds)",
                      [r.get("sim_compute_s") for r in runs]))
        lines.append(("simulator: process start charged (s)", [x.get("process_start_s") for x in pred]))
        lines.append(("simulator: loopback round trip (s, measured upload / requests)", [x.get("rtt_s") for x in pred]))
        lines.append((
            "simulator: per task cycle per client (s, mean of the seeds)",
            [x.get("per_task_cycle_per_client_s") for x in pred],
        ))
        lines.append(("simulator / deployment", [x.get("vs_deployment") for x in pred]))
        clock = [r.get("predicted_clock", {}) for r in runs]
        lines.append(("simulator, the clock's own charges: per task cycle (s)",
                      [x.get("per_task_cycle_per_client_s") for x in clock]))
        lines.append(("simulator (clock's charges) / deployment", [x.get("vs_deployment") for x in clock]))
    if idle:
        lines.append(
            (
                f"idle client CPU, % of one core ({next(iter(idle.values()))['wall_s']:.0f} s)",
                [idle.get(f"{r['poll_interval_s']:g}", {}).get("client_cpu_percent_of_one_core") for r in runs],
            )
        )
    width = max(len(n) for n, _ in lines + [(head[0], None)])
    fmt = lambda v: "-" if v is None else f"{v:.3f}" if isinstance(v, float) else str(v)  # noqa: E731
    out = [head[0].ljust(width) + "".join(h.rjust(14) for h in head[1:])]
    out += [n.ljust(width) + "".join(fmt(v).rjust(14) for v in vals) for n, vals in lines]
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    p = parser()
    args = p.parse_args(argv)
    if args.probe_child:
        probe_child(args)
        return 0
    lo, hi = SUPEREXEC_POLL_BOUNDS
    for interval in args.poll_interval:
        if not lo <= interval <= hi:
            p.error(f"--poll-interval {interval}: Flower allows {lo} to {hi} seconds")
    for setting in args.setting:
        try:
            parse_setting(setting)
        except ValueError as exc:
            p.error(str(exc))
    if args.versions < 3 or args.clients < 1 or args.sim_seeds < 1:
        p.error("--versions must be >= 3, --clients >= 1 and --sim-seeds >= 1")
    results: dict[str, Any] = {
        "setup": {
            "model": args.model,
            "model_options": args.model_options,
            "compressor": args.compressor,
            "compressor_options": args.compressor_options,
            "mode": "async",
            "buffer_size": 1,
            "clients": args.clients,
            "local_steps": args.local_steps,
            "versions": args.versions,
            "load_average": os.getloadavg(),
        },
        "runs": [],
    }
    with tempfile.TemporaryDirectory(prefix="latency-") as tmp:
        base = args.keep.resolve() if args.keep else Path(tmp)
        if args.probe:
            results["probe"] = probe(args)
            print(f"probe (fresh process, median of {args.probe}): {json.dumps(results['probe'])}", flush=True)
        for interval in args.poll_interval:
            for setting in args.setting:
                work = base / f"{setting.replace(':', '-')}-poll-{interval:g}"
                work.mkdir(parents=True, exist_ok=True)
                res = deployment(args, interval, setting, work)
                if args.probe:
                    probe_res = results["probe"]
                    compute = probe_res["warm_train_seconds"]
                    if res["worker"] != "cold" and res.get("train_seconds_median"):
                        compute = res["train_seconds_median"]  # the run's own, under the run's own load
                    res["compute_s"] = probe_res["train_seconds" if res["worker"] == "cold" else "warm_train_seconds"]
                    res["overhead_s"] = round(res["per_task_cycle_per_client_s"] - res["compute_s"], 3)
                    res["sim_compute_s"] = round(compute, 3)
                    res["predicted"] = predict(args, res, compute, work)
                    res["predicted_clock"] = predict(args, res, compute, work, "clock")
                results["runs"].append(res)
                print(f"{setting} @ poll {interval:g} s: {json.dumps(res)}", flush=True)
        if args.idle > 0:
            (base / "idle").mkdir(parents=True, exist_ok=True)
            results["idle_cpu"] = idle_cpu(args, base / "idle")
            print(f"idle CPU: {json.dumps(results['idle_cpu'])}", flush=True)
    results["setup"]["load_average_end"] = os.getloadavg()
    print()
    print(table(results, args.clients))
    if args.json:
        write_json(args.json, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())

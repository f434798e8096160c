"""Wire calibration: the product's wire-bytes model against an independent TCP count, both directions.

A real loopback deployment: Flower's SuperLink (started as ``flower-server`` starts it) and N SuperNodes (started
by ``flower-client``) that connect through a counting TCP proxy written here, which forwards every byte and
records (time, connection, direction, bytes, HTTP request path). Two phases:

* idle: the nodes are connected, no run: polls and heartbeats only;
* busy: one fedcomp run of ``--versions`` versions, submitted with ``flwr run`` (the product's run config).

The model side uses only what the product knows: ``summary.json`` (Flower object bytes and object counts of every
task and reply, the run's length) and :data:`fedcomp.sim.wirecost.FLOWER_1_41`. The table compares model and proxy per
direction; ``--fit`` prints per-request constants measured from the proxy's per-path tally (what
``FLOWER_1_41`` holds). JSON goes to ``--out/wire_calibration.json``.

    .venv/bin/python benchmarks/wire_calibration.py --clients 2 --versions 6 --idle 60
    .venv/bin/python benchmarks/wire_calibration.py --model resnet-1m --versions 6 --compressor dgc+int8
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from fedcomp.sim.wirecost import FLOWER_1_41  # noqa: E402
from fedcomp.tools.processes import (  # noqa: E402
    ManagedProcess,
    flower_env,
    free_port,
    run_status,
    signal_pids,
    submit_run,
    superlink_argv,
    wait_http_ready,
    write_flower_config,
    write_overrides,
)

UP, DOWN = "up", "down"
HANG_S = 900  # bounds a hang only
REQUEST = re.compile(rb"(?:GET|POST) (/[^ ]*) HTTP/1\.[01]\r\n")


@dataclass
class Request:
    """One HTTP request/response exchange seen by the proxy: wire bytes up (request) and down (response)."""

    t: float
    conn: int
    path: str
    up: int = 0
    down: int = 0


@dataclass
class CountingProxy:
    """TCP proxy ``127.0.0.1:port`` -> ``upstream`` that counts every byte per connection and direction, with
    wall-clock times, and splits them into HTTP exchanges by request line (HTTP/1.1 without pipelining: the bytes
    coming back on a connection answer its last request). ``samples`` keeps the first bytes of one request and
    response per path (to read the headers)."""

    upstream: tuple[str, int]
    port: int = 0
    requests: list[Request] = field(default_factory=list)
    samples: dict[str, dict[str, bytes]] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _loop: asyncio.AbstractEventLoop | None = None
    _conns: int = 0

    def start(self) -> CountingProxy:
        ready = threading.Event()

        def run() -> None:
            self._loop = asyncio.new_event_loop()
            server = self._loop.run_until_complete(asyncio.start_server(self._serve, "127.0.0.1", self.port))
            self.port = server.sockets[0].getsockname()[1]
            ready.set()
            self._loop.run_forever()

        threading.Thread(target=run, daemon=True, name="counting-proxy").start()
        ready.wait(10)
        return self

    def stop(self) -> None:
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._loop.stop)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._conns += 1
        conn = self._conns
        current: list[Request | None] = [None]
        try:
            up_r, up_w = await asyncio.open_connection(*self.upstream)
        except OSError:
            writer.close()
            return

        def count(data: bytes, direction: str) -> None:
            with self._lock:
                if direction == UP:
                    for m in REQUEST.finditer(data):  # bytes before a request line end the previous exchange
                        current[0] = Request(time.time(), conn, m.group(1).decode())
                        self.requests.append(current[0])
                        sample = self.samples.setdefault(current[0].path, {})
                        sample.setdefault(UP, data[m.start() : m.start() + 1500])
                    req = current[0] or Request(time.time(), conn, "(before any request)")
                    if current[0] is None:
                        current[0] = req
                        self.requests.append(req)
                    req.up += len(data)
                else:
                    req = current[0] or Request(time.time(), conn, "(no request)")
                    req.down += len(data)
                    self.samples.setdefault(req.path, {}).setdefault(DOWN, data[:600])

        async def pump(src: asyncio.StreamReader, dst: asyncio.StreamWriter, direction: str) -> None:
            try:
                while data := await src.read(65536):
                    count(data, direction)
                    dst.write(data)
                    await dst.drain()
            except (ConnectionError, OSError):
                pass
            finally:
                try:
                    dst.close()
                except (ConnectionError, OSError):  # pragma: no cover
                    pass

        await asyncio.gather(pump(reader, up_w, UP), pump(up_r, writer, DOWN))

    def window(self, t0: float, t1: float) -> list[Request]:
        """Exchanges that started in ``[t0, t1)`` (wall clock)."""
        with self._lock:
            return [r for r in self.requests if t0 <= r.t < t1]


#: a pull-messages answer larger than this carried a task (an empty one is ≈128 B on the wire)
EMPTY_POLL_MAX = 200


def kind(r: Request) -> str:
    name = r.path.rsplit("/", 1)[-1]
    if name == "pull-messages":
        return "poll (empty)" if r.down <= EMPTY_POLL_MAX else "pull-messages (task)"
    return name


def totals(reqs: list[Request]) -> dict[str, int]:
    return {UP: sum(r.up for r in reqs), DOWN: sum(r.down for r in reqs)}


def by_kind(reqs: list[Request]) -> dict[str, dict[str, float]]:
    """Per exchange kind: count, wire bytes up and down, and their means."""
    out: dict[str, dict[str, float]] = {}
    for r in reqs:
        row = out.setdefault(kind(r), {"requests": 0, UP: 0, DOWN: 0})
        row["requests"] += 1
        row[UP] += r.up
        row[DOWN] += r.down
    for row in out.values():
        row["mean_up"] = round(row[UP] / row["requests"], 1)
        row["mean_down"] = round(row[DOWN] / row["requests"], 1)
    return dict(sorted(out.items()))


def fit_cost(kinds: dict[str, dict[str, float]], summary: dict[str, Any], clients: int) -> dict[str, float]:
    """``WireCost`` constants measured from one busy window: means per exchange kind, object framing beyond the
    Flower object bytes of ``summary.json``'s totals, the bundle per client."""
    t = summary["totals"]

    def mean(k: str, d: str) -> float:
        return kinds.get(k, {}).get(f"mean_{d}", 0.0)

    def n(k: str) -> int:
        return int(kinds.get(k, {}).get("requests", 0))

    fit = {
        "task_up": mean("pull-messages (task)", UP) + mean("confirm-message-received", UP),
        "task_down": mean("pull-messages (task)", DOWN) + mean("confirm-message-received", DOWN),
        "pull_object_up": mean("pull-object", UP),
        "pull_object_down": (kinds.get("pull-object", {}).get(DOWN, 0) - t["flower_bytes_down"])
        / max(n("pull-object"), 1),
        "reply_up": mean("push-messages", UP),
        "reply_down": mean("push-messages", DOWN),
        "push_object_up": (kinds.get("push-object", {}).get(UP, 0) - t["flower_bytes_up"]) / max(n("push-object"), 1),
        "push_object_down": mean("push-object", DOWN),
        "poll_up": mean("poll (empty)", UP),
        "poll_down": mean("poll (empty)", DOWN),
        "heartbeat_up": mean("send-node-heartbeat", UP),
        "heartbeat_down": mean("send-node-heartbeat", DOWN),
        "bundle_up": (kinds.get("get-run", {}).get(UP, 0) + kinds.get("get-fab", {}).get(UP, 0)) / max(clients, 1),
        "bundle_down": (kinds.get("get-run", {}).get(DOWN, 0) + kinds.get("get-fab", {}).get(DOWN, 0))
        / max(clients, 1),
        "empty_polls": n("poll (empty)"),
        "heartbeats": n("send-node-heartbeat"),
    }
    return {k: round(v, 1) for k, v in fit.items()}


def reconcile(kinds: dict[str, dict[str, float]], summary: dict[str, Any]) -> dict[str, dict[str, float]]:
    """Message counts both ways: what the proxy saw and what the wire model charged (tasks fetched, replies
    pushed, empty polls, heartbeats), so a miss names its part."""
    w, t = summary["wire"], summary["totals"]
    cost = FLOWER_1_41

    def n(k: str) -> int:
        return int(kinds.get(k, {}).get("requests", 0))

    model = {
        "tasks fetched": t["messages_down"] - w.get("unfetched_tasks", 0.0),
        "replies pushed": w.get("replies", t["messages_up"]),
        "empty polls": w["waiting_node_seconds"] / cost.poll_interval_s
        + w.get("empty_repolls", t["messages_up"]) * cost.polls_per_reply,
        "heartbeats": w["connected_node_seconds"] / cost.heartbeat_interval_s,
    }
    proxy = {"tasks fetched": n("pull-messages (task)"), "replies pushed": n("push-messages"),
             "empty polls": n("poll (empty)"), "heartbeats": n("send-node-heartbeat")}
    return {k: {"proxy": proxy[k], "model": round(model[k], 2)} for k in model}


def deployment(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    """Idle phase, then one run; the proxy's exchanges and the product's summary for each."""
    port = free_port()
    home = work / "server-home"
    env = flower_env(home)
    env["PYTHONPATH"] = str(ROOT)
    address = f"127.0.0.1:{port}"
    write_flower_config(home, "fedcomp", address, insecure=True)
    procs: list[ManagedProcess] = []
    proxy = CountingProxy(("127.0.0.1", port)).start()
    result: dict[str, Any] = {}
    try:
        link = ManagedProcess(
            "flower-superlink", superlink_argv(port, extra=["--insecure"]), work / "superlink.log", env
        )
        procs.append(link)
        wait_http_ready(address, 300, link)
        for i in range(args.clients):
            cenv = flower_env(work / f"client{i}-home")
            cenv["PYTHONPATH"] = str(ROOT)
            argv = [sys.executable, "-m", "clients.launcher", "--server", f"127.0.0.1:{proxy.port}", "--insecure"]
            argv += ["--partition-id", str(i), "--num-partitions", str(args.clients)]
            argv += ["--flwr-home", str(work / f"client{i}-home")]
            procs.append(ManagedProcess(f"client{i}", argv, work / f"client{i}.log", cenv, cwd=ROOT))
        # connected: every node has polled at least once, and the first heartbeat went by
        end = time.monotonic() + HANG_S
        while sum(kind(r) == "poll (empty)" for r in proxy.requests) < 2 * args.clients:
            assert time.monotonic() < end, "SuperNodes did not connect"
            time.sleep(0.5)
        time.sleep(2.0)
        t_idle = time.time()
        time.sleep(args.idle)
        t_busy = time.time()
        idle = proxy.window(t_idle, t_busy)
        node_s = args.clients * (t_busy - t_idle)
        result["idle"] = {
            "seconds": round(t_busy - t_idle, 2),
            "clients": args.clients,
            "proxy": totals(idle),
            "model": dict(zip((UP, DOWN), FLOWER_1_41.idle(node_s), strict=True)),
            "by_kind": by_kind(idle),
            "per_node_second": {d: round(v / node_s, 1) for d, v in totals(idle).items()},
        }
        out = work / "out"
        values: dict[str, Any] = {
            "mode": args.mode,
            "num-versions": args.versions,
            "min-clients": args.clients,
            "compressor": args.compressor,
            "model": args.model,
            "out-dir": str(out),
            "local-steps": args.local_steps,
            "run-timeout": float(HANG_S),
            "node-wait": float(HANG_S),
        }
        for key in ("model_options", "compressor_options", "downlink"):
            if getattr(args, key):
                values[key.replace("_", "-")] = getattr(args, key)
        run_id = submit_run(ROOT, "fedcomp", env, write_overrides(work / "run-config.toml", values))
        end = time.monotonic() + HANG_S
        while not (status := run_status("fedcomp", run_id, env)).startswith("finished"):
            assert time.monotonic() < end, f"run {run_id} did not finish ({status})"
            time.sleep(1.0)
        summary = json.loads((out / "summary.json").read_text())
        busy = proxy.window(summary["started_at"], summary["ended_at"])
        kinds = by_kind(busy)
        result["busy"] = {
            "status": status,
            "seconds": round(summary["ended_at"] - summary["started_at"], 2),
            "clients": args.clients,
            "proxy": totals(busy),
            "model": {UP: summary["wire"]["wire_bytes_up"], DOWN: summary["wire"]["wire_bytes_down"]},
            "model_parts": summary["wire"]["parts"],
            "by_kind": kinds,
            "fit": fit_cost(kinds, summary, args.clients),
            "counts": reconcile(kinds, summary),
            "exchanges": [(round(r.t - summary["started_at"], 3), r.conn, kind(r), r.up, r.down) for r in busy],
            "load_average": os.getloadavg(),
            "summary": summary,
        }
        result["samples"] = {
            path: {d: b.decode("latin-1") for d, b in sample.items()} for path, sample in proxy.samples.items()
        }
    finally:
        for p in reversed(procs):
            p.stop()
        signal_pids([pid for p in procs for pid in p.known], 9)
        proxy.stop()
    return result


def table(res: dict[str, Any]) -> str:
    lines = [f"{'phase':6} {'dir':5} {'proxy (wire B)':>15} {'model (wire B)':>15} {'model/proxy':>11}"]
    for phase in ("idle", "busy"):
        for d in (UP, DOWN):
            p, m = res[phase]["proxy"][d], res[phase]["model"][d]
            lines.append(f"{phase:6} {d:5} {p:>15,} {m:>15,} {m / max(p, 1):>11.3f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    p.add_argument("--clients", type=int, default=2)
    p.add_argument("--versions", type=int, default=6)
    p.add_argument("--idle", type=float, default=60.0, help="seconds of the idle phase")
    p.add_argument("--mode", default="async", choices=("async", "sync"))
    p.add_argument("--model", default="mlp")
    p.add_argument("--model-options", default="")
    p.add_argument("--compressor", default="dgc")
    p.add_argument("--compressor-options", default="")
    p.add_argument("--downlink", default="")
    p.add_argument("--local-steps", type=int, default=10)
    p.add_argument("--out", type=Path, default=None, help="folder for wire_calibration.json and the logs")
    args = p.parse_args(argv)
    work = Path(args.out or tempfile.mkdtemp(prefix="wirecal-")).resolve()
    work.mkdir(parents=True, exist_ok=True)
    res = deployment(args, work)
    res["args"] = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    (work / "wire_calibration.json").write_text(json.dumps(res, indent=1, default=str))
    print(table(res))
    s = res["busy"]["summary"]
    brief = {
        k: s.get(k)
        for k in (
            "versions",
            "num_parameters",
            "flower_objects_up_per_reply",
            "protocol_wire_bytes_per_reply",
            "wire_bytes_up_per_reply",
            "wire_bytes_down_per_task",
        )
    }
    print(
        json.dumps(
            {
                "idle": {k: res["idle"][k] for k in ("seconds", "proxy", "model", "per_node_second")},
                "busy": {k: res["busy"][k] for k in ("seconds", "proxy", "model", "model_parts", "fit", "counts",
                                                     "load_average")},
                "by_kind": res["busy"]["by_kind"],
                "summary": brief,
            },
            indent=1,
            default=str,
        )
    )
    print(f"results: {work / 'wire_calibration.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Run a scenario: every method on the same clients, data and links, through the real server loops.

For each method: the server is built exactly as the Flower ServerApp builds it (``fedcomp.task.serverside``:
``build_server``, ``loop_config``), the clients are the fedcomp ClientApp run by an engine
(``simulations.engines``), and the loop registered under ``mode`` in ``fedcomp.server.loops.LOOPS`` runs over a
``fedcomp.sim.virtual.VirtualTransport`` and its ``VirtualClock``. Budgets are the method's ``num_versions`` and
``run_timeout`` (virtual seconds; 0 = none).

Outputs (``write_outputs``): ``<method>.jsonl`` (one row per model version), ``summary.json``, ``summary.csv``,
``scenario.json`` (the validated input) and the PNG plots of ``simulations.plots``.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from fedcomp.server.ledger import NodeIdentities
from fedcomp.server.loops import LOOPS, Reporter
from fedcomp.sim.virtual import Engine, VirtualClock, VirtualTransport
from fedcomp.task.config import RunConfig
from fedcomp.task.heap import keep_freed_memory
from fedcomp.task.serverside import build_server, loop_config
from fedcomp.task.training import evaluate, run_loss
from fedcomp.tools.summary import ByteCounts, run_summary
from simulations.scenario import Method, Scenario

NODE_ID_BASE = 10_000  # in-process node ids: NODE_ID_BASE + partition index (Flower's are random)


@dataclass
class MethodResult:
    """One method's run: per-version rows, the summary row, per-node link stats, applied-staleness counts."""

    method: str
    rows: list[dict[str, Any]]
    summary: dict[str, Any]
    nodes: list[dict[str, Any]] = field(default_factory=list)
    staleness_hist: dict[int, int] = field(default_factory=dict)
    split: dict[str, dict[str, float]] = field(default_factory=dict)  # link -> mean seconds per delivered task


class Progress:
    """A tqdm bar on stderr per method: virtual time, version, accuracy, wire bytes (up + down)."""

    def __init__(self, name: str, total: int, enabled: bool) -> None:
        self.bar = None
        if enabled:
            from tqdm import tqdm

            self.bar = tqdm(total=total, desc=f"{name:>12}", unit="ver", file=sys.stderr, leave=True)

    def update(self, row: dict[str, Any]) -> None:
        if self.bar is None:
            return
        self.bar.update(row["version"] - self.bar.n)
        acc = row.get("accuracy")
        self.bar.set_postfix_str(
            f"t={row['time']:.0f}s acc={'-' if acc is None else f'{acc:.3f}'} "
            f"wire={row['wire_bytes_total'] / 1e6:.2f}MB",
            refresh=False,
        )

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def drive(
    scenario: Scenario,
    method: Method,
    engine: Engine,
    node_index: dict[int, int],
    out_dir: Path | None,
    times: Callable[[], dict[str, float]] = dict,
) -> MethodResult:
    """Run ``method`` over ``engine`` (node id -> partition index in ``node_index``) in virtual time on the
    product's loops (``server = "strategy"``: ``simulations.public.drive_strategy``)."""
    run: RunConfig = method.run
    torch.set_num_threads(scenario.sim.threads)
    keep_freed_memory()
    t0 = time.perf_counter()
    model, proto, test = build_server(run)
    nodes = node_profiles(scenario, node_index)
    clock = VirtualClock()
    transport = VirtualTransport(engine, nodes, clock, scenario.timing(method))
    rows = RowWriter(scenario, method, out_dir, t0)

    def server_eval(params: dict[str, torch.Tensor]) -> dict[str, float]:
        res = evaluate(model, test, torch.device("cpu"), loss=run_loss(run))
        return {"accuracy": res["accuracy"], "loss": res["loss"]}

    reporter = Reporter(None, server_eval, run.eval_every, clock=clock, progress=lambda row: rows(row, transport))
    loop = LOOPS.get(run.mode)(proto, transport, loop_config(run), reporter, clock=clock)
    try:
        loop.run()
    finally:
        rows.close()
        transport.close()
    if not reporter.rows or "accuracy" not in reporter.rows[-1] or reporter.rows[-1]["version"] != proto.version:
        reporter.last_eval = server_eval(proto.params)
    return method_result(scenario, method, proto, loop, reporter, clock, transport, t0, times)


def node_profiles(scenario: Scenario, node_index: dict[int, int]) -> dict[int, Any]:
    """Node id -> its link and device profile (``Scenario.node_profiles`` by partition index)."""
    profiles = scenario.node_profiles()
    return {nid: profiles[idx] for nid, idx in node_index.items()}


class RowWriter:
    """Each version's row: its wall seconds and cumulative wire bytes (every node, idle polls included) added, the
    row appended to ``OUT/<method>.jsonl`` and shown on the progress bar."""

    def __init__(self, scenario: Scenario, method: Method, out_dir: Path | None, t0: float) -> None:
        self.t0 = t0
        self.jsonl = (out_dir / f"{method.name}.jsonl") if out_dir else None
        if self.jsonl:
            self.jsonl.parent.mkdir(parents=True, exist_ok=True)
            self.jsonl.write_text("")
        self.bar = Progress(method.name, method.run.num_versions, scenario.sim.progress)

    def __call__(self, row: dict[str, Any], transport: VirtualTransport) -> None:
        row["wall_s"] = round(time.perf_counter() - self.t0, 3)
        totals = transport.totals(row["time"])
        row.update({k: totals[k] for k in ("wire_bytes_up", "wire_bytes_down", "wire_bytes_total")})
        if self.jsonl:
            with self.jsonl.open("a") as f:
                f.write(json.dumps(row) + "\n")
        self.bar.update(row)

    def close(self) -> None:
        self.bar.close()


def method_result(
    scenario: Scenario, method: Method, proto: Any, loop: Any, reporter: Reporter, clock: VirtualClock,
    transport: VirtualTransport, t0: float, times: Callable[[], dict[str, float]],
) -> MethodResult:
    """The method's rows, summary, per-node rows and link split once its loop has run."""
    summary = _summary(scenario, method, proto, loop, reporter, clock, transport, time.perf_counter() - t0) | times()
    nodes = transport.nodes
    node_rows, split = _per_node(transport, nodes, loop.auto.summary() if loop.auto is not None else {}, proto.book)
    return MethodResult(method.name, reporter.rows, summary, node_rows, dict(proto.totals.staleness_hist), split)


def _summary(
    scenario: Scenario, method: Method, proto: Any, loop: Any, reporter: Reporter, clock: VirtualClock,
    transport: VirtualTransport, wall_s: float,
) -> dict[str, Any]:
    """One method's figures: ``fedcomp.tools.summary.run_summary`` over the virtual transport's byte counts, then
    what the virtual clock adds (``SIMULATION_FIGURES``: best accuracy and time to target, the time split, link
    outcomes)."""
    stats = list(transport.stats.values())
    t = transport.totals()
    counts = ByteCounts(
        t["payload_bytes_up"], t["payload_bytes_down"], t["flower_bytes_up"], t["flower_bytes_down"],
        t["wire_bytes_up"], t["wire_bytes_down"], replies=sum(s.delivered for s in stats),
        tasks=sum(s.tasks for s in stats), flower_objects_up=proto.totals.flower_objects_up,
    )
    core = run_summary(proto, reporter, method.run, loop, counts, wall_s)
    evaluated = [r["accuracy"] for r in reporter.rows if r.get("accuracy") is not None]
    return {"method": method.name} | core | {
        "worker": method.worker,
        "server": method.server,
        "seed": scenario.seed,
        "superexec_poll_s": transport.config.superexec_poll_s,
        "codec_calibrated": transport.config.codec.charged,
        "best_accuracy": max(evaluated, default=core["accuracy"]),
        "time_to_target_s": time_to_target(reporter.rows, scenario.target_accuracy, core["initial_accuracy"]),
        "virtual_s": round(clock.now(), 3),
        **split_summary(stats),
        "link_losses": sum(s.lost_down + s.lost_up for s in stats),
        "disconnects": sum(s.disconnects for s in stats),
    }


def _per_node(
    transport: VirtualTransport, nodes: dict[int, Any], auto: dict[int, dict[str, Any]], book: NodeIdentities
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Per client: its counters and wire bytes (idle polls included), its updates applied and nacked (the server's
    ledger: whose data the model learned from), and under ``density=auto`` the last density chosen and the link
    the server fitted; per link: the task-time split."""
    rows = []
    for nid, s in transport.stats.items():
        prof = nodes[nid]
        idle_up, idle_down = transport.idle_wire(nid)
        led = book.clients.get(nid)
        rows.append({"client": prof.index, "link": prof.link.name, "device": prof.device.name, **asdict(s),
                     "applied": led.applied if led else 0, "nacked": led.nacked if led else 0,
                     "idle_wire_up": idle_up, "idle_wire_down": idle_down,
                     "wire_bytes_up": s.wire_up + idle_up, "wire_bytes_down": s.wire_down + idle_down,
                     **{f"auto_{k}": v for k, v in auto.get(nid, {}).items()}})
    rows.sort(key=lambda r: r["client"])
    by_link: dict[str, list[Any]] = {}
    for nid, s in transport.stats.items():
        by_link.setdefault(nodes[nid].link.name, []).append(s)
    return rows, {link: split_summary(group) for link, group in by_link.items()}


#: Flower's latency parts of a delivered task's virtual time (``fedcomp.sim.virtual.NodeStats``), in summary order.
LATENCY_PARTS = ("poll_wait_s", "round_trip_s", "superexec_wait_s", "process_start_s", "reply_check_s",
                 "server_wait_s")
#: Every part of a delivered task's virtual time, from dispatch to the server seeing the reply, in summary order
#: (``codec_s``: the client's downlink decode and its update's compress + encode, compute beside training).
SPLIT_PARTS = ("compute_s", "codec_s", "transfer_s", *LATENCY_PARTS, "queue_s")


def split_summary(stats: Any) -> dict[str, float]:
    """Mean seconds per delivered task: ``task_compute_s`` (training), ``task_codec_s`` (decode + compress +
    encode), ``task_transfer_s`` (bytes over bandwidth),
    ``task_latency_s`` (Flower's latency, the sum of ``task_poll_wait_s``, ``task_round_trip_s``,
    ``task_superexec_wait_s``, ``task_process_start_s``, ``task_reply_check_s`` and ``task_server_wait_s``),
    ``task_queue_s`` and ``task_total_s`` (all of them); each ``None`` when no task was delivered.

    Example:
        >>> from fedcomp.sim.virtual import NodeStats
        >>> s = split_summary([NodeStats(timed=2, compute_s=4.0, process_start_s=2.0, server_wait_s=0.25)])
        >>> s["task_compute_s"], s["task_process_start_s"], s["task_latency_s"], s["task_total_s"]
        (2.0, 1.0, 1.125, 3.125)
    """
    stats = list(stats)
    n = sum(s.timed for s in stats)
    if not n:  # no task delivered: no mean (None, "-" in the tables), and no 0 for a mean over seeds to take in
        return {f"task_{p}": None for p in (*SPLIT_PARTS, "latency_s", "total_s")}
    out = {f"task_{p}": round(sum(getattr(s, p) for s in stats) / n, 3) for p in SPLIT_PARTS}
    out["task_latency_s"] = round(sum(out[f"task_{p}"] for p in LATENCY_PARTS), 3)
    out["task_total_s"] = round(sum(out[f"task_{p}"] for p in SPLIT_PARTS), 3)
    return out


def time_to_target(rows: list[dict[str, Any]], target: float, initial: float | None = None) -> float | None:
    """Virtual time of the first evaluated version with accuracy >= ``target``; 0.0 when the starting model's
    accuracy ``initial`` already is (no method then gets a speedup); None if never reached."""
    if initial is not None and initial >= target - 1e-12:
        return 0.0
    for r in rows:
        if r.get("accuracy") is not None and r["accuracy"] >= target - 1e-12:
            return r["time"]
    return None


def add_comparisons(results: list[MethodResult], baseline: str, also: tuple[str, ...] = ()) -> None:
    """``speedup`` = baseline time to target / this method's; ``delta_accuracy`` = accuracy - the baseline's;
    ``speedup_vs_NAME`` for each method ``NAME`` of ``also`` that ran."""
    by_name = {r.method: r.summary for r in results}
    base = by_name[baseline]
    for r in results:
        s = r.summary
        s["speedup"] = _ratio(base["time_to_target_s"], s["time_to_target_s"])
        s["delta_accuracy"] = _difference(s["accuracy"], base["accuracy"])
        for name in also:
            if name in by_name:
                s[f"speedup_vs_{name}"] = _ratio(by_name[name]["time_to_target_s"], s["time_to_target_s"])


def _difference(this: float | None, base: float | None) -> float | None:
    return round(this - base, 4) if (this is not None and base is not None) else None


def _ratio(base: float | None, this: float | None) -> float | None:
    return round(base / this, 2) if (base is not None and this) else None

"""A run's summary: the figures every run reports under one set of names, deployed or simulated.

``run_summary`` gives what ran, how far it got, its accuracy and what became of the updates; a deployment's
``summary.json`` is it plus its metered totals and per-update byte figures (``summarize``); a simulation's method
row is it plus what the virtual clock adds (``simulations.runner``).
"""

from __future__ import annotations

import time
from typing import Any

from fedcomp.downlink import dense_fp32_bytes
from fedcomp.server import ServerProtocol
from fedcomp.server.loops import Reporter
from fedcomp.sim.wirecost import FLOWER_1_41, TaskClock, WireCost, protocol_wire_bytes, run_wire_bytes
from fedcomp.task.config import RunConfig


def wire_summary(totals: dict[str, Any], clock: TaskClock, now: float, cost: WireCost = FLOWER_1_41) -> dict[str, Any]:
    """Wire bytes of the run by part (tasks, replies, polls, heartbeats, bundle), from the Flower object totals
    and the clock (docs/protocol.md, "Wire bytes")."""
    counts = clock.counts(totals, now, cost.poll_interval_s)
    parts = run_wire_bytes(cost, counts)
    return {
        "wire_bytes_up": parts["total"][0],
        "wire_bytes_down": parts["total"][1],
        "protocol_wire_bytes": protocol_wire_bytes(counts, parts),
        "parts": {k: {"up": v[0], "down": v[1]} for k, v in parts.items() if k != "total"},
        "clients": counts.clients,
        "connected_node_seconds": round(counts.connected_s, 2),
        "waiting_node_seconds": round(counts.waiting_s, 2),
        "model": "flwr 1.41 over HTTP",
    }


def per_update(t: dict[str, Any], wire: dict[str, Any] | None) -> dict[str, Any]:
    """Payload, Flower object and wire bytes per reply and per applied update, each named."""
    out: dict[str, Any] = {}
    for unit, n in (("reply", t["messages_up"]), ("applied_update", t["accepted"])):
        n = max(int(n), 1)
        out[f"payload_bytes_up_per_{unit}"] = t["payload_bytes_up"] / n
        out[f"flower_bytes_up_per_{unit}"] = t["flower_bytes_up"] / n
        if wire is not None:
            out[f"wire_bytes_up_per_{unit}"] = wire["wire_bytes_up"] / n
            out[f"wire_bytes_down_per_{unit}"] = wire["wire_bytes_down"] / n
    if wire is not None:  # wire - the Flower object bytes it carried, bundle excluded (never negative)
        out["protocol_wire_bytes_per_reply"] = wire["protocol_wire_bytes"] / max(int(t["messages_up"]), 1)
    return out


def run_summary(proto: ServerProtocol, reporter: Reporter, run: RunConfig, loop: Any) -> dict[str, Any]:
    """The figures every run reports under the same names, deployed (``summarize``) or simulated
    (``simulations.runner``): what ran, how far it got, its accuracy and what became of the updates. Folds the
    protocol's per-node counters into its totals, so call it once per run.

    Example (keys): ``mode, compressor, model, num_parameters, dense_fp32_bytes, downlink, versions,
    target_versions, completed, stopped_reason, initial_accuracy, accuracy, loss, applied, stale, timeout, lost,
    mean_staleness, prefetch, prefetched, prefetched_applied, prefetched_mean_staleness``.
    """
    proto.totals.merge(proto.stats)
    t = proto.totals
    hist = t.staleness_hist
    n = sum(hist.values())
    return {
        "mode": run.mode,
        "compressor": run.compressor,
        "model": run.model,
        "num_parameters": proto.spec.total_numel,
        "dense_fp32_bytes": proto.spec.dense_bytes,
        "downlink": run.downlink,
        "versions": proto.version,
        "target_versions": run.num_versions,
        "completed": proto.version >= run.num_versions,
        "stopped_reason": loop.stopped_reason,
        "initial_accuracy": reporter.initial_eval.get("accuracy"),
        "accuracy": reporter.last_eval.get("accuracy"),
        "loss": reporter.last_eval.get("loss"),
        "applied": t.accepted,
        "stale": t.stale,
        "timeout": t.timeout,
        "lost": t.lost,
        "mean_staleness": round(sum(k * v for k, v in hist.items()) / n, 3) if n else 0.0,
        "prefetch": proto.config.prefetch,
        "prefetched": t.prefetched,
        "prefetched_applied": t.prefetched_applied,
        "prefetched_mean_staleness": round(t.prefetched_staleness / t.prefetched_applied, 3)
        if t.prefetched_applied
        else 0.0,
    }


def summarize(
    proto: ServerProtocol, reporter: Reporter, run: RunConfig, wall: float, loop: Any, clock: TaskClock | None = None
) -> dict[str, Any]:
    """A deployment's ``summary.json``: ``run_summary`` plus totals and per-update figures (payload vs dense
    fp32, Flower object bytes, wire bytes, messages per update). ``clock``: the deployment's task clock; with it
    the summary carries wire bytes."""
    core = run_summary(proto, reporter, run, loop)
    t = proto.totals
    replies = max(t.messages_up, 1)
    accepted = max(t.accepted, 1)
    spec = proto.spec
    totals = t.to_dict()
    wire = wire_summary(totals, clock, time.monotonic()) if clock is not None else None
    if wire is not None:
        totals["wire_bytes_up"], totals["wire_bytes_down"] = wire["wire_bytes_up"], wire["wire_bytes_down"]
    return core | {
        "wall_seconds": round(wall, 2),
        "federated_evaluation": loop.fed_eval,
        "compressor_options": run.compressor_kwargs,
        "payload_bytes_per_update": t.payload_bytes_up / replies,
        "compression_ratio": spec.dense_bytes * replies / max(t.payload_bytes_up, 1),
        "flower_bytes_per_update": t.flower_bytes_up / replies,
        "flower_objects_per_update": t.flower_objects_up / replies,
        "payload_bytes_per_task": t.payload_bytes_down / max(t.messages_down, 1),
        "downlink_vs_dense_fp32": dense_fp32_bytes(spec) * max(t.messages_down, 1) / max(t.payload_bytes_down, 1),
        "downlink_totals": loop.downlink.summary(),
        "flower_bytes_per_task": t.flower_bytes_down / max(t.messages_down, 1),
        "messages_per_applied_update": (t.messages_up + t.messages_down) / accepted,
        **per_update(totals, wire),
        **({"auto_density": loop.auto.report()} if loop.auto is not None else {}),
        "wire": wire,
        "totals": totals,
    }



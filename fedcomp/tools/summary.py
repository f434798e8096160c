"""A run's summary: one builder, one set of names, for the product's ServerApp (``summary.json``), the simulations
(a method's row of ``summary.json`` / ``summary.csv``) and ``Compressed(..., out_dir=...)``.

``run_summary`` is the builder: every figure of ``FIGURES`` (name -> unit and meaning), from the protocol, the
reporter, the loop and the run's byte counts (``ByteCounts``: each source counts bytes its own way, the names and
the arithmetic are this module's). A deployment adds ``DEPLOYMENT_FIGURES`` (``deployment_summary``), a
simulation ``SIMULATION_FIGURES`` (``simulations.runner``); no figure has two names, and none of the added
names is a ``FIGURES`` name (tests/test_summary_names.py).

Units: accuracy is a fraction in [0, 1] (server-side, held-out split), bytes are bytes, seconds are seconds;
"per reply" divides by the replies the server got (stale and rejected included), "per applied update" by the
updates applied, "per task" by the tasks sent. Three byte figures, never mixed: payload (the fedcomp blobs),
Flower object (the serialized Flower messages) and wire (docs/protocol.md, "Wire bytes").

Example:
    >>> counts = ByteCounts(payload_bytes_up=100, payload_bytes_down=400, flower_bytes_up=300, flower_bytes_down=900,
    ...                     wire_bytes_up=1000, wire_bytes_down=2000, replies=4, tasks=4, flower_objects_up=12)
    >>> f = byte_figures(counts, applied=2, dense_bytes=1000)
    >>> f["payload_bytes_up_per_reply"], f["payload_bytes_up_per_applied_update"], f["uplink_vs_dense_fp32"]
    (25.0, 50.0, 40.0)
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Any

from fedcomp.downlink import dense_fp32_bytes
from fedcomp.server import ServerProtocol
from fedcomp.server.loops import Reporter
from fedcomp.sim.wirecost import FLOWER_1_41, MeteredTransport, TaskClock, WireCost, protocol_wire_bytes, run_wire_bytes

_BYTES = ("payload", "flower", "wire")
#: The byte figures per unit: up per reply and per applied update, down per task and per applied update.
_PER = (("up", "reply", "reply"), ("up", "applied_update", "applied update"), ("down", "task", "task sent"),
        ("down", "applied_update", "applied update"))
_COUNT = {"reply": "replies", "task": "tasks"}

#: Every run's figures: name -> unit and meaning.
FIGURES: dict[str, str] = {
    "mode": "sync or async",
    "compressor": "the client pipeline's compressor name",
    "model": "the model's name",
    "num_parameters": "trainable parameters (count)",
    "dense_fp32_bytes": "bytes of the trainable parameters as float32",
    "downlink": "the model broadcast mode (dense, fp16, int8, delta)",
    "versions": "model versions made (count)",
    "target_versions": "model versions asked for (count)",
    "completed": "versions >= target_versions (bool)",
    "stopped_reason": "why the run stopped before its target ('' when it reached it)",
    "initial_accuracy": "accuracy of the starting model (fraction 0-1; None without evaluation)",
    "accuracy": "accuracy of the final model (fraction 0-1, server-side, held-out split)",
    "loss": "loss of the final model (the run's loss, held-out split)",
    "applied": "updates applied (count)",
    "stale": "updates nacked stale (count)",
    "timeout": "tasks nacked after their timeout (count)",
    "lost": "tasks nacked lost: error replies, node gone, no reply in their round (count)",
    "rejected": "replies rejected and nacked: unreadable, failing a check (count)",
    "reject_reasons": "rejected replies by reason category (docs/protocol.md, 'Hostile input')",
    "mean_staleness": "mean staleness of the applied updates (versions)",
    "prefetch": "tasks queued per node behind the one it runs (count)",
    "prefetched": "tasks sent queued behind another (count)",
    "prefetched_applied": "... whose update was applied (count)",
    "prefetched_mean_staleness": "mean staleness of those (versions)",
    **{f"{fig}_bytes_{d}": f"{fig} bytes, whole run, {d}" for fig in _BYTES for d in ("up", "down")},
    "wire_bytes_total": "wire bytes up + down",
    "replies": "replies the server handled, stale and rejected included (count; wire.replies also counts those read "
               "after the run's last version)",
    "tasks": "train tasks sent (count)",
    **{f"{fig}_bytes_{d}_per_{unit}": f"{fig} bytes {d} per {what} (bytes; None when there were none)"
       for fig in _BYTES for d, unit, what in _PER},
    "flower_objects_up_per_reply": "Flower objects per reply (count)",
    "messages_per_applied_update": "(replies + tasks) / applied updates",
    "uplink_vs_dense_fp32": "dense fp32 bytes / payload bytes, per reply (ratio)",
    "downlink_vs_dense_fp32": "dense fp32 bytes / payload bytes, per task (ratio)",
    "downlink_full": "tasks that carried a full model (count)",
    "downlink_delta": "tasks that carried a delta chain (count)",
    "downlink_full_bytes": "payload bytes of those full models",
    "downlink_delta_bytes": "payload bytes of those delta chains",
    "downlink_resyncs": "clients sent a full model again after a failed task (count)",
    "wall_s": "wall-clock seconds of the run",
}
#: What a deployment's ``summary.json`` adds (``deployment_summary``).
DEPLOYMENT_FIGURES: dict[str, str] = {
    "federated_evaluation": "the nodes' example-weighted accuracy/loss of their test shares (fed-eval = true)",
    "compressor_options": "the compressor's options",
    "protocol_wire_bytes_per_reply": "wire bytes beyond the Flower object bytes they carried, per reply",
    "auto_density": "density=auto: each node's fitted link, last density and tasks per density (only then)",
    "wire": "the wire model's parts: tasks, replies (every reply read, also after the last version), polls, "
            "heartbeats, bundle",
    "totals": "the protocol's counters, whole run (fedcomp check reads them)",
    "started_at": "wall clock (s since the epoch) when the run started",
    "ended_at": "wall clock (s since the epoch) when the summary was written",
    "train_seconds_median": "the clients' median reported train-seconds per task (decode, train, compress)",
}
#: What a simulation's method row adds (``simulations.runner``; ``speedup_vs_NAME`` per ``compare_to`` method).
SIMULATION_FIGURES: dict[str, str] = {
    "method": "the scenario's method name",
    "worker": "cold or warm ClientApp process",
    "server": "loops (the product's) or strategy (Compressed(FedAvg(), mode=\"async\"))",
    "seed": "the scenario's seed",
    "superexec_poll_s": "the SuperExec's task poll interval charged (s)",
    "codec_calibrated": "whether the client codec's time was charged",
    "best_accuracy": "best evaluated accuracy of the run (fraction 0-1)",
    "time_to_target_s": "virtual seconds to the scenario's target accuracy (None: never)",
    "virtual_s": "virtual seconds of the run",
    **{f"task_{p}": f"mean {p[:-2]} seconds per delivered task" for p in (
        "compute_s", "codec_s", "transfer_s", "poll_wait_s", "round_trip_s", "superexec_wait_s", "process_start_s",
        "reply_check_s", "server_wait_s", "queue_s", "latency_s", "total_s")},
    "link_losses": "messages the links lost (count)",
    "disconnects": "client disconnects (count)",
    "updates": "updates the engine ran (count)",
    "flower_s": "seconds in Flower's code (engine)",
    "fedcomp_s": "seconds in fedcomp's client code (engine)",
    "engine_wall_s": "wall seconds of the engine",
    "flower_ms_per_update": "ms in Flower's code per update (engine)",
    "fedcomp_ms_per_update": "ms in fedcomp's client code per update (engine)",
    "speedup": "the baseline's time to target / this method's",
    "delta_accuracy": "accuracy - the baseline's (fraction)",
}


@dataclass(frozen=True)
class ByteCounts:
    """A run's byte and message counts as its source measured them (a deployment: the protocol's totals and the
    wire model; a simulation: the virtual transport's). ``wire_bytes_*``: None when not measured."""

    payload_bytes_up: int
    payload_bytes_down: int
    flower_bytes_up: int
    flower_bytes_down: int
    wire_bytes_up: int | None
    wire_bytes_down: int | None
    replies: int
    tasks: int
    flower_objects_up: int

    @staticmethod
    def of_totals(totals: dict[str, Any], wire: dict[str, Any] | None) -> ByteCounts:
        """The counts of a protocol's ``VersionStats`` totals, with the wire model's (``wire_summary``)."""
        return ByteCounts(
            int(totals["payload_bytes_up"]), int(totals["payload_bytes_down"]), int(totals["flower_bytes_up"]),
            int(totals["flower_bytes_down"]), wire["wire_bytes_up"] if wire else None,
            wire["wire_bytes_down"] if wire else None, int(totals["messages_up"]), int(totals["messages_down"]),
            int(totals["flower_objects_up"]),
        )


def _per(total: int | None, n: int) -> float | None:
    return round(total / n, 1) if (total is not None and n) else None


def byte_figures(c: ByteCounts, applied: int, dense_bytes: int, dense_down: int | None = None) -> dict[str, Any]:
    """The byte figures of ``FIGURES``: totals, per reply, per applied update, per task, and the ratios to dense
    fp32 (``dense_down``: the downlink's dense size, default ``dense_bytes``)."""
    totals = {f"{fig}_bytes_{d}": getattr(c, f"{fig}_bytes_{d}") for fig in _BYTES for d in ("up", "down")}
    wire_total = None if c.wire_bytes_up is None else c.wire_bytes_up + (c.wire_bytes_down or 0)
    out: dict[str, Any] = {**totals, "wire_bytes_total": wire_total, "replies": c.replies, "tasks": c.tasks}
    for fig in _BYTES:
        for d, unit, _ in _PER:
            n = applied if unit == "applied_update" else getattr(c, _COUNT[unit])
            out[f"{fig}_bytes_{d}_per_{unit}"] = _per(totals[f"{fig}_bytes_{d}"], n)
    out["flower_objects_up_per_reply"] = _per(c.flower_objects_up, c.replies)
    out["messages_per_applied_update"] = _per(c.replies + c.tasks, applied)
    up, down = c.payload_bytes_up, c.payload_bytes_down
    out["uplink_vs_dense_fp32"] = round(dense_bytes * c.replies / up, 2) if up else None
    dense_down = dense_bytes if dense_down is None else dense_down
    out["downlink_vs_dense_fp32"] = round(dense_down * c.tasks / down, 2) if down else None
    return out


def run_summary(
    proto: ServerProtocol, reporter: Reporter, run: Any, loop: Any, counts: ByteCounts, wall_s: float
) -> dict[str, Any]:
    """Every figure of ``FIGURES`` for a run: what ran (``run``: its ``RunConfig``, or anything with ``mode``,
    ``compressor``, ``model``, ``downlink``, ``num_versions``), how far it got, its accuracy, what became of the
    updates, its bytes. Rolls the protocol's counters since the last version into its totals first."""
    proto.roll_stats()
    t = proto.totals
    hist = t.staleness_hist
    n = sum(hist.values())
    downlink = loop.downlink.summary()
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
        "stopped_reason": loop.stopped_reason or "",
        "initial_accuracy": reporter.initial_eval.get("accuracy"),
        "accuracy": reporter.last_eval.get("accuracy"),
        "loss": reporter.last_eval.get("loss"),
        "applied": t.accepted,
        "stale": t.stale,
        "timeout": t.timeout,
        "lost": t.lost,
        "rejected": t.rejected,
        "reject_reasons": dict(t.reject_reasons),
        "mean_staleness": round(sum(k * v for k, v in hist.items()) / n, 3) if n else 0.0,
        "prefetch": proto.config.prefetch,
        "prefetched": t.prefetched,
        "prefetched_applied": t.prefetched_applied,
        "prefetched_mean_staleness": round(t.prefetched_staleness / t.prefetched_applied, 3)
        if t.prefetched_applied
        else 0.0,
        **byte_figures(counts, t.accepted, proto.spec.dense_bytes, dense_fp32_bytes(proto.spec)),
        **{f"downlink_{k}": downlink.get(k, 0) for k in ("full", "delta", "full_bytes", "delta_bytes", "resyncs")},
        "wall_s": round(wall_s, 2),
    }


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
        "replies": counts.replies,  # read by the server, handled or not (docs/protocol.md, "Wire bytes")
        "empty_repolls": counts.repolls,
        "unfetched_tasks": round(counts.unfetched_tasks, 3),
        "model": "flwr 1.41 over HTTP",
    }


def deployment_summary(
    proto: ServerProtocol, reporter: Reporter, run: Any, wall: float, loop: Any, clock: TaskClock | None = None,
    *, fed_eval: Any = None, compressor_options: Any = None,
) -> dict[str, Any]:
    """A deployment's ``summary.json``: ``run_summary`` plus ``DEPLOYMENT_FIGURES``. ``clock``: the deployment's
    task clock; with it the summary carries wire bytes (else they are None)."""
    proto.roll_stats()
    totals = proto.totals.to_dict()
    wire = wire_summary(totals, clock, time.monotonic()) if clock is not None else None
    core = run_summary(proto, reporter, run, loop, ByteCounts.of_totals(totals, wire), wall)
    if wire is not None:
        totals["wire_bytes_up"], totals["wire_bytes_down"] = wire["wire_bytes_up"], wire["wire_bytes_down"]
    ended = time.time()
    return core | {
        "federated_evaluation": fed_eval,
        "compressor_options": compressor_options,
        "protocol_wire_bytes_per_reply": _per(wire["protocol_wire_bytes"], core["replies"]) if wire else None,
        **({"auto_density": loop.auto.report()} if getattr(loop, "auto", None) is not None else {}),
        "wire": wire,
        "totals": totals,
        "started_at": ended - (time.monotonic() - clock.start) if clock is not None else ended - wall,
        "ended_at": ended,
    }


def metered(summary: dict[str, Any], transport: MeteredTransport, unread: int) -> dict[str, Any]:
    """``summary`` with what the deployment's wire meter saw: the replies read after the loop
    (``wire.replies_after_the_run``) and the clients' median reported train-seconds (a node's first task also
    builds its worker: the median)."""
    if summary.get("wire") is not None:
        summary["wire"]["replies_after_the_run"] = unread
    if transport.train_seconds:
        summary["train_seconds_median"] = statistics.median(transport.train_seconds)
    return summary

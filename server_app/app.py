"""The fedcomp Flower ``ServerApp``: sync rounds or staleness-bounded async (FedBuff), by ``mode``.

Thin glue: it builds the model, the ``ServerProtocol`` (ledger, staleness bound, buffer, optimizer) and a
``GridTransport``, then runs the loop registered under ``mode`` in ``fedcomp.server.loops.LOOPS``. Results go to
``out-dir``: ``metrics.jsonl`` (one row per version), ``checkpoint.pt`` (every ``checkpoint-every`` versions),
``summary.json`` (totals and per-update figures: payload, Flower object and wire bytes, per reply and per applied
update; wire bytes from ``fedcomp.sim.wirecost``, docs/protocol.md "Wire bytes"), ``server.log`` (the ServerApp's own
log lines: Flower runs the ServerApp with its output discarded, so its warnings, such as failed tasks and TTL
expiries, are kept here and ``flower-server`` prints them).
"""

from __future__ import annotations

import json
import logging
import statistics
import time
from logging import ERROR, INFO, WARNING
from pathlib import Path
from typing import Any

import torch
from flwr.app import Context
from flwr.common.logger import LOGGER_NAME, log
from flwr.serverapp import Grid, ServerApp

from fedcomp.downlink import dense_fp32_bytes
from fedcomp.flower.config import RunConfig
from fedcomp.flower.transport import GridTransport
from fedcomp.protocol import ProtocolConfig
from fedcomp.registry import ConfigError
from fedcomp.server import ClientSelection, ServerProtocol
from fedcomp.server.loops import COMPUTE_METRIC, LOOPS, Event, LoopConfig, ReplyEvent, Reporter, SendReceipt, Transport
from fedcomp.server.optimizers import SERVER_OPTIMIZERS
from fedcomp.server.staleness import STALENESS
from fedcomp.sim.wirecost import FLOWER_1_41, TaskClock, WireCost, protocol_wire_bytes, run_wire_bytes
from fedcomp.spec import ModelSpec
from fedcomp.task.plugins import TRUSTED
from fedcomp.task.training import datasets, evaluate, make_model, run_loss

app = ServerApp()


class RunStoppedShort(RuntimeError):
    """The run ended before ``num-versions`` (run timeout, no clients, every task failing): the ServerApp raises
    it after writing ``summary.json``, so Flower marks the run ``finished:failed`` with this one line as its
    details and ``flower-server`` exits non-zero."""


def protocol_config(run: RunConfig) -> ProtocolConfig:
    sync = run.mode == "sync"
    return ProtocolConfig(
        buffer_size=0 if sync else run.buffer_size,
        max_staleness=0 if sync else run.max_staleness,
        weight_by_examples=sync,
        normalize=run.effective_normalize,
        task_timeout=run.task_timeout,
        max_blob_bytes=run.max_update_bytes,
        max_update_norm=run.max_update_norm,
        durable_acks=run.checkpoint_every > 0,
        aggregate_device=run.aggregate_device,
        prefetch=0 if sync else run.prefetch,
        balance=1.0 if sync else run.balance,
    )


def loop_config(run: RunConfig) -> LoopConfig:
    return LoopConfig(
        num_versions=run.num_versions,
        concurrency=run.concurrency,
        selection=ClientSelection(run.fraction, run.min_clients, run.over_selection),
        round_timeout=run.round_timeout,
        run_timeout=run.run_timeout,
        min_clients=run.min_clients,
        node_wait=run.node_wait,
        poll_interval=run.poll_interval,
        fed_eval_every=run.eval_every if run.fed_eval else 0,
        fed_eval_timeout=run.fed_eval_timeout if run.fed_eval else 0.0,
        max_failures=run.max_failures,
        downlink=run.downlink,
        downlink_options=run.downlink_kwargs,
        auto_density=run.compression.auto_density,
        prefetch_lead=run.prefetch_lead,
    )


class MeteredTransport(Transport):
    """A transport that tells a ``TaskClock`` which node holds which task when, for the wire model's polls."""

    def __init__(self, inner: Transport, clock: TaskClock) -> None:
        self.inner, self.clock = inner, clock
        self.train_seconds: list[float] = []  # each reply's own train-seconds metric (decode, train, compress)

    def clients(self) -> list[int]:
        nodes = self.inner.clients()
        self.clock.seen(nodes)
        return nodes

    def send(self, task: Any, model: bytes) -> SendReceipt:
        receipt = self.inner.send(task, model)
        self.clock.sent(task.client, task.task_id, time.monotonic(), receipt.flower_bytes, receipt.flower_objects)
        return receipt

    def poll(self, wait: float) -> list[Event]:
        events = self.inner.poll(wait)
        now = time.monotonic()
        for event in events:
            size = (event.flower_bytes, event.flower_objects) if isinstance(event, ReplyEvent) else (0, 0)
            self.clock.replied(event.task_id, now, *size)
            if isinstance(event, ReplyEvent) and COMPUTE_METRIC in event.metrics:
                self.train_seconds.append(float(event.metrics[COMPUTE_METRIC]))
        return events

    def drain(self, wait: float = 0.5) -> int:
        """After the loop: read the replies that landed since its last read (pushed by nodes that were still
        working when the run reached its last version) for the wire figures only; up to ``wait`` seconds. They
        crossed the wire, so the wire model counts them; the protocol never sees them. Returns how many."""
        end, n = time.monotonic() + wait, 0
        while (left := end - time.monotonic()) > 0 and (events := self.poll(left)):
            n += len(events)
        return n

    def evaluate(self, clients: list[int], model: bytes, version: int, timeout: float) -> list[dict[str, float]]:
        return self.inner.evaluate(clients, model, version, timeout)


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


def metered(summary: dict[str, Any], transport: MeteredTransport, unread: int) -> dict[str, Any]:
    """``summary`` with what the meter saw: the replies read after the loop (``wire.replies_after_the_run``), the
    clients' median reported train-seconds (a node's first task also builds its worker: the median), and the
    wall-clock window the wire figures cover (``started_at``, ``ended_at``: now)."""
    if summary.get("wire") is not None:
        summary["wire"]["replies_after_the_run"] = unread
    if transport.train_seconds:
        summary["train_seconds_median"] = statistics.median(transport.train_seconds)
    summary["ended_at"] = time.time()
    summary["started_at"] = summary["ended_at"] - (time.monotonic() - transport.clock.start)
    return summary


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


def build_server(run: RunConfig) -> tuple[torch.nn.Module, ServerProtocol, Any]:
    """Model, protocol and the held-out split (resumed from ``run.resume`` when set)."""
    train, test = datasets(run)
    model = make_model(run, train)
    spec = ModelSpec.from_module(model)
    params = {n: p.data for n, p in model.named_parameters() if p.requires_grad}
    opt_opts: dict[str, Any] = {"lr": run.server_lr}
    if run.server_optimizer == "sgd":
        opt_opts["momentum"] = run.server_momentum
    proto = ServerProtocol(
        spec,
        params,
        SERVER_OPTIMIZERS.build(run.server_optimizer, **opt_opts),
        STALENESS.build(run.staleness, **run.staleness_kwargs),
        protocol_config(run),
    )
    if run.resume:
        check_resume(run.resume)
        try:
            Reporter.load_checkpoint(run.resume, proto)
        except (KeyError, TypeError, ValueError, RuntimeError, IndexError) as exc:
            raise ConfigError(f"resume: {run.resume} does not fit this run ({_first_line(exc)})") from None
        log(INFO, "[fedcomp] resumed from %s at version %d", run.resume, proto.version)
    return model, proto, test


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0] if text else ''}".rstrip(": ")


def check_resume(path: str) -> None:
    """Raise ``ConfigError`` (one line) unless ``path`` is a readable fedcomp checkpoint: missing, a directory,
    random bytes and a truncated file are all refused before anything starts."""
    p = Path(path).expanduser()
    if not p.exists():
        raise ConfigError(f"resume: {path} does not exist")
    if not p.is_file():
        raise ConfigError(f"resume: {path} is not a file")
    try:
        state = torch.load(p, weights_only=True)
    except Exception as exc:  # noqa: BLE001 - torch.load raises many types on a torn or foreign file
        raise ConfigError(f"resume: {path} is not a readable checkpoint ({_first_line(exc)})") from None
    proto = state.get("protocol") if isinstance(state, dict) else None
    if not isinstance(proto, dict) or not isinstance(proto.get("version"), int):
        raise ConfigError(f"resume: {path} is not a fedcomp checkpoint (no protocol state)")


@app.main()
def main(grid: Grid, context: Context) -> None:
    run = RunConfig.from_flower(context.run_config, plugins=TRUSTED)  # the ServerApp is the submitter's code
    t0 = time.monotonic()
    model, proto, test = build_server(run)
    out = Path(run.out_dir).expanduser()
    if not out.is_absolute():
        out = Path.cwd() / out
    out.mkdir(parents=True, exist_ok=True)
    handler = logging.FileHandler(out / "server.log", encoding="utf-8")  # Flower drops the ServerApp's output
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s"))
    flwr_logger = logging.getLogger(LOGGER_NAME)
    flwr_logger.addHandler(handler)
    try:
        serve(grid, context, run, out, t0, model, proto, test)
    except Exception as exc:
        log(ERROR, "[fedcomp] %s", _first_line(exc))
        raise
    finally:
        flwr_logger.removeHandler(handler)
        handler.close()


def serve(
    grid: Grid, context: Context, run: RunConfig, out: Path, t0: float, model: torch.nn.Module, proto: ServerProtocol,
    test: Any,
) -> None:
    """The run itself: the loop of ``run.mode`` over the Grid, metrics, checkpoints, ``summary.json``."""
    (out / "run_config.json").write_text(json.dumps(dict(context.run_config), indent=1, default=str))

    def server_eval(params: dict[str, torch.Tensor]) -> dict[str, float]:
        res = evaluate(model, test, torch.device("cpu"), loss=run_loss(run))
        return {"accuracy": res["accuracy"], "loss": res["loss"]}

    def progress(row: dict[str, Any]) -> None:
        log(
            INFO,
            "[fedcomp] version %d  acc %s  accepted %d stale %d rejected %d dup %d late %d timeout %d lost %d",
            row["version"],
            row.get("accuracy", "-"),
            row["accepted"],
            row["stale"],
            row["rejected"],
            row["duplicate"],
            row["late"],
            row["timeout"],
            row["lost"],
        )

    reporter = Reporter(out, server_eval, run.eval_every, run.checkpoint_every, progress=progress)
    if run.resume:
        reporter.resume_time(run.resume)  # metrics time goes on from the checkpoint's
        proto.restart()  # fresh task-id range, clients resync (docs/protocol.md, "Server restart")
        if run.checkpoint_every:
            reporter.save_checkpoint(proto)  # make the new task-id range durable before any task is sent
    clock = TaskClock(start=time.monotonic())
    transport = MeteredTransport(GridTransport(grid, max_reads_per_s=run.max_reads_per_s), clock)
    loop = LOOPS.get(run.mode)(
        proto, transport, loop_config(run), reporter, log=lambda s: log(WARNING, "[fedcomp] %s", s)
    )
    log(
        INFO,
        "[fedcomp] %s mode, %d versions, model %s (%d parameters, %d dense bytes), compressor %s",
        run.mode,
        run.num_versions,
        run.model,
        proto.spec.total_numel,
        proto.spec.dense_bytes,
        run.compressor,
    )
    loop.run()
    unread = transport.drain()  # replies pushed after the loop's last read: on the wire, never handled
    if not reporter.rows or reporter.rows[-1]["version"] != proto.version or "accuracy" not in reporter.rows[-1]:
        reporter.last_eval = server_eval(proto.params)
    summary = metered(summarize(proto, reporter, run, time.monotonic() - t0, loop, clock), transport, unread)
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    log(INFO, "[fedcomp] done: %s", json.dumps({k: v for k, v in summary.items() if k != "totals"}))
    if not summary["completed"]:
        reason = loop.stopped_reason or "unknown cause"
        raise RunStoppedShort(f"stopped at version {proto.version} of {run.num_versions}: {reason}")

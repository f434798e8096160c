"""The fedcomp Flower ``ServerApp``: sync rounds or staleness-bounded async (FedBuff), by ``mode``.

Thin glue: it builds the model and the ``ServerProtocol`` (ledger, staleness bound, buffer, optimizer) with
``fedcomp.task.serverside`` and a ``GridTransport``, then runs the loop registered under ``mode`` in
``fedcomp.server.loops.LOOPS``. Results go to ``out-dir``: ``metrics.jsonl`` (one row per version),
``checkpoint.pt`` (every ``checkpoint-every`` versions), ``summary.json`` (``fedcomp.tools.summary``: totals and
per-update figures, payload, Flower object and wire bytes, per reply and per applied update; wire bytes from
``fedcomp.sim.wirecost``, docs/protocol.md "Wire bytes"), ``server.log`` (the ServerApp's own log lines: Flower
runs the ServerApp with its output discarded, so its warnings, such as failed tasks and TTL expiries, are kept
here and ``flower-server`` prints them).
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from logging import ERROR, INFO, WARNING
from pathlib import Path
from typing import Any

import torch
from flwr.app import ArrayRecord, Context, MetricRecord
from flwr.common.logger import LOGGER_NAME, log
from flwr.serverapp import Grid, ServerApp
from flwr.serverapp import strategy as strategies

from fedcomp.flower import Compressed, records
from fedcomp.flower.transport import GridTransport
from fedcomp.server.loops import LOOPS, Reporter
from fedcomp.sim.wirecost import MeteredTransport, TaskClock
from fedcomp.task.config import RunConfig
from fedcomp.task.plugins import TRUSTED
from fedcomp.task.serverside import build_server, first_line, loop_config
from fedcomp.task.strategyargs import compressed_kwargs, wrapped_strategy
from fedcomp.task.training import datasets, evaluate, make_model, run_loss
from fedcomp.tools.summary import deployment_summary, metered

app = ServerApp()


class RunStoppedShort(RuntimeError):
    """The run ended before ``num-versions`` (run timeout, no clients, every task failing): the ServerApp raises
    it after writing ``summary.json``, so Flower marks the run ``finished:failed`` with this one line as its
    details and ``flower-server`` exits non-zero."""


@app.main()
def main(grid: Grid, context: Context) -> None:
    run = RunConfig.from_flower(context.run_config, plugins=TRUSTED)  # the ServerApp is the submitter's code
    t0 = time.monotonic()
    out = Path(run.out_dir).expanduser()
    if not out.is_absolute():
        out = Path.cwd() / out
    out.mkdir(parents=True, exist_ok=True)
    handler = logging.FileHandler(out / "server.log", encoding="utf-8")  # Flower drops the ServerApp's output
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s"))
    flwr_logger = logging.getLogger(LOGGER_NAME)
    flwr_logger.addHandler(handler)
    try:
        (out / "run_config.json").write_text(json.dumps(dict(context.run_config), indent=1, default=str))
        SERVE[run.mode](grid, run, out, t0)
    except Exception as exc:
        log(ERROR, "[fedcomp] %s", first_line(exc))
        raise
    finally:
        flwr_logger.removeHandler(handler)
        handler.close()


def _evaluate(run: RunConfig, model: torch.nn.Module, test: Any) -> Callable[[], dict[str, float]]:
    def server_eval() -> dict[str, float]:
        res = evaluate(model, test, torch.device("cpu"), loss=run_loss(run))
        return {"accuracy": res["accuracy"], "loss": res["loss"]}

    return server_eval


def serve_strategy(grid: Grid, run: RunConfig, out: Path, t0: float) -> None:
    """Async mode: ``Compressed(<Flower strategy>, mode="async")`` (``fedcomp.task.strategyargs``) started on the
    Grid, as any Flower app starts it; the run files are the strategy's (``out_dir``, ``fedcomp.flower.runfiles``)."""
    del t0
    train, test = datasets(run)
    model = make_model(run, train)
    name, kwargs = wrapped_strategy(run)
    strategy = Compressed(getattr(strategies, name)(**kwargs), **compressed_kwargs(
        run, out_dir=str(out), checkpoint_every=run.checkpoint_every, resume=run.resume))
    server_eval = _evaluate(run, model, test)

    def evaluate_fn(version: int, arrays: ArrayRecord) -> MetricRecord:
        model.load_state_dict(arrays.to_torch_state_dict(), strict=False)
        res = server_eval()
        log(INFO, "[fedcomp] version %d  acc %.4f  loss %.4f", version, res["accuracy"], res["loss"])
        return MetricRecord(res)

    log(INFO, "[fedcomp] async mode, %d versions, model %s, compressor %s, server step %s%s", run.num_versions,
        run.model, run.compressor, name, f", resumed from {run.resume}" if run.resume else "")
    strategy.start(grid, ArrayRecord(model.state_dict()), num_rounds=run.num_versions, timeout=run.task_timeout,
                   evaluate_fn=evaluate_fn)
    summary = json.loads((out / "summary.json").read_text())
    log(INFO, "[fedcomp] done: %s", json.dumps({k: v for k, v in summary.items() if k != "totals"}))
    if not summary["completed"]:
        reason = summary["stopped_reason"] or "unknown cause"
        raise RunStoppedShort(f"stopped at version {summary['versions']} of {run.num_versions}: {reason}")


def log_progress(row: dict[str, Any]) -> None:
    """The sync loop's line per version (``server.log``; ``flower-server`` prints it)."""
    log(INFO, "[fedcomp] version %d  acc %s  accepted %d stale %d rejected %d dup %d late %d timeout %d lost %d",
        row["version"], row.get("accuracy", "-"), row["accepted"], row["stale"], row["rejected"], row["duplicate"],
        row["late"], row["timeout"], row["lost"])


def serve_loop(grid: Grid, run: RunConfig, out: Path, t0: float) -> None:
    """Sync mode: the product's sync loop over the Grid, metrics, checkpoints, ``summary.json``."""
    model, proto, test = build_server(run)
    if run.resume:
        log(INFO, "[fedcomp] resumed from %s at version %d", run.resume, proto.version)
    evaluate_model = _evaluate(run, model, test)

    def server_eval(params: dict[str, torch.Tensor]) -> dict[str, float]:
        del params  # the model's parameters are ``proto.params``
        return evaluate_model()

    reporter = Reporter(out, server_eval, run.eval_every, run.checkpoint_every, progress=log_progress)
    if run.resume:
        reporter.resume_time(run.resume)  # metrics time goes on from the checkpoint's
        proto.restart()  # fresh task-id range, clients resync (docs/protocol.md, "Server restart")
        if run.checkpoint_every:
            reporter.save_checkpoint(proto)  # make the new task-id range durable before any task is sent
    clock = TaskClock(start=time.monotonic())
    tasks = records.TaskFormat(run.compression.to_flat(), records.ArrayLayout.of_spec(proto.spec))
    transport = MeteredTransport(GridTransport(grid, max_reads_per_s=run.max_reads_per_s, tasks=tasks), clock)
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
    summary = metered(deployment_summary(proto, reporter, run, time.monotonic() - t0, loop, clock,
                                         fed_eval=loop.fed_eval, compressor_options=run.compressor_kwargs),
                      transport, unread)
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    log(INFO, "[fedcomp] done: %s", json.dumps({k: v for k, v in summary.items() if k != "totals"}))
    if not summary["completed"]:
        reason = loop.stopped_reason or "unknown cause"
        raise RunStoppedShort(f"stopped at version {proto.version} of {run.num_versions}: {reason}")


#: ``mode`` -> how the ServerApp serves it.
SERVE: dict[str, Callable[[Grid, RunConfig, Path, float], None]] = {"sync": serve_loop, "async": serve_strategy}

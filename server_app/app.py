"""The fedcomp Flower ``ServerApp``: sync rounds or staleness-bounded async (FedBuff), by ``mode``.

Thin glue: it builds the model and ``Compressed(<Flower strategy>, mode=...)`` on fedcomp's loop from the run config
(``fedcomp.task.strategyargs``) and starts it on the Grid, the two lines any Flower app uses. Results go to ``out-dir``:
``metrics.jsonl`` (one row per version), ``checkpoint.pt`` (every ``checkpoint-every`` versions), ``summary.json``
(``fedcomp.tools.summary``: totals and per-update figures, payload, Flower object and wire bytes, per reply and per
applied update; wire bytes from ``fedcomp.sim.wirecost``, docs/protocol.md "Wire bytes"), ``server.log`` (the
ServerApp's own log lines: Flower runs the ServerApp with its output discarded, so its warnings, such as failed tasks
and TTL expiries, are kept here and ``flower-server`` prints them).
"""

from __future__ import annotations

import json
import logging
from logging import ERROR, INFO, WARNING
from pathlib import Path

import torch
from flwr.app import ArrayRecord, Context, MetricRecord
from flwr.common.logger import LOGGER_NAME, log
from flwr.serverapp import Grid, ServerApp
from flwr.serverapp import strategy as strategies

from fedcomp.flower import Compressed
from fedcomp.flower.runfiles import clear_earlier
from fedcomp.task.config import RunConfig
from fedcomp.task.plugins import TRUSTED
from fedcomp.task.strategyargs import compressed_kwargs, unused_keys, wrapped_strategy
from fedcomp.task.training import datasets, evaluate, make_model, run_loss
from fedcomp.tensortree import first_line

app = ServerApp()


class RunStoppedShort(RuntimeError):
    """The run ended before ``num-versions`` (run timeout, no clients, every task failing): the ServerApp raises
    it after writing ``summary.json``, so Flower marks the run ``finished:failed`` with this one line as its
    details and ``flower-server`` exits non-zero."""


@app.main()
def main(grid: Grid, context: Context) -> None:
    run = RunConfig.from_flower(context.run_config, plugins=TRUSTED)  # the ServerApp is the submitter's code
    out = Path(run.out_dir).expanduser()
    if not out.is_absolute():
        out = Path.cwd() / out
    out.mkdir(parents=True, exist_ok=True)
    handler = logging.FileHandler(out / "server.log", encoding="utf-8")  # Flower drops the ServerApp's output
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s"))
    flwr_logger = logging.getLogger(LOGGER_NAME)
    flwr_logger.addHandler(handler)
    try:
        clear_earlier(out, resumed=bool(run.resume))  # a run that fails at its checks leaves no earlier run's files
        (out / "run_config.json").write_text(json.dumps(dict(context.run_config), indent=1, default=str))
        serve(grid, run, out)
    except Exception as exc:
        log(ERROR, "[fedcomp] %s", first_line(exc))
        raise
    finally:
        flwr_logger.removeHandler(handler)
        handler.close()


def public_strategy(run: RunConfig, out: Path) -> tuple[str, Compressed]:
    """The wrapped Flower strategy's name and ``Compressed`` around it for ``run``, writing its run files to
    ``out``: every option checked (``ConfigError``), nothing started (``flower-server`` checks a run with it
    before any process starts)."""
    name, kwargs = wrapped_strategy(run)
    return name, Compressed(getattr(strategies, name)(**kwargs), **compressed_kwargs(
        run, out_dir=str(out), checkpoint_every=run.checkpoint_every, resume=run.resume))


def serve(grid: Grid, run: RunConfig, out: Path) -> None:
    """``Compressed(<Flower strategy>, mode=run.mode)`` on fedcomp's loop (``fedcomp.task.strategyargs``), started
    on the Grid as any Flower app starts it: async (FedBuff) or sync rounds (``loop="fedcomp"``: over-selection,
    node wait, run timeout, max failures); the run files are the strategy's (``out_dir``,
    ``fedcomp.flower.runfiles``); keys of the other mode that ``run`` sets are a warning (``unused_keys``)."""
    if unused := unused_keys(run):
        log(WARNING, "[fedcomp] %s: read only in %s mode; this %s run does not use them", unused,
            "sync" if run.mode == "async" else "async", run.mode)
    train, test = datasets(run)
    model = make_model(run, train)
    name, strategy = public_strategy(run, out)

    def evaluate_fn(version: int, arrays: ArrayRecord) -> MetricRecord:
        """The model of ``version`` on the held-out split, on the server."""
        model.load_state_dict(arrays.to_torch_state_dict(), strict=False)
        res = evaluate(model, test, torch.device("cpu"), loss=run_loss(run))
        log(INFO, "[fedcomp] version %d  acc %.4f  loss %.4f", version, res["accuracy"], res["loss"])
        return MetricRecord({"accuracy": res["accuracy"], "loss": res["loss"]})

    log(INFO, "[fedcomp] %s mode, %d versions, model %s, compressor %s, server step %s%s", run.mode,
        run.num_versions, run.model, run.compressor, name, f", resumed from {run.resume}" if run.resume else "")
    timeout = run.round_timeout if run.mode == "sync" else run.task_timeout
    strategy.start(grid, ArrayRecord(model.state_dict()), num_rounds=run.num_versions, timeout=timeout,
                   evaluate_fn=evaluate_fn)
    summary = json.loads((out / "summary.json").read_text())
    log(INFO, "[fedcomp] done: %s", json.dumps({k: v for k, v in summary.items() if k != "totals"}))
    if not summary["completed"]:
        reason = summary["stopped_reason"] or "unknown cause"
        raise RunStoppedShort(f"stopped at version {summary['versions']} of {run.num_versions}: {reason}")

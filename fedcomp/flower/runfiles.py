"""What a run of ``Compressed`` on fedcomp's loop (``mode="async"``, ``loop="fedcomp"``) with ``out_dir`` leaves
on disk, and how it goes on from it.

The same files as the product's ServerApp, written by the same pieces: ``metrics.jsonl`` (one row per version,
``fedcomp.server.loops.Reporter``), ``checkpoint.pt`` every ``checkpoint_every`` versions (the protocol's ledger
and model, plus the arrays of the wrapped strategy's model that travel dense, under ``extra["dense"]``; acks
wait for it: durable acks) and ``summary.json`` (``fedcomp.tools.summary.deployment_summary``, the one builder),
so ``fedcomp check OUT`` accounts for every update of a Flower app's run. ``resume=PATH`` restores the model,
the ledger and the version (``start``'s ``num_rounds`` is then the version to reach), sends the open tasks'
nacks (``lost: server restarted``) and goes on writing the same files. The wrapped strategy's own server state
(FedAvgM's momentum, FedAdam / FedYogi / FedAdagrad's moments: ``fedcomp.flower.strategystate``) is in the
checkpoint too, under ``extra["strategy"]``, and comes back on resume: a resumed run makes the model an
uninterrupted one would have made. So do the run's wire counts so far (``extra["wire"]``): a resumed run's
``summary.json`` counts the whole run's wire bytes, as it counts its payload and Flower object bytes.

    >>> strategy = Compressed(FedAvg(), mode="async", out_dir="out", checkpoint_every=5)  # doctest: +SKIP
    >>> strategy = Compressed(FedAvg(), mode="async", out_dir="out", checkpoint_every=5,
    ...                       resume="out/checkpoint.pt")  # doctest: +SKIP
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from flwr.app import Array, ArrayRecord

from fedcomp.flower import strategystate
from fedcomp.flower.records import ArrayLayout
from fedcomp.registry import ConfigError
from fedcomp.server import ServerProtocol
from fedcomp.server.loops import Clock, Reporter, mend_tail
from fedcomp.sim.wirecost import RunCounts, TaskClock, saved_counts
from fedcomp.task.config import Compression
from fedcomp.task.serverside import resume as load_checkpoint
from fedcomp.tensortree import first_line
from fedcomp.tools.summary import deployment_summary, metered


@dataclass(frozen=True)
class RunInfo:
    """What ran, for the summary: a Flower app's own model has no registered name (``model`` is empty)."""

    mode: str
    compressor: str
    downlink: str
    num_versions: int
    model: str = ""


def dense_state(current: ArrayRecord, names: list[str]) -> dict[str, torch.Tensor]:
    """The model's arrays outside the update (``names``: the update's), as tensors for the checkpoint."""
    return {n: torch.from_numpy(np.array(current[n].numpy())) for n in current.keys() if n not in names}


def resume(
    proto: ServerProtocol, path: str, current: ArrayRecord, layout: ArrayLayout, strategy: object,
    compression: Compression,
) -> tuple[ArrayRecord, RunCounts | None]:
    """Load the checkpoint at ``path`` into ``proto`` and the wrapped ``strategy``'s server state
    (``strategystate.restore``), and return the model it holds in ``current``'s layout (the update's arrays from
    the protocol, the dense ones from the checkpoint's ``extra``) and the run's wire counts up to the checkpoint
    (``extra["wire"]``; None in a checkpoint of an older fedcomp). ``ConfigError`` when it does not fit, when
    ``strategy`` keeps state and the checkpoint has none (written before it was kept), or when the checkpoint's
    run compressed otherwise for the clients (``Compression.client_part``: their states would refuse every task)."""
    extra = load_checkpoint(proto, path)
    dense = extra.get("dense", {}) if isinstance(extra, dict) else None
    if not isinstance(dense, dict) or not isinstance(extra.get("strategy", {}), dict):
        raise ConfigError(f"resume: {path} is not a checkpoint of a Flower app's run (its extra state is malformed)")
    _check_compression(path, extra.get("compression"), compression)
    try:
        wire = saved_counts(extra["wire"]) if "wire" in extra else None
    except ValueError as exc:
        raise ConfigError(f"resume: {path} holds malformed wire counts ({exc})") from None
    if "strategy" in extra:
        try:
            strategystate.restore(strategy, extra["strategy"])
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise ConfigError(f"resume: {path} holds a malformed server state ({first_line(exc)})") from None
    elif strategystate.check(strategy):
        raise ConfigError(
            f"resume: {path} holds no server state of {type(strategy).__name__} (a checkpoint of an older "
            "fedcomp): its momentum / moments would restart at zero; start a fresh run"
        )
    out = ArrayRecord()
    for name in current.keys():
        t = proto.params.get(name, dense.get(name))
        if not isinstance(t, torch.Tensor):  # its training would be lost: the run would go on from the initial array
            raise ConfigError(f"resume: {path} holds no array {name!r} of this model")
        out[name] = Array(t.detach().to("cpu").numpy())
    proto.restart()  # fresh task-id range; the open tasks' clients hear "lost: server restarted"
    return layout.conform(out), wire


def _check_compression(path: str, saved: Any, compression: Compression) -> None:
    """``ConfigError`` unless the checkpoint's compression (``to_flat``; none in a checkpoint of an older fedcomp)
    makes the clients' states this run's does."""
    if saved is None:
        return
    try:
        same = Compression.from_flat(saved).client_part() == compression.client_part()
    except (ConfigError, TypeError, ValueError, AttributeError) as exc:
        raise ConfigError(f"resume: {path} holds a malformed compression ({first_line(exc)})") from None
    if not same:
        raise ConfigError(f"resume: {path} was made by a run compressing with {saved}, this run asks for "
                          f"{compression.to_flat()}: every client's state would refuse its tasks; resume with the "
                          "same compression or start a fresh run")


def reporter(
    cfg: Any, proto: ServerProtocol, buffer: Any, evaluate: Callable[..., dict[str, float]] | None,
    progress: Callable[[dict[str, Any]], None], clock: Clock | None = None,
    wire: Callable[[], RunCounts] | None = None,
) -> Reporter:
    """The run's ``Reporter``: files under ``cfg.out_dir`` (none without it); a fresh run clears an earlier run's
    metrics and summary there and moves its checkpoint to ``checkpoint.earlier.pt`` (a resume can still name it;
    nothing reads it as this run's), a resumed one goes on from the checkpoint's time and makes its restart
    durable. ``wire``: the run's wire counts so far, kept in each checkpoint (a resumed run's summary counts the
    whole run's wire bytes, as it does its other bytes)."""
    out = Path(cfg.out_dir).expanduser() if cfg.out_dir else None
    names = list(proto.spec.names)
    strategy = buffer.wrapper.strategy

    def extra() -> dict[str, Any]:
        return {"dense": dense_state(buffer.current, names), "strategy": strategystate.save(strategy),
                "compression": buffer.wrapper.compression.to_flat(),
                **({"wire": dataclasses.asdict(wire())} if wire is not None else {})}

    rep = Reporter(out, evaluate, cfg.eval_every, checkpoint_every=cfg.checkpoint_every, clock=clock,
                   progress=progress, extra_state=extra)
    if out is not None:
        clear_earlier(out, resumed=bool(cfg.resume))
    if cfg.resume:
        rep.resume_time(cfg.resume)
        if rep.checkpoint_path is not None and cfg.checkpoint_every:
            rep.save_checkpoint(proto)  # the new task-id range is durable before any task is sent
    return rep


def clear_earlier(out: Path, resumed: bool) -> None:
    """Clear what an earlier run left in ``out`` that could pass for this one's: its ``summary.json``, and unless
    this run resumes, its ``metrics.jsonl`` and its ``checkpoint.pt`` (moved to ``checkpoint.earlier.pt``: a resume
    can still name it; ``fedcomp check`` never reads it as this run's). A resumed run's metrics lose a last row a
    crash tore off (``mend_tail``): the rows it appends start on a line of their own."""
    (out / "summary.json").unlink(missing_ok=True)
    if resumed:
        mend_tail(out / "metrics.jsonl")
    else:
        (out / "metrics.jsonl").unlink(missing_ok=True)
        if (earlier := out / "checkpoint.pt").exists():
            earlier.replace(out / "checkpoint.earlier.pt")


def write_summary(
    cfg: Any, wrapper: Any, rep: Reporter, loop: Any, num_versions: int, wall: float, clock: TaskClock | None = None,
    fed_eval: list[dict[str, Any]] | None = None, meter: Any = None, unread: int = 0,
) -> Path:
    """``OUT/summary.json`` of the run (``fedcomp.tools.summary.deployment_summary``; with ``clock``, the run's
    task clock, the wire figures of Flower 1.41's transport, as the product's ServerApp reports them; ``fed_eval``:
    the federated evaluations' rows; ``meter``, the run's ``MeteredTransport``, and ``unread``, the replies it read
    after the loop: ``fedcomp.tools.summary.metered``)."""
    c = wrapper.compression
    info = RunInfo(wrapper.options.mode, c.compressor, c.downlink, num_versions, cfg.model_name)
    summary = deployment_summary(wrapper.proto, rep, info, wall, loop, clock, fed_eval=fed_eval,
                                 compressor_options=c.options)
    if meter is not None:
        summary = metered(summary, meter, unread)
    path = Path(cfg.out_dir).expanduser() / "summary.json"
    path.write_text(json.dumps(summary, indent=1, default=str))
    return path

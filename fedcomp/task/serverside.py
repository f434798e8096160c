"""The server side of a run, built from its ``RunConfig``: the protocol's rules (``protocol_config``), the loop's
options (``loop_config``), and the model, ``ServerProtocol`` and held-out split (``build_server``, resumed from
``run.resume`` when set). The product's ServerApp, ``flower-server`` (checking a run config before anything
starts) and the simulations build a run's server side with these and nothing else; none of them builds anything
at import.

>>> from fedcomp.task.config import RunConfig
>>> loop_config(RunConfig(num_versions=3)).num_versions
3
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from fedcomp.protocol import ProtocolConfig
from fedcomp.registry import ConfigError
from fedcomp.server import ClientSelection, ServerProtocol
from fedcomp.server.loops import LoopConfig, Reporter
from fedcomp.server.optimizers import SERVER_OPTIMIZERS
from fedcomp.server.staleness import STALENESS
from fedcomp.spec import ModelSpec
from fedcomp.task.config import RunConfig
from fedcomp.task.training import datasets, make_model
from fedcomp.tensortree import first_line


def protocol_config(run: RunConfig) -> ProtocolConfig:
    """The ledger's and buffer's rules of ``run`` (sync: ``fedcomp.protocol.SYNC_RULES``)."""
    return ProtocolConfig.of_mode(
        run.mode,
        buffer_size=run.buffer_size,
        max_staleness=run.max_staleness,
        normalize=run.effective_normalize,
        task_timeout=run.task_timeout,
        max_blob_bytes=run.max_update_bytes,
        max_update_norm=run.max_update_norm,
        durable_acks=run.checkpoint_every > 0,
        aggregate_device=run.aggregate_device,
        prefetch=run.prefetch,
        balance=run.balance,
    )


def loop_config(run: RunConfig) -> LoopConfig:
    """The options of the loop registered under ``run.mode`` (``fedcomp.server.loops.LOOPS``)."""
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


def build_server(run: RunConfig) -> tuple[torch.nn.Module, ServerProtocol, Any]:
    """Model, protocol and the held-out split (resumed from ``run.resume`` when set; a checkpoint that does not
    fit the run: ``ConfigError``, one line)."""
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
        resume(proto, run.resume)
        check_versions_left(proto.version, run.num_versions, run.resume)
    return model, proto, test


def check_versions_left(version: int, num_versions: int, path: str) -> None:
    """A resumed run must have versions left to make: the checkpoint at ``path`` holds ``version``, the run stops
    at ``num_versions`` (a total, not a count of more); ``ConfigError`` otherwise, not a run that ends at once."""
    if version >= num_versions:
        raise ConfigError(f"resume: {path} is at version {version} and the run stops at version {num_versions}: "
                          f"nothing left to train; ask for more than {version} versions")


def resume(proto: ServerProtocol, path: str) -> dict[str, Any]:
    """Load the checkpoint at ``path`` into ``proto`` (``check_resume`` first) and return its ``extra`` state;
    ``ConfigError`` (one line) when it does not fit ``proto``'s model."""
    check_resume(path)
    try:
        return Reporter.load_checkpoint(path, proto)
    except (KeyError, TypeError, ValueError, RuntimeError, IndexError, AttributeError, SyntaxError) as exc:
        raise ConfigError(f"resume: {path} does not fit this run ({first_line(exc)})") from None


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
        raise ConfigError(f"resume: {path} is not a readable checkpoint ({first_line(exc)})") from None
    proto = state.get("protocol") if isinstance(state, dict) else None
    if not isinstance(proto, dict) or not isinstance(proto.get("version"), int):
        raise ConfigError(f"resume: {path} is not a fedcomp checkpoint (no protocol state)")

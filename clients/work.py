"""The ClientApp's heavy half: one train or evaluate task, from the task's records to the reply's records.

Per ``train`` task it follows the ``fedcomp.flower.ClientSession`` contract (the same session
``compression_mod`` uses): apply the server's acks/nacks (a nack restores that update into the residual), load
the global model from the task's blob, train (``local-mode``), compress and encode the pseudo-gradient, and
reply with one blob, one small ConfigRecord and one MetricRecord. The pseudo-gradient goes from the trainer to
the pipeline as torch tensors on the training device (a GPU node compresses it with the fused kernels without a
copy to the CPU). Node settings come from ``context.node_config`` (``fedcomp.task.config.NodeConfig``; the
``worker-*`` keys of ``clients.channel`` are read there, not by ``NodeConfig``).

Where the session lives:

* **no worker** (``clients.app`` runs this in the ``flwr-clientapp`` process): ``ClientSession.load``, i.e.
  ``context.state``, else ``state-dir/client-state.pt``, else a fresh session; saved into both before the reply.
* **a kept ``Bench`` in process** (the simulator's warm nodes): the session and model stay in memory while
  ``context.state`` holds the very record this bench saved; it is still saved there after every task.
* **a warm worker** (``clients.worker`` keeps a ``Bench``): the session stays in the worker's memory and is
  written to the state dir before each reply leaves. The state dir is then the one source of truth: when the
  node config names a worker, a session is loaded from the state dir first (``context.state`` may hold an older
  one from a task that ran in-process), and the worker reloads it whenever the file is not the one it wrote
  last. A restarted worker so continues with the same sequence numbers, residual and pending updates.

The state dir holds one server run's session (``fedcomp.flower.statedir``): a task of another run (its
``run-key``) sets the folder's session aside and starts afresh. A task holds the folder's session lock from
loading the session to saving it, so a task run beside a busy worker never interleaves with the worker's.

A task that arrives again after its update was made (the reply never left: a worker died after saving) first
hands that update back to the residual, so nothing is counted twice or lost.

>>> reply = train_content(task.content, context)  # doctest: +SKIP
>>> records.read_reply(reply)[1].seq  # doctest: +SKIP
1
"""

from __future__ import annotations

import contextlib
import time
from pathlib import Path
from typing import Any

import torch
from flwr.app import Context, MetricRecord, RecordDict

from clients.channel import SOCKET_KEY, node_settings
from clients.trainer import LOCAL_TRAINERS, select_device
from fedcomp.flower import records
from fedcomp.flower.session import STATE_KEY, ClientSession
from fedcomp.flower.statedir import STATE_FILE, StateDir
from fedcomp.protocol import Outcome, Resolution
from fedcomp.spec import ModelSpec
from fedcomp.task.config import NodeConfig, RunConfig
from fedcomp.task.training import datasets, evaluate, make_model, node_partition, run_loss, subset
from fedcomp.wire import decode


def load_tensors(model: torch.nn.Module, tensors: dict[str, torch.Tensor]) -> None:
    """Copy ``tensors`` (CPU, by parameter name) into ``model``'s parameters."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name in tensors:
                p.copy_(tensors[name].to(p.device))


def configs(context: Context) -> tuple[RunConfig, NodeConfig]:
    """The typed run and node config of ``context`` (the worker's keys left out of the node config). The run
    config imports only the plug-in modules the node allows (``allow-plugins``): ``PluginNotAllowed`` otherwise,
    before anything of that module is imported."""
    node = NodeConfig.from_flower(node_settings(context.node_config))
    return RunConfig.from_flower(context.run_config, plugins=node.plugins), node


def _file_id(path: Path) -> tuple[int, int, int] | None:
    try:
        st = path.stat()
    except FileNotFoundError:
        return None
    return st.st_ino, st.st_mtime_ns, st.st_size


class Bench:
    """What a node keeps between tasks: data, model, spec and session, each valid for one key (run id, run
    config, node config, device), so a new run or other settings never reuse a wrong one.

    The in-process path uses a fresh ``Bench`` per task (today's cold behaviour); a warm worker keeps one, and
    so does the simulator for each node of a warm method (``simulations.engines.InProcessEngine``).

    >>> bench = Bench(); train_content(t1, ctx, bench); train_content(t2, ctx, bench)  # doctest: +SKIP
    """

    def __init__(self) -> None:
        self.key: tuple | None = None
        self.split: Any = None
        self.test: Any = None
        self.model: torch.nn.Module | None = None
        self.initial: dict[str, torch.Tensor] = {}
        self.spec: ModelSpec | None = None
        self.session: ClientSession | None = None
        self.saved: tuple[int, int, int] | None = None  # the state file as this bench last wrote it
        self.record: Any = None  # the context.state record this bench last wrote

    def use(self, context: Context, device: torch.device) -> None:
        """Forget everything when ``context`` asks for another run, other settings or another device."""
        key = (context.run_id, context.node_id, tuple(sorted(context.run_config.items())),
               tuple(sorted(node_settings(context.node_config).items())), str(device))
        if key != self.key:
            self.__init__()  # type: ignore[misc]
            self.key = key

    def training(self, run: RunConfig, node: NodeConfig, device: torch.device) -> tuple[Any, torch.nn.Module]:
        """The node's partition and the run's model on ``device``, reset to its initial weights."""
        if self.model is None:
            self.split = node_partition(run, node)
            self.model = make_model(run, self.split)
            self.spec = ModelSpec.from_module(self.model)
            self.initial = {k: v.detach().clone() for k, v in self.model.state_dict().items()}
            self.model.to(device)
        else:
            self.model.load_state_dict(self.initial)
        return self.split, self.model

    def session_for(
        self, context: Context, run: RunConfig, node: NodeConfig, device: torch.device, run_key: int = 0
    ) -> ClientSession:
        """The newest session of server run ``run_key`` (see the module docstring for where it lives)."""
        assert self.spec is not None
        kept = self.session is not None and (not run_key or self.session.run_key == run_key)
        held = context.state.array_records.get(STATE_KEY)
        if kept and held is not None and held is self.record:  # the context this bench saved
            return self.session  # type: ignore[return-value]
        path = Path(node.state_dir) / STATE_FILE if node.state_dir else None
        warm = path is not None and SOCKET_KEY in context.node_config
        if warm and kept and _file_id(path) == self.saved:
            return self.session  # type: ignore[return-value]
        return ClientSession.load(context, run.compression, self.spec, node.state_dir, device=device,
                                  backend=node.kernel_backend, run_key=run_key, dir_first=warm)

    def keep(self, session: ClientSession, node: NodeConfig, context: Context) -> None:
        """Remember ``session`` as the one the state dir and ``context.state`` now hold."""
        self.session = session
        self.saved = _file_id(Path(node.state_dir) / STATE_FILE) if node.state_dir else None
        self.record = context.state.array_records.get(STATE_KEY)


def train_content(content: RecordDict, context: Context, bench: Bench | None = None) -> RecordDict:
    """One train task: the reply's records (blob, ``ReplyMeta``, metrics). The session is saved (``context.state``,
    and the state dir when set) before this returns."""
    t0 = time.perf_counter()
    bench = bench or Bench()
    run, node = configs(context)
    device = select_device(node)
    bench.use(context, device)
    task = records.read_task(content)
    split, model = bench.training(run, node, device)
    spec = bench.spec
    assert spec is not None
    with StateDir(node.state_dir).session_lock() if node.state_dir else contextlib.nullcontext():
        session = bench.session_for(context, run, node, device, task.run_key)
        if task.task_id in session.task_seqs:  # answered before, but that reply never left: back into the residual
            session.apply([Resolution(task.task_id, 0, Outcome.LOST)])
        applied = session.resolve(task.resolutions)
        replica = session.receive_model(context, spec, task.model)
        if replica.version != task.base_version:
            raise records.RecordError(f"model blob is version {replica.version}, task says {task.base_version}")
        load_tensors(model, replica.tensors)
        generator = torch.Generator().manual_seed(run.seed * 1_000_003 + node.partition_id * 7919 + task.task_id)
        result = LOCAL_TRAINERS.get(run.local_mode)()(model, split, run, device, generator)
        session.steps_done += run.local_steps
        session.pipeline.set_epoch(session.steps_done * run.batch_size / max(len(split), 1))
        if task.density:  # the server's choice for this task (density="auto", fedcomp.server.linkaware)
            session.pipeline.compressor.set_density(task.density)
        blob, seq = session.send(task.task_id, result.pseudo_grad, task.base_version, context.node_id)
        session.save(context, node.state_dir)
        bench.keep(session, node, context)
    metrics = {
        "train-loss": result.loss,
        "train-seconds": time.perf_counter() - t0,
        "payload-bytes": float(len(blob)),
        "dense-bytes": float(spec.dense_bytes),
        "pending": float(len(session.pipeline.pending)),
        "acked": float(applied.get("applied", 0)),
        "nacked": float(sum(v for k, v in applied.items() if k != "applied")),
        "resynced": float(task.resync),
        "gpu": float(device.type == "cuda"),
    }
    meta = session.reply_meta(task.task_id, seq, result.num_examples)  # incarnation + other pending tasks
    return records.reply_content(blob, meta, metrics)


def evaluate_content(content: RecordDict, context: Context, bench: Bench | None = None) -> RecordDict:
    """Federated evaluation of the task's model on this node's share of the test split: ``{"metrics": ...}``."""
    bench = bench or Bench()
    run, node = configs(context)
    device = select_device(node)
    bench.use(context, device)
    if bench.test is None:
        _, test = datasets(run)
        bench.test = subset(test, range(node.partition_id, len(test), node.num_partitions))
    model = make_model(run, bench.test)
    load_tensors(model, decode(records.read_blob(content, "model"), ModelSpec.from_module(model)).to_dense())
    res = evaluate(model.to(device), bench.test, device, loss=run_loss(run))
    return RecordDict({"metrics": MetricRecord(res)})


#: Message type -> handler ``(content, context, bench) -> reply content``.
HANDLERS = {"train": train_content, "evaluate": evaluate_content}

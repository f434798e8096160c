"""Typed views of Flower's run config (``[tool.flwr.app.config]``), node config (``--node-config``) and of the
compression settings a server sends with every task (``Compression``).

Both the ServerApp and the ClientApp read the same run config, so one ``RunConfig`` describes the whole run.
Keys are kebab-case (``num-versions``). Compressor and staleness options are one string each,
``"density=0.01 momentum=0.9"`` (Flower only overrides keys the app's pyproject declares, and the option names
depend on the compressor). Unknown keys and bad values raise ``ConfigError`` naming the key, so a typo never
silently falls back to a default.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
import shlex
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from fedcomp.client.pipeline import Pipeline, build
from fedcomp.downlink import DOWNLINKS
from fedcomp.registry import ConfigError, check_ranges
from fedcomp.server.linkaware import AutoDensityConfig
from fedcomp.spec import ModelSpec
from fedcomp.task.data import DATASETS, PARTITIONERS, base_name, reach
from fedcomp.task.models import MODELS
from fedcomp.task.plugins import ALLOW_ENV, GROUPS, NODE_DEFAULT, PluginPolicy, build_loss, import_module_of, resolve

#: Field metadata of a dataclass field that is not a Flower config key (set by the process, never by a config).
NOT_A_KEY = {"config-key": False}


def config_fields(cls: type) -> list[dataclasses.Field]:
    """The fields of ``cls`` that are Flower config keys (``kebab-case`` of their names)."""
    return [f for f in dataclasses.fields(cls) if f.init and f.metadata.get("config-key", True)]


def parse_options(text: str, key: str) -> dict[str, Any]:
    """``"a=1 b=0.5,c=true d=name e=1024,1024 f='my dir'"`` -> ``{"a": 1, "b": 0.5, "c": True, "d": "name",
    "e": "1024,1024", "f": "my dir"}``.

    Items are separated by spaces, or by a comma that starts the next ``name=`` (a comma inside a value stays);
    quote a value with spaces. Numbers and true/false are converted; everything else stays a string.
    """
    out: dict[str, Any] = {}
    try:
        tokens = shlex.split(text)
    except ValueError as exc:
        raise ConfigError(f"{key}: {exc} in {text!r}") from None
    for token in (t.strip(",") for t in tokens):
        for item in re.split(r",(?=[A-Za-z_][\w-]*=)", token) if token else []:
            name, eq, raw = item.partition("=")
            if not eq or not name:
                raise ConfigError(f"{key}: expected name=value items, got {item!r}")
            value: Any = raw
            if raw.lower() in ("true", "false"):
                value = raw.lower() == "true"
            else:
                for conv in (int, float):
                    try:
                        value = conv(raw)
                        break
                    except ValueError:
                        continue
            out[name.replace("-", "_")] = value
    return out


def _coerce(key: str, value: Any, kind: Any) -> Any:
    if isinstance(kind, str):  # postponed annotation
        kind = {"int": int, "float": float, "bool": bool, "str": str}[kind]
    if kind is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "false", "1", "0", "yes", "no"):
            return value.lower() in ("true", "1", "yes")
        raise ConfigError(f"{key}: expected true/false, got {value!r}")
    if kind is int:
        return _whole(key, value)
    if kind is float:
        try:
            return float(value)
        except (TypeError, ValueError):
            raise ConfigError(f"{key}: expected a number, got {value!r}") from None
    return str(value)


def _whole(key: str, value: Any) -> int:
    """An int config value, exactly: an int, a float or a string that is a whole number (``3``, ``3.0``, ``"3"``,
    ``"1e3"``) within int64; ``ConfigError`` for anything else (a bool, NaN, inf, ``2.5``, ``10**400``).

    >>> _whole("seed", "1152921504606846977"), _whole("seed", 1e3)
    (1152921504606846977, 1000)
    """
    n: Any = None
    if isinstance(value, int) and not isinstance(value, bool):
        n = value
    elif isinstance(value, (float, str)):
        try:
            n = int(value) if isinstance(value, str) else None
        except ValueError:
            pass
        if n is None:
            try:
                f = float(value)
            except ValueError:
                f = math.nan
            n = int(f) if math.isfinite(f) and f == int(f) else None
    if n is None or not -(2**63) <= n < 2**63:
        raise ConfigError(f"{key}: expected an integer (64-bit), got {str(value)[:40]!r}")
    return n


def _from_flat(cls: type, flat: Mapping[str, Any], what: str, **given: Any) -> Any:
    fields = {f.name.replace("_", "-"): f for f in config_fields(cls)}
    hints = typing.get_type_hints(cls)
    kwargs: dict[str, Any] = dict(given)
    for key, value in flat.items():
        if key in fields:
            f = fields[key]
            kind = hints[f.name]
            if isinstance(kind, types.UnionType):
                kind = next(a for a in typing.get_args(kind) if a is not type(None))
            kwargs[f.name] = _coerce(key, value, kind)
        else:
            raise ConfigError(f"unknown {what} key {key!r}; known: {', '.join(sorted(fields))}")
    try:
        return cls(**kwargs)
    except (TypeError, ValueError) as exc:  # a ConfigError keeps its kind (PluginNotAllowed), with the prefix
        raise (type(exc) if isinstance(exc, ConfigError) else ConfigError)(f"{what}: {exc}") from exc


#: The end of the seeds a run takes, numpy's range (the batches' seed, ``seed * 1_000_003 + ...``, stays in int64).
SEED_END = 2**32
#: A model's options that come from the dataset, never from ``model-options`` (a value there was a ``TypeError``
#: mid-build: the model got them twice).
BUILT_FROM_DATA = frozenset({"in_shape", "num_classes"})
#: ``density=auto``: the server picks each node's density per task (``fedcomp.server.linkaware``).
AUTO = "auto"
#: Compressor options read by the server's density policy, not by the client's pipeline.
SERVER_OPTIONS = ("upload_budget",)


#: ``fedcomp.client.pipeline.build``'s own keywords: a compressor option of one of these names is refused (a server
#: could otherwise turn off a node's running totals, which ``fedcomp check`` reads, or pick its kernels).
BUILD_KEYWORDS = frozenset({"name", "spec", "memory", "backend", "totals"})


@dataclass(frozen=True)
class Compression:
    """How clients compress their updates and how the server sends the model; travels with every task.

    ``compressor``: a ``fedcomp.COMPRESSORS`` name or ``"sparsifier+quantizer"``; ``memory``: a
    ``fedcomp.MEMORIES`` name (``""``: the compressor's default); ``options``: ``"key=value ..."`` for both
    (``density=0.01 momentum=0.9``); ``downlink``: a ``fedcomp.downlink.DOWNLINKS`` mode with its
    ``downlink_options``. Every name and option is checked here: a bad one raises ``ConfigError`` before any
    message leaves the server.

    >>> Compression("dgc+int8", options="density=0.01").options_dict
    {'density': 0.01}
    """

    compressor: str = "dgc+int8"
    memory: str = ""
    options: str = "density=0.01"
    downlink: str = "dense"
    downlink_options: str = ""

    def __post_init__(self) -> None:
        self.pipeline(ModelSpec((("check", (2,)),)))  # unknown names and options fail here
        if self.auto_density is None and any(k in self.options_dict for k in SERVER_OPTIONS):
            raise ConfigError(f"compressor-options: {', '.join(SERVER_OPTIONS)} only go with density=auto")
        DOWNLINKS.make_config(self.downlink, **parse_options(self.downlink_options, "downlink-options"))

    @property
    def options_dict(self) -> dict[str, Any]:
        return parse_options(self.options, "compressor-options")

    @property
    def auto_density(self) -> AutoDensityConfig | None:
        """The server's link-aware density policy when ``density=auto`` (``upload_budget=`` tunes it), else None."""
        opts = self.options_dict
        if opts.get("density") != AUTO:
            return None
        return AutoDensityConfig(**{k: opts[k] for k in SERVER_OPTIONS if k in opts})

    def pipeline(self, spec: ModelSpec, backend: str | None = None) -> Pipeline:
        """A fresh send pipeline (compressor + error-feedback memory) over ``spec``. Under ``density=auto`` it
        starts at the first probe density; each task then carries the server's choice (``set_density``)."""
        opts = {k: v for k, v in self.options_dict.items() if k not in SERVER_OPTIONS}
        if own := sorted(set(opts) & BUILD_KEYWORDS):  # the node's, never the server's (totals: its own record)
            raise ConfigError(f"compressor-options: {', '.join(own)} is not a compressor or memory option")
        if opts.get("density") == AUTO:
            opts["density"] = AutoDensityConfig().probe[0]
        return build(self.compressor, spec, memory=self.memory or None, backend=backend, **opts)

    def client_part(self) -> tuple[str, str, dict[str, Any], str, dict[str, Any]]:
        """What a client's saved state is made for: every field but the options only the server reads (the
        ``density=auto`` policy's, the downlink's ``history``), so a run resumed with other ones continues the
        clients' states.

        >>> Compression(downlink="delta", downlink_options="history=4").client_part()[3:]
        ('delta', {})
        """
        opts = {k: v for k, v in self.options_dict.items() if k not in SERVER_OPTIONS}
        down = {k: v for k, v in parse_options(self.downlink_options, "downlink-options").items() if k != "history"}
        return self.compressor, self.memory, opts, self.downlink, down

    def to_flat(self) -> dict[str, str]:
        """The fields as kebab-case keys (one ConfigRecord's worth)."""
        return {f.name.replace("_", "-"): str(getattr(self, f.name)) for f in dataclasses.fields(self)}

    @staticmethod
    def from_flat(flat: Mapping[str, Any]) -> Compression:
        return _from_flat(Compression, flat, "compression")


@dataclass(frozen=True)
class RunConfig:
    """Everything about one fedcomp run on Flower (see docs/protocol.md, "Run config").

    ``plugins`` is not a config key: the process that reads the config says which plug-in modules named in it may
    be imported (``fedcomp.task.plugins.PluginPolicy``): a client node what its operator allowed
    (``NodeConfig.plugins``), the server and local simulations ``TRUSTED``. Plug-in names are checked (and
    imported, where allowed) when the config is built.

    >>> RunConfig.from_flower({"model": "os:system"}).model  # doctest: +IGNORE_EXCEPTION_DETAIL
    Traceback (most recent call last):
    PluginNotAllowed: model 'os:system': this node does not allow the plug-in module 'os'; ...
    """

    mode: str = "async"
    num_versions: int = 20
    # data and model: registered names, "package.module:callable", or entry points (fedcomp.task.plugins)
    dataset: str = "digits"
    dataset_options: str = ""
    model: str = "mlp"
    model_options: str = ""
    loss: str = "cross_entropy"
    partitioner: str = "iid"
    dirichlet_alpha: float = 0.5
    seed: int = 0
    # client: local training and compression
    local_mode: str = "delta"
    local_steps: int = 10
    local_lr: float = 0.1
    local_momentum: float = 0.0
    batch_size: int = 32
    compressor: str = "dgc"
    memory: str = "residual"
    compressor_options: str = "density=0.02"
    # downlink: the model sent with each task (fedcomp.downlink)
    downlink: str = "dense"
    downlink_options: str = ""
    downlink_history: int = 16
    # server: aggregation
    server_optimizer: str = "sgd"
    server_lr: float = 1.0
    server_momentum: float = 0.0
    staleness: str = "polynomial"
    staleness_options: str = ""
    max_staleness: int = 4
    balance: float = 1.0  # async: weight nodes applied less often than the average up to this factor (1 = off)
    buffer_size: int = 2
    concurrency: int = 0
    prefetch: int = 1  # async: tasks queued per node behind the one it runs (0 = none)
    prefetch_lead: float = 2.0  # async: queue a node's next task this many seconds before it should need it
    normalize: str = ""
    # sync rounds
    fraction: float = 1.0
    min_clients: int = 1
    over_selection: float = 0.0
    round_timeout: float = 120.0
    # time bounds
    task_timeout: float = 120.0
    run_timeout: float = 0.0
    node_wait: float = 300.0
    poll_interval: float = 0.5
    max_reads_per_s: float = 200.0  # reads of the replies still missing: at most this many pull requests a second
    max_failures: int = 50
    # evaluation, metrics, checkpoints
    eval_every: int = 1
    fed_eval: bool = False
    fed_eval_timeout: float = 60.0
    checkpoint_every: int = 0
    out_dir: str = "results/flower"
    resume: str = ""
    # hostile input
    max_update_norm: float = 0.0
    max_update_bytes: int = 0
    # server hardware
    aggregate_device: str = "cpu"
    # who may be imported for plug-ins: the reading process's choice, never the config's
    plugins: PluginPolicy = field(default=NODE_DEFAULT, metadata=NOT_A_KEY)

    def __post_init__(self) -> None:
        if self.mode not in ("sync", "async"):
            raise ConfigError(f"mode must be 'sync' or 'async', got {self.mode!r}")
        if self.local_mode not in LOCAL_MODES:
            raise ConfigError(f"local-mode must be one of {', '.join(LOCAL_MODES)}, got {self.local_mode!r}")
        PARTITIONERS.get(self.partitioner)  # an unknown partitioner fails here, not in every client's task
        DOWNLINKS.make_config(self.downlink, **self.downlink_kwargs)  # a bad mode or option fails here
        _ = self.compression  # a bad compressor, memory or option fails here
        for name in ("num_versions", "local_steps", "batch_size", "min_clients"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        check_ranges(("buffer-size", self.buffer_size, ">= 1", self.buffer_size >= 1),
                     *((n.replace("_", "-"), getattr(self, n), ">= 0", getattr(self, n) >= 0)
                       for n in ("max_staleness", "concurrency", "prefetch")))
        parse_options(self.compressor_options, "compressor-options")
        parse_options(self.staleness_options, "staleness-options")
        check_ranges(("max-update-norm", self.max_update_norm, "finite and >= 0", 0 <= self.max_update_norm < math.inf),
                     ("max-update-bytes", self.max_update_bytes, ">= 0", self.max_update_bytes >= 0))
        if self.normalize not in ("", "count", "weights", "sum"):
            raise ConfigError(f"normalize must be count, weights or sum, got {self.normalize!r}")
        if self.mode == "sync" and self.normalize not in ("", "weights"):
            raise ConfigError(f"normalize={self.normalize!r} is an async option: sync rounds take the example-weighted "
                              "mean (FedAvg's; 'weights')")
        from fedcomp.server.optimizers import SERVER_OPTIMIZERS
        from fedcomp.server.selection import MAX_OVER_SELECTION
        from fedcomp.server.staleness import STALENESS

        checks = [("fraction", "> 0", self.fraction > 0)]
        checks += [(n, "finite and > 0", 0 < getattr(self, n) < math.inf)  # a NaN fails every check
                   for n in ("task_timeout", "round_timeout", "local_lr", "server_lr", "poll_interval",
                             "dirichlet_alpha")]
        checks += [("seed", "in [0, 2**32)", 0 <= self.seed < SEED_END)]
        checks += [(n, ">= 0", getattr(self, n) >= 0) for n in ("run_timeout", "node_wait", "fed_eval_timeout",
                   "checkpoint_every", "eval_every", "max_failures", "local_momentum",
                   "server_momentum", "prefetch_lead")]
        checks += [("fraction", "<= 1", self.fraction <= 1), ("local_momentum", "< 1", self.local_momentum < 1),
                   ("over_selection", f"in [0, {MAX_OVER_SELECTION:g}]",
                    0 <= self.over_selection <= MAX_OVER_SELECTION),
                   ("server_momentum", "< 1", self.server_momentum < 1),
                   ("downlink_history", ">= 1", self.downlink_history >= 1),
                   ("max_reads_per_s", "finite and > 0", 0 < self.max_reads_per_s < math.inf),
                   ("balance", "finite and >= 1", 1 <= self.balance < math.inf)]
        check_ranges(*((n.replace("_", "-"), getattr(self, n), rule, ok) for n, rule, ok in checks))
        SERVER_OPTIMIZERS.get(self.server_optimizer)
        STALENESS.make_config(self.staleness, **self.staleness_kwargs)
        self.check_plugins()

    @staticmethod
    def from_flower(run_config: Mapping[str, Any], plugins: PluginPolicy = NODE_DEFAULT) -> RunConfig:
        """The typed view of a Flower run config, importing plug-ins only as ``plugins`` allows."""
        return _from_flat(RunConfig, run_config, "run config", plugins=plugins)

    @property
    def plugin_modules(self) -> tuple[str, ...]:
        """The modules the model, dataset and loss name by import path (what a node would have to allow)."""
        return tuple(sorted({m for m in map(import_module_of, (self.model, self.dataset, self.loss)) if m}))

    @property
    def model_kwargs(self) -> dict[str, Any]:
        return parse_options(self.model_options, "model-options")

    @property
    def dataset_kwargs(self) -> dict[str, Any]:
        return parse_options(self.dataset_options, "dataset-options")

    def check_plugins(self) -> None:
        """Resolve the model, dataset and loss names (importing plug-ins) and check built-ins' options:
        ``ConfigError`` before any work starts."""
        for name, registry, group, options in (
            (self.model, MODELS, "model", self.model_kwargs),
            (self.dataset, DATASETS, "dataset", self.dataset_kwargs),
        ):
            if name.startswith("hf:"):
                continue
            resolve(name, registry, GROUPS[group], self.plugins)
            known = registry.config_fields(name) - BUILT_FROM_DATA if name in registry else set(options)
            if unknown := set(options) - known:  # a plug-in not registered takes what it is given
                raise ConfigError(f"{group}-options: unknown option(s) {sorted(unknown)} for {name!r}; "
                                  f"known: {sorted(known)}")
        build_loss(self.loss, self.plugins)

    @property
    def compression(self) -> Compression:
        """What the run's clients compress with (the downlink history is the server's business)."""
        return Compression(self.compressor, self.memory, self.compressor_options, self.downlink, self.downlink_options)

    @property
    def compressor_kwargs(self) -> dict[str, Any]:
        return parse_options(self.compressor_options, "compressor-options")

    @property
    def downlink_kwargs(self) -> dict[str, Any]:
        """``downlink-options`` plus ``downlink-history`` for the modes that keep a history (``delta``)."""
        opts = parse_options(self.downlink_options, "downlink-options")
        if "history" in DOWNLINKS.config_fields(self.downlink):
            opts.setdefault("history", self.downlink_history)
        return opts

    @property
    def staleness_kwargs(self) -> dict[str, Any]:
        return parse_options(self.staleness_options, "staleness-options")

    @property
    def effective_normalize(self) -> str:
        """Default: FedBuff ÷K in async mode, FedAvg ÷Σ examples in sync mode."""
        return self.normalize or ("count" if self.mode == "async" else "weights")


#: The run config's ``local-mode`` values: what a client sends, the model delta after ``local-steps`` steps or the
#: mean gradient over them (the ClientApp's trainers, ``clients.trainer.LOCAL_TRAINERS``, one per name).
LOCAL_MODES = ("delta", "gradient")

#: Node config ``kernels`` -> the pipeline's kernel backend (``fedcomp.client.pipeline.Pipeline``; ``None`` = by
#: device).
KERNELS: dict[str, str | None] = {"auto": None, "torch": "torch", "triton": "triton"}


class TaskRefused(ConfigError):
    """A run asks more of this node than its operator allows (``NodeConfig.admit``)."""


@dataclass(frozen=True)
class NodeConfig:
    """What ``flower-client`` (or the simulation engine) tells a node about itself, and what it lets a run ask
    of it: plug-in modules (``allow-plugins``), and per task at most ``max-task-examples`` training examples
    (``local-steps`` x ``batch-size``) on a model of at most ``max-parameters`` parameters, from a dataset whose
    size the run chooses (``mnist1d``'s ``num_samples``) of at most ``max-dataset-values`` input values (0 = no
    cap).

    >>> NodeConfig(max_task_examples=1000).admit(RunConfig(local_steps=100, batch_size=32))  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    fedcomp.task.config.TaskRefused: this node allows at most 1,000 for max-task-examples; the run asks 3,200 ...
    """

    partition_id: int = 0
    num_partitions: int = 1
    gpu: bool = False
    device_class: str = "cpu"
    state_dir: str = ""  # where the client keeps its state between runs (survives a server restart); "" = none
    kernels: str = "auto"  # send-step kernels: auto (Triton on CUDA, torch on CPU), torch, triton
    # the node's warm worker (flower-client --worker warm; clients/worker.py): its socket, key file, connect wait
    worker_socket: str = ""
    worker_key: str = ""
    worker_wait: float = 20.0
    # plug-in modules a run config may name (flower-client --allow-plugin): "mypkg other.mod", "*" = any
    allow_plugins: str = ""
    # built-in datasets that read the node's files or the network a run may name (--allow-dataset): "cifar10", "*"
    allow_datasets: str = ""
    # what one task may ask of this node (flower-client --max-task-examples / --max-parameters /
    # --max-dataset-values; 0 = no cap)
    max_task_examples: int = 100_000
    max_parameters: int = 100_000_000
    max_dataset_values: int = 10_000_000

    def __post_init__(self) -> None:
        self.plugins  # noqa: B018 - a malformed allow-plugins fails here
        check_ranges(*((n, getattr(self, n.replace("-", "_")), ">= 0", getattr(self, n.replace("-", "_")) >= 0)
                       for n in ("max-task-examples", "max-parameters", "max-dataset-values")))
        if not 0 <= self.partition_id < self.num_partitions:
            raise ConfigError(
                f"partition-id must be in [0, num-partitions), got {self.partition_id}/{self.num_partitions}"
            )
        if self.kernels not in KERNELS:
            raise ConfigError(f"kernels must be one of {', '.join(KERNELS)}, got {self.kernels!r}")
        unknown = [n for n in self.allow_datasets.split() if n != "*" and not reach(n)]
        if unknown:
            known = ", ".join(n for n in DATASETS.names() if reach(n))
            raise ConfigError(f"allow-datasets: {unknown[0]!r} is not a dataset that reads files or the network "
                              f"(those are: {known}; '*' = all)")

    @property
    def plugins(self) -> PluginPolicy:
        """What this node lets a run config import (``fedcomp.task.plugins``): ``allow-plugins`` and the modules
        in the node process's ``FEDCOMP_ALLOW_PLUGINS`` (the operator's environment, never the run's)."""
        return PluginPolicy.parse(self.allow_plugins) | PluginPolicy.parse(os.environ.get(ALLOW_ENV, ""))

    def admit(self, run: RunConfig, parameters: int = 0, dataset_values: int = 0) -> None:
        """``TaskRefused`` when ``run`` (with a model of ``parameters`` and a dataset of ``dataset_values`` input
        values; 0 = not counted) asks more of this node than it allows: checked before the dataset is made, the
        model is built or a step is taken; a built-in dataset that reads the node's files or the network only where
        ``allow-datasets`` names it."""
        reaches, name = reach(run.dataset), base_name(run.dataset)
        allowed = self.allow_datasets.split()
        if reaches and "*" not in allowed and name not in allowed:
            raise TaskRefused(f"the run's dataset {run.dataset!r} reads {reaches}, which this node does not let a run "
                              f"ask for. The node's operator may allow it: flower-client --allow-dataset {name}")
        asks = (("max-task-examples", run.local_steps * run.batch_size,
                 f"local-steps {run.local_steps} x batch-size {run.batch_size}"),
                ("max-parameters", parameters, f"model {run.model!r}"),
                ("max-dataset-values", dataset_values, f"dataset {run.dataset!r} with {run.dataset_options!r}"))
        for key, asked, what in asks:
            cap = getattr(self, key.replace("-", "_"))
            if cap and asked > cap:
                raise TaskRefused(f"this node allows at most {cap:,} for {key}; the run asks {asked:,} ({what}). "
                                  f"The node's operator may raise it: flower-client --{key} N")

    @property
    def kernel_backend(self) -> str | None:
        """The pipeline backend of ``kernels``: ``None`` for ``auto`` (by the tensors' device)."""
        return KERNELS[self.kernels]

    @staticmethod
    def from_flower(node_config: Mapping[str, Any]) -> NodeConfig:
        return _from_flat(NodeConfig, node_config, "node config")

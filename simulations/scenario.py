"""Scenario files: one TOML file = clients (link + device mix), data, model, methods, budget.

Layout (every key is validated; an unknown key or a bad value raises ``ConfigError`` naming it)::

    name = "main"                  # free text
    description = "..."
    seed = 0                       # data partition, model init, client batches, link faults
    methods = ["fedavg", "dgc-async"]   # which [method.*] to run, in this order
    baseline = "fedavg"            # speedups are relative to it (default, or when it is not run: the first method)
    compare_to = ["fedbuff"]       # more speedup columns: speedup_vs_fedbuff (methods that did not run are skipped)
    target_accuracy = 0.95         # "virtual time to target" threshold (0..1)

    [sim]                          # the simulator (SimOptions)
    engine = "inprocess"           # "inprocess" (ClientApp in this process) or "ray" (Flower's simulation engine)
    cold_start_s = 5.1             # Flower's per-task charges (fedcomp.sim.virtual.TimingConfig), seconds >= 0:
    warm_start_s = 0.16            #   ClientApp process start (cold / warm worker), a warm node's worker start
    worker_start_s = 2.4           #   (its first task), SuperExec task poll interval (a method may set its own),
    superexec_poll_s = 0.2         #   the server's reply pull interval (longer when more replies are awaited than
    server_pull_s = 0.25           #   the method's max_reads_per_s allows: Scenario.timing)
    read_phase = "random"          #   where the server's first read of a reply lands: "random" or "half"
    codec = "table"                # the client's decode + compress + encode per task: "table" (the calibration,
                                   #   fedcomp.sim.codeccost; a model/compressor it lacks is charged nothing and
                                   #   the summary says codec_calibrated = false) or "off"
    workers = 2                    # methods run at once, each in its own process
    order = ["dgc-async"]          # with workers > 1: start these first, in this order (then the rest, most local
                                   #   steps first); names of [method.*] tables, those not run are skipped
    ...

    [run]                          # fedcomp.task.config.RunConfig fields (snake_case), shared by all methods
    model = "cnn"
    ...

    [method.fedavg]                # per method: RunConfig fields overriding [run] (not the other mode's keys,
                                   #   fedcomp.task.strategyargs.MODE_KEYS: [run] may hold both modes')
    mode = "sync"
    worker = "cold"                # not a RunConfig field: how the SuperNode runs a task, "warm" (default) or
                                   # "cold" (a fresh ClientApp process per task); may be set in [run] for all
    superexec_poll_s = 1.0         # not a RunConfig field: this method's SuperExec poll (default: [sim]'s)
    server = "strategy"            # not a RunConfig field: the method run by Compressed(FedAvg(), mode=...), the
                                   # public strategy (default "loops": the product's own server loops)

    [[clients]]                    # groups of identical clients, in partition order
    count = 2
    link = "datacenter"            # a preset of fedcomp.sim.links.LINKS or a [links.NAME] table
    device = "datacenter_gpu"      # a preset of fedcomp.sim.links.DEVICES or a [devices.NAME] table
    availability = { period_s = 600, online_s = 400, phase_s = "spread" }   # optional

    [links.flaky_lte]              # custom link: base preset + changes, or all of up_mbps/down_mbps/rtt_ms
    base = "lte"
    loss = 0.02

``apply_overrides`` applies ``--set key=value`` pairs (dotted paths: ``run.local_steps=5``,
``method.dgc-async.buffer_size=4``, ``clients.0.count=3``, ``methods=fedavg,dgc-async``); values are TOML
literals, else strings.
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import math
import re
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fedcomp.compressors.base import COMPRESSORS
from fedcomp.flower.grid import read_interval
from fedcomp.registry import ConfigError
from fedcomp.server.linkaware import AutoDensityConfig
from fedcomp.server.selection import ClientSelection
from fedcomp.sim.codeccost import NO_CODEC, CodecCost, codec_cost
from fedcomp.sim.links import (
    DEVICES,
    LINKS,
    Availability,
    DeviceProfile,
    LinkProfile,
    device_from_config,
    link_from_config,
)
from fedcomp.sim.virtual import (
    COLD_START_S,
    SERVER_PULL_S,
    SUPEREXEC_POLL_S,
    WARM_START_S,
    WORKER_START_S,
    WORKERS,
    NodeProfile,
    TimingConfig,
)
from fedcomp.task.config import SEED_END, RunConfig, config_fields
from fedcomp.task.plugins import TRUSTED
from fedcomp.task.strategyargs import MODE_KEYS

if sys.version_info >= (3, 11):
    import tomllib
else:  # Python 3.10: the tomli backport (same API)
    import tomli as tomllib

SCENARIO_DIR = Path(__file__).parent / "scenarios"
DEFAULT_SCENARIO = "main"
ENGINES = ("inprocess", "ray")
CODEC_MODES = ("table", "off")
TOP_KEYS = {"name", "description", "seed", "methods", "baseline", "compare_to", "target_accuracy", "sim", "run",
            "method", "clients", "links", "devices"}
#: RunConfig keys a scenario does not set: the simulator owns them.
RESERVED_RUN_KEYS = {"seed", "out_dir", "resume", "node_wait", "fed_eval", "fed_eval_timeout", "checkpoint_every"}
#: Keys of ``[run]`` / ``[method.NAME]`` that are the simulator's, not RunConfig's (with their defaults; None: the
#: ``[sim]`` option of that name).
METHOD_KEYS: dict[str, Any] = {"worker": "warm", "superexec_poll_s": None, "server": "loops"}
#: Which server runs a method: the product's loops (``fedcomp.server.loops`` over ``ServerProtocol``), or fedcomp's
#: public strategy, ``Compressed(FedAvg(), mode=...)`` on fedcomp's loop (``simulations.public``; in process).
SERVERS = ("loops", "strategy")


@dataclass(frozen=True)
class SimOptions:
    """The simulator's own options.

    ``engine``: ``"inprocess"`` or ``"ray"``. ``threads``: torch CPU threads (1 is fastest for small models).
    ``ray_cpus_per_client``: Ray resources of one ClientApp. ``count_bytes``, ``detect_s``, ``rejoin_s`` and the
    per-task charges ``cold_start_s``, ``warm_start_s``, ``worker_start_s``, ``superexec_poll_s``,
    ``server_pull_s`` and ``read_phase``: see ``fedcomp.sim.virtual.TimingConfig`` (each checked there).
    ``codec``: ``"table"`` charges each task the client's decode + compress + encode from the calibration table
    (``fedcomp.sim.codeccost``), ``"off"`` charges none. ``progress``: show a progress bar. ``workers``:
    methods run at once (in-process engine), each in its own process; ``order``: the methods they start first, in
    this order (then the others, most local steps asked first; ``simulations.backends.start_order``).
    """

    engine: str = "inprocess"
    threads: int = 1
    ray_cpus_per_client: float = 1.0
    count_bytes: str = "wire"
    detect_s: float = 60.0
    rejoin_s: float = 300.0
    progress: bool = True
    workers: int = 1
    cold_start_s: float = COLD_START_S
    warm_start_s: float = WARM_START_S
    superexec_poll_s: float = SUPEREXEC_POLL_S
    server_pull_s: float = SERVER_PULL_S
    read_phase: str = "random"
    order: tuple[str, ...] = ()
    worker_start_s: float = WORKER_START_S
    codec: str = "table"

    def __post_init__(self) -> None:
        if not isinstance(self.order, (list, tuple)) or not all(isinstance(n, str) for n in self.order):
            raise ConfigError(f"sim.order must be a list of method names, got {self.order!r}")
        object.__setattr__(self, "order", tuple(self.order))
        try:
            self.timing()
        except ConfigError as exc:
            raise ConfigError(f"sim.{exc}") from None
        if self.workers < 1:
            raise ConfigError(f"sim.workers must be >= 1, got {self.workers}")
        if self.codec not in CODEC_MODES:
            raise ConfigError(f"sim.codec must be one of {CODEC_MODES}, got {self.codec!r}")
        if self.engine not in ENGINES:
            raise ConfigError(f"sim.engine must be one of {ENGINES}, got {self.engine!r}")
        if self.threads < 1 or not self.ray_cpus_per_client > 0:
            raise ConfigError("sim.threads must be >= 1 and sim.ray_cpus_per_client > 0")

    def timing(
        self, seed: int = 0, worker: str = "warm", server_pull_s: float | None = None,
        superexec_poll_s: float | None = None, codec: CodecCost = NO_CODEC, codec_density: float = 0.0,
    ) -> TimingConfig:
        """The clock's ``TimingConfig`` from these options (raises ``ConfigError`` on a bad value);
        ``server_pull_s`` / ``superexec_poll_s``: the method's (default: the option's); ``codec`` at
        ``codec_density``: the method's codec charge."""
        return TimingConfig(
            seed=seed, count_bytes=self.count_bytes, detect_s=self.detect_s, rejoin_s=self.rejoin_s, worker=worker,
            cold_start_s=self.cold_start_s, warm_start_s=self.warm_start_s, worker_start_s=self.worker_start_s,
            superexec_poll_s=self.superexec_poll_s if superexec_poll_s is None else superexec_poll_s,
            server_pull_s=self.server_pull_s if server_pull_s is None else server_pull_s, read_phase=self.read_phase,
            codec=codec, codec_density=codec_density,
        )


@dataclass(frozen=True)
class ClientGroup:
    """``count`` clients with the same link, device and availability (``phase_s="spread"`` staggers them)."""

    count: int
    link: str
    device: str
    availability: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Method:
    """One method of the comparison: a name, the full RunConfig it runs with, how the SuperNodes run its tasks
    (``worker``: ``fedcomp.sim.virtual.WORKERS``) and which server runs it (``server``: ``SERVERS``)."""

    name: str
    run: RunConfig
    worker: str = METHOD_KEYS["worker"]
    superexec_poll_s: float | None = None  # None: [sim]'s
    server: str = METHOD_KEYS["server"]  # SERVERS

    @property
    def codec(self) -> CodecCost | None:
        """The calibrated decode + compress + encode of this method's clients (``fedcomp.sim.codeccost``); None
        when the table lacks the model, compressor or downlink mode."""
        return codec_cost(self.run.model, self.run.compressor, self.run.downlink, options=self.run.model_options)

    @property
    def codec_density(self) -> float:
        """The density the clients compress at (``density=auto``: the first probe; each task then carries the
        server's choice), 0 for a compressor without one."""
        d = self.run.compressor_kwargs.get("density")
        if d == "auto":
            return AutoDensityConfig().probe[0]
        if d is None:
            d = getattr(COMPRESSORS.make_config(self.run.compressor.split("+")[0]), "density", 0.0)
        return float(d)

    @property
    def flat(self) -> dict[str, Any]:
        """The run config as Flower's flat kebab-case mapping (what ``context.run_config`` holds)."""
        return {f.name.replace("_", "-"): getattr(self.run, f.name) for f in config_fields(RunConfig)}


@dataclass(frozen=True)
class Scenario:
    name: str
    description: str
    seed: int
    target_accuracy: float
    baseline: str
    methods: tuple[Method, ...]
    clients: tuple[ClientGroup, ...]
    links: Mapping[str, LinkProfile]
    devices: Mapping[str, DeviceProfile]
    sim: SimOptions
    raw: Mapping[str, Any]  # the validated input, for the output folder
    compare_to: tuple[str, ...] = ()

    @property
    def num_clients(self) -> int:
        return sum(g.count for g in self.clients)

    def method(self, name: str) -> Method:
        for m in self.methods:
            if m.name == name:
                return m
        raise ConfigError(f"no method {name!r}; have {[m.name for m in self.methods]}")

    def timing(self, method: Method | None = None) -> TimingConfig:
        """How the clock charges ``method``'s tasks (the ``[sim]`` options, the method's worker). The server reads
        every reply it awaits once per read, so, as in a deployment (``fedcomp.flower.grid.read_interval``), its
        pull interval grows to ``open_tasks / max_reads_per_s`` when that is longer than ``server_pull_s`` (0
        keeps the charge off)."""
        if method is None:
            return self.sim.timing(self.seed, METHOD_KEYS["worker"])
        pull = self.sim.server_pull_s
        if pull > 0:
            pull = read_interval(self.open_tasks(method), pull, method.run.max_reads_per_s)
        codec = (method.codec or NO_CODEC) if self.sim.codec == "table" else NO_CODEC
        return self.sim.timing(self.seed, method.worker, server_pull_s=pull, superexec_poll_s=method.superexec_poll_s,
                               codec=codec, codec_density=method.codec_density if codec.charged else 0.0)

    def open_tasks(self, method: Method) -> int:
        """The replies a deployment's server awaits at once for ``method``: async, each busy node's task and the
        ones queued behind it (``concurrency``, 0 = every client, x (1 + ``prefetch``)); sync, a round's
        selection (``fedcomp.server.selection.ClientSelection``)."""
        run, n = method.run, self.num_clients
        if run.mode == "async":
            return min(run.concurrency or n, n) * (1 + run.prefetch)
        return ClientSelection(run.fraction, run.min_clients, run.over_selection).size(n)

    def node_profiles(self) -> list[NodeProfile]:
        """One profile per client, in partition order (client ``i`` trains on partition ``i``)."""
        out: list[NodeProfile] = []
        for g in self.clients:
            for k in range(g.count):
                avail = dict(g.availability)
                if avail.get("phase_s") == "spread":
                    avail["phase_s"] = float(avail.get("period_s", 0.0)) * k / g.count
                out.append(NodeProfile(len(out), self.links[g.link], self.devices[g.device], Availability(**avail)))
        return out


# ---- loading -----------------------------------------------------------------------------------------------


def built_in_names() -> list[str]:
    """The names of the scenarios in ``simulations/scenarios``, sorted."""
    return sorted(q.stem for q in SCENARIO_DIR.glob("*.toml"))


def scenario_path(name_or_path: str | Path | None) -> Path:
    """A file path, or the name of a file in ``simulations/scenarios`` (``"main"`` -> ``main.toml``)."""
    if name_or_path is None:
        name_or_path = DEFAULT_SCENARIO
    p = Path(name_or_path)
    if p.suffix == ".toml" or p.is_file():  # a folder of that name (an earlier --out) never hides a built-in
        if not p.is_file():
            raise FileNotFoundError(f"scenario file {p} not found")
        return p
    built_in = SCENARIO_DIR / f"{p.name}.toml"
    if not built_in.is_file():
        folder = f" ({p} is a folder, not a .toml file)" if p.is_dir() else ""
        known = ", ".join(built_in_names())
        raise FileNotFoundError(f"no scenario {str(name_or_path)!r}{folder}; built-in: {known}")
    return built_in


def load(name_or_path: str | Path | None = None, overrides: list[str] | None = None) -> Scenario:
    """Read, override and validate a scenario."""
    path = scenario_path(name_or_path)
    try:
        raw = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path}: {exc}") from None
    raw.setdefault("name", path.stem)
    raw = apply_overrides(raw, overrides or [])
    check_shadowed(raw, overrides or [])
    return from_dict(raw)


def check_shadowed(raw: Mapping[str, Any], overrides: list[str]) -> None:
    """A ``--set`` that would change nothing is an error, never a silent no-op: ``run.KEY=...`` that every method
    run overrides in its own table (name the methods to set it on instead), ``method.NAME.KEY=...`` for a
    method that does not run (a typo, or one missing from ``methods``), or ``baseline=NAME`` for one that does
    not run (the speedups would be relative to the first method run instead)."""
    tables = raw.get("method", {})
    names = raw.get("methods", list(tables) if isinstance(tables, Mapping) else [])
    if isinstance(names, str):
        names = [n.strip() for n in names.split(",") if n.strip()]
    if not isinstance(tables, Mapping) or not isinstance(names, list) or not names:
        return
    for item in overrides:
        parts = item.partition("=")[0].strip().split(".")
        if parts == ["baseline"] and isinstance(raw.get("baseline"), str) and raw["baseline"] not in names:
            raise ConfigError(
                f"--set baseline={raw.get('baseline')} has no effect: it is not among the methods run "
                f"({', '.join(map(str, names))}); add it with --set methods=..."
            )
        if len(parts) >= 3 and parts[0] == "method" and parts[1] not in names:
            raise ConfigError(
                f"--set {'.'.join(parts)} has no effect: {parts[1]!r} is not among the methods run "
                f"({', '.join(names)}); a typo, or add it with --set methods=..."
            )
        if len(parts) != 2 or parts[0] != "run":
            continue
        setters = [n for n in names if isinstance(tables.get(n), Mapping) and parts[1] in tables[n]]
        if len(setters) == len(names):
            raise ConfigError(
                f"--set run.{parts[1]} has no effect: every method sets {parts[1]} itself "
                f"({', '.join(f'method.{n}' for n in setters)}); use --set method.NAME.{parts[1]}=VALUE"
            )


def parse_value(text: str) -> Any:
    """A TOML literal (``3``, ``0.5``, ``true``, ``"x"``, ``[1, 2]``, ``{a = 1}``), else the text itself."""
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text


def apply_overrides(raw: Mapping[str, Any], overrides: list[str]) -> dict[str, Any]:
    """A copy of ``raw`` with each ``dotted.key=value`` set (list items by index; tables are created)."""
    out = copy.deepcopy(dict(raw))
    for item in overrides:
        key, eq, value = item.partition("=")
        if not eq or not key.strip():
            raise ConfigError(f"--set expects key=value, got {item!r}")
        parts = key.strip().split(".")
        if parts[0] not in TOP_KEYS:
            raise ConfigError(f"--set {key}: unknown top-level key {parts[0]!r}; known: {sorted(TOP_KEYS)}")
        node: Any = out
        for i, part in enumerate(parts[:-1]):
            if isinstance(node, list):
                nxt = _list_item(node, part, key)
            else:
                nxt = node.setdefault(part, {} if not parts[i + 1].isdigit() else [])
            if not isinstance(nxt, (dict, list)):
                raise ConfigError(f"--set {key}: {part!r} is a value, not a table")
            node = nxt
        last = parts[-1]
        if isinstance(node, list):
            idx = _index(last, node, key)
            node[idx] = parse_value(value)
        else:
            node[last] = parse_value(value)
    return out


def _index(part: str, items: list[Any], key: str) -> int:
    if not part.isdigit() or int(part) >= len(items):
        raise ConfigError(f"--set {key}: {part!r} is not an index of a list of {len(items)}")
    return int(part)


def _list_item(items: list[Any], part: str, key: str) -> Any:
    return items[_index(part, items, key)]


def _table(raw: Mapping[str, Any], key: str) -> dict[str, Any]:
    v = raw.get(key, {})
    if not isinstance(v, Mapping):
        raise ConfigError(f"{key} must be a table, got {v!r}")
    return dict(v)


def _dataclass(cls: type, values: Mapping[str, Any], what: str) -> Any:
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = set(values) - known
    if unknown:
        raise ConfigError(f"{what}: unknown key(s) {sorted(unknown)}; known: {sorted(known)}")
    hints = {f.name: f.type for f in dataclasses.fields(cls)}
    for k, v in values.items():
        want = {"int": int, "float": (int, float), "bool": bool, "str": str}.get(str(hints[k]))
        if want is not None and (not isinstance(v, want) or (want is not bool and isinstance(v, bool))):
            raise ConfigError(f"{what}.{k}: expected {hints[k]}, got {v!r}")
    return cls(**values)


def _check_run_keys(values: Mapping[str, Any], what: str) -> None:
    """The keys of a ``[run]`` or ``[method.NAME]`` table are RunConfig's (less the simulator's own) or
    ``METHOD_KEYS``: ``ConfigError`` naming ``what`` otherwise."""
    bad = set(values) & RESERVED_RUN_KEYS
    if bad:
        raise ConfigError(f"{what}: {sorted(bad)} are set by the simulator (use the top-level seed)")
    known = ({f.name for f in config_fields(RunConfig)} - RESERVED_RUN_KEYS) | set(METHOD_KEYS)
    unknown = set(values) - known
    if unknown:
        near = sorted({m for k in unknown for m in difflib.get_close_matches(k, known, 1)})
        hint = f" (did you mean {', '.join(near)}?)" if near else ""
        raise ConfigError(f"{what}: unknown run key(s) {sorted(unknown)}{hint}; known: {', '.join(sorted(known))}")


def _run_config(values: Mapping[str, Any], seed: int, what: str) -> RunConfig:
    _check_run_keys(values, what)
    flat = {k.replace("_", "-"): v for k, v in values.items()}
    flat["seed"] = seed
    try:
        return RunConfig.from_flower(flat, plugins=TRUSTED)  # the scenario is its user's own
    except ConfigError as exc:
        raise ConfigError(f"{what}: {snake_case_keys(str(exc))}") from None


def snake_case_keys(message: str) -> str:
    """RunConfig's errors name keys as Flower spells them (``task-timeout``); a scenario spells them
    ``task_timeout``: say it the scenario's way."""
    message = message.removeprefix("run config: ")
    for name in sorted((f.name for f in config_fields(RunConfig) if "_" in f.name), key=len, reverse=True):
        message = re.sub(rf"(?<![\w-]){re.escape(name.replace('_', '-'))}(?![\w-])", name, message)
    return message


def from_dict(raw: Mapping[str, Any]) -> Scenario:
    """Validate a parsed scenario (see the module docstring for the layout)."""
    unknown = set(raw) - TOP_KEYS
    if unknown:
        raise ConfigError(f"unknown scenario key(s) {sorted(unknown)}; known: {sorted(TOP_KEYS)}")
    seed = raw.get("seed", 0)
    if not isinstance(seed, int) or isinstance(seed, bool) or not 0 <= seed < SEED_END:
        raise ConfigError(f"seed must be an integer in [0, 2**32), got {seed!r}")
    target = raw.get("target_accuracy", 0.9)
    if not isinstance(target, (int, float)) or isinstance(target, bool) or not 0 < target <= 1:
        raise ConfigError(f"target_accuracy must be in (0, 1], got {target!r}")
    sim = _dataclass(SimOptions, _table(raw, "sim"), "sim")
    links, devices = _profiles(raw)
    groups = _client_groups(raw, links, devices)
    methods, tables = _methods(raw, seed)
    names = [m.name for m in methods]
    baseline = raw.get("baseline", names[0])
    if not isinstance(baseline, str):
        raise ConfigError(f"baseline must be a method's name, got {str(baseline)[:40]}")
    if baseline not in tables:
        raise ConfigError(f"baseline {baseline!r} has no [method.NAME] table; defined: {sorted(tables)}")
    if baseline not in names:  # a --set methods=... without it: compare with the first method run
        baseline = names[0]
    compare_to = raw.get("compare_to", [])
    if not isinstance(compare_to, list) or not all(isinstance(n, str) and n in tables for n in compare_to):
        raise ConfigError(f"compare_to must list [method.NAME] tables; defined: {sorted(tables)}; got {compare_to!r}")
    if not set(sim.order) <= set(tables) or len(set(sim.order)) != len(sim.order):
        raise ConfigError(f"sim.order must list [method.NAME] tables once each; defined: {sorted(tables)}; "
                          f"got {list(sim.order)!r}")
    return Scenario(
        name=str(raw.get("name", "scenario")),
        description=str(raw.get("description", "")),
        seed=seed,
        target_accuracy=float(target),
        baseline=baseline,
        methods=methods,
        clients=tuple(groups),
        links=links,
        devices=devices,
        sim=sim,
        raw=dict(raw),
        compare_to=tuple(compare_to),
    )


def _profiles(raw: Mapping[str, Any]) -> tuple[dict[str, LinkProfile], dict[str, DeviceProfile]]:
    """The link and device presets, plus and overridden by the scenario's ``[links.*]`` / ``[devices.*]``."""
    links: dict[str, LinkProfile] = dict(LINKS)
    for name, cfg in _table(raw, "links").items():
        try:
            links[name] = link_from_config(name, _table({name: cfg}, name))
        except ValueError as exc:
            raise ConfigError(f"links.{name}: {exc}") from None
    devices: dict[str, DeviceProfile] = dict(DEVICES)
    for name, cfg in _table(raw, "devices").items():
        try:
            devices[name] = device_from_config(name, _table({name: cfg}, name))
        except ValueError as exc:
            raise ConfigError(f"devices.{name}: {exc}") from None
    return links, devices


def _client_groups(
    raw: Mapping[str, Any], links: Mapping[str, LinkProfile], devices: Mapping[str, DeviceProfile]
) -> list[ClientGroup]:
    """The ``[[clients]]`` tables, each checked: count, a known link and device, a valid availability."""
    groups_raw = raw.get("clients", [])
    if not isinstance(groups_raw, list) or not groups_raw:
        raise ConfigError("clients must be a non-empty list of [[clients]] tables")
    groups = []
    for i, g in enumerate(groups_raw):
        if not isinstance(g, Mapping):
            raise ConfigError(f"clients.{i} must be a table, got {g!r}")
        group = _dataclass(ClientGroup, g, f"clients.{i}")
        if not isinstance(group.availability, Mapping):
            raise ConfigError(f"clients.{i}.availability must be a table, got {group.availability!r}")
        if not isinstance(group.count, int) or group.count < 1:
            raise ConfigError(f"clients.{i}.count must be an integer >= 1, got {group.count!r}")
        if group.link not in links:
            raise ConfigError(f"clients.{i}.link: unknown link {group.link!r}; known: {sorted(links)}")
        if group.device not in devices:
            raise ConfigError(f"clients.{i}.device: unknown device {group.device!r}; known: {sorted(devices)}")
        avail = dict(group.availability)
        if avail.get("phase_s") == "spread":
            avail["phase_s"] = 0.0
        try:
            _dataclass(Availability, avail, f"clients.{i}.availability")
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"clients.{i}.availability: {exc}") from None
        groups.append(group)
    return groups


def _method(name: str, values: dict[str, Any], seed: int) -> Method:
    """One method from its merged ``[run]`` + ``[method.NAME]`` keys: the simulator's (``METHOD_KEYS``), checked
    here, and the RunConfig's."""
    own = {k: values.pop(k) for k in list(values) if k in METHOD_KEYS}
    worker = own.get("worker", METHOD_KEYS["worker"])
    if worker not in WORKERS:
        raise ConfigError(f"method.{name}.worker must be one of {WORKERS}, got {worker!r}")
    poll = own.get("superexec_poll_s")
    if poll is not None and (isinstance(poll, bool) or not isinstance(poll, (int, float)) or not 0 <= poll < math.inf):
        raise ConfigError(f"method.{name}.superexec_poll_s must be a finite number >= 0, got {poll!r}")
    poll = None if poll is None else float(poll)
    server = own.get("server", METHOD_KEYS["server"])
    if server not in SERVERS:
        raise ConfigError(f"method.{name}.server must be one of {SERVERS}, got {server!r}")
    run = _run_config(values, seed, f"method.{name}")
    return Method(name, run, worker=worker, superexec_poll_s=poll, server=server)


def _methods(raw: Mapping[str, Any], seed: int) -> tuple[tuple[Method, ...], Mapping[str, Any]]:
    """The methods to run, in ``methods`` order, each ``[run]`` merged with its ``[method.NAME]``; and every
    method table (a baseline or ``compare_to`` may name one that does not run)."""
    shared = _table(raw, "run")
    tables = _table(raw, "method")
    names = raw.get("methods", list(tables))
    if isinstance(names, str):
        names = [n.strip() for n in names.split(",") if n.strip()]
    if not isinstance(names, list) or not names or not all(isinstance(n, str) for n in names):
        raise ConfigError(f"methods must be a non-empty list of method names, got {names!r}")
    missing = [n for n in names if n not in tables]
    if missing:
        raise ConfigError(f"methods {missing} have no [method.NAME] table; defined: {sorted(tables)}")
    if len(set(names)) != len(names):
        raise ConfigError(f"methods lists a name twice: {names}")
    for what, table in (("run", shared), *((f"method.{n}", _table(tables, n)) for n in names)):
        _check_run_keys(table, what)  # a typo is named where it was made, not in every method it reaches
    methods = tuple(_method(n, {**shared, **_table(tables, n)}, seed) for n in names)
    for m in methods:
        other = set(MODE_KEYS["sync" if m.run.mode == "async" else "async"]) & set(_table(tables, m.name))
        if other:  # [run] is shared by methods of both modes; a method's own table is this method's
            raise ConfigError(f"method.{m.name}: {', '.join(sorted(other))} read only in "
                              f"{'sync' if m.run.mode == 'async' else 'async'} mode; this method is {m.run.mode}")
        if m.run.run_timeout and not math.isfinite(m.run.run_timeout):
            raise ConfigError(f"method.{m.name}.run_timeout must be finite")
    return methods, tables

"""Did a run lose anything? ``fedcomp check OUT [--client-state DIR ...]`` reads what a finished or crashed run
left behind and accounts for every update.

Inputs (all optional but one of the first three):

* ``OUT/summary.json``: the whole run's counters (``totals`` of a deployment; ``methods`` of a simulation, with
  ``<method>.jsonl`` next to it);
* ``OUT/metrics.jsonl``: one row of counters per version (a crashed run has no summary: the rows are summed,
  versions redone after a ``--resume`` counted once);
* ``OUT/checkpoint.pt``: the server's ledger per client node (incarnation, applied, nacked, last seq, the acks and
  nacks not yet delivered);
* ``DIR/client-state.pt`` of each client (``flower-client --state-dir``; ``client-state.run-<key>.pt``, the
  checkpoint's run's, while another run's session is the current one): sent, acked, nacked, pending updates,
  residual and the pipeline's running ``totals`` (``fedcomp.client.totals.Totals``).

What is checked, per client state: every update sent is acked, nacked or still pending
(``sent == acked + nacked + pending``); gradient mass is conserved (``outstanding == residual + Σ pending`` per
tensor, ``outstanding`` = Σ computed - Σ applied, within ``CheckConfig.rtol`` of the tensors' magnitude per update
sent: float32 rounding); and, with the server's checkpoint, what will become of each pending update (an ack or a
nack waiting in the server's outbox, a nack at the resync after a restart) — one the final checkpoint knows
nothing about is *stranded*. Exit code (``CheckReport.exit_code``): 0 everything accounted for,
1 something lost or not conserved; bad input raises ``CheckInputError`` (the CLI exits 2).

>>> report = check("results/deploy", ["state/c0", "state/c1"])  # doctest: +SKIP
>>> report.exit_code, report.problems  # doctest: +SKIP
(0, [])
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from fedcomp import tensortree
from fedcomp.client.pipeline import Pipeline
from fedcomp.client.totals import outstanding_of
from fedcomp.compressors.base import COMPRESSORS
from fedcomp.memory.base import MEMORIES
from fedcomp.payload import Update
from fedcomp.registry import ConfigError
from fedcomp.spec import ModelSpec
from fedcomp.tensortree import first_line
from fedcomp.tools.report import table
from fedcomp.wire import WireError, decode

#: The client state file in a ``--state-dir`` (written by ``fedcomp.flower.session.ClientSession.save``).
STATE_FILE = "client-state.pt"
#: The nack outcomes: the update was not applied and went back into the client's residual.
NACKS = ("stale", "timeout", "lost", "rejected")
#: What ``fedcomp.client.totals.Totals.state_dict`` holds.
TOTALS_KEYS = ("acked", "nacked")  # and "outstanding", or "computed" and "applied" (earlier releases)
#: Fates of an update still pending on a client.
ACK_WAITING, NACK_WAITING, RESYNC, AFTER_CHECKPOINT, STRANDED = (
    "ack waiting",
    "nack waiting",
    "nack at resync",
    "after the checkpoint",
    "unknown to the server",
)


class CheckInputError(ValueError):
    """A missing folder or an unreadable file; the message is one line naming it."""


@dataclass(frozen=True)
class CheckConfig:
    """``rtol``: conservation tolerance per update sent, relative to the largest magnitude among the tensor's
    outstanding, residual and pending sums (float32 rounding of one error-feedback step is ~6e-8)."""

    rtol: float = 1e-6

    def __post_init__(self) -> None:
        if not (math.isfinite(self.rtol) and self.rtol > 0):
            raise ConfigError(f"rtol must be a positive number, got {self.rtol}")


@dataclass
class ServerCounts:
    """The server's counters of one run (deployment) or one method (simulation). ``None``: not recorded."""

    name: str
    source: str
    versions: int | None = None
    target_versions: int | None = None
    stopped: str = ""
    tasks: int | None = None
    applied: int = 0
    duplicate: int | None = 0
    late: int | None = 0
    nacked: dict[str, int | None] = field(default_factory=dict)
    reject_reasons: dict[str, int] = field(default_factory=dict)
    redone_versions: int = 0  # metrics rows superseded by a resumed run (crashed run without summary.json)
    foreign_rows: str = ""  # why a simulation's per-version rows are not its summary's run (another run's)

    @property
    def nacked_total(self) -> int:
        return sum(v or 0 for v in self.nacked.values())

    @property
    def open_at_end(self) -> int | None:
        """Tasks with no outcome when the run ended (no reply yet: its update, if computed, is pending on the
        client). ``tasks`` counts the tasks sent and those a client reported pending that the counters never saw
        sent (``unknown_tasks``: a dead server's after its checkpoint), each nacked ``lost``, and a checkpoint counts
        its open tasks ``lost`` (a resume nacks them), so over resumes this stays the tasks really open (counters
        written by earlier releases lack both and could go negative)."""
        if self.tasks is None or any(v is None for v in self.nacked.values()):
            return None
        return self.tasks - self.applied - self.nacked_total


@dataclass
class LedgerRow:
    """One client node in the server's checkpoint."""

    node: int
    incarnation: int
    applied: int
    nacked: int
    last_seq: int
    acks_waiting: int
    nacks_waiting: int
    resync: bool


@dataclass
class Conservation:
    """Per client: ``max_gap`` = max over elements of ``|outstanding - residual - Σ pending|`` divided by that
    tensor's magnitude (worst tensor); conserved iff every tensor's gap is within ``rtol * (sent + 1)``.
    ``outstanding`` = Σ computed - Σ applied (``fedcomp.client.totals``)."""

    max_gap: float
    tolerance: float
    worst_tensor: str
    conserved: bool
    outstanding_norm: float
    residual_norm: float
    pending_norm: float


@dataclass
class ClientCheck:
    """One client state. ``None`` fields were not recorded (a state saved before the pipeline kept totals, a
    memory without a residual, no server checkpoint)."""

    path: str
    incarnation: int
    nodes: list[int]
    sent: int
    acked: int | None
    nacked: int | None
    pending: int
    fates: dict[str, int] | None
    conservation: Conservation | None
    #: Updates the server's ledger counts as applied for this client's node(s) (final checkpoint only).
    server_applied: int | None = None

    @property
    def known_applied(self) -> int | None:
        """Updates this client knows were applied: acked, or with an ack waiting in the server's outbox."""
        if self.acked is None or self.fates is None:
            return None
        return self.acked + self.fates[ACK_WAITING]

    @property
    def unaccounted(self) -> int | None:
        if self.acked is None or self.nacked is None:
            return None
        return self.sent - self.acked - self.nacked - self.pending

    @property
    def stranded(self) -> int:
        return (self.fates or {}).get(STRANDED, 0)


@dataclass
class CheckReport:
    out: str
    kind: str  # "deployment" | "simulation"
    runs: list[ServerCounts]
    checkpoint_version: int | None
    checkpoint_final: bool | None  # None: no checkpoint; False: the run went on after it
    ledgers: list[LedgerRow]
    clients: list[ClientCheck]
    problems: list[str]
    notes: list[str]

    @property
    def exit_code(self) -> int:
        return 1 if self.problems else 0

    def client_totals(self) -> dict[str, int | None]:
        """Sent, acked, nacked, pending and unaccounted summed over the client states (``None``: some state did
        not record it)."""
        out: dict[str, int | None] = {}
        for key in ("sent", "acked", "nacked", "pending", "unaccounted"):
            vals = [getattr(c, key) for c in self.clients]
            out[key] = None if any(v is None for v in vals) else sum(vals)
        return out

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["client_totals"] = self.client_totals()
        for run, row in zip(self.runs, d["runs"], strict=True):
            row["open_at_end"] = run.open_at_end
            row["nacked_total"] = run.nacked_total
        for client, row in zip(self.clients, d["clients"], strict=True):
            row["unaccounted"] = client.unaccounted
            row["known_applied"] = client.known_applied
            row["stranded"] = client.stranded
        d["exit_code"] = self.exit_code
        d["verdict"] = self.verdict
        return d

    @property
    def verdict(self) -> str:
        if self.problems:
            return "NOT accounted for: " + "; ".join(self.problems)
        return "everything accounted for"

    def text(self) -> str:
        """The report as a few aligned tables and a verdict line."""
        lines = [f"{self.kind} run in {self.out}"]
        rows = []
        for r in self.runs:
            row: dict[str, Any] = {"run": r.name, "source": r.source}
            row["versions"] = "-" if r.versions is None else f"{r.versions}" + (
                f"/{r.target_versions}" if r.target_versions else ""
            )
            row.update(tasks=_na(r.tasks), applied=r.applied, duplicate=_na(r.duplicate), late=_na(r.late))
            row.update({k: _na(v) for k, v in r.nacked.items()})
            row["open at end"] = _na(r.open_at_end)
            rows.append(row)
        lines += ["", "server (updates)", table(rows)]
        for r in self.runs:
            if r.stopped:
                lines.append(f"{r.name}: stopped: {r.stopped}")
            if r.reject_reasons:
                lines.append(f"{r.name}: rejected by reason: {r.reject_reasons}")
        if self.checkpoint_version is not None:
            state = {True: "final", False: "the run went on after it", None: ""}[self.checkpoint_final]
            lines += ["", f"server checkpoint at version {self.checkpoint_version} ({state}): ledger per client node"]
            rows = [{**asdict(x), "incarnation": f"{x.incarnation:x}"} for x in self.ledgers]  # an id, not a count
            lines.append(table(rows) if rows else "(no client nodes)")
        if self.clients:
            crow = []
            for c in self.clients:
                cons = c.conservation
                crow.append(
                    {
                        "client state": c.path,
                        "nodes": ",".join(map(str, c.nodes)) or "-",
                        "sent": c.sent,
                        "acked": _na(c.acked),
                        "nacked": _na(c.nacked),
                        "pending": c.pending,
                        "unaccounted": _na(c.unaccounted),
                        "applied (client/server)": f"{_na(c.known_applied)}/{_na(c.server_applied)}",
                        "pending fate": _fates(c.fates) if c.pending else "-",
                        "conserved": "not recorded"
                        if cons is None
                        else f"{'yes' if cons.conserved else 'NO'} (gap {cons.max_gap:.1e}, tol {cons.tolerance:.1e})",
                    }
                )
            if len(self.clients) > 1:
                tot = self.client_totals()
                crow.append({"client state": "total", "nodes": "", **{k: _na(v) for k, v in tot.items()},
                             "applied (client/server)": "", "pending fate": "", "conserved": ""})
            lines += ["", "clients", table(crow)]
        lines += [""] + [f"note: {n}" for n in self.notes]
        lines.append(self.verdict)
        return "\n".join(lines)


def _na(v: Any) -> Any:
    return "not recorded" if v is None else v


def _fates(fates: dict[str, int] | None) -> str:
    if fates is None:
        return "not recorded"
    return ", ".join(f"{n} {k}" for k, n in fates.items() if n)


# ---- reading ----------------------------------------------------------------------------------------------------
def _json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckInputError(f"{path}: not readable JSON ({first_line(exc)})") from None


def _jsonl(path: Path) -> list[dict[str, Any]]:
    rows = []
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise CheckInputError(f"{path}: not readable ({first_line(exc)})") from None
    for i, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            if i == len(lines):  # a crash can tear the last line: that version's counters are missing
                continue
            raise CheckInputError(f"{path}: line {i} is not JSON") from None
        if not isinstance(row, dict) or not isinstance(row.get("version"), int):
            raise CheckInputError(f"{path}: line {i} is not a metrics row (no version)")
        rows.append(row)
    return rows


def _read_state(path: Path) -> Any:
    """A client state file (``fedcomp.tensortree``), or ``CheckInputError`` naming what is wrong with it."""
    try:
        return tensortree.loads(path.read_bytes())
    except (OSError, tensortree.TreeError) as exc:
        raise CheckInputError(f"{path}: not a readable client state ({first_line(exc)})") from None


def _torch_load(path: Path, what: str) -> Any:
    try:
        return torch.load(path, weights_only=True, map_location="cpu")
    except Exception as exc:  # noqa: BLE001 - torch.load raises many types on a torn or foreign file
        raise CheckInputError(f"{path}: not a readable {what} ({first_line(exc)})") from None


def _sim_stop(reason: Any) -> str:
    """A simulated method's stop reason, '' when it ran its budget out."""
    return "" if reason in (None, "budget", "") else str(reason)


def _int(d: Mapping[str, Any], key: str, path: Path) -> int:
    v = d.get(key, 0)
    if isinstance(v, bool) or not isinstance(v, int):
        raise CheckInputError(f"{path}: {key!r} is not a count ({v!r})")
    return v


def _counts_from_totals(name: str, source: str, t: Mapping[str, Any], path: Path) -> ServerCounts:
    """A deployment's ``VersionStats`` dict (summary ``totals``, checkpoint ``totals`` or summed rows)."""
    return ServerCounts(
        name=name,
        source=source,
        tasks=_int(t, "messages_down", path) + _int(t, "unknown_tasks", path),
        applied=_int(t, "accepted", path),
        duplicate=_int(t, "duplicate", path),
        late=_int(t, "late", path),
        nacked={k: _int(t, k, path) for k in NACKS},
        reject_reasons=dict(t.get("reject_reasons") or {}),
    )


def _sum_rows(rows: Sequence[dict[str, Any]]) -> tuple[dict[str, Any], int, int]:
    """Counters summed over metrics rows, each version counted once: when a resumed run writes a version again,
    the earlier rows from that version on are dropped (their updates were not in the checkpointed model).
    Returns (sums, last version, rows dropped)."""
    kept: list[dict[str, Any]] = []
    dropped = 0
    for row in rows:
        v = row["version"]
        while kept and kept[-1]["version"] >= v:
            kept.pop()
            dropped += 1
        kept.append(row)
    sums: dict[str, Any] = {"reject_reasons": {}}
    for row in kept:
        for k, x in row.items():
            if k == "reject_reasons" and isinstance(x, dict):
                for r, n in x.items():
                    sums["reject_reasons"][r] = sums["reject_reasons"].get(r, 0) + int(n)
            elif isinstance(x, int) and not isinstance(x, bool) and k != "version":
                sums[k] = sums.get(k, 0) + x
    return sums, (kept[-1]["version"] if kept else 0), dropped


def _deployment(out: Path, summary: Any, notes: list[str]) -> ServerCounts | None:
    metrics = out / "metrics.jsonl"
    if summary is not None:
        if not isinstance(summary, dict) or not isinstance(summary.get("totals"), dict):
            raise CheckInputError(f"{out / 'summary.json'}: not a fedcomp summary (no totals)")
        run = _counts_from_totals("run", "summary.json", summary["totals"], out / "summary.json")
        run.versions, run.target_versions = summary.get("versions"), summary.get("target_versions")
        run.stopped = "" if summary.get("completed", True) else str(summary.get("stopped_reason") or "stopped short")
        return run
    if metrics.exists():
        sums, last, dropped = _sum_rows(_jsonl(metrics))
        run = _counts_from_totals("run", "metrics.jsonl", sums, metrics)
        run.versions, run.redone_versions = last, dropped
        run.stopped = "no summary.json: the run did not finish (crashed or still running)"
        notes.append("counters summed from metrics.jsonl up to the last version written; outcomes after it are not"
                     " recorded")
        if dropped:
            notes.append(f"{dropped} metrics rows were written again by a resumed run: counted once")
        return run
    return None


def _foreign_rows(name: str, versions: Any, last: int, redone: int) -> str:
    """Why a simulation's rows (reaching version ``last``, ``redone`` of them written again) are not the run of a
    summary with ``versions``, or ``""``: a simulation never writes a version twice nor past its summary's."""
    if not isinstance(versions, int) or (last <= versions and not redone):
        return ""
    again = f" and write {redone} again" if redone else ""
    return (f"{name} is not this summary's run: its rows reach version {last}{again}, the summary has {versions} "
            "(another run, or two at once, wrote into this folder)")


SIM_NOTE = ("simulation: duplicate and late come from the per-version rows (up to the last version), rejected from "
            "the summary (the rows' where a summary predates it); the clients' states live in memory and are not "
            "saved")


def _simulation(out: Path, summary: Mapping[str, Any], notes: list[str]) -> list[ServerCounts]:
    runs = []
    methods = summary.get("methods")
    if not isinstance(methods, list):
        raise CheckInputError(f"{out / 'summary.json'}: 'methods' is not a list")
    for m in methods:
        if not isinstance(m, dict) or not isinstance(m.get("method"), str):
            raise CheckInputError(f"{out / 'summary.json'}: a method row has no name")
        name = m["method"]
        jsonl = out / f"{name}.jsonl"
        rows = _jsonl(jsonl) if jsonl.exists() else []
        sums, last, redone = _sum_rows(rows)
        versions = m.get("versions")
        missing = len(set(range(1, versions + 1)) - {r["version"] for r in rows}) if isinstance(versions, int) else 0
        foreign = _foreign_rows(jsonl.name, versions, last, redone) if rows else ""
        have_rows = jsonl.exists() and not missing and not foreign
        if jsonl.exists() and missing:  # torn or cut: its duplicate and late counts would be partial
            notes.append(f"{jsonl.name}: {missing} of its {versions} versions have no row: duplicate, late unknown")
        path = out / "summary.json"
        run = ServerCounts(
            name=name,
            source="summary.json" + (f" + {jsonl.name}" if have_rows else ""),
            versions=versions,
            stopped=_sim_stop(m.get("stopped_reason", m.get("stopped"))),
            tasks=_int(m, "tasks", path) if "tasks" in m else None,
            applied=_int(m, "applied", path),
            duplicate=sums.get("duplicate") if have_rows else None,
            late=sums.get("late") if have_rows else None,
            nacked={
                "stale": _int(m, "stale", path),
                "timeout": _int(m, "timeout", path),
                "lost": _int(m, "lost", path),
                "rejected": _int(m, "rejected", path) if "rejected" in m  # the whole run's; rows: to the last version
                else sums.get("rejected") if have_rows else None,
            },
            reject_reasons=dict(m.get("reject_reasons") or sums.get("reject_reasons") or {}),
            foreign_rows=foreign,
        )
        runs.append(run)
    notes.append(SIM_NOTE)
    return runs


def _runs(out: Path, summary: Any, notes: list[str]) -> list[ServerCounts]:
    """The server's counts of each run in ``out``: a simulation's methods (each seed's, for ``--seeds``: the top
    figures are means) or a deployment's one run (none without its files)."""
    if isinstance(summary, dict) and "methods" in summary:
        return _seeds(out, summary, notes) if "seeds" in summary else _simulation(out, summary, notes)
    run = _deployment(out, summary, notes)
    return [run] if run is not None else []


def _seeds(out: Path, summary: Mapping[str, Any], notes: list[str]) -> list[ServerCounts]:
    """The runs of a ``fedcomp sim --seeds`` folder: each seed's (``seed-N/``), named ``seed N: method``."""
    seeds = summary.get("seeds")
    if not isinstance(seeds, list) or not seeds or not all(isinstance(s, int) for s in seeds):
        raise CheckInputError(f"{out / 'summary.json'}: 'seeds' is not a list of seeds")
    runs = []
    for seed in seeds:
        folder = out / f"seed-{seed}"
        if not (folder / "summary.json").exists():
            raise CheckInputError(f"{folder}: no summary.json (the seed's run did not finish)")
        for run in _simulation(folder, _json(folder / "summary.json"), []):
            run.name = f"seed {seed}: {run.name}"
            runs.append(run)
    notes.append(SIM_NOTE)
    return runs


def _ledgers(proto: Mapping[str, Any], path: Path) -> list[LedgerRow]:
    rows = []
    clients = proto.get("clients")
    if not isinstance(clients, dict):
        raise CheckInputError(f"{path}: the checkpoint has no client ledger")
    for node, led in clients.items():
        if not isinstance(led, dict) or not isinstance(led.get("outbox"), list):
            raise CheckInputError(f"{path}: the ledger of client {node} is malformed")
        outs = [str(r.get("outcome")) for r in led["outbox"] if isinstance(r, dict)]
        rows.append(
            LedgerRow(
                node=int(node),
                incarnation=_int(led, "incarnation", path),
                applied=_int(led, "applied", path),
                nacked=_int(led, "nacked", path),
                last_seq=_int(led, "last_seq", path),
                acks_waiting=sum(o == "applied" for o in outs),
                nacks_waiting=sum(o in NACKS for o in outs),
                resync=bool(led.get("resync", False)),
            )
        )
    return sorted(rows, key=lambda r: r.node)


def _outbox(proto: Mapping[str, Any]) -> dict[int, tuple[int, str]]:
    """task id -> (node, outcome) of every resolution the server has not delivered yet."""
    found = {}
    for node, led in proto["clients"].items():
        for r in led["outbox"]:
            if isinstance(r, dict) and "task_id" in r:
                found[int(r["task_id"])] = (int(node), str(r.get("outcome")))
    return found


# ---- one client state -------------------------------------------------------------------------------------------
def _state_path(arg: str | Path, run_key: int = 0) -> Path:
    """A client state file; for a state dir, run ``run_key``'s session in it: its set-aside file while another
    run's session is the current one (``fedcomp.flower.statedir``), else ``client-state.pt``."""
    p = Path(arg).expanduser()
    if p.is_dir():
        aside = p / f"client-state.run-{run_key:x}.pt"
        p = aside if run_key and aside.is_file() else p / STATE_FILE
    if not p.is_file():
        raise CheckInputError(f"{arg}: no {STATE_FILE} there (pass a client's --state-dir)")
    return p


def _spec_candidates(pipe: Mapping[str, Any], server_spec: ModelSpec | None) -> list[ModelSpec]:
    """Specs to decode a client's pending blobs with: the server's model, else the order the state keeps."""
    specs = [server_spec] if server_spec is not None else []
    totals = pipe.get("totals")
    sums = _sums(totals) if isinstance(totals, dict) else None
    if sums:
        specs.append(ModelSpec.from_tensors(sums))
    return specs


def _sums(totals: Mapping[str, Any]) -> dict[str, torch.Tensor] | None:
    """The tensors a totals state keeps per name (for their names and shapes): ``outstanding`` or ``computed``;
    ``None`` unless that is a dict of tensors."""
    sums = totals.get("outstanding", totals.get("computed"))
    if isinstance(sums, dict) and all(isinstance(t, torch.Tensor) for t in sums.values()):
        return sums
    return None


def _decode_pending(pending: Any, specs: list[ModelSpec], path: Path) -> tuple[ModelSpec | None, dict[int, Update]]:
    """The state's pending updates, read by ``Pipeline.load_state_dict`` (whatever form the pipeline saves them
    in); encoded blobs are decoded against the first spec that fits."""
    if not pending:
        return (specs[0] if specs else None), {}
    last: Exception | None = None
    for spec in specs:
        reader = Pipeline(spec, COMPRESSORS.build("identity"), MEMORIES.build("none"))
        try:
            reader.load_state_dict({"compressor": {}, "memory": {}, "next_seq": 1, "pending": pending, "totals": None})
            held: dict[int, Any] = dict(reader.pending)
            return spec, {
                int(seq): decode(bytes(u), spec) if isinstance(u, (bytes, bytearray)) else u for seq, u in held.items()
            }
        except WireError as exc:
            last = exc
        except (KeyError, TypeError, ValueError, AttributeError, RuntimeError) as exc:
            raise CheckInputError(f"{path}: a pending update is malformed ({first_line(exc)})") from None
    why = first_line(last) if last else "no model spec: no server checkpoint and no totals in the state"
    raise CheckInputError(f"{path}: a pending update cannot be decoded ({why})")


def _residuals(state: Mapping[str, Any], path: Path) -> Any:
    """The state's error-feedback memory, loaded by its registered name (``None`` if the state does not say)."""
    flat = state.get("compression")
    if not isinstance(flat, dict):
        return None
    try:
        name = str(flat.get("memory") or "") or COMPRESSORS.get(str(flat["compressor"]).split("+")[0]).default_memory
        memory = MEMORIES.build(name)
        memory.load_state_dict(state["pipeline"]["memory"])
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise CheckInputError(f"{path}: its error-feedback memory cannot be read ({first_line(exc)})") from None
    return memory


def _totals_ok(totals: Any) -> bool:
    """A totals state of either layout: integer counts and a dict of tensors."""
    counts = isinstance(totals, dict) and all(isinstance(totals.get(k), int) for k in TOTALS_KEYS)
    return counts and _sums(totals) is not None


def _outstanding(totals: Mapping[str, Any], path: Path) -> dict[str, torch.Tensor]:
    """The state's ``outstanding`` sums (``fedcomp.client.totals.outstanding_of``), or ``CheckInputError``."""
    try:
        return outstanding_of(totals)
    except (KeyError, TypeError, ValueError, AttributeError, RuntimeError) as exc:
        raise CheckInputError(f"{path}: its running totals are malformed ({first_line(exc)})") from None


def _conservation(
    outstanding: Mapping[str, torch.Tensor],
    memory: Any,
    spec: ModelSpec,
    pending: Mapping[int, Any],
    sent: int,
    cfg: CheckConfig,
    path: Path,
) -> Conservation:
    worst, worst_tol, worst_name, ok = 0.0, 0.0, "", True
    norms = dict.fromkeys(("outstanding", "residual", "pending"), 0.0)
    for name, shape in spec.entries:
        zero = torch.zeros(shape, dtype=torch.float64)
        try:
            held = [u.tensors[name].to_dense().double() for u in pending.values()]
            parts = {"outstanding": outstanding.get(name, zero), "residual": _residual(memory, name, zero)}
            bad = [t.shape for t in [*parts.values(), *held] if t.shape != zero.shape]
        except (KeyError, RuntimeError, ValueError) as exc:
            raise CheckInputError(f"{path}: its parts disagree on tensor {name!r} ({first_line(exc)})") from None
        if bad:
            raise CheckInputError(f"{path}: its parts disagree on tensor {name!r} (shape {tuple(bad[0])}, not {shape})")
        parts["pending"] = sum(held, zero)
        for k, t in parts.items():
            norms[k] += float(t.square().sum())
        gap = parts["outstanding"] - parts["residual"] - parts["pending"]
        scale = max(float(t.abs().max()) if t.numel() else 0.0 for t in parts.values())
        tol = cfg.rtol * (sent + 1)
        rel = float(gap.abs().max()) / scale if scale > 0 and gap.numel() else 0.0
        if not math.isfinite(rel) or rel > tol:
            ok = False
        if not math.isfinite(rel) or rel >= worst:
            worst, worst_tol, worst_name = rel, tol, name
    return Conservation(
        worst, worst_tol, worst_name, ok, *(math.sqrt(norms[k]) for k in ("outstanding", "residual", "pending"))
    )


def _residual(memory: Any, name: str, zero: torch.Tensor) -> torch.Tensor:
    try:
        return memory.residual(name).detach().to("cpu", torch.float64)
    except KeyError:  # nothing computed for this tensor yet
        return zero


def check_client(
    arg: str | Path,
    *,
    server_spec: ModelSpec | None = None,
    outbox: Mapping[int, tuple[int, str]] | None = None,
    ledgers: Sequence[LedgerRow] = (),
    checkpoint_final: bool | None = None,
    resumable: bool = False,
    config: CheckConfig = CheckConfig(),
    run_key: int = 0,
) -> ClientCheck:
    """Account for one client state (see the module docstring); ``outbox``/``ledgers`` come from the server's
    checkpoint (``checkpoint_final`` False: the run went on after it; True: it is the run's last state).
    ``resumable``: the run did not finish and the checkpoint is where a ``--resume`` continues, so every client
    is resynced (its pending updates without a waiting resolution are nacked); ``run_key``: the checkpoint's run."""
    path = _state_path(arg, run_key)
    state = _read_state(path)
    try:
        pipe = state["pipeline"]
        incarnation = int(state["incarnation"])
        next_seq = int(pipe["next_seq"])
        seqs = sorted(int(s) for s in dict(pipe["pending"]))
        task_seqs = {int(t): int(s) for t, s in dict(state.get("task_seqs") or {}).items()}
    except (KeyError, TypeError, ValueError, AttributeError, OverflowError) as exc:
        raise CheckInputError(f"{path}: not a fedcomp client state ({first_line(exc)})") from None
    spec, pending = _decode_pending(pipe["pending"], _spec_candidates(pipe, server_spec), path)
    totals = pipe.get("totals")
    if totals is not None and not _totals_ok(totals):
        raise CheckInputError(f"{path}: its running totals are malformed")
    sent = next_seq - 1
    acked = None if totals is None else int(totals["acked"])
    nacked = None if totals is None else int(totals["nacked"])
    memory = _residuals(state, path) if totals is not None else None
    sums = _sums(totals) if totals is not None else None
    if spec is None and sums:
        spec = ModelSpec.from_tensors(sums)
    conservation = None
    if totals is not None and memory is not None and spec is not None:
        conservation = _conservation(_outstanding(totals, path), memory, spec, pending, sent, config, path)
    seq_task = {s: t for t, s in task_seqs.items()}
    nodes = sorted({r.node for r in ledgers if incarnation and r.incarnation == incarnation})
    fates = None
    if outbox is not None:
        fates = dict.fromkeys((ACK_WAITING, NACK_WAITING, RESYNC, AFTER_CHECKPOINT, STRANDED), 0)
        for seq in seqs:
            res = outbox.get(seq_task.get(seq, -1))
            if res is not None:
                nodes = sorted({*nodes, res[0]})
        resync = resumable or any(r.resync for r in ledgers if r.node in nodes)
        for seq in seqs:
            res = outbox.get(seq_task.get(seq, -1))
            if res is not None:
                fates[ACK_WAITING if res[1] == "applied" else NACK_WAITING] += 1
            elif resync:
                fates[RESYNC] += 1
            elif checkpoint_final:
                fates[STRANDED] += 1
            else:
                fates[AFTER_CHECKPOINT] += 1
    return ClientCheck(str(arg), incarnation, nodes, sent, acked, nacked, len(seqs), fates, conservation)


# ---- the whole run ----------------------------------------------------------------------------------------------
def check(
    out: str | Path, client_states: Iterable[str | Path] = (), config: CheckConfig = CheckConfig()
) -> CheckReport:
    """Read ``out`` (a deployment's ``--out`` or a simulation's output folder) and the client states; see the
    module docstring. Raises ``CheckInputError`` (one line) on a missing folder or an unreadable file."""
    folder = Path(out).expanduser()
    if not folder.is_dir():
        raise CheckInputError(f"{out}: {'a file, not a folder' if folder.exists() else 'no such folder'}")
    notes: list[str] = []
    summary = _json(folder / "summary.json") if (folder / "summary.json").exists() else None
    simulation = isinstance(summary, dict) and "methods" in summary
    runs = _runs(folder, summary, notes)
    ckpt_path = folder / "checkpoint.pt"
    proto = _protocol_state(ckpt_path) if ckpt_path.exists() else None
    if not runs and proto is None:
        raise _no_outputs(out, folder)
    ledgers: list[LedgerRow] = []
    outbox = None
    server_spec = None
    final = None
    version = None
    if proto is not None:
        version = proto["version"]
        ledgers = _ledgers(proto, ckpt_path)
        outbox = _outbox(proto)
        params = proto.get("params")
        if isinstance(params, dict) and params:
            server_spec = ModelSpec.from_tensors(params)
        if summary is None:  # a crashed run: the checkpoint is where a --resume continues (every client resyncs)
            final = runs[0].versions == version if runs else True
            if not runs:
                runs = [_counts_from_totals("run", "checkpoint.pt", proto.get("totals") or {}, ckpt_path)]
                runs[0].versions = version
                runs[0].stopped = "no summary.json or metrics.jsonl: counters as of the checkpoint"
        else:
            final = runs[0].versions == version
    clients = [
        check_client(
            c,
            server_spec=server_spec,
            outbox=outbox,
            ledgers=ledgers,
            checkpoint_final=final,
            resumable=proto is not None and summary is None,
            config=config,
            run_key=int(proto.get("run_key", 0) or 0) if proto is not None else 0,
        )
        for c in client_states
    ]
    if final and proto is not None:
        for c in clients:
            if c.nodes:
                c.server_applied = sum(led.applied for led in ledgers if led.node in c.nodes)
    problems = [*_run_problems(runs), *_problems(clients)]
    _explain(runs, clients, proto is not None, notes, simulation)
    return CheckReport(str(out), "simulation" if simulation else "deployment", runs, version, final, ledgers, clients,
                       problems, notes)


def _protocol_state(ckpt_path: Path) -> dict[str, Any]:
    """The server protocol's state in a checkpoint; ``CheckInputError`` if the file is not a fedcomp checkpoint."""
    ckpt = _torch_load(ckpt_path, "checkpoint")
    proto = ckpt.get("protocol") if isinstance(ckpt, dict) else None
    if not isinstance(proto, dict) or not isinstance(proto.get("version"), int):
        raise CheckInputError(f"{ckpt_path}: not a fedcomp checkpoint (no protocol state)")
    params, totals = proto.get("params", {}), proto.get("totals", {})
    if not isinstance(params, dict) or not all(isinstance(t, torch.Tensor) for t in params.values()):
        raise CheckInputError(f"{ckpt_path}: malformed checkpoint (its params are not a dict of tensors)")
    if not isinstance(totals, dict):
        raise CheckInputError(f"{ckpt_path}: malformed checkpoint (its totals are a {type(totals).__name__})")
    return proto


def _no_outputs(out: str | Path, folder: Path) -> CheckInputError:
    """The error for a folder without a run's outputs, naming a simulation stopped before its summary."""
    rows = sorted(p.name for p in folder.glob("*.jsonl"))
    if rows:  # a fedcomp sim stopped before its summary: its clients lived in its memory, nothing kept to check
        return CheckInputError(f"{out}: {', '.join(rows)} but no summary.json: a simulation that did not finish "
                               "(its clients' states lived in its memory); run it again")
    return CheckInputError(f"{out}: no run outputs there (summary.json, metrics.jsonl or checkpoint.pt)")


def _run_problems(runs: Sequence[ServerCounts]) -> list[str]:
    """Counts that cannot add up: more outcomes (applied and nacked) than tasks; a simulation's rows that are
    another run's."""
    return [*(f"{r.name}: {-r.open_at_end} more outcome(s) (applied + nacked) than tasks: the counts do not add up"
              for r in runs if r.open_at_end is not None and r.open_at_end < 0),
            *(f"{r.name}: {r.foreign_rows}" for r in runs if r.foreign_rows)]


def _problems(clients: Sequence[ClientCheck]) -> list[str]:
    problems = []
    for c in clients:
        if c.unaccounted:
            problems.append(f"{c.path}: {c.unaccounted} update(s) sent but neither acked, nacked nor pending")
        if c.conservation is not None and not c.conservation.conserved:
            cons = c.conservation
            problems.append(
                f"{c.path}: gradient mass NOT conserved (tensor {cons.worst_tensor}: gap {cons.max_gap:.3g} of its "
                f"magnitude > tolerance {cons.tolerance:.3g})"
            )
        known, server = c.known_applied, c.server_applied
        if known is not None and server is not None and known > server:
            problems.append(f"{c.path}: the client counts {known} update(s) applied, the server's ledger {server}: "
                            "mass the client let go of is not in the model")
        if c.stranded:
            problems.append(f"{c.path}: {c.stranded} pending update(s) stranded: the server's final checkpoint has "
                            "no ack or nack for them and will not resync this client")
    return problems


def _explain(
    runs: Sequence[ServerCounts], clients: Sequence[ClientCheck], have_ckpt: bool, notes: list[str], simulation: bool
) -> None:
    if clients and runs:
        dup = sum(r.duplicate or 0 for r in runs)
        notes.append(f"duplicates (ignored, never applied): {dup} in the run; per client the server does not record"
                     " them, nor the reason of each nack (only the run's counts by reason)")
    if not clients and not simulation:
        notes.append("no client state given (--client-state DIR): per-client accounting and conservation not checked")
    elif not have_ckpt:
        notes.append("no server checkpoint (checkpoint-every > 0 writes one): the fate of pending updates is not "
                     "recorded")
    if any(c.acked is None for c in clients):
        notes.append("a client state without running totals (saved by an older fedcomp or a memory without "
                     "residual): its acked/nacked counts and conservation are not recorded")
    for c in clients:
        known, server = c.known_applied, c.server_applied
        if known is not None and server is not None and known < server:
            notes.append(f"{c.path}: the server's ledger counts {server} update(s) applied for node(s) "
                         f"{', '.join(map(str, c.nodes))}, this state knows of {known} (an earlier client state on the "
                         "same node id counts there too)")
    for r in runs:
        if r.open_at_end is not None and r.open_at_end > 0:
            notes.append(f"{r.name}: {r.open_at_end} task(s) had no outcome when the run ended; their updates, if "
                         "computed, are pending on the clients")

"""The accuracy / bytes / time frontier that decides fedcomp's defaults.

Two parts (``--part app|sim|both``):

* **app**: the example app (examples/compressed-digits: the digits MLP, stock Flower ``FedAvg``) on the in-process
  federation of benchmarks/flowerkit.py (each message crosses a protobuf round trip; no Ray, no HTTP), as
  benchmarks/bench_flower_api.py runs it: plain FedAvg and ``Compressed(FedAvg(...), ...)`` variants. Per round:
  server-side accuracy, cumulative uplink **payload bytes** (the fedcomp blob; for plain FedAvg the reply's array
  data) and cumulative uplink **Flower object bytes** (every serialized Flower object of the replies). Reported:
  accuracy at rounds 5, 10, 20, the uplink ratio plain / variant in each figure (same figure on both sides), the
  worst accuracy gap to plain over rounds 5..N, and whether the goal holds (gap <= 1 point at every round from 5
  on, >= 20x fewer uplink Flower object bytes over the run).
* **sim**: the main job's clients and model (simulations/scenarios/main.toml: resnet-1m, 10 clients on
  WiFi/LTE/slow 4G/3G) with async methods built here from main.toml's tables: fedbuff, int8-async, DGC async
  at 1/3/10% with int8 values and the main job's delta downlink, lowrank async, and ``density=auto``. Per
  method, from its per-version rows: accuracy at versions 5, 10, 20 and the virtual time, cumulative uplink wire
  bytes and version at which the target accuracy (0.95) is first reached.

A row whose compressor or option does not exist in this tree (``lowrank``, ``density=auto``) prints
``not available: ...`` and is listed under ``missing`` in the JSON; any other failure makes the exit code 1.

    python benchmarks/frontier.py --part app [--rounds 20] [--nodes 4] [--explore] [--add "topk+int4 density=0.2"]
    python benchmarks/frontier.py --part sim [--sim-out results/frontier/sim] [--sim-versions N]
    python benchmarks/frontier.py --part both --json frontier.json --plot results/frontier [--quick]
"""

from __future__ import annotations

import argparse
import copy
import json
import logging
import math
import random
import sys
import time
import traceback
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
APP_DIR = ROOT / "examples" / "compressed-digits"
for _p in (str(ROOT), str(APP_DIR)):
    if _p not in sys.path:
        sys.path.insert(0, _p)

from fedcomp.tools.report import _fmt, table  # noqa: E402

#: Rounds (app) / versions (sim) at which accuracy is reported.
REPORT_AT = (5, 10, 20)
#: The goal for a default: accuracy within GOAL_GAP points of plain FedAvg at every round from GOAL_FROM on, with
#: at least GOAL_RATIO times fewer uplink Flower object bytes over the run.
GOAL_GAP, GOAL_FROM, GOAL_RATIO = 1.0, 5, 20.0
#: The figure the goal's byte ratio is judged on (the same figure on both sides).
GOAL_FIGURE = "flower"


# ---- variants ------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class AppVariant:
    """One row of the app part. ``compressor=None``: plain FedAvg (no mod, no wrapper). ``compressor=""``: the
    wrapper's defaults, ``Compressed(FedAvg(...))`` with no arguments. ``optional``: a row for a compressor or
    option others are adding; when this tree lacks it the row is "not available", not a failure."""

    name: str
    compressor: str | None
    options: Mapping[str, Any] = field(default_factory=dict)
    optional: bool = False

    @property
    def plain(self) -> bool:
        return self.compressor is None

    def strategy_args(self) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """``Compressed(fedavg, *args, **kwargs)``'s extra arguments."""
        return ((self.compressor,) if self.compressor else ()), dict(self.options)


def _dgc(d: float, **kw: Any) -> AppVariant:
    extra = "".join(f" {k}={v}" for k, v in kw.items())
    return AppVariant(f"dgc+int8 d={d:g}{extra}", "dgc+int8", {"density": d, **kw})


def _spec_variant(spec: str) -> AppVariant:
    """``"topk+int4 density=0.2 block=64"`` -> a variant of that compressor and options (``--add``)."""
    from fedcomp.task.config import parse_options

    comp, _, opts = spec.strip().partition(" ")
    if not comp:
        raise ValueError(f"--add expects 'COMPRESSOR [key=value ...]', got {spec!r}")
    return AppVariant(spec.strip(), comp, parse_options(opts, "--add"))


APP_VARIANTS: tuple[AppVariant, ...] = (
    AppVariant("plain FedAvg", None),
    AppVariant("int8", "int8"),
    *(_dgc(d) for d in (0.01, 0.03, 0.1, 0.3)),
    *(_dgc(d, warmup_epochs=4) for d in (0.01, 0.03, 0.1, 0.3)),
    *(AppVariant(f"{c} d={d:g}", c, {"density": d}) for c in ("topk+int4", "topk+int8") for d in (0.1, 0.3)),
    AppVariant("defaults", ""),
    AppVariant("lowrank rank=4", "lowrank", {"rank": 4}, optional=True),
)

#: ``--explore``: settings beyond the list, near the goal's edge.
EXPLORE_VARIANTS: tuple[AppVariant, ...] = (
    AppVariant("topk+int4 d=0.2", "topk+int4", {"density": 0.2}),
    AppVariant("topk+int4 d=0.15", "topk+int4", {"density": 0.15}),
    AppVariant("topk+int4 d=0.1 stochastic=False", "topk+int4", {"density": 0.1, "stochastic": False}),
    AppVariant("topk+int4 d=0.1 block=64", "topk+int4", {"density": 0.1, "block": 64}),
    _dgc(0.1, warmup_epochs=1),  # the first round at 25% (the nearest to a dense first round the options give)
    _dgc(0.1, warmup_epochs=2),
    _dgc(0.1, warmup_epochs=4, block=1024),
    AppVariant("dgc+int4 d=0.1 warmup_epochs=4", "dgc+int4", {"density": 0.1, "warmup_epochs": 4}),
    AppVariant("dgc+int4 d=0.1 warmup_epochs=2", "dgc+int4", {"density": 0.1, "warmup_epochs": 2}),
    AppVariant("dgc+int4 d=0.15", "dgc+int4", {"density": 0.15}),
    AppVariant("dgc+int4 d=0.1 warmup_epochs=4 stochastic=False", "dgc+int4",
               {"density": 0.1, "warmup_epochs": 4, "stochastic": False}),
    AppVariant("dgc+int4 d=0.1 warmup_epochs=6", "dgc+int4", {"density": 0.1, "warmup_epochs": 6}),
    AppVariant("dgc+int4 d=0.12 warmup_epochs=4", "dgc+int4", {"density": 0.12, "warmup_epochs": 4}),
    AppVariant("dgc+int4 d=0.15 warmup_epochs=4", "dgc+int4", {"density": 0.15, "warmup_epochs": 4}),
)

#: ``--quick``: fewer rounds and these rows (names of APP_VARIANTS).
QUICK_APP = ("plain FedAvg", "dgc+int8 d=0.1", "defaults", "lowrank rank=4")
QUICK_ROUNDS = 6


# ---- pure helpers (tests/test_frontier.py) ---------------------------------------------------------------------


def cumulative(values: Iterable[float]) -> list[float]:
    """Running sums: ``[1, 2, 3] -> [1, 3, 6]``."""
    out, total = [], 0.0
    for v in values:
        total += v
        out.append(total)
    return out


def value_at(rows: Sequence[Mapping[str, Any]], step: int, key: str = "round", field_: str = "accuracy") -> Any:
    """``field_`` of the row whose ``key`` equals ``step`` (None when there is none or it has no value)."""
    for r in rows:
        if r.get(key) == step:
            return r.get(field_)
    return None


def worst_gap(
    base: Sequence[Mapping[str, Any]], rows: Sequence[Mapping[str, Any]], first: int = GOAL_FROM, key: str = "round"
) -> tuple[float | None, int | None]:
    """The largest ``base - row`` accuracy difference, in points, over the steps ``>= first`` both have, and the
    step where it is (the first such step on ties). Positive: the row is worse than the base. ``(None, None)``
    when no step is shared."""
    base_acc = {r[key]: r["accuracy"] for r in base if r.get(key) is not None and r.get("accuracy") is not None}
    worst: tuple[float | None, int | None] = (None, None)
    for r in rows:
        step, acc = r.get(key), r.get("accuracy")
        if step is None or acc is None or step < first or step not in base_acc:
            continue
        gap = 100.0 * (base_acc[step] - acc)
        if worst[0] is None or gap > worst[0] + 1e-12:
            worst = (gap, step)
    return worst


def mean_gap(
    base: Sequence[Mapping[str, Any]], rows: Sequence[Mapping[str, Any]], first: int = GOAL_FROM, key: str = "round"
) -> float | None:
    """The mean ``base - row`` accuracy difference, in points, over the steps ``>= first`` both have (a systematic
    loss shows here; round-to-round noise of a small test set mostly cancels). None when no step is shared."""
    base_acc = {r[key]: r["accuracy"] for r in base if r.get(key) is not None and r.get("accuracy") is not None}
    gaps = [100.0 * (base_acc[r[key]] - r["accuracy"]) for r in rows
            if r.get(key) is not None and r.get("accuracy") is not None and r[key] >= first and r[key] in base_acc]
    return sum(gaps) / len(gaps) if gaps else None


def byte_ratio(base_bytes: float | None, bytes_: float | None) -> float | None:
    """``base / this`` (how many times fewer bytes than the base); None if either is missing or ``bytes_`` is 0."""
    if base_bytes is None or not bytes_:
        return None
    return base_bytes / bytes_


def app_summary(
    plain: Mapping[str, Any], row: Mapping[str, Any], at: Sequence[int] = REPORT_AT, first: int = GOAL_FROM
) -> dict[str, Any]:
    """One variant's line against plain FedAvg. ``row["rounds"]`` holds per-round dicts with ``round``,
    ``accuracy``, ``cum_payload_up`` and ``cum_flower_up``; the last one's totals are the run's."""
    rounds, base_rounds = row["rounds"], plain["rounds"]
    last, base_last = rounds[-1], base_rounds[-1]
    gap, gap_round = worst_gap(base_rounds, rounds, first)
    ratio_flower = byte_ratio(base_last["cum_flower_up"], last["cum_flower_up"])
    ratio_payload = byte_ratio(base_last["cum_payload_up"], last["cum_payload_up"])
    out: dict[str, Any] = {"variant": row["name"]}
    for k in at:
        out[f"acc@{k}"] = _pct(value_at(rounds, k))
    out |= {
        "payload_up": last["cum_payload_up"],
        "flower_up": last["cum_flower_up"],
        "x_payload": ratio_payload,
        "x_flower": ratio_flower,
        "worst_gap": gap,
        "worst_gap_round": gap_round,
        "mean_gap": mean_gap(base_rounds, rounds, first),
    }
    out["meets_goal"] = meets_goal(out)
    return out


def meets_goal(summary: Mapping[str, Any], max_gap: float = GOAL_GAP, min_ratio: float = GOAL_RATIO,
               figure: str = GOAL_FIGURE) -> bool:
    """Accuracy within ``max_gap`` points of plain at every round from round 5 on (``worst_gap``) and at least
    ``min_ratio`` times fewer uplink bytes in ``figure`` (``x_flower`` or ``x_payload``)."""
    gap, ratio = summary.get("worst_gap"), summary.get(f"x_{figure}")
    return gap is not None and ratio is not None and gap <= max_gap + 1e-9 and ratio >= min_ratio


def goal_miss(summary: Mapping[str, Any], max_gap: float = GOAL_GAP, min_ratio: float = GOAL_RATIO,
              figure: str = GOAL_FIGURE) -> tuple[float, float]:
    """By how much a row misses the goal: (accuracy points over ``max_gap``, factor short of ``min_ratio``), each
    0 / 1 when met. ``(inf, inf)`` for a row without figures."""
    gap, ratio = summary.get("worst_gap"), summary.get(f"x_{figure}")
    if gap is None or ratio is None:
        return math.inf, math.inf
    return max(gap - max_gap, 0.0), max(min_ratio / ratio, 1.0)


def best_row(summaries: Sequence[Mapping[str, Any]]) -> Mapping[str, Any] | None:
    """The row to recommend: among those that meet the goal, the most uplink Flower object bytes saved; else the
    one that misses the accuracy bound by least among those that meet the byte ratio, else the smallest miss."""
    rows = [s for s in summaries if s.get("worst_gap") is not None and s.get("x_flower") is not None]
    ok = [s for s in rows if s.get("meets_goal")]
    if ok:
        return max(ok, key=lambda s: s["x_flower"])
    if not rows:
        return None
    return min(rows, key=lambda s: (goal_miss(s)[1] > 1.0, goal_miss(s)[0], goal_miss(s)[1]))


def across_seeds(by_seed: Mapping[int, Sequence[Mapping[str, Any]]]) -> list[dict[str, Any]]:
    """Per variant, over the seeds it ran with: the worst gap of each seed and the largest, the smallest uplink
    ratio in Flower object bytes, and whether the goal holds on every seed (rows in first-seed order)."""
    names: list[str] = []
    for rows in by_seed.values():
        names += [r["variant"] for r in rows if r["variant"] not in names]
    out = []
    for name in names:
        got = {seed: next((r for r in rows if r["variant"] == name), None) for seed, rows in by_seed.items()}
        got = {seed: r for seed, r in got.items() if r is not None}
        gaps = [r["worst_gap"] for r in got.values() if r.get("worst_gap") is not None]
        means = [r["mean_gap"] for r in got.values() if r.get("mean_gap") is not None]
        ratios = [r["x_flower"] for r in got.values() if r.get("x_flower") is not None]
        row: dict[str, Any] = {"variant": name, "seeds": len(got)}
        row |= {f"gap@seed{seed}": r.get("worst_gap") for seed, r in got.items()}
        row |= {"max_gap": max(gaps) if gaps else None, "mean_gap": sum(means) / len(means) if means else None,
                "seeds_met": sum(bool(r.get("meets_goal")) for r in got.values()),
                "min_x_flower": min(ratios) if ratios else None,
                "meets_all": bool(got) and all(r.get("meets_goal") for r in got.values())}
        out.append(row)
    return out


def first_reach(rows: Sequence[Mapping[str, Any]], target: float) -> dict[str, Any] | None:
    """The first evaluated row with ``accuracy >= target`` (fraction): its version, virtual time and cumulative
    uplink wire bytes; None if never reached."""
    for r in rows:
        if r.get("accuracy") is not None and r["accuracy"] >= target - 1e-12:
            return {"version": r["version"], "time": r["time"], "wire_bytes_up": r.get("wire_bytes_up")}
    return None


def sim_summary(name: str, rows: Sequence[Mapping[str, Any]], target: float,
                at: Sequence[int] = REPORT_AT) -> dict[str, Any]:
    """One method's line from its per-version rows (``version``, ``time``, ``accuracy``, ``wire_bytes_up``)."""
    out: dict[str, Any] = {"method": name}
    for k in at:
        out[f"acc@{k}"] = _pct(value_at(rows, k, key="version"))
    hit = first_reach(rows, target)
    evaluated = [r for r in rows if r.get("accuracy") is not None]
    out |= {
        "versions_to_target": hit["version"] if hit else None,
        "time_to_target_s": hit["time"] if hit else None,
        "wire_up_to_target": hit["wire_bytes_up"] if hit else None,
        "accuracy": round(evaluated[-1]["accuracy"], 4) if evaluated else None,
        "versions": rows[-1]["version"] if rows else 0,
        "virtual_s": rows[-1]["time"] if rows else None,
        "wire_up_total": rows[-1].get("wire_bytes_up") if rows else None,
    }
    return out


def _pct(x: float | None) -> float | None:
    return None if x is None else round(100.0 * x, 2)


def format_table(rows: Sequence[Mapping[str, Any]], columns: Sequence[str]) -> str:
    """``fedcomp.tools.report.table`` with this benchmark's cells: None as ``-``, yes/no, floats to 2 decimals."""

    def cell(v: Any) -> str:
        if isinstance(v, bool):
            return "yes" if v else "no"
        if isinstance(v, float) and not math.isnan(v) and abs(v) < 1e5:
            return f"{v:.2f}"
        return "-" if v is None else _fmt(v)

    return table([{c: cell(r.get(c)) for c in columns} for r in rows], columns)


def progress(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# ---- part 1: the example app --------------------------------------------------------------------------------


class NotAvailable(Exception):
    """The row's compressor or option is not in this tree (yet)."""


def _round_grid(nodes: int, compressed: bool) -> Any:
    """A LocalGrid of the example app's ClientApp that also keeps each round's replies apart."""
    from digits_app import client_app
    from flwr.clientapp import ClientApp

    from benchmarks.flowerkit import LocalGrid

    class RoundGrid(LocalGrid):
        def __init__(self, *a: Any, **kw: Any) -> None:
            super().__init__(*a, **kw)
            self.by_round: list[list[Any]] = []

        def send_and_receive(self, messages: Iterable[Any], *, timeout: float | None = None) -> Iterable[Any]:
            messages, start = list(messages), len(self.replies)
            out = super().send_and_receive(messages, timeout=timeout)
            if any(m.metadata.message_type.split(".")[0] == "train" for m in messages):  # one call per round
                self.by_round.append(self.replies[start:])
            return out

    if compressed:
        app = client_app.app
    else:  # the plain app: ClientApp() with the same train function
        app = ClientApp()
        app.train()(client_app.train)
    return RoundGrid(
        {100 + i: (app, {"partition-id": i, "num-partitions": nodes}) for i in range(nodes)},
        {"local-epochs": 1, "lr": 0.1},
    )


def _reply_bytes(reply: Any, compressed: bool) -> tuple[int, int]:
    """(payload bytes, Flower object bytes) of one reply: the fedcomp blob, or the plain reply's array data."""
    from fedcomp.flower import records

    flower, _ = records.flower_size(reply)
    if reply.has_error():
        return 0, flower
    if compressed:
        blob, _ = records.read_mod_reply(reply.content)
        return len(blob), flower
    arrays = reply.content.array_records.get("arrays")
    return (sum(len(a.data) for a in arrays.values()) if arrays is not None else 0), flower


def make_strategy(variant: AppVariant, nodes: int) -> Any:
    """FedAvg as the example app builds it, wrapped by ``Compressed`` unless the row is plain. Raises
    ``NotAvailable`` for an optional row whose compressor or options this tree does not have."""
    from flwr.serverapp.strategy import FedAvg

    import fedcomp
    from fedcomp.flower import Compressed
    from fedcomp.registry import ConfigError

    fedavg = FedAvg(fraction_evaluate=0.0, min_train_nodes=nodes, min_available_nodes=nodes)
    if variant.plain:
        return fedavg
    args, kwargs = variant.strategy_args()
    if variant.optional and variant.compressor:
        missing = [p for p in variant.compressor.split("+") if p not in fedcomp.COMPRESSORS.names()]
        if missing:
            raise NotAvailable(f"compressor {'+'.join(missing)!r} is not registered in fedcomp.COMPRESSORS "
                               f"(have: {', '.join(sorted(fedcomp.COMPRESSORS.names()))})")
    try:
        return Compressed(fedavg, *args, **kwargs)
    except ConfigError as exc:
        if variant.optional:
            raise NotAvailable(f"ConfigError: {exc}") from None
        raise


def run_app_variant(variant: AppVariant, rounds: int, nodes: int, seed: int = 0) -> dict[str, Any]:
    """One variant, ``rounds`` rounds on ``nodes`` nodes: per-round accuracy and uplink bytes (see module doc)."""
    import torch
    from digits_app import server_app
    from digits_app.task import Net
    from flwr.app import ArrayRecord, ConfigRecord

    from benchmarks.flowerkit import server_identity

    t0 = time.perf_counter()
    strategy = make_strategy(variant, nodes)
    grid = _round_grid(nodes, not variant.plain)
    random.seed(seed)  # FedAvg samples the round's nodes with `random`: the order replies are summed in
    torch.manual_seed(seed)  # the initial model
    with server_identity():
        result = strategy.start(grid, ArrayRecord(Net().state_dict()), num_rounds=rounds,
                                train_config=ConfigRecord({"lr": 0.1}), evaluate_fn=server_app.central_evaluate)
    accs = result.evaluate_metrics_serverapp
    per_round = []
    cum_payload = cum_flower = 0
    for rnd, replies in enumerate(grid.by_round, start=1):
        sizes = [_reply_bytes(r, not variant.plain) for r in replies]
        payload, flower = sum(p for p, _ in sizes), sum(f for _, f in sizes)
        cum_payload, cum_flower = cum_payload + payload, cum_flower + flower
        acc = accs.get(rnd, {}).get("accuracy")
        per_round.append({"round": rnd, "accuracy": None if acc is None else float(acc), "replies": len(replies),
                          "payload_up": payload, "flower_up": flower,
                          "cum_payload_up": cum_payload, "cum_flower_up": cum_flower})
    row: dict[str, Any] = {
        "name": variant.name, "status": "ok", "compressor": variant.compressor, "options": dict(variant.options),
        "initial_accuracy": float(accs[0]["accuracy"]) if 0 in accs else None, "rounds": per_round,
        "wall_s": round(time.perf_counter() - t0, 2),
    }
    if not variant.plain:
        t = strategy.totals  # the wrapper's own count: a check on ours
        row["wrapper_totals"] = {"payload_bytes_up": t.payload_bytes_up, "flower_bytes_up": t.flower_bytes_up,
                                 "flower_bytes_down": t.flower_bytes_down, "messages_up": t.messages_up}
        row["counts_agree"] = t.payload_bytes_up == cum_payload and t.flower_bytes_up == cum_flower
        if not row["counts_agree"]:
            progress(f"  warning: {variant.name}: uplink bytes counted here (payload {cum_payload:,}, Flower objects "
                     f"{cum_flower:,}) differ from Compressed.totals ({t.payload_bytes_up:,}, {t.flower_bytes_up:,})")
    return row


def run_app(variants: Sequence[AppVariant], rounds: int, nodes: int, seed: int) -> dict[str, Any]:
    """Every variant in turn (plain first); returns ``{"rows", "missing", "failed", "summary", ...}``."""
    from flwr.common.logger import FLOWER_LOGGER

    FLOWER_LOGGER.setLevel(logging.ERROR)  # not FedAvg's 'fraction_evaluate is 0' warning per row
    rows: list[dict[str, Any]] = []
    missing: list[dict[str, str]] = []
    failed: list[dict[str, str]] = []
    plain: dict[str, Any] | None = None
    for i, v in enumerate(variants, start=1):
        tag = f"[app {i}/{len(variants)}] {v.name}"
        try:
            row = run_app_variant(v, rounds, nodes, seed)
        except NotAvailable as exc:
            progress(f"{tag}: not available: {exc}")
            missing.append({"name": v.name, "reason": str(exc)})
            continue
        except Exception as exc:  # noqa: BLE001 - one broken row must not take the others down
            progress(f"{tag}: FAILED: {type(exc).__name__}: {exc}")
            traceback.print_exc(file=sys.stderr)
            failed.append({"name": v.name, "error": f"{type(exc).__name__}: {exc}"})
            continue
        rows.append(row)
        if v.plain:
            plain = row
        last = row["rounds"][-1]
        line = (f"{tag}: acc {100 * (last['accuracy'] or 0):.2f} at round {last['round']}, "
                f"uplink {last['cum_payload_up']:,} payload B / {last['cum_flower_up']:,} Flower object B")
        if plain is not None and not v.plain:
            s = app_summary(plain, row)
            line += (f", {s['x_flower']:.1f}x fewer Flower object B, worst gap "
                     f"{s['worst_gap']:+.2f} pts (round {s['worst_gap_round']})")
        progress(f"{line}, {row['wall_s']:.1f} s")
    summary = [app_summary(plain, r) for r in rows] if plain is not None else []
    return {"rounds": rounds, "nodes": nodes, "seed": seed, "rows": rows, "summary": summary,
            "missing": missing, "failed": failed}


APP_COLUMNS = ["variant", *(f"acc@{k}" for k in REPORT_AT), "payload_up", "flower_up", "x_payload", "x_flower",
               "worst_gap", "worst_gap_round", "mean_gap", "meets_goal"]


def print_app(res: dict[str, Any], params: int) -> None:
    cols = [c for c in APP_COLUMNS if not c.startswith("acc@") or int(c[4:]) <= res["rounds"]]
    print(f"\n== app: examples/compressed-digits, {params:,} parameters, {res['nodes']} nodes, {res['rounds']} "
          f"rounds, FedAvg, seed {res['seed']} ==")
    print(f"acc@N: server-side accuracy (%) after round N; payload_up / flower_up: uplink bytes over the run "
          f"(payload: fedcomp blob, plain: array data; Flower object bytes: every serialized Flower object of the "
          f"replies); x_*: plain / variant in that same figure; worst_gap: max(plain - variant) in points over "
          f"rounds {GOAL_FROM}..{res['rounds']}, mean_gap: its mean; goal: worst_gap <= {GOAL_GAP:g} and "
          f"x_flower >= {GOAL_RATIO:g}")
    print(format_table(res["summary"], cols))
    for m in res["missing"]:
        print(f"{m['name']}: not available: {m['reason']}")
    for f in res["failed"]:
        print(f"{f['name']}: FAILED: {f['error']}")
    best = best_row([s for s in res["summary"] if s["variant"] != "plain FedAvg"])
    if best is not None:
        gap_miss, ratio_miss = goal_miss(best)
        verdict = "meets the goal" if best["meets_goal"] else (
            f"misses it by {gap_miss:.2f} points" + (f" and {ratio_miss:.2f}x in bytes" if ratio_miss > 1 else ""))
        print(f"best: {best['variant']}: worst gap {best['worst_gap']:+.2f} pts (round {best['worst_gap_round']}), "
              f"{best['x_flower']:.1f}x fewer uplink Flower object bytes: {verdict}")
    print("\nper-round accuracy (%):")
    by_name = {r["name"]: r for r in res["rows"]}
    header = ["variant", *(str(r) for r in range(1, res["rounds"] + 1))]
    lines = [{"variant": n, **{str(x["round"]): _pct(x["accuracy"]) for x in r["rounds"]}} for n, r in by_name.items()]
    print(format_table(lines, header))


# ---- part 2: the simulator ----------------------------------------------------------------------------------

#: Methods the scenario has whose compressor or option others are adding: "not available" when validation fails.
SIM_OPTIONAL = ("lowrank-async", "auto", "auto-async")
QUICK_SIM = ("fedbuff", "dgc-int8-10", "lowrank-async", "auto")
QUICK_VERSIONS = 8


def frontier_raw(main_toml: Path | None = None) -> dict[str, Any]:
    """The frontier scenario, built from main.toml's tables (same clients, data, model, seed, [run] and FedBuff /
    int8-async settings): fedbuff, int8-async, DGC async with int8 values at 1/3/10% and the DGC method's delta
    downlink, lowrank async (rank 4, same downlink), ``auto`` (``dgc+int8`` with ``density=auto``, same downlink)
    and the main job's ``auto-async`` (the same with the int8 downlink)."""
    from simulations.scenario import SCENARIO_DIR, tomllib

    raw = tomllib.loads((main_toml or SCENARIO_DIR / "main.toml").read_text())
    tables = raw["method"]
    dgc = dict(tables["dgc-async"])
    methods: dict[str, dict[str, Any]] = {"fedbuff": dict(tables["fedbuff"]), "int8-async": dict(tables["int8-async"])}
    for pct, d in ((1, 0.01), (3, 0.03), (10, 0.1)):
        methods[f"dgc-int8-{pct}"] = dgc | {"compressor": "dgc+int8", "compressor_options": f"density={d:g}"}
    methods["lowrank-async"] = dgc | {"compressor": "lowrank", "compressor_options": "rank=4"}
    methods["auto"] = dgc | {"compressor": "dgc+int8", "compressor_options": "density=auto"}
    methods["auto-async"] = dict(tables["auto-async"])  # the main job's row: density=auto with the int8 downlink
    raw = copy.deepcopy(raw)
    raw.update(name="frontier", method=methods, methods=list(methods), baseline="fedbuff", compare_to=[],
               description="the main job's clients and model, async methods (benchmarks/frontier.py)")
    raw.setdefault("sim", {})["progress"] = False
    return raw


def run_sim(names: Sequence[str] | None, out: Path, versions: int | None, workers: int) -> dict[str, Any]:
    """Validate each method on its own (a missing compressor or option makes only that row "not available"),
    run the others ``workers`` at a time, summarize their per-version rows."""
    from fedcomp.registry import ConfigError
    from simulations.runner import MethodResult
    from simulations.scenario import from_dict

    raw = frontier_raw()
    names = list(names or raw["methods"])
    if versions:
        for n in names:
            raw["method"][n]["num_versions"] = versions
    raw["sim"]["workers"] = workers
    missing, failed, ok = [], [], []
    for n in names:
        try:
            from_dict(raw | {"methods": [n], "baseline": n})
        except ConfigError as exc:
            if n in SIM_OPTIONAL:
                progress(f"[sim] {n}: not available: {exc}")
                missing.append({"name": n, "reason": str(exc)})
            else:
                progress(f"[sim] {n}: FAILED validation: {exc}")
                failed.append({"name": n, "error": f"ConfigError: {exc}"})
            continue
        ok.append(n)
    results: dict[str, MethodResult] = {}
    if ok:
        sc = from_dict(raw | {"methods": ok, "baseline": ok[0]})
        out.mkdir(parents=True, exist_ok=True)
        (out / "scenario.json").write_text(json.dumps(sc.raw, indent=1, default=str) + "\n")
        progress(f"[sim] running {', '.join(ok)} ({min(workers, len(ok))} at a time; results in {out})")
        for name, res, err in _run_methods(sc, ok, out, workers):
            if err is not None:
                progress(f"[sim] {name}: FAILED: {err}")
                failed.append({"name": name, "error": err})
                continue
            results[name] = res
            s = sim_summary(name, res.rows, sc.target_accuracy)
            progress(f"[sim] {name}: {s['versions']} versions, accuracy {s['accuracy']}, "
                     f"{100 * sc.target_accuracy:g}% at {s['time_to_target_s']} virtual s "
                     f"(version {s['versions_to_target']}), wall {res.summary.get('wall_s')} s")
    target = float(raw.get("target_accuracy", 0.95))
    summary = [sim_summary(n, results[n].rows, target) for n in ok if n in results]
    return {"target": target, "out": str(out), "summary": summary, "missing": missing, "failed": failed,
            "rows": {n: results[n].rows for n in ok if n in results},
            "method_summaries": {n: results[n].summary for n in ok if n in results},
            "methods": {n: raw["method"][n] for n in names}}


def _run_methods(sc: Any, names: Sequence[str], out: Path, workers: int) -> Iterable[tuple[str, Any, str | None]]:
    """(name, MethodResult or None, error or None) per method, as they finish; one failure stops no other."""
    from simulations.backends import BACKENDS, _run_one

    if workers <= 1 or len(names) == 1:
        backend = BACKENDS.build(sc.sim.engine)
        for n in names:
            progress(f"[sim] {n}: running")
            try:
                yield n, backend.run(sc, sc.method(n), out), None
            except Exception as exc:  # noqa: BLE001
                traceback.print_exc(file=sys.stderr)
                yield n, None, f"{type(exc).__name__}: {exc}"
        return
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor, as_completed

    ctx = multiprocessing.get_context("spawn")  # as simulations.backends.run_scenario: a fresh interpreter each
    with ProcessPoolExecutor(min(workers, len(names)), mp_context=ctx) as pool:
        futures = {pool.submit(_run_one, sc, n, out): n for n in names}
        for fut in as_completed(futures):
            n = futures[fut]
            try:
                yield n, fut.result(), None
            except Exception as exc:  # noqa: BLE001
                yield n, None, f"{type(exc).__name__}: {exc}"


SIM_COLUMNS = ["method", *(f"acc@{k}" for k in REPORT_AT), "versions_to_target", "time_to_target_s",
               "wire_up_to_target", "accuracy", "versions", "virtual_s", "wire_up_total"]


def print_sim(res: dict[str, Any]) -> None:
    print(f"\n== sim: main.toml's clients and model (resnet-1m, 10 clients on WiFi/LTE/slow 4G/3G), async methods, "
          f"target {100 * res['target']:g}% ==")
    print("acc@N: accuracy (%) at version N; *_to_target: first version reaching the target, its virtual time (s) "
          "and cumulative uplink wire bytes (all clients, idle polls included); wire_up_total: over the run")
    print(format_table(res["summary"], SIM_COLUMNS))
    for m in res["missing"]:
        print(f"{m['name']}: not available: {m['reason']}")
    for f in res["failed"]:
        print(f"{f['name']}: FAILED: {f['error']}")


# ---- plots --------------------------------------------------------------------------------------------------


def plot_app(res: dict[str, Any], out: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(17, 6))
    cmap, dashes = plt.get_cmap("tab20"), ("-", "--", ":", "-.")
    for i, row in enumerate(res["rows"]):
        rs = [r for r in row["rounds"] if r["accuracy"] is not None]
        style = {"color": "black", "linewidth": 2.5} if row["compressor"] is None else {
            "color": cmap(i % 20), "linestyle": dashes[(i // 10) % len(dashes)], "linewidth": 1.2}
        ax1.plot([r["cum_flower_up"] for r in rs], [100 * r["accuracy"] for r in rs], marker=".", label=row["name"],
                 **style)
        ax2.plot([r["round"] for r in rs], [100 * r["accuracy"] for r in rs], marker=".", label=row["name"], **style)
    ax1.set_xscale("log")
    ax1.set_xlabel("cumulative uplink Flower object bytes")
    ax2.set_xlabel("round")
    for ax in (ax1, ax2):
        ax.set_ylabel("server-side accuracy (%)")
        ax.grid(True, alpha=0.3)
        ax.set_ylim(bottom=max(0.0, min(ax.get_ylim()[0], 60.0)))
    ax2.xaxis.get_major_locator().set_params(integer=True)
    ax2.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.suptitle(f"example app (digits MLP, FedAvg, {res['nodes']} nodes): accuracy vs uplink bytes and rounds")
    fig.tight_layout()
    path = out / "frontier_app.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_sim(res: dict[str, Any], out: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(14, 5.5))
    for name, rows in res["rows"].items():
        rs = [r for r in rows if r.get("accuracy") is not None]
        ax1.plot([max(r["wire_bytes_up"], 1) for r in rs], [100 * r["accuracy"] for r in rs], label=name)
        ax2.plot([r["time"] for r in rs], [100 * r["accuracy"] for r in rs], label=name)
    ax1.set_xscale("log")
    ax1.set_xlabel("cumulative uplink wire bytes (all clients)")
    ax2.set_xlabel("virtual time (s)")
    for ax in (ax1, ax2):
        ax.set_ylabel("server-side accuracy (%)")
        ax.axhline(100 * res["target"], color="grey", linestyle=":", linewidth=1)
        ax.grid(True, alpha=0.3)
    ax2.legend(fontsize=8, loc="lower right")
    fig.suptitle("simulator (main job's clients, resnet-1m): accuracy vs uplink wire bytes and virtual time")
    fig.tight_layout()
    path = out / "frontier_sim.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


# ---- command line -------------------------------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 epilog="Exit code: 0 every row ran or is 'not available'; 1 a row failed; "
                                        "2 bad arguments.")
    ap.add_argument("--part", choices=("app", "sim", "both"), default="both", help="default: %(default)s")
    ap.add_argument("--json", type=Path, metavar="OUT", help="write every row and summary here")
    ap.add_argument("--plot", type=Path, metavar="DIR", help="write frontier_app.png / frontier_sim.png here")
    ap.add_argument("--quick", action="store_true",
                    help=f"a smaller run: app {QUICK_ROUNDS} rounds, rows {', '.join(QUICK_APP)}; sim "
                         f"{QUICK_VERSIONS} versions, methods {', '.join(QUICK_SIM)}")
    ap.add_argument("--rounds", type=int, default=None, help=f"app rounds (default: 20; --quick: {QUICK_ROUNDS})")
    ap.add_argument("--nodes", type=int, default=4, help="app nodes (default: %(default)s)")
    ap.add_argument("--seed", default="0", help="app: seeds `random` (FedAvg's node order, hence the order replies "
                    "are summed) and torch (the initial model); a comma-separated list runs every row per seed and "
                    "adds a table across seeds (default: %(default)s)")
    ap.add_argument("--only", action="append", default=[], metavar="NAME",
                    help="app: run only rows whose name contains NAME (repeatable; plain FedAvg always runs)")
    ap.add_argument("--explore", action="store_true", help="app: also run the exploration rows: "
                    + "; ".join(v.name for v in EXPLORE_VARIANTS))
    ap.add_argument("--add", action="append", default=[], metavar="SPEC",
                    help="app: one more row, 'COMPRESSOR key=value ...' (e.g. 'topk+int4 density=0.2'); repeatable")
    ap.add_argument("--methods", default=None, help="sim: comma-separated methods (default: all of the scenario)")
    ap.add_argument("--sim-versions", type=int, default=None, help="sim: num_versions for every method "
                    "(default: main.toml's: fedbuff / int8-async 50, DGC-based 80)")
    ap.add_argument("--sim-out", type=Path, default=ROOT / "results" / "frontier" / "sim",
                    help="sim: output folder of the per-version JSONL (default: %(default)s)")
    ap.add_argument("--workers", type=int, default=2, help="sim: methods at once (default: %(default)s)")
    ap.add_argument("--extra-only", action="store_true",
                    help="app: run only plain FedAvg and the --explore / --add rows, not the list")
    ap.add_argument("--threads", type=int, default=1, help="app: torch CPU threads (default: %(default)s; the MLP "
                    "gains nothing from more, and 2 threads on 2 busy cores ran 6x slower)")
    args = ap.parse_args(argv)
    if args.rounds is None:
        args.rounds = QUICK_ROUNDS if args.quick else 20
    try:
        args.seeds = [int(x) for x in str(args.seed).split(",") if x.strip()]
    except ValueError:
        ap.error(f"--seed expects integers, got {args.seed!r}")
    if not args.seeds:
        ap.error("--seed names no seed")
    if args.rounds < 1 or args.nodes < 1 or args.workers < 1 or args.threads < 1:
        ap.error("--rounds, --nodes, --workers and --threads must be >= 1")
    return args


def app_variants(args: argparse.Namespace) -> list[AppVariant]:
    variants = list(APP_VARIANTS[:1] if args.extra_only else APP_VARIANTS)
    if args.quick:
        variants = [v for v in variants if v.name in QUICK_APP]
    if args.explore:
        variants += EXPLORE_VARIANTS
    variants += [_spec_variant(s) for s in args.add]
    if args.only:
        variants = [v for v in variants if v.plain or any(o in v.name for o in args.only)]
    return variants


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    doc: dict[str, Any] = {"argv": list(sys.argv[1:] if argv is None else argv), "goal": {
        "max_gap_points": GOAL_GAP, "from_round": GOAL_FROM, "min_ratio": GOAL_RATIO,
        "ratio_figure": "uplink Flower object bytes over the run (plain / variant)"}}
    failed = False
    t0 = time.perf_counter()
    if args.part in ("app", "both"):
        import torch

        torch.set_num_threads(args.threads)
        try:
            variants = app_variants(args)
        except Exception as exc:  # noqa: BLE001 - a bad --add
            print(f"frontier: error: {exc}", file=sys.stderr)
            return 2
        from digits_app.task import Net

        by_seed = {}
        for seed in args.seeds:
            ta = time.perf_counter()
            app = run_app(variants, args.rounds, args.nodes, seed)
            app["wall_s"] = round(time.perf_counter() - ta, 1)
            app["parameters"] = sum(p.numel() for p in Net().parameters())
            print_app(app, app["parameters"])
            print(f"app wall {app['wall_s']:.1f} s (seed {seed})")
            by_seed[seed] = app
            failed |= bool(app["failed"]) or not any(r["compressor"] is None for r in app["rows"])
        doc["app"] = by_seed[args.seeds[0]]
        if len(args.seeds) > 1:
            doc["app_by_seed"] = {str(k): v for k, v in by_seed.items()}
            doc["app_across_seeds"] = across_seeds({k: v["summary"] for k, v in by_seed.items()})
            print(f"\n== app across seeds {', '.join(map(str, args.seeds))}: worst gap (points) per seed, "
                  f"the largest, the mean gap over rounds and seeds, on how many seeds the goal holds, the smallest "
                  f"uplink ratio in Flower object bytes, goal met on every seed ==")
            print(format_table(doc["app_across_seeds"], list(doc["app_across_seeds"][0])))
    if args.part in ("sim", "both"):
        ts = time.perf_counter()
        names = [n.strip() for n in args.methods.split(",") if n.strip()] if args.methods else (
            list(QUICK_SIM) if args.quick else None)
        versions = args.sim_versions or (QUICK_VERSIONS if args.quick else None)
        try:
            sim = run_sim(names, args.sim_out, versions, args.workers)
        except Exception as exc:  # noqa: BLE001
            traceback.print_exc(file=sys.stderr)
            sim = {"summary": [], "missing": [], "failed": [{"name": "*", "error": f"{type(exc).__name__}: {exc}"}],
                   "rows": {}, "target": 0.95}
        sim["wall_s"] = round(time.perf_counter() - ts, 1)
        print_sim(sim)
        print(f"sim wall {sim['wall_s']:.1f} s")
        doc["sim"] = sim
        failed |= bool(sim["failed"])
    doc["wall_s"] = round(time.perf_counter() - t0, 1)
    if args.plot:
        args.plot.mkdir(parents=True, exist_ok=True)
        files = []
        if doc.get("app", {}).get("rows"):
            files.append(plot_app(doc["app"], args.plot))
        if doc.get("sim", {}).get("rows"):
            files.append(plot_sim(doc["sim"], args.plot))
        print(f"plots: {', '.join(str(f) for f in files) or '(nothing to plot)'}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        missing = sorted({m["name"] for part in ("app", "sim") for m in doc.get(part, {}).get("missing", [])})
        doc["missing"] = missing
        args.json.write_text(json.dumps(doc, indent=1, default=str) + "\n")
        print(f"json: {args.json}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

"""Simulation plots (matplotlib Agg, PNG), each titled with the scenario's name: accuracy vs virtual time and vs
total wire bytes (up + down, idle polls included) with each method's target crossing marked, wire bytes up and
down per client, staleness histogram of applied updates.

Axes never clip a curve (the y range covers every evaluated accuracy); log axes carry plain tick labels
("2 s", "1 min", "10 MB") instead of powers of ten.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from pathlib import Path

from simulations.runner import MethodResult, time_to_target


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def fmt_seconds(v: float) -> str:
    """A label for virtual seconds: ``fmt_seconds(17.309) == "17.3 s"``, ``fmt_seconds(2000) == "2,000 s"``,
    ``fmt_seconds(36000) == "10 h"``."""
    if v >= 20_000:
        return f"{v / 3600:.3g} h"
    return f"{v:,.0f} s" if v >= 100 else f"{v:.3g} s"


def fmt_bytes(v: float) -> str:
    """A label for bytes, 3 significant digits: ``fmt_bytes(2e6) == "2 MB"``, ``fmt_bytes(1.5e9) == "1.5 GB"``."""
    for unit, size in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if v >= size:
            return f"{v / size:.3g} {unit}"
    return f"{v:.3g} B"


def _log_axis(axis, fmt: Callable[[float], str]) -> None:
    """Log scale with labels at 1, 2 and 5 of each decade, written by ``fmt``."""
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    axis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
    axis.set_major_formatter(FuncFormatter(lambda v, _pos: fmt(v) if v > 0 else ""))
    axis.set_minor_formatter(NullFormatter())


def _curve(rows: list[dict], x: str) -> tuple[list[float], list[float]]:
    pts = [(r[x], 100 * r["accuracy"]) for r in rows if r.get("accuracy") is not None and r.get(x) is not None]
    return [p[0] for p in pts], [p[1] for p in pts]


def _crossing(rows: list[dict], x: str, target: float) -> tuple[float, float] | None:
    """``(x, accuracy %)`` of the first evaluated row at or above ``target``; None if never reached."""
    t = time_to_target(rows, target)
    if t is None:
        return None
    for r in rows:
        if r.get("accuracy") is not None and r["time"] == t and r.get(x) is not None:
            return r[x], 100 * r["accuracy"]
    return None


def _accuracy(results: Sequence[MethodResult], out: Path, target: float, x: str, xlabel: str, name: str,
              title: str, fmt: Callable[[float], str]) -> Path:
    plt = _plt()
    fig, ax = plt.subplots(figsize=(8, 5))
    xs_all: list[float] = []
    ys_all: list[float] = []
    for i, r in enumerate(results):
        xs, ys = _curve(r.rows, x)
        initial = r.summary.get("initial_accuracy")
        at_start = initial is not None and time_to_target([], target, initial) == 0.0  # the table's 0 s
        line, = ax.plot(xs, ys, label=f"{r.method} (at the target from the start)" if at_start else r.method, lw=1.4)
        xs_all += xs
        ys_all += ys
        hit = None if at_start else _crossing(r.rows, x, target)
        if hit is not None:
            ax.plot([hit[0]], [hit[1]], "o", color=line.get_color(), ms=7, mfc="none", mew=1.8)
            ax.axvline(hit[0], color=line.get_color(), ls=":", lw=0.9)
            ax.annotate(fmt(hit[0]), hit, textcoords="offset points", xytext=(4, -14 - 11 * i), fontsize=8,
                        color=line.get_color())
    ax.axhline(100 * target, color="gray", ls="--", lw=0.8, label=f"target {100 * target:.1f}%")
    ax.set(xlabel=xlabel, ylabel="test accuracy (%)", title=title)
    positive = [v for v in xs_all if v > 0]
    if positive:
        ax.set_xscale("log")
        lo, hi = min(positive), max(positive)
        ax.set_xlim(lo / 1.3, hi * 1.3)
        _log_axis(ax.xaxis, fmt)
    if ys_all:  # every point visible: nothing below the lowest accuracy is cut off
        ys_all.append(100 * target)  # and the target line
        ax.set_ylim(max(0.0, math.floor(min(ys_all) - 2)), min(100.5, max(ys_all) + 2))
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    path = out / name
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_bytes_per_client(results: Sequence[MethodResult], out: Path, scenario: str = "") -> Path:
    """Wire bytes up and down per client (messages, the app bundle and idle polls), one bar per method."""
    plt = _plt()
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.6), sharex=True)
    n = len(results)
    width = 0.8 / max(n, 1)

    def wire(row: dict, d: str) -> float:
        return float(row.get(f"wire_bytes_{d}", 0))

    for i, r in enumerate(results):
        xs = [row["client"] + (i - (n - 1) / 2) * width for row in r.nodes]
        ax1.bar(xs, [wire(row, "up") for row in r.nodes], width, label=r.method)
        ax2.bar(xs, [wire(row, "down") for row in r.nodes], width, label=r.method)
    if results:
        ticks = [row["client"] for row in results[0].nodes]
        labels = [f"{row['client']}\n{row['link']}" for row in results[0].nodes]
        for ax in (ax1, ax2):
            ax.set_xticks(ticks, labels, fontsize=7)
    ax1.set(ylabel="wire bytes up", title="uplink (client -> server) per client")
    ax2.set(ylabel="wire bytes down", title="downlink (server -> client) per client")
    for ax, d in ((ax1, "up"), (ax2, "down")):
        if any(wire(row, d) > 0 for r in results for row in r.nodes):
            ax.set_yscale("log")
            _log_axis(ax.yaxis, fmt_bytes)
        ax.grid(alpha=0.3, axis="y", which="both")
    ax1.legend(fontsize=7)
    fig.suptitle(f"scenario {scenario}: wire bytes per client (messages, app bundle, idle polls)" if scenario
                 else "wire bytes per client")
    fig.tight_layout()
    path = out / "bytes_per_client.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_staleness(results: Sequence[MethodResult], out: Path, scenario: str = "") -> Path:
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7, 4))
    n = len(results)
    width = 0.8 / max(n, 1)
    for i, r in enumerate(results):
        total = sum(r.staleness_hist.values()) or 1
        ks = sorted(r.staleness_hist)
        ax.bar([k + (i - (n - 1) / 2) * width for k in ks], [r.staleness_hist[k] / total for k in ks], width,
               label=r.method)
    ax.set(xlabel="staleness tau = V - v of applied updates", ylabel="share of applied updates",
           title=f"scenario {scenario}: staleness of applied updates" if scenario else "staleness of applied updates")
    ax.grid(alpha=0.3, axis="y")
    ax.legend(fontsize=8)
    fig.tight_layout()
    path = out / "staleness.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_all(results: Sequence[MethodResult], out: Path, target: float, scenario: str = "") -> list[Path]:
    head = f"scenario {scenario}: " if scenario else ""
    return [
        _accuracy(results, out, target, "time", "virtual time (log)", "accuracy_vs_time.png",
                  f"{head}accuracy vs virtual time (o = target reached)", fmt_seconds),
        _accuracy(results, out, target, "wire_bytes_total", "wire bytes, up + down, all clients (log)",
                  "accuracy_vs_wire_bytes.png", f"{head}accuracy vs total wire bytes (o = target reached)",
                  fmt_bytes),
        plot_bytes_per_client(results, out, scenario),
        plot_staleness(results, out, scenario),
    ]

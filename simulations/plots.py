"""Simulation plots (matplotlib Agg, PNG): accuracy vs virtual time, accuracy vs uplink bytes, bytes per
client, staleness histogram of applied updates."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from simulations.runner import MethodResult


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _curve(rows: list[dict], x: str) -> tuple[list[float], list[float]]:
    pts = [(r[x], 100 * r["accuracy"]) for r in rows if r.get("accuracy") is not None]
    return [p[0] for p in pts], [p[1] for p in pts]


def _accuracy(results: Sequence[MethodResult], out: Path, target: float, x: str, xlabel: str, name: str,
              scale: float = 1.0) -> Path:
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for r in results:
        xs, ys = _curve(r.rows, x)
        ax.plot([v / scale for v in xs], ys, label=r.method, lw=1.2)
    ax.axhline(100 * target, color="gray", ls="--", lw=0.8, label=f"target {100 * target:.1f}%")
    ax.set(xlabel=xlabel, ylabel="test accuracy (%)")
    if any(v > 0 for r in results for v in _curve(r.rows, x)[0]):
        ax.set_xscale("log")
    ys_all = [y for r in results for y in _curve(r.rows, x)[1]]
    if ys_all:
        ax.set_ylim(max(0.0, min(100 * target - 15, max(ys_all) - 30)), 100)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path = out / name
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_bytes_per_client(results: Sequence[MethodResult], out: Path) -> Path:
    plt = _plt()
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2), sharex=True)
    n = len(results)
    width = 0.8 / max(n, 1)
    for i, r in enumerate(results):
        xs = [row["client"] + (i - (n - 1) / 2) * width for row in r.nodes]
        ax1.bar(xs, [row["bytes_up"] / 1e6 for row in r.nodes], width, label=r.method)
        ax2.bar(xs, [row["bytes_down"] / 1e6 for row in r.nodes], width, label=r.method)
    if results:
        ticks = [row["client"] for row in results[0].nodes]
        labels = [f"{row['client']}\n{row['link']}" for row in results[0].nodes]
        for ax in (ax1, ax2):
            ax.set_xticks(ticks, labels, fontsize=7, rotation=45)
    ax1.set(ylabel="uplink MB", title="uplink bytes per client")
    ax2.set(ylabel="downlink MB", title="downlink bytes per client")
    if any(row["bytes_up"] > 0 for r in results for row in r.nodes):
        ax1.set_yscale("log")
    if any(row["bytes_down"] > 0 for r in results for row in r.nodes):
        ax2.set_yscale("log")
    for ax in (ax1, ax2):
        ax.grid(alpha=0.3, axis="y")
    ax1.legend(fontsize=7)
    fig.tight_layout()
    path = out / "bytes_per_client.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_staleness(results: Sequence[MethodResult], out: Path) -> Path:
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7, 4))
    n = len(results)
    width = 0.8 / max(n, 1)
    for i, r in enumerate(results):
        total = sum(r.staleness_hist.values()) or 1
        ks = sorted(r.staleness_hist)
        ax.bar([k + (i - (n - 1) / 2) * width for k in ks], [r.staleness_hist[k] / total for k in ks], width,
               label=r.method)
    ax.set(xlabel="staleness tau = V - v of applied updates", ylabel="share of applied updates")
    ax.grid(alpha=0.3, axis="y")
    ax.legend(fontsize=8)
    fig.tight_layout()
    path = out / "staleness.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_all(results: Sequence[MethodResult], out: Path, target: float) -> list[Path]:
    return [
        _accuracy(results, out, target, "time", "virtual time (s)", "accuracy_vs_time.png"),
        _accuracy(results, out, target, "up_bytes", "uplink MB (all clients, Flower messages)",
                  "accuracy_vs_uplink.png", scale=1e6),
        plot_bytes_per_client(results, out),
        plot_staleness(results, out),
    ]

"""Plots for people who would rather look than read (matplotlib, Agg backend, PNG files)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path


def plot_dp(results: Sequence, out: Path) -> Path:
    """Test accuracy against epochs and against uplink bytes, one line per method."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    for r in results:
        h = r.history
        label = r.config["method"]
        ax1.plot([row["epoch"] for row in h], [row["accuracy"] for row in h], label=label)
        ax2.plot([row["uplink_bytes"] / 1e6 for row in h], [row["accuracy"] for row in h], label=label)
    ax1.set(xlabel="epoch", ylabel="test accuracy (%)", title="accuracy vs epochs")
    ax2.set(xlabel="uplink MB (all workers)", ylabel="test accuracy (%)", title="accuracy vs uplink bytes")
    ax2.set_xscale("log")
    for ax in (ax1, ax2):
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    path = out / "accuracy.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path

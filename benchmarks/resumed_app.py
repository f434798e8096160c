"""An app of a kind the tests do not have, stopped and resumed through fedcomp's two lines: a depthwise-separable
CNN (depthwise and pointwise convolutions, GroupNorm, a learnable temperature on the logits) with stock
``FedYogi``, ``compression_mod`` + ``Compressed(FedYogi, "dgc+int8", density="auto", mode="async", out_dir=...,
checkpoint_every=2)`` on the in-process federation of benchmarks/compatkit.py, 4 nodes. One run straight to
``--versions``; one stopped at half of them and resumed from its checkpoint (``resume=``) to the same version.

    python benchmarks/resumed_app.py [--versions 48] [--seed 0] [--out DIR]

Prints per run the final accuracy, the replies the server handled against the replies its wire figures count
(``summary.json``: ``replies``, ``wire.replies``), the wire bytes up per handled reply, ``fedcomp check``'s
verdict and the wall seconds. The wall time is this process only: local training of 4 nodes, compression,
decode and aggregation; no transport latency (no SuperLink, HTTP, polls or process starts). The wire figures are
the wire model's (docs/protocol.md, "Wire bytes"), counted from the run's Flower objects and task clock.
"""

from __future__ import annotations

import argparse
import json
import logging
import shutil
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
from flwr.common.logger import FLOWER_LOGGER  # noqa: E402
from torch import nn  # noqa: E402

from benchmarks import compatkit  # noqa: E402
from fedcomp.tools.check import check  # noqa: E402

OPTIONS = {"density": "auto", "mode": "async", "buffer_size": 2, "max_staleness": 4, "checkpoint_every": 2}


class SeparableNet(nn.Module):
    """Depthwise 3x3 then pointwise 1x1 convolutions twice, GroupNorm, global average pool, a linear head whose
    logits are divided by a learnable temperature (a scalar parameter)."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(
            nn.Conv2d(1, 1, 3, padding=1, groups=1), nn.Conv2d(1, 16, 1), nn.GroupNorm(4, 16), nn.ReLU(),
            nn.Conv2d(16, 16, 3, padding=1, groups=16), nn.Conv2d(16, 32, 1), nn.GroupNorm(4, 32), nn.ReLU(),
            nn.AdaptiveAvgPool2d(1), nn.Flatten())
        self.head = nn.Linear(32, 10)
        self.temperature = nn.Parameter(torch.ones(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x.reshape(-1, 1, 8, 8))) / self.temperature.clamp(min=0.1)


def report(name: str, out: Path, cell: compatkit.Cell, wall: float) -> None:
    summary = json.loads((out / "summary.json").read_text())
    acc = 100 * cell.accuracy[max(cell.accuracy)]
    verdict = check(out, []).verdict
    print(f"{name:9s} final {acc:.1f}%  replies {summary['replies']} handled, {summary['wire']['replies']} on the "
          f"wire; {summary['wire_bytes_up'] / summary['replies']:,.0f} wire B up per handled reply; check: "
          f"{verdict}; wall {wall:.1f} s")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--versions", type=int, default=48, help="the version both runs reach (even, >= 4)")
    ap.add_argument("--seed", type=int, default=0, help="the initial model's seed")
    ap.add_argument("--out", type=Path, default=None, help="keep the runs' folders here (default: a temp folder)")
    args = ap.parse_args()
    if args.versions < 4 or args.versions % 2:
        ap.error(f"--versions must be even and >= 4, got {args.versions}")
    FLOWER_LOGGER.setLevel(logging.ERROR)
    compatkit.FAMILIES["separable"] = compatkit.Family(SeparableNet, lr=0.3, seed=args.seed)
    root = args.out or Path(tempfile.mkdtemp(prefix="resumed-app-"))
    for name in ("straight", "resumed"):
        shutil.rmtree(root / name, ignore_errors=True)
    start = time.perf_counter()
    cell = compatkit.run_cell("separable", "FedYogi", args.versions, out_dir=str(root / "straight"), **OPTIONS)
    report("straight", root / "straight", cell, time.perf_counter() - start)
    start = time.perf_counter()
    compatkit.run_cell("separable", "FedYogi", args.versions // 2, out_dir=str(root / "resumed"), **OPTIONS)
    cell = compatkit.run_cell("separable", "FedYogi", args.versions, out_dir=str(root / "resumed"),
                              resume=str(root / "resumed" / "checkpoint.pt"), **OPTIONS)
    report("resumed", root / "resumed", cell, time.perf_counter() - start)
    if args.out is None:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()

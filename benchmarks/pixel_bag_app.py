"""An app of a kind the tests do not have, through fedcomp's two lines: a bag of pixel embeddings (each pixel of a
digit quantized to 17 levels is a token; ``nn.EmbeddingBag`` averages their embeddings, a linear head reads the
mean) with a stock strategy (``FedAvgM`` by default) on the in-process federation of benchmarks/compatkit.py, 4
nodes. Three runs per seed: plain sync rounds; async FedBuff (K = 2, S = 4) with whole fp32 updates
(``Compressed(..., "identity", mode="async")``: the uncompressed async baseline); the same with ``compression_mod``
+ ``Compressed(..., "dgc+int8", density=0.05, mode="async")``.

    python benchmarks/pixel_bag_app.py [--rounds 8] [--versions 32] [--strategy FedAvgM] [--seeds 0,1,2]

Prints accuracy per round or version, payload and Flower object bytes up per reply, the conservation error and
the wall seconds per run, then per run over the seeds: the mean final accuracy and the mean over the last quarter
of rounds or versions. The wall time is this process only: local training of 4 nodes, compression, decode and
aggregation; no transport latency (no SuperLink, no HTTP, no polls), so it is not a deployment figure.
"""

from __future__ import annotations

import argparse
import logging
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
from flwr.common.logger import FLOWER_LOGGER  # noqa: E402
from torch import nn  # noqa: E402

from benchmarks import compatkit  # noqa: E402

LEVELS = 17  # compatkit's digits are pixel / 16: 0, 1/16, ..., 1
ASYNC = {"mode": "async", "buffer_size": 2, "max_staleness": 4}


class PixelBag(nn.Module):
    """Token ``position * LEVELS + level`` per pixel; the mean of their embeddings; ReLU; a linear head."""

    def __init__(self) -> None:
        super().__init__()
        self.bag = nn.EmbeddingBag(64 * LEVELS, 32, mode="mean")
        self.head = nn.Sequential(nn.ReLU(), nn.Linear(32, 10))
        self.register_buffer("offsets", torch.arange(64) * LEVELS, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tokens = (x.reshape(-1, 64).clamp(0, 1) * (LEVELS - 1)).round().long() + self.offsets
        return self.head(self.bag(tokens))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=8, help="sync rounds of the plain run")
    ap.add_argument("--versions", type=int, default=32, help="model versions of the async runs")
    ap.add_argument("--strategy", default="FedAvgM", choices=sorted(compatkit.STRATEGIES), help="the stock strategy")
    ap.add_argument("--seeds", default="0", help="comma-separated seeds of the initial model (default: 0)")
    args = ap.parse_args()
    try:
        seeds = [int(s) for s in args.seeds.split(",")]
    except ValueError:
        ap.error(f"--seeds: not a comma-separated list of integers: {args.seeds!r}")
    FLOWER_LOGGER.setLevel(logging.ERROR)
    runs = {
        "plain sync": (args.rounds, {"compressed": False}),
        "fp32 async": (args.versions, {"compressor": "identity", **ASYNC}),
        "dgc+int8 async": (args.versions, {"density": 0.05, **ASYNC}),
    }
    finals: dict[str, list[float]] = {name: [] for name in runs}
    tails: dict[str, list[float]] = {name: [] for name in runs}
    for seed in seeds:
        compatkit.FAMILIES["bag"] = compatkit.Family(PixelBag, lr=0.5, seed=seed)
        print(f"== seed {seed}, {args.strategy}")
        for name, (rounds, kw) in runs.items():
            start = time.perf_counter()
            cell = compatkit.run_cell("bag", args.strategy, rounds, **kw)
            wall = time.perf_counter() - start
            acc = [100 * cell.accuracy[r] for r in sorted(cell.accuracy)]
            finals[name].append(acc[-1])
            tails[name].append(statistics.mean(acc[-max(1, len(acc) // 4):]))
            cons = "-" if cell.conservation is None else f"{cell.conservation:.1e}"
            print(f"{name:15s} acc: {' '.join(f'{a:.1f}' for a in acc)}")
            print(f"{'':15s} payload up {cell.payload_bytes / cell.replies:,.0f} B/reply, Flower objects up "
                  f"{cell.uplink_bytes / cell.replies:,.0f} B/reply; conservation {cons}; wall {wall:.1f} s")
    print(f"== over seeds {args.seeds}: mean final accuracy, mean over the last quarter of rounds or versions")
    for name in runs:
        final, tail = statistics.mean(finals[name]), statistics.mean(tails[name])
        print(f"{name:15s} final {final:.1f}%  last quarter {tail:.1f}%")


if __name__ == "__main__":
    main()

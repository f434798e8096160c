"""An app of a kind the tests do not have, through fedcomp's two lines: a GRU over the rows of each digit (a
recurrent model: GRU weights, a LayerNorm, a linear head) with FedProx, plain and with ``compression_mod`` +
``Compressed(FedProx, "dgc+int8", density=0.02)`` (and ``"sign"``), on the in-process federation of
benchmarks/flowerkit.py.

    python benchmarks/other_app.py [--rounds 10]

Prints accuracy per round, payload and Flower object bytes up, the conservation error and the wall seconds per
round. The wall time is this process only: local training of 4 nodes one after another, compression, decode and
aggregation, and the protobuf round trip of every message; no transport latency (no SuperLink, no HTTP, no
polls), so it is not a deployment figure.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
from flwr.common.logger import FLOWER_LOGGER  # noqa: E402
from torch import nn  # noqa: E402

from benchmarks import compatkit  # noqa: E402


class RowGRU(nn.Module):
    """A GRU reading the 8 rows of a digit, LayerNorm on its last state, a linear head."""

    def __init__(self) -> None:
        super().__init__()
        self.gru = nn.GRU(8, 48, batch_first=True)
        self.norm = nn.LayerNorm(48)
        self.head = nn.Linear(48, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out, _ = self.gru(x.view(-1, 8, 8))
        return self.head(self.norm(out[:, -1]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=10)
    args = ap.parse_args()
    FLOWER_LOGGER.setLevel(logging.ERROR)
    compatkit.FAMILIES["gru"] = compatkit.Family(RowGRU, lr=0.2)
    settings = {"plain": {"compressed": False}, "dgc+int8 2%": {"density": 0.02}, "sign": {"compressor": "sign"}}
    for name, kw in settings.items():
        start = time.perf_counter()
        cell = compatkit.run_cell("gru", "FedProx", args.rounds, **kw)
        wall = time.perf_counter() - start
        acc = " ".join(f"{100 * cell.accuracy[r]:.1f}" for r in sorted(cell.accuracy))
        cons = "-" if cell.conservation is None else f"{cell.conservation:.1e}"
        print(f"{name:12s} acc/round: {acc}")
        print(f"{'':12s} payload up {cell.payload_bytes / cell.replies:,.0f} B/reply, Flower objects up "
              f"{cell.uplink_bytes / cell.replies:,.0f} B/reply, conservation {cons}, "
              f"wall {wall / args.rounds:.2f} s/round (in-process compute only)")


if __name__ == "__main__":
    main()

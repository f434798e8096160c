"""An ordinary Flower app the tests do not have: a 1-D conv net (GroupNorm, GELU) over the 30 features of
scikit-learn's breast-cancer data (binary), stock FedTrimmedAvg, 4 nodes, 8 rounds, on Flower's own
``run_simulation`` (Ray, ``InMemoryGrid``), plain or with fedcomp's two lines at their defaults
(``ClientApp(mods=[compression_mod])``, ``Compressed(FedTrimmedAvg(...))``).

    python benchmarks/conv1d_app.py plain OUT.json
    python benchmarks/conv1d_app.py compressed OUT.json

Writes server-side accuracy per round (120 held-out rows), wall seconds per round (this process: Ray messaging,
the 4 nodes' local training, compression, decode, aggregation; no HTTP, no SuperNode polls) and, compressed, the
uplink payload and Flower object bytes per round (the ``fedcomp-*`` train metrics).
"""

from __future__ import annotations

import json
import sys
import time

import torch
from flwr.app import ArrayRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.serverapp import Grid, ServerApp
from flwr.serverapp.strategy import FedTrimmedAvg
from flwr.simulation import run_simulation
from sklearn.datasets import load_breast_cancer
from torch import nn

from fedcomp.flower import Compressed, compression_mod

ROUNDS, NODES = 8, 4
_x, _y = load_breast_cancer(return_X_y=True)
X = torch.tensor((_x - _x.mean(0)) / _x.std(0), dtype=torch.float32)
Y = torch.tensor(_y)
PERM = torch.randperm(len(Y), generator=torch.Generator().manual_seed(0))
TEST, TRAIN = PERM[:120], PERM[120:]


class ConvNet(nn.Module):
    """Two 1-D convolutions over the feature vector, GroupNorm, pooled, a two-layer head (11,106 parameters)."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(
            nn.Conv1d(1, 16, 5, padding=2), nn.GroupNorm(4, 16), nn.GELU(),
            nn.Conv1d(16, 32, 5, padding=2), nn.GELU(), nn.AdaptiveAvgPool1d(4), nn.Flatten(),
            nn.Linear(128, 64), nn.GELU(), nn.Linear(64, 2),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x.unsqueeze(1))


def accuracy(arrays: ArrayRecord) -> float:
    model = ConvNet()
    model.load_state_dict(arrays.to_torch_state_dict())
    with torch.no_grad():
        return float((model(X[TEST]).argmax(1) == Y[TEST]).float().mean())


def client_app(mods: list) -> ClientApp:
    app = ClientApp(mods=mods)

    @app.train()
    def train(msg: Message, context: Context) -> Message:
        model = ConvNet()
        model.load_state_dict(msg.content["arrays"].to_torch_state_dict())
        pid, n = int(context.node_config["partition-id"]), int(context.node_config["num-partitions"])
        idx = TRAIN[pid::n]
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        for _ in range(2):
            for b in range(0, len(idx), 32):
                j = idx[b : b + 32]
                opt.zero_grad()
                nn.functional.cross_entropy(model(X[j]), Y[j]).backward()
                opt.step()
        metrics = MetricRecord({"num-examples": len(idx)})
        return Message(RecordDict({"arrays": ArrayRecord(model.state_dict()), "metrics": metrics}), reply_to=msg)

    return app


def run(compressed: bool, out: str) -> None:
    app = ServerApp()

    @app.main()
    def main(grid: Grid, context: Context) -> None:
        plain = FedTrimmedAvg(beta=0.25, fraction_evaluate=0.0, min_train_nodes=NODES, min_available_nodes=NODES)
        strategy = Compressed(plain) if compressed else plain  # the second line: the defaults
        marks: list[float] = []

        def evaluate(server_round: int, arrays: ArrayRecord) -> MetricRecord:
            marks.append(time.perf_counter())
            return MetricRecord({"accuracy": accuracy(arrays)})

        torch.manual_seed(0)
        res = strategy.start(grid, ArrayRecord(ConvNet().state_dict()), num_rounds=ROUNDS, evaluate_fn=evaluate)
        tm = res.train_metrics_clientapp
        up = {k: [tm[r].get(f"fedcomp-{k}-bytes-up") for r in range(1, ROUNDS + 1)] for k in ("payload", "flower")}
        result = {
            "grid": type(grid).__name__,
            "accuracy": [round(res.evaluate_metrics_serverapp[r]["accuracy"], 4) for r in range(ROUNDS + 1)],
            "round_wall_s": [round(b - a, 2) for a, b in zip(marks, marks[1:], strict=False)],
            **({"payload_bytes_up": up["payload"], "flower_bytes_up": up["flower"]} if compressed else {}),
        }
        with open(out, "w") as f:
            json.dump(result, f)

    resources = {"client_resources": {"num_cpus": 1}, "init_args": {"num_cpus": 2}}
    run_simulation(app, client_app([compression_mod] if compressed else []), num_supernodes=NODES,
                   backend_config=resources)


if __name__ == "__main__":
    if len(sys.argv) != 3 or sys.argv[1] not in ("plain", "compressed"):
        sys.exit("usage: conv1d_app.py plain|compressed OUT.json")
    run(sys.argv[1] == "compressed", sys.argv[2])

"""The example app (examples/compressed-digits) plain vs with ``compression_mod`` + ``Compressed(FedAvg)``.

Runs every variant on the same in-process federation (benchmarks/flowerkit.py: each message crosses a protobuf round
trip, no Ray, no SuperLink) and prints final accuracy and, per reply and per task, the Flower object bytes
(every serialized Flower object of the message) and the objects per message; for the compressed variants also
the payload bytes (the fedcomp blob). Wire bytes (HTTP, polls) are not measured here.

    python benchmarks/bench_flower_api.py [--rounds 20] [--nodes 4] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "examples" / "compressed-digits")]

import torch  # noqa: E402
from digits_app import client_app, server_app  # noqa: E402
from digits_app.task import Net  # noqa: E402
from flwr.app import ArrayRecord, ConfigRecord  # noqa: E402
from flwr.clientapp import ClientApp  # noqa: E402
from flwr.serverapp.strategy import FedAvg  # noqa: E402

from benchmarks.flowerkit import LocalGrid, server_identity  # noqa: E402
from fedcomp.flower import Compressed, records  # noqa: E402

VARIANTS = {
    "plain FedAvg": None,
    "dgc+int8 1%": {"compressor": "dgc+int8", "density": 0.01},
    "dgc+int8 1%, int8 down": {"compressor": "dgc+int8", "density": 0.01, "downlink": "int8"},
    "dgc+int8 1%, delta down": {
        "compressor": "dgc+int8",
        "density": 0.01,
        "downlink": "delta",
        "downlink_options": "compressor=topk+int8 density=0.05",
    },
}


def plain_client() -> ClientApp:
    app = ClientApp()
    app.train()(client_app.train)
    return app


def run(options: dict | None, rounds: int, nodes: int) -> dict:
    app = client_app.app if options is not None else plain_client()
    grid = LocalGrid(
        {100 + i: (app, {"partition-id": i, "num-partitions": nodes}) for i in range(nodes)},
        {"local-epochs": 1, "lr": 0.1},
    )
    fedavg = FedAvg(fraction_evaluate=0.0, min_train_nodes=nodes, min_available_nodes=nodes)
    strategy = Compressed(fedavg, **options) if options is not None else fedavg
    torch.manual_seed(0)
    with server_identity():
        result = strategy.start(grid, ArrayRecord(Net().state_dict()), num_rounds=rounds,
                                train_config=ConfigRecord({"lr": 0.1}), evaluate_fn=server_app.central_evaluate)
    tasks = [records.flower_size(m) for m in grid.sent if m.metadata.message_type == "train"]
    replies = [records.flower_size(m) for m in grid.replies if not m.has_error()]
    row = {
        "accuracy": result.evaluate_metrics_serverapp[rounds]["accuracy"],
        "flower_bytes_up_per_reply": sum(b for b, _ in replies) / len(replies),
        "flower_objects_up_per_reply": sum(o for _, o in replies) / len(replies),
        "flower_bytes_down_per_task": sum(b for b, _ in tasks) / len(tasks),
        "flower_objects_down_per_task": sum(o for _, o in tasks) / len(tasks),
    }
    if options is not None:
        t = strategy.totals
        row["payload_bytes_up_per_reply"] = t.payload_bytes_up / max(t.messages_up, 1)
        row["payload_bytes_down_per_task"] = t.payload_bytes_down / max(t.messages_down, 1)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--nodes", type=int, default=4)
    ap.add_argument("--json", type=Path, help="also write the rows here")
    args = ap.parse_args()
    logging.getLogger("flwr").setLevel(logging.WARNING)
    rows = {name: run(opts, args.rounds, args.nodes) for name, opts in VARIANTS.items()}
    base = rows["plain FedAvg"]
    print(f"{args.nodes} nodes, {args.rounds} rounds, {sum(p.numel() for p in Net().parameters())} parameters")
    print(f"{'variant':>26} {'acc':>6} {'payload/reply':>13} {'flower B/reply':>14} {'x':>6} {'obj':>4}"
          f" {'payload/task':>12} {'flower B/task':>13} {'obj':>4}")
    for name, r in rows.items():
        ratio = base["flower_bytes_up_per_reply"] / r["flower_bytes_up_per_reply"]
        print(f"{name:>26} {100 * r['accuracy']:6.2f} {r.get('payload_bytes_up_per_reply', float('nan')):13.0f}"
              f" {r['flower_bytes_up_per_reply']:14.0f} {ratio:6.1f}"
              f" {r['flower_objects_up_per_reply']:4.0f} {r.get('payload_bytes_down_per_task', float('nan')):12.0f}"
              f" {r['flower_bytes_down_per_task']:13.0f} {r['flower_objects_down_per_task']:4.0f}")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()

"""The GRU app of ``benchmarks/other_app.py`` with stock ``FedAvgM``, through Flower's own simulation engine
(``flwr.simulation.run_simulation``: an ``InMemoryGrid``, whose ``send_and_receive`` is Flower's, so
``Compressed.start`` reads it through ``PromptGrid``): plain, plain on ``PromptGrid(grid)`` (its read counts) and
with ``compression_mod`` + ``Compressed(FedAvgM, "dgc+int8", density=0.02)``.

    python benchmarks/other_app_sim.py [--rounds 5] [--nodes 4]

Prints the server-side accuracy per round and the wall seconds of ``strategy.start``: local training of the
nodes in Flower's simulation engine (Ray actors), compression, decode, aggregation and the in-memory grid's
message passing and polling; not Ray's start-up, and no SuperLink, HTTP or SuperNode polls (not a deployment
figure).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]

from flwr.app import ConfigRecord, Context, MetricRecord  # noqa: E402
from flwr.serverapp import Grid, ServerApp  # noqa: E402
from flwr.serverapp.strategy import FedAvgM  # noqa: E402
from flwr.simulation import run_simulation  # noqa: E402
from other_app import RowGRU  # noqa: E402

from benchmarks import compatkit  # noqa: E402
from fedcomp.flower import Compressed, PromptGrid, compression_mod  # noqa: E402

FAMILY = compatkit.Family(RowGRU, lr=0.2)


def server_app(nodes: int, rounds: int, compressed: bool, prompt: bool, out: dict) -> ServerApp:
    app = ServerApp()

    @app.main()
    def main(grid: Grid, context: Context) -> None:
        base = FedAvgM(fraction_evaluate=0.0, min_train_nodes=nodes, min_available_nodes=nodes)
        strategy = Compressed(base, "dgc+int8", density=0.02) if compressed else base
        used = PromptGrid(grid) if prompt else grid
        start = time.perf_counter()
        result = strategy.start(
            grid=used, initial_arrays=FAMILY.record(FAMILY.build()), num_rounds=rounds,
            train_config=ConfigRecord({"lr": 0.05}),
            evaluate_fn=lambda rnd, arrays: MetricRecord({"accuracy": compatkit.accuracy(FAMILY, arrays)}),
        )
        out["wall_s"] = round(time.perf_counter() - start, 2)
        out["accuracy"] = [round(100 * float(m["accuracy"]), 1)
                           for r, m in sorted(result.evaluate_metrics_serverapp.items()) if r > 0]
        out["grid"] = type(grid).__name__
        out["reads"] = used.reader.stats.as_dict() if prompt else None

    return app


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--nodes", type=int, default=4)
    args = ap.parse_args()
    for name, compressed, prompt in (("plain", False, False), ("plain on PromptGrid", False, True),
                                     ("dgc+int8 2%", True, False)):
        out: dict = {}
        client = compatkit.client_app(FAMILY, [compression_mod] if compressed else [])
        run_simulation(server_app=server_app(args.nodes, args.rounds, compressed, prompt, out), client_app=client,
                       num_supernodes=args.nodes, backend_config={"client_resources": {"num_cpus": 1}})
        print(f"{name:20s} {out}", flush=True)


if __name__ == "__main__":
    main()

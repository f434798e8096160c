"""An ordinary Flower app with one server line changed: sync FedAvg against ``Compressed(FedAvg(...),
mode="async")``, through Flower's own simulation engine (``flwr.simulation.run_simulation``, Ray).

The app: an MLP on scikit-learn's digits (1,500 training images split over 4 nodes, 297 held out), its own train
function (one epoch of SGD, momentum 0.9, batches of 32) and stock ``FedAvg``; node 0 sleeps ``--slow`` seconds
more per task (a phone among laptops). Three runs, side by side in one process:

* ``sync plain``: ``FedAvg(...).start(...)``, as a Flower user runs it;
* ``sync dgc+int8``: ``Compressed(FedAvg(...), "dgc+int8", density=D)`` (the client has ``compression_mod``);
* ``async dgc+int8``: the same line with ``mode="async", buffer_size=K, max_staleness=S`` (FedBuff).

    python benchmarks/async_app_sim.py [--rounds 20] [--versions 40] [--slow 2] [--targets 0.85 0.9] [--json out.json]

Each run first trains one untimed plain round, so that every node's Ray actor has started (on a loaded 2-core
machine the actors' start-up took 40-65 s, more than the training itself). Prints, per run: wall seconds of
``strategy.start`` (local training in Ray's actors, the slow node's sleep, compression, decode, aggregation, the
in-memory grid; no SuperLink, HTTP or SuperNode polls: not a deployment figure), wall seconds until the
server-side accuracy first reached each of ``--targets``, the final accuracy, and the uplink Flower object bytes
per train reply (every serialized Flower object of the reply; not payload bytes, not wire bytes).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Iterable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]

from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MetricRecord  # noqa: E402
from flwr.serverapp import Grid, ServerApp  # noqa: E402
from flwr.serverapp.strategy import FedAvg  # noqa: E402
from flwr.simulation import run_simulation  # noqa: E402
from ordinary_app import NODES, accuracy, client_app, model  # noqa: E402

from fedcomp.flower import Compressed, PromptGrid, compression_mod, records  # noqa: E402


class Metered(PromptGrid):
    """``PromptGrid`` that adds up the Flower object bytes of the train replies it returns (plain runs)."""

    def __init__(self, grid: Grid) -> None:
        super().__init__(grid)
        self.bytes = self.replies = 0

    def send_and_receive(self, messages: Iterable[Message], *, timeout: float | None = None) -> Iterable[Message]:
        got = list(self.grid.send_and_receive(messages, timeout=timeout))  # Flower's own loop, as plain FedAvg
        for reply in got:
            if not reply.has_error() and reply.metadata.message_type == "train":
                self.bytes += records.flower_size(reply)[0]
                self.replies += 1
        return got


def server_app(kind: str, args: argparse.Namespace, out: dict) -> ServerApp:
    app = ServerApp()

    @app.main()
    def main(grid: Grid, context: Context) -> None:
        base = FedAvg(fraction_evaluate=0.0, min_available_nodes=NODES, min_train_nodes=NODES)
        options = {"mode": "async", "buffer_size": args.buffer, "max_staleness": args.staleness}
        options = options if kind == "async" else {}
        strategy = base if kind == "plain" else Compressed(base, "dgc+int8", density=args.density, **options)
        used = Metered(grid) if kind == "plain" else grid
        curve: list[tuple[int, float, float]] = []
        warm = FedAvg(fraction_evaluate=0.0, min_available_nodes=NODES, min_train_nodes=NODES)
        warm.start(grid=PromptGrid(grid), initial_arrays=ArrayRecord(model().state_dict()), num_rounds=1,
                   train_config=ConfigRecord({"lr": args.lr}))  # untimed: every node's actor started, once
        start = time.perf_counter()

        def evaluate(rnd: int, arrays: ArrayRecord) -> MetricRecord:
            acc = accuracy(arrays)
            curve.append((rnd, round(time.perf_counter() - start, 2), round(100 * acc, 1)))
            return MetricRecord({"accuracy": acc})

        strategy.start(grid=used, initial_arrays=ArrayRecord(model().state_dict()),
                       num_rounds=args.versions if kind == "async" else args.rounds,
                       train_config=ConfigRecord({"lr": args.lr}), evaluate_fn=evaluate)
        out["wall_s"] = round(time.perf_counter() - start, 2)
        for target in args.targets:
            out[f"to_{round(100 * target)}_s"] = next((t for _, t, a in curve if a >= 100 * target), None)
        out["accuracy"] = round(curve[-1][2] / 100, 3)  # fraction, as every summary (fedcomp.tools.summary)
        out["best_accuracy"] = round(max(a for _, _, a in curve) / 100, 3)
        out["curve"] = curve
        if kind == "plain":
            out["flower_bytes_up_per_reply"] = round(used.bytes / max(used.replies, 1))
            out["replies"] = used.replies
        else:
            t = strategy.totals
            out["flower_bytes_up_per_reply"] = round(t.flower_bytes_up / max(t.messages_up, 1))
            out["payload_bytes_up_per_reply"] = round(t.payload_bytes_up / max(t.messages_up, 1))
            out["replies"] = t.messages_up
            out["applied"], out["stale"] = t.accepted, t.stale
            out["staleness_hist"] = dict(t.staleness_hist)
        if kind == "async":  # per node: updates applied, nacked, and its last task cycles (dispatch -> reply, s)
            loop = strategy.loop
            out["nodes"] = sorted(
                [led.applied, led.nacked, [round(c, 1) for c in loop.prefetch.cycles.get(node, [])]]
                for node, led in strategy.proto.book.clients.items()
            )

    return app


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=20, help="sync rounds")
    ap.add_argument("--versions", type=int, default=40, help="async model versions")
    ap.add_argument("--buffer", type=int, default=2, help="async K")
    ap.add_argument("--staleness", type=int, default=8, help="async max staleness S")
    ap.add_argument("--density", type=float, default=0.02)
    ap.add_argument("--slow", type=float, default=2.0, help="extra seconds per task on node 0")
    ap.add_argument("--targets", type=float, nargs="+", default=[0.85, 0.9])
    ap.add_argument("--lr", type=float, default=0.1, help="the clients' SGD learning rate")
    ap.add_argument("--runs", default="plain,sync,async")
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    rows = {}
    for kind in args.runs.split(","):
        out: dict = {}
        mods = [] if kind == "plain" else [compression_mod]
        run_simulation(server_app=server_app(kind, args, out), client_app=client_app(mods, args.slow),
                       num_supernodes=NODES,
                       backend_config={"client_resources": {"num_cpus": 1}, "init_args": {"num_cpus": NODES}})
        rows[kind] = out
        print(f"{kind:6s} " + json.dumps({k: v for k, v in out.items() if k != "curve"}), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()

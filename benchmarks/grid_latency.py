"""Server-side wait per exchange: Flower's ``send_and_receive`` loop (a pull, then ``time.sleep(3)``) vs ``PromptGrid``.

What is measured: the wall time of ``grid.send_and_receive(messages)`` (one exchange: a strategy round is two, train
and evaluate) on the in-process federation of benchmarks/flowerkit.py (each message and reply crosses a protobuf round
trip, replies are real Flower ``Message`` objects made by a ClientApp) where the reply of each node becomes
pullable a simulated delay after the push, drawn per node and exchange from U(``--delay-min``, ``--delay-max``)
with a fixed seed, the same draws for both grids. The two grids:

* ``flower``: that federation with ``send_and_receive`` = Flower 1.41's own ``HttpGrid.send_and_receive`` (the
  function itself, unchanged: push, pull, ``time.sleep(3)``, pull, ... until every reply is in), which is what a
  ServerApp in a deployment or ``flwr run`` gets;
* ``prompt``: ``PromptGrid`` around the same federation, pulling every ``--interval`` seconds, one
  ``pull_messages`` call per reply still missing (``ReplyReader``; *pulls* counts calls).

Exchanges alternate between the two grids, so a load change on the machine hits both. Reported per grid: the
exchange time (median, p90, mean, max) and the *wait*: the exchange time minus the time at which its last reply
became pullable (what the pull loop adds on top of the clients' own time). Not measured: HTTP, the SuperLink, a
real client's training; a pull here costs microseconds, where against a SuperLink it is one local HTTP request
(``--pull-cost`` adds a fixed cost per pull to see its effect).

    python benchmarks/grid_latency.py [--rounds 20] [--nodes 2] [--delay-min 0.2] [--delay-max 2.0]
                                      [--interval 0.1] [--seed 0] [--json OUT]
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from flwr.app import Message, MetricRecord, RecordDict  # noqa: E402
from flwr.superlink.grid.http_grid import HttpGrid  # noqa: E402

from benchmarks.flowerkit import LocalGrid, server_identity  # noqa: E402
from fedcomp.flower import PromptGrid  # noqa: E402
from fedcomp.tools.report import write_json  # noqa: E402


def echo(msg: Message, context) -> Message:
    """A ClientApp that answers at once: the delay is the grid's."""
    return Message(RecordDict({"metrics": MetricRecord({"num-examples": 1})}), reply_to=msg)


class DelayedGrid(LocalGrid):
    """The in-process federation, each reply pullable ``delays.pop(0)`` seconds after its push, with Flower's own
    HTTP ``send_and_receive``."""

    send_and_receive = HttpGrid.send_and_receive  # Flower 1.41's loop, unchanged

    def __init__(self, nodes: int, pull_cost: float) -> None:
        super().__init__({100 + i: (echo, {}) for i in range(nodes)})
        self.delays: list[float] = []
        self.ready_at: dict[str, float] = {}
        self.pull_cost = pull_cost
        self.pulls = 0

    def push_messages(self, messages):
        ids = list(super().push_messages(messages))
        now = time.perf_counter()
        for mid in ids:
            self.ready_at[mid] = now + self.delays.pop(0)
        return ids

    def pull_messages(self, message_ids):
        self.pulls += 1
        if self.pull_cost:
            time.sleep(self.pull_cost)
        now = time.perf_counter()
        return super().pull_messages([m for m in message_ids if self.ready_at[m] <= now])


def exchange(grid, inner: DelayedGrid, delays: list[float], nodes: int) -> dict[str, float]:
    """One ``send_and_receive`` of a message to every node; its time, wait after the last reply, pulls."""
    inner.delays = list(delays)
    messages = [Message(RecordDict(), dst_node_id=100 + i, message_type="train") for i in range(nodes)]
    pulls, start = inner.pulls, time.perf_counter()
    replies = list(grid.send_and_receive(messages, timeout=3600))
    end = time.perf_counter()
    if len(replies) != nodes or any(r.has_error() for r in replies):
        raise RuntimeError(f"expected {nodes} replies, got {len(replies)}")
    last = max(inner.ready_at[r.metadata.reply_to_message_id] for r in replies)
    return {"round_s": end - start, "wait_s": end - last, "pulls": inner.pulls - pulls}


def p90(values: Sequence[float]) -> float:
    return statistics.quantiles(values, n=10, method="inclusive")[-1] if len(values) > 1 else values[0]


def summary(rows: list[dict[str, float]]) -> dict[str, float]:
    rounds, waits = [r["round_s"] for r in rows], [r["wait_s"] for r in rows]
    return {
        "exchanges": len(rows),
        "round_median_s": statistics.median(rounds), "round_p90_s": p90(rounds),
        "round_mean_s": statistics.fmean(rounds), "round_max_s": max(rounds),
        "wait_median_s": statistics.median(waits), "wait_p90_s": p90(waits), "wait_mean_s": statistics.fmean(waits),
        "pulls_mean": statistics.fmean(r["pulls"] for r in rows),
    }


def measure(args: argparse.Namespace) -> dict:
    rng = random.Random(args.seed)
    draws = [[rng.uniform(args.delay_min, args.delay_max) for _ in range(args.nodes)] for _ in range(args.rounds)]
    flower, prompt_inner = DelayedGrid(args.nodes, args.pull_cost), DelayedGrid(args.nodes, args.pull_cost)
    grids = {"flower": (flower, flower), "prompt": (PromptGrid(prompt_inner, args.interval), prompt_inner)}
    rows: dict[str, list] = {name: [] for name in grids}
    with server_identity():
        for i, delays in enumerate(draws):
            for name in (("flower", "prompt") if i % 2 == 0 else ("prompt", "flower")):
                rows[name].append(exchange(*grids[name], delays, args.nodes))
            print(f"exchange {i + 1}/{args.rounds}: slowest node {max(delays):.2f} s, flower "
                  f"{rows['flower'][-1]['round_s']:.2f} s, prompt {rows['prompt'][-1]['round_s']:.2f} s",
                  file=sys.stderr, flush=True)
    config = {k: getattr(args, k) for k in ("rounds", "nodes", "delay_min", "delay_max", "interval", "seed",
                                             "pull_cost")}
    return {"config": config, "summary": {n: summary(r) for n, r in rows.items()}, "exchanges": rows,
            "slowest_delay_s": [max(d) for d in draws]}


def table(result: dict) -> str:
    cfg, s = result["config"], result["summary"]
    label = {"flower": "Flower 1.41 `HttpGrid.send_and_receive` (sleep 3 s)",
             "prompt": f"`PromptGrid` (pull every {cfg['interval']:g} s)"}
    slowest = result["slowest_delay_s"]
    lines = [
        f"{cfg['rounds']} exchanges x {cfg['nodes']} nodes, reply delays U({cfg['delay_min']:g}, {cfg['delay_max']:g})"
        f" s (seed {cfg['seed']}; slowest node per exchange: median {statistics.median(slowest):.2f} s, p90 "
        f"{p90(slowest):.2f} s), pull cost {cfg['pull_cost']:g} s",
        "",
        "| grid | exchange median s | p90 s | mean s | max s | wait after last reply: median s | p90 s | mean s "
        "| pulls / exchange |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name in ("flower", "prompt"):
        r = s[name]
        lines.append(f"| {label[name]} | {r['round_median_s']:.2f} | {r['round_p90_s']:.2f} | {r['round_mean_s']:.2f} "
                     f"| {r['round_max_s']:.2f} | {r['wait_median_s']:.3f} | {r['wait_p90_s']:.3f} "
                     f"| {r['wait_mean_s']:.3f} | {r['pulls_mean']:.1f} |")
    saved = s["flower"]["round_mean_s"] - s["prompt"]["round_mean_s"]
    lines += ["", f"saved per exchange (mean): {saved:.2f} s; per strategy round (train + evaluate): {2 * saved:.2f} s"]
    return "\n".join(lines)


def parse(argv: Sequence[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("--rounds", type=int, default=20, help="exchanges per grid (default: %(default)s)")
    ap.add_argument("--nodes", type=int, default=2, help="nodes answering each exchange (default: %(default)s)")
    ap.add_argument("--delay-min", type=float, default=0.2, help="seconds (default: %(default)s)")
    ap.add_argument("--delay-max", type=float, default=2.0, help="seconds (default: %(default)s)")
    ap.add_argument("--interval", type=float, default=0.1, help="PromptGrid's pull interval (default: %(default)s)")
    ap.add_argument("--pull-cost", type=float, default=0.0, help="seconds added to every pull (default: 0)")
    ap.add_argument("--seed", type=int, default=0, help="seeds the delays (default: %(default)s)")
    ap.add_argument("--json", type=Path, metavar="OUT", help="write the configuration, summary and every exchange")
    args = ap.parse_args(argv)
    if args.rounds < 1 or args.nodes < 1 or not 0 <= args.delay_min <= args.delay_max or args.pull_cost < 0:
        ap.error("need --rounds >= 1, --nodes >= 1, 0 <= --delay-min <= --delay-max, --pull-cost >= 0")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse(argv)
    result = measure(args)
    print(table(result))
    if args.json:
        write_json(args.json, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Reading replies when one upload is slow: Flower's one ``pull_messages`` call for every id vs ``ReplyReader``.

What runs: an in-process stand-in for Flower 1.41's deployment grid (``HttpGrid`` against a SuperLink), since a
slow upload cannot be made on loopback without throttling the link. Per exchange, ``--nodes`` replies; reply i
becomes visible to a pull at ``visible[i]`` seconds after the push (the SuperNode's ``PushMessages``) and its
objects are all uploaded at ``complete[i]``. A ``pull_messages(ids)`` call does what Flower's does: one request
(``--pull-cost`` seconds) hands out every visible reply among ``ids`` (the SuperLink forgets it), then the
replies are downloaded one after another, and a reply not complete yet makes the reader back off 1, 2, 4 ...
10 s (+-20 % jitter: ``flwr/supercore/inflatable/inflatable_utils.py``, ``pull_objects``) until it is.

One reply (the slow node) becomes visible at U(0.1, 0.3) s and uploads for ``--slow-upload`` seconds; the
others become visible at U(0.2, ``--fast-spread``) s and upload for ``--fast-upload`` seconds. Same draws for
both readers; they alternate per repeat. The readers:

* ``flower``: every ``--interval`` s one ``grid.pull_messages(missing ids)`` (what ``GridTransport`` and
  ``PromptGrid`` did before ``ReplyReader``);
* ``reader``: ``fedcomp.flower.grid.ReplyReader`` (one pull per id, background threads) every ``--interval`` s,
  woken early by a reply (as ``GridTransport.poll`` runs it).

Reported, median over repeats: when the fast replies reach the caller (seconds after the push, and seconds after
their upload was complete), when the slow one does, how many pulls backed off (fast / slow replies), the
requests per exchange. The stand-in's numbers are Flower's schedule, not a measured SuperLink.

    python benchmarks/grid_reads.py [--repeats 5] [--nodes 4] [--slow-upload 5] [--fast-upload 0.02]
                                    [--interval 0.25] [--seed 0] [--json OUT]
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from fedcomp.flower.grid import ReplyReader  # noqa: E402
from fedcomp.tools.report import write_json  # noqa: E402

BACKOFF_START, BACKOFF_CAP = 1.0, 10.0  # Flower 1.41's PULL_INITIAL_BACKOFF, PULL_BACKOFF_CAP


class FlowerLikeGrid:
    """Flower 1.41's ``HttpGrid.pull_messages`` against a SuperLink, on timetables: ``visible[id]`` and
    ``complete[id]`` are seconds after ``start``. ``backoffs[id]``: the backoff sleeps its download took."""

    def __init__(self, visible: dict[str, float], complete: dict[str, float], pull_cost: float, seed: int) -> None:
        self.visible, self.complete, self.pull_cost = visible, complete, pull_cost
        self.store = set(visible)
        self.backoffs = dict.fromkeys(visible, 0)
        self.requests = 0
        self.lock = threading.Lock()
        self.rng = random.Random(seed)
        self.start = time.perf_counter()

    def now(self) -> float:
        return time.perf_counter() - self.start

    def pull_messages(self, message_ids):
        time.sleep(self.pull_cost)
        with self.lock:
            self.requests += 1
            out = [m for m in message_ids if m in self.store and self.visible[m] <= self.now()]
            self.store.difference_update(out)
        for mid in out:  # downloaded one after another
            delay = BACKOFF_START
            while self.now() < self.complete[mid]:
                with self.lock:
                    self.backoffs[mid] += 1
                    jitter = self.rng.uniform(0.8, 1.2)
                time.sleep(delay * jitter)
                delay = min(2 * delay, BACKOFF_CAP)
        return [SimpleNamespace(metadata=SimpleNamespace(reply_to_message_id=m)) for m in out]


def flower_loop(grid: FlowerLikeGrid, interval: float) -> dict[str, float]:
    """One ``pull_messages`` for every missing id, every ``interval`` s; arrival time per id."""
    missing, arrived = set(grid.visible), {}
    while missing:
        for reply in grid.pull_messages(sorted(missing)):
            arrived[reply.metadata.reply_to_message_id] = grid.now()
            missing.discard(reply.metadata.reply_to_message_id)
        if missing:
            time.sleep(interval)
    return arrived


def reader_loop(grid: FlowerLikeGrid, interval: float) -> dict[str, float]:
    """``ReplyReader`` as ``GridTransport.poll`` drives it; arrival time per id."""
    reader, missing, arrived = ReplyReader(grid), set(grid.visible), {}
    while missing:
        for reply in reader.read(sorted(missing)):
            arrived[reply.metadata.reply_to_message_id] = grid.now()
            missing.discard(reply.metadata.reply_to_message_id)
        if missing:
            reader.wait(interval)
    return arrived


LOOPS: dict[str, Callable[[FlowerLikeGrid, float], dict[str, float]]] = {"flower": flower_loop, "reader": reader_loop}


def timetable(rng: random.Random, args: argparse.Namespace) -> tuple[dict[str, float], dict[str, float]]:
    visible = {"slow": rng.uniform(0.1, 0.3)} | {f"fast{i}": rng.uniform(0.2, args.fast_spread)
                                                 for i in range(args.nodes - 1)}
    complete = {m: v + (args.slow_upload if m == "slow" else args.fast_upload) for m, v in visible.items()}
    return visible, complete


def exchange(name: str, visible, complete, args: argparse.Namespace, seed: int) -> dict[str, float]:
    grid = FlowerLikeGrid(visible, complete, args.pull_cost, seed)
    arrived = LOOPS[name](grid, args.interval)
    fast = [m for m in visible if m != "slow"]
    return {
        "fast_arrival_s": statistics.median(arrived[m] for m in fast),
        "fast_last_arrival_s": max(arrived[m] for m in fast),
        "fast_after_complete_s": statistics.median(arrived[m] - complete[m] for m in fast),
        "slow_arrival_s": arrived["slow"],
        "slow_after_complete_s": arrived["slow"] - complete["slow"],
        "fast_backoffs": sum(grid.backoffs[m] > 0 for m in fast),
        "slow_backoffs": grid.backoffs["slow"],
        "requests": grid.requests,
    }


def measure(args: argparse.Namespace) -> dict:
    rng = random.Random(args.seed)
    rows: dict[str, list[dict[str, float]]] = {name: [] for name in LOOPS}
    for i in range(args.repeats):
        visible, complete = timetable(rng, args)
        for name in (("flower", "reader") if i % 2 == 0 else ("reader", "flower")):
            rows[name].append(exchange(name, visible, complete, args, args.seed + i))
        print(f"repeat {i + 1}/{args.repeats}: fast replies (median) flower {rows['flower'][-1]['fast_arrival_s']:.2f}"
              f" s, reader {rows['reader'][-1]['fast_arrival_s']:.2f} s", file=sys.stderr, flush=True)
    summary = {name: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for name, rs in rows.items()}
    config = {k: getattr(args, k) for k in ("repeats", "nodes", "slow_upload", "fast_upload", "fast_spread",
                                             "interval", "pull_cost", "seed")}
    return {"config": config, "summary": summary, "exchanges": rows}


def table(result: dict) -> str:
    cfg, s = result["config"], result["summary"]
    lines = [
        f"{cfg['repeats']} repeats x {cfg['nodes']} replies: 1 uploads {cfg['slow_upload']:g} s, "
        f"{cfg['nodes'] - 1} upload {cfg['fast_upload']:g} s (visible at U(0.2, {cfg['fast_spread']:g}) s); "
        f"pull every {cfg['interval']:g} s, {cfg['pull_cost'] * 1000:g} ms per request; medians over repeats",
        "",
        "| reader | fast replies in: median s | last fast s | fast: s after complete | slow in s "
        "| slow: s after complete | fast replies backed off | slow backoff sleeps | requests / exchange |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    label = {"flower": "one `pull_messages` for all ids (before)", "reader": "`ReplyReader` (one pull per id)"}
    for name in ("flower", "reader"):
        r = s[name]
        lines.append(f"| {label[name]} | {r['fast_arrival_s']:.2f} | {r['fast_last_arrival_s']:.2f} "
                     f"| {r['fast_after_complete_s']:.2f} | {r['slow_arrival_s']:.2f} "
                     f"| {r['slow_after_complete_s']:.2f} "
                     f"| {r['fast_backoffs']:g} | {r['slow_backoffs']:g} | {r['requests']:g} |")
    return "\n".join(lines)


def parse(argv: Sequence[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("--repeats", type=int, default=5, help="exchanges per reader (default: %(default)s)")
    ap.add_argument("--nodes", type=int, default=4, help="replies per exchange, one slow (default: %(default)s)")
    ap.add_argument("--slow-upload", type=float, default=5.0, help="seconds (default: %(default)s)")
    ap.add_argument("--fast-upload", type=float, default=0.02, help="seconds (default: %(default)s)")
    ap.add_argument("--fast-spread", type=float, default=1.5, help="fast replies visible by (default: %(default)s)")
    ap.add_argument("--interval", type=float, default=0.25, help="seconds between reads (default: %(default)s)")
    ap.add_argument("--pull-cost", type=float, default=0.002, help="seconds per request (default: %(default)s)")
    ap.add_argument("--seed", type=int, default=0, help="seeds the timetables and jitter (default: %(default)s)")
    ap.add_argument("--json", type=Path, metavar="OUT", help="write the configuration, summary and every exchange")
    args = ap.parse_args(argv)
    if args.repeats < 1 or args.nodes < 2 or min(args.slow_upload, args.fast_upload, args.pull_cost) < 0 \
            or args.fast_spread < 0.2 or args.interval <= 0:
        ap.error("need --repeats >= 1, --nodes >= 2, uploads and --pull-cost >= 0, --fast-spread >= 0.2, "
                 "--interval > 0")
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

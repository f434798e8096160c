"""A warm node's load + save of its session with a state dir, with and without the session cache.

For each size: a float32 model of ``--params`` (millions, a few tensors), a ``ClientSession`` with the ``dgc``
compressor and memory (momentum and velocity, each one model's worth, plus the running totals: the state is
about 3 x 4 bytes per parameter) after one ``send``, saved into a temporary state dir. Then, alternately, a task's
``ClientSession.load`` (a fresh Context, as the warm worker gives it: the session is not in ``context.state``)
and ``save`` (``to_bytes``, the atomic write with fsync), with the cache (the process saved the file last: the
object is taken from memory) and without it (the cache emptied first: the file is read and deserialized, as
before the cache). Printed: milliseconds per load, per save and per load + save (median over ``--repeats``), the
state file's bytes and the load ratio. Compute time only; no training, no Flower messages.

    python benchmarks/bench_session_cache.py [--params 1 11] [--repeats 7] [--json F]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch
from flwr.app import Context, RecordDict

from fedcomp.flower.session import KEPT, ClientSession
from fedcomp.spec import ModelSpec
from fedcomp.task.config import Compression
from fedcomp.task.heap import keep_freed_memory

COMPRESSION = Compression("dgc", "dgc", "density=0.01")


def spec_of(millions: float) -> ModelSpec:
    """Four square-ish weight tensors and their biases, ``millions`` parameters in all."""
    side = int((millions * 1e6 / 4) ** 0.5)
    entries = []
    for i in range(4):
        entries += [(f"layer{i}.weight", (side, side)), (f"layer{i}.bias", (side,))]
    return ModelSpec(tuple(entries))


def one_task(spec: ModelSpec, state_dir: str, cached: bool) -> tuple[float, float]:
    """One load + save: seconds for each."""
    if not cached:
        KEPT.drop()
    ctx = Context(1, 9, {"state-dir": state_dir}, RecordDict(), {})
    t0 = time.perf_counter()
    session = ClientSession.load(ctx, COMPRESSION, spec, state_dir, run_key=7, dir_first=True)
    t1 = time.perf_counter()
    session.save(ctx, state_dir)
    return t1 - t0, time.perf_counter() - t1


def measure(millions: float, repeats: int) -> dict[str, float]:
    spec = spec_of(millions)
    gen = torch.Generator().manual_seed(0)
    with tempfile.TemporaryDirectory() as tmp:
        state_dir = str(Path(tmp) / "state")
        session = ClientSession.fresh(COMPRESSION, spec, run_key=7)
        session.send(1, {n: torch.randn(s, generator=gen) for n, s in spec.entries}, 0, 9)
        session.save(Context(1, 9, {}, RecordDict(), {}), state_dir)
        times: dict[bool, list[tuple[float, float]]] = {True: [], False: []}
        one_task(spec, state_dir, False)  # warm-up (page cache, allocator)
        for _ in range(repeats):
            for cached in (False, True):  # side by side: the machine's speed drifts
                times[cached].append(one_task(spec, state_dir, cached))
        hits = KEPT.hits
        size = (Path(state_dir) / "client-state.pt").stat().st_size
    med = {c: (statistics.median(t[0] for t in ts) * 1e3, statistics.median(t[1] for t in ts) * 1e3,
               statistics.median(sum(t) for t in ts) * 1e3) for c, ts in times.items()}
    return {
        "params": spec.total_numel,
        "state_bytes": size,
        "load_ms_file": round(med[False][0], 2),
        "load_ms_cached": round(med[True][0], 3),
        "save_ms_file": round(med[False][1], 1),
        "save_ms_cached": round(med[True][1], 1),
        "task_ms_file": round(med[False][2], 1),
        "task_ms_cached": round(med[True][2], 1),
        "load_speedup": round(med[False][0] / max(med[True][0], 1e-9), 1),
        "cache_hits": hits,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--params", nargs="+", type=float, default=[1.0, 11.0], help="model sizes, millions")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--json", help="also write the rows here")
    args = ap.parse_args()
    if args.repeats < 1:
        ap.error("--repeats must be >= 1")
    keep_freed_memory()
    torch.set_num_threads(1)
    rows = []
    for m in args.params:
        KEPT.hits = 0
        rows.append(measure(m, args.repeats))
    head = ("params", "state bytes", "load file ms", "load cached ms", "save ms (file / cached)",
            "load+save file ms", "load+save cached ms")
    print("  ".join(f"{h:>12}" for h in head))
    for r in rows:
        cells = (f"{r['params']:,}", f"{r['state_bytes']:,}", r["load_ms_file"], r["load_ms_cached"],
                 f"{r['save_ms_file']} / {r['save_ms_cached']}", r["task_ms_file"], r["task_ms_cached"])
        print("  ".join(f"{c:>12}" for c in cells))
    print(json.dumps(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()

"""A client's per-task bookkeeping on the main job's model: send, ack and the saved state, per compressor.

For each compressor: a fresh ``ClientSession`` on resnet-1m (GroupNorm, 1,228,970 parameters on 1 x 8 x 8 digits),
the ``residual`` memory, five warm-up tasks, then ``--blocks`` blocks of ``--tasks`` tasks, each task one
``send`` (compensate, compress, update the memory and the running totals, encode), the ack of the previous
update (as the next task brings it) and ``to_bytes`` (the state ``ClientSession.save`` puts in
``context.state``). Printed: ms per task (minimum and median over blocks), the state's bytes and the payload
bytes of one update. Then the read a task makes where no state dir keeps the session in memory
(``ClientSession.from_bytes`` of ``context.state``: parse, content checks, the pending updates checked by
``fedcomp.wire.check``), minimum over ``--reads`` reads, with one pending update and with four (three more sent
unacked). Training and Flower's objects are not included.

    python benchmarks/bench_client_state.py [--compressors identity int8 dgc] [--tasks 8] [--blocks 6] [--reads 7]
        [--json F]

Compare two checkouts by running this in each, alternately (the machine's speed drifts).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from fedcomp.flower.session import ClientSession
from fedcomp.spec import ModelSpec
from fedcomp.task.config import RunConfig
from fedcomp.task.heap import keep_freed_memory
from fedcomp.task.models import build_model

OPTIONS = {"dgc": "density=0.01", "dgc+int8": "density=0.01"}  # the main job's (auto picks per task)


def read_ms(session: ClientSession, run: RunConfig, spec: ModelSpec, reads: int) -> float:
    """Minimum ms of ``ClientSession.from_bytes`` over ``reads`` reads of ``session``'s saved state."""
    data, times = session.to_bytes(), []
    for _ in range(reads):
        t0 = time.perf_counter()
        ClientSession.from_bytes(data, run.compression, spec, run_key=session.run_key)
        times.append((time.perf_counter() - t0) * 1e3)
    return round(min(times), 2)


def measure(compressor: str, tasks: int, blocks: int, reads: int) -> dict[str, float]:
    run = RunConfig(compressor=compressor, compressor_options=OPTIONS.get(compressor, ""), memory="residual")
    model = build_model("resnet-1m", (1, 8, 8), 10, seed=0, norm="group")
    spec = ModelSpec.from_module(model)
    session = ClientSession.fresh(run.compression, spec)
    gen = torch.Generator().manual_seed(0)
    grads = [{n: torch.randn(p.shape, generator=gen) * 1e-3 for n, p in model.named_parameters()} for _ in range(3)]
    blob = b""
    task, times = 1, []
    for block in range(blocks + 1):  # block 0 warms up
        t0 = time.perf_counter()
        for _ in range(tasks if block else 5):
            blob, _ = session.send(task, grads[task % 3], 0, 1)
            if task > 1:
                session.pipeline.ack(task - 1)
            session.to_bytes()
            task += 1
        if block:
            times.append((time.perf_counter() - t0) / tasks * 1e3)
    row = {
        "compressor": compressor,
        "ms_per_task_min": round(min(times), 2),
        "ms_per_task_median": round(statistics.median(times), 2),
        "state_bytes": len(session.to_bytes()),
        "payload_bytes": len(blob),
        "read_ms_1_pending": read_ms(session, run, spec, reads),
    }
    for _ in range(3):
        session.send(task, grads[task % 3], 0, 1)
        task += 1
    row["read_ms_4_pending"] = read_ms(session, run, spec, reads)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--compressors", nargs="+", default=["identity", "int8", "dgc", "dgc+int8"])
    ap.add_argument("--tasks", type=int, default=8, help="tasks per timed block")
    ap.add_argument("--blocks", type=int, default=6, help="timed blocks")
    ap.add_argument("--reads", type=int, default=7, help="timed reads of the saved state (their minimum)")
    ap.add_argument("--json", help="also write the rows here")
    args = ap.parse_args()
    if args.tasks < 1 or args.blocks < 1 or args.reads < 1:
        ap.error("--tasks, --blocks and --reads must be >= 1")
    keep_freed_memory()
    torch.set_num_threads(1)
    rows = [measure(c, args.tasks, args.blocks, args.reads) for c in args.compressors]
    print(f"{'compressor':>10}  {'ms/task min':>11}  {'median':>7}  {'state bytes':>12}  {'payload bytes':>13}  "
          f"{'read ms, 1 pending':>18}  {'4 pending':>9}")
    for r in rows:
        print(f"{r['compressor']:>10}  {r['ms_per_task_min']:>11}  {r['ms_per_task_median']:>7}  "
              f"{r['state_bytes']:>12,}  {r['payload_bytes']:>13,}  {r['read_ms_1_pending']:>18}  "
              f"{r['read_ms_4_pending']:>9}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()

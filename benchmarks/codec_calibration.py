"""What a client computes besides training, on this CPU: the table the simulator's clock charges per task.

Per model (``--model NAME[:OPTIONS]``, built for its workload's inputs (``INPUT_SHAPES``: digits' 1x8x8, ``cnn1d``
mnist1d's 1x1x40) and 10 classes, ``--threads`` torch threads as
``fedcomp sim`` uses) it measures, each the minimum over ``--reps`` timed repeats after two untimed ones (the
minimum: the figure least disturbed by other work on the machine):

* ``train_s_per_sample``: one SGD step (forward, cross-entropy, backward, step) on a batch of ``--batch`` random
  inputs, divided by the batch: the reference a simulated device's ``s_per_sample`` is divided by to scale
  the codec seconds (``fedcomp.sim.codeccost.CodecCost.scaled``);
* ``uplink[COMPRESSOR][DENSITY]``: one ``Pipeline.send`` (error-feedback compensate, compress, memory update,
  wire encode; the running totals on, as a client's session keeps them) of a fresh random update of the model's
  shape, built as a client builds it (``fedcomp.client.pipeline.build``, the compressor's default memory),
  past any warm-up schedule (``set_epoch``); sparsifiers at every ``--densities`` value (density ``0`` for the
  others);
* ``downlink[MODE]``: one ``fedcomp.downlink.receive`` of the blob a client gets (``dense``: the fp32 model;
  ``fp16``/``int8``: a full quantized copy; ``delta``: a chain of ``--behind`` deltas of ``topk+int8`` at 2%, the
  main job's) plus, for every mode but ``dense``, the replica's ``to_bytes`` (the session keeps it in
  ``context.state``).

Writes the table as JSON (``--out``; default: ``fedcomp/sim/codec_calibration.json``, which the simulator reads)
and prints it as a table; ``--merge`` keeps the other models already in ``--out`` (each model's entry records the
load average it was measured under).

    .venv/bin/python benchmarks/codec_calibration.py --reps 5
    .venv/bin/python benchmarks/codec_calibration.py --model cnn1d --merge    # add one model to the table
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F  # noqa: N812

from fedcomp.client.pipeline import build
from fedcomp.compressors.base import COMPRESSORS, Sparsifier
from fedcomp.downlink import receive
from fedcomp.downlink.broadcaster import build_broadcaster
from fedcomp.sim.codeccost import CODEC_TABLE
from fedcomp.spec import ModelSpec
from fedcomp.task.models import build_model
from fedcomp.tools.report import table

MODELS = ("mlp", "cnn", "resnet20", "resnet-1m:norm=group", "cnn1d")
#: The input shape a model is calibrated on: its workload's (digits' 1x8x8 unless named here).
INPUT_SHAPES = {"cnn1d": (1, 1, 40)}
#: Single compressors (every one registered) and the compositions the scenarios and tests use.
COMPOSED = ("dgc+int8", "dgc+int4", "dgc+fp16", "topk+int8", "topk+int4", "topk+fp16", "randomk+int8")
DENSITIES = (0.001, 0.01, 0.03, 0.1, 0.3)
DOWNLINKS = {"dense": {}, "fp16": {}, "int8": {}, "delta": {"compressor": "topk+int8", "density": 0.02}}


def best_of(fn: Callable[[], Any], reps: int, setup: Callable[[], Any] | None = None) -> float:
    """Minimum wall seconds of ``fn()`` over ``reps`` timed calls after two untimed ones (``setup`` untimed)."""
    times = []
    for i in range(reps + 2):
        if setup is not None:
            setup()
        t0 = time.perf_counter()
        fn()
        if i >= 2:
            times.append(time.perf_counter() - t0)
    return min(times)


def train_s_per_sample(model: torch.nn.Module, shape: tuple[int, ...], batch: int, reps: int) -> float:
    x, y = torch.randn(batch, *shape), torch.randint(0, 10, (batch,))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)

    def step() -> None:
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()

    return best_of(step, reps) / batch


def uplink_s(spec: ModelSpec, name: str, density: float, reps: int) -> float:
    opts = {"density": density} if density > 0 else {}
    pipe = build(name, spec, **opts)
    pipe.set_epoch(1e6)  # past any warm-up: the density asked for
    grads: dict[str, torch.Tensor] = {}

    def fresh() -> None:
        grads.clear()
        grads.update({n: torch.randn(spec.shape(n)) for n in spec.names})

    return best_of(lambda: pipe.send(grads), reps, fresh)


def downlink_s(spec: ModelSpec, params: dict[str, torch.Tensor], mode: str, behind: int, reps: int) -> float:
    b = build_broadcaster(mode, spec, **DOWNLINKS[mode])
    held = receive(b.message(1, 1, params, 0), spec, None)
    b.on_reply(1, 1)
    cur = {n: t.clone() for n, t in params.items()}
    for v in range(1, behind + 1):  # the versions the client missed
        cur = {n: t + 0.01 * torch.randn_like(t) for n, t in cur.items()}
        b.publish(cur, v)
    blob = b.message(1, 2, cur, behind)

    def once() -> None:
        replica = receive(blob, spec, held)
        if mode != "dense":
            replica.to_bytes(spec)

    return best_of(once, reps)


def calibrate(model_arg: str, args: argparse.Namespace) -> tuple[str, dict[str, Any]]:
    name, _, opt_text = model_arg.partition(":")
    options = dict(kv.split("=", 1) for kv in opt_text.split() if kv)
    shape = INPUT_SHAPES.get(name, (1, 8, 8))
    model = build_model(name, shape, 10, seed=0, **options)
    spec = ModelSpec.from_module(model)
    params = {n: t.detach().clone() for n, t in model.state_dict().items() if n in set(spec.names)}
    entry: dict[str, Any] = {"options": opt_text, "numel": spec.total_numel, "input_shape": list(shape),
                             "load_avg_1m": round(os.getloadavg()[0], 2),
                             "train_s_per_sample": train_s_per_sample(model, shape, args.batch, args.reps)}
    up: dict[str, dict[str, float]] = {}
    for comp in [*sorted(COMPRESSORS.names()), *COMPOSED]:
        sparse = issubclass(COMPRESSORS.get(comp.split("+")[0]), Sparsifier)
        points = args.densities if sparse else (0,)
        up[comp] = {f"{d:g}": round(uplink_s(spec, comp, d, args.reps), 6) for d in points}
    entry["uplink"] = up
    entry["downlink"] = {m: round(downlink_s(spec, params, m, args.behind, args.reps), 6) for m in DOWNLINKS}
    return (name if model_arg in MODELS else model_arg), entry  # an option variant: its own entry, NAME:OPTIONS


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", action="append", default=None, help=f"NAME[:OPTIONS] (default: {', '.join(MODELS)})")
    p.add_argument("--densities", type=float, nargs="+", default=list(DENSITIES))
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--behind", type=int, default=3, help="versions a delta-downlink client is behind")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", type=Path, default=CODEC_TABLE)
    p.add_argument("--merge", action="store_true", help="keep the other models already in --out")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    models = json.loads(args.out.read_text())["models"] if args.merge and args.out.is_file() else {}
    measured = {}
    for m in args.model or MODELS:
        name, entry = calibrate(m, args)
        models[name] = measured[name] = entry
        print(f"{name}: {entry['numel']:,} parameters, {1e6 * entry['train_s_per_sample']:.1f} us/sample", flush=True)
    doc = {"what": "client codec seconds per task on the calibration CPU (benchmarks/codec_calibration.py)",
           "cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(), "threads": args.threads,
           "torch": torch.__version__, "reps": args.reps, "batch": args.batch, "delta_behind": args.behind,
           "load_avg_1m": round(os.getloadavg()[0], 2), "models": models}
    args.out.write_text(json.dumps(doc, indent=1) + "\n")
    rows = []
    for name, e in measured.items():
        for comp, pts in e["uplink"].items():
            rows.append({"model": name, "what": f"up {comp}", **{f"d={d}": f"{1e3 * s:.2f}" for d, s in pts.items()}})
        rows += [{"model": name, "what": f"down {m}", "d=0": f"{1e3 * s:.2f}"} for m, s in e["downlink"].items()]
    print("milliseconds per task on this CPU:")
    print(table(rows, ["model", "what", "d=0", *[f"d={d:g}" for d in args.densities]]))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

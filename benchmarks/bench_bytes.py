"""Wire bytes per kept element and whole-model compression vs dense fp32, for top-k sparsified gradients.

Selection is exact per-tensor ``torch.topk`` on |g| (k = max(1, round(density * numel))), so the figures measure
the codec alone. Values are sent as fp32, fp16, or int8 (blockwise absmax: scale = absmax / 127 per block of 256
kept values, code = round(value / scale)). Cases:

* ``student-t``: i.i.d. Student-t (df 3) "gradients" of 1M and 25M elements (one 2-D tensor each);
* ``resnet20/digits``: real gradients of ResNet-20 (fedcomp.task.models) on the digits data (fedcomp.task.data), taken
  after a few SGD steps. Two variants: ``all-sparse`` (every tensor top-k'd) and ``dgc-rule`` (tensors with
  ``dim <= 1`` or fewer than 1024 elements sent whole as fp32, as the sparsifiers do).

Columns: ``B/kept`` = (blob bytes minus the records of tensors sent whole) / kept elements, i.e. fixed header,
CRC and every sparse record, divided by what was kept; ``ratio`` = dense fp32 model bytes / blob bytes. Encode and
decode times are medians, for information only.

Second table, **whole updates of the built-in models** (``--presets``, by default ``resnet20``, ``mlp``
with ``hidden=1024,1024`` on 8x8 digits, and the size presets ``resnet-1m``, ``resnet18``, ``resnet-25m`` on
3x32x32 inputs): the real send pipeline (``fedcomp.build("dgc" | "dgc+int8", spec)``, DGC memory with momentum
0.9, no warm-up) over ``--preset-steps`` consecutive gradients of the model (SGD, lr 0.05, momentum 0.9, batch 8
of Gaussian inputs with random labels: the byte count depends on the shapes and the kept counts, not on the
data), for each density, value coding (``fp32`` = ``dgc``, ``int8`` = ``dgc+int8``) and small-tensor policy
(``group``, the default, and ``dense``, the old rule). ``bytes`` is the last update's blob (steady state: the
memory is warm, the density final), ``small B`` the bytes of the small tensors' records in it, ``ratio`` = dense
fp32 model bytes / ``bytes``.

    python benchmarks/bench_bytes.py [--sizes 1000000 25000000] [--densities 1e-2 1e-3 1e-4] [--json out.json]
    python benchmarks/bench_bytes.py --sizes --no-resnet --presets     # only the built-in models table
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time
from collections import Counter
from collections.abc import Callable, Mapping

import numpy as np
import torch

from fedcomp.payload import TensorPayload, Update, ValueCoding, Values
from fedcomp.spec import ModelSpec
from fedcomp.wire import decode, encode, encoded_size_breakdown
from fedcomp.wire.codec import inspect
from fedcomp.wire.index import IndexCoding

BLOCK = 256
VALUE_CODINGS = ("fp32", "fp16", "int8")


def int8_blockwise(x: torch.Tensor, block: int = BLOCK) -> Values:
    """Blockwise absmax int8 codes of a 1-D float32 tensor (zero blocks get scale 0 and codes 0)."""
    n = x.numel()
    padded = torch.zeros(Values.num_blocks(n, block) * block)
    padded[:n] = x
    scales = padded.view(-1, block).abs().amax(1) / 127
    per = scales.repeat_interleave(block)[:n]
    codes = torch.round(x / torch.where(per > 0, per, torch.ones_like(per))).clamp(-127, 127).to(torch.int8)
    return Values(ValueCoding.INT8, codes, scales, block)


def code_values(x: torch.Tensor, coding: str) -> Values:
    if coding == "fp32":
        return Values.f32(x)
    if coding == "fp16":
        return Values(ValueCoding.F16, x.to(torch.float16))
    return int8_blockwise(x)


def topk_payload(g: torch.Tensor, density: float, coding: str) -> TensorPayload:
    flat = g.reshape(-1)
    k = max(1, round(density * flat.numel()))
    idx = torch.topk(flat.abs(), k, sorted=False).indices.sort().values
    return TensorPayload(tuple(g.shape), code_values(flat[idx], coding), idx)


def sends_whole(g: torch.Tensor) -> bool:
    return g.dim() <= 1 or g.numel() < 1024


def median_ms(fn: Callable[[], object], reps: int) -> float:
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def measure(case: str, grads: Mapping[str, torch.Tensor], density: float, coding: str, dgc_rule: bool, reps: int):
    spec = ModelSpec.from_tensors(grads)
    tensors = {
        name: TensorPayload(tuple(g.shape), Values.f32(g.reshape(-1)))
        if dgc_rule and sends_whole(g)
        else topk_payload(g, density, coding)
        for name, g in grads.items()
    }
    update = Update(tensors, base_version=1, seq=1, client_id=1)
    blob = encode(update, spec)
    records = inspect(blob, spec)
    sparse = [r for r in records if r.index_coding is not IndexCoding.DENSE]
    kept = sum(r.nnz for r in sparse)
    whole_bytes = sum(r.nbytes for r in records if r.index_coding is IndexCoding.DENSE)
    return {
        "case": case,
        "numel": spec.total_numel,
        "density": density,
        "values": coding,
        "kept": kept,
        "bytes": len(blob),
        "bytes_per_kept": (len(blob) - whole_bytes) / kept,
        "ratio": spec.dense_bytes / len(blob),
        "index_codings": dict(Counter(r.index_coding.name.lower() for r in sparse)),
        "breakdown": encoded_size_breakdown(blob, spec),
        "encode_ms": median_ms(lambda: encode(update, spec), reps),
        "decode_ms": median_ms(lambda: decode(blob, spec), reps),
    }


def student_t(n: int, seed: int) -> dict[str, torch.Tensor]:
    rows = math.isqrt(n)
    while n % rows:
        rows -= 1
    g = np.random.default_rng(seed).standard_t(3, n).astype(np.float32)
    return {"weight": torch.from_numpy(g).view(rows, n // rows)}


def resnet_grads(steps: int, seed: int) -> dict[str, torch.Tensor]:
    """ResNet-20 gradients on one digits minibatch of 64 after ``steps`` SGD steps (lr 0.05, momentum 0.9)."""
    from fedcomp.task.data import batches, load_dataset
    from fedcomp.task.models import build_model

    train, _ = load_dataset("digits")
    model = build_model("resnet20", in_shape=train.in_shape, num_classes=train.num_classes, seed=seed)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    gen = torch.Generator().manual_seed(seed)
    loss_fn = torch.nn.CrossEntropyLoss()
    done = 0
    while True:
        for x, y in batches(train.x, train.y, 64, generator=gen, drop_last=True):
            opt.zero_grad()
            loss_fn(model(x), y).backward()
            if done == steps:
                return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
            opt.step()
            done += 1


PRESETS: dict[str, tuple[str, tuple[int, int, int], dict]] = {
    "resnet20": ("resnet20", (3, 32, 32), {}),
    "mlp-1024x2": ("mlp", (1, 8, 8), {"hidden": "1024,1024"}),
    "resnet-1m": ("resnet-1m", (3, 32, 32), {}),
    "resnet18": ("resnet18", (3, 32, 32), {}),
    "resnet-25m": ("resnet-25m", (3, 32, 32), {}),
}
PRESET_VALUES = {"fp32": "dgc", "int8": "dgc+int8"}


def model_grads(preset: str, steps: int, seed: int) -> tuple[ModelSpec, list[dict[str, torch.Tensor]]]:
    """``steps`` consecutive gradients of a built-in model (batch 8 of Gaussian inputs, random labels)."""
    from fedcomp.task.models import build_model

    name, shape, options = PRESETS[preset]
    model = build_model(name, shape, 10, seed=seed, **options)
    spec = ModelSpec.from_module(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        x = torch.randn(8, *shape, generator=gen)
        y = torch.randint(0, 10, (8,), generator=gen)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        out.append({n: p.grad.detach().clone() for n, p in model.named_parameters() if p.requires_grad})
        opt.step()
    return spec, out


def measure_preset(preset: str, spec: ModelSpec, grads: list[dict[str, torch.Tensor]], density: float,
                   values: str, small: str) -> dict:
    import fedcomp

    pipe = fedcomp.build(PRESET_VALUES[values], spec, density=density, small=small)
    sizes = [len(blob := pipe.send(g)) for g in grads]
    small_names = {n for n, s in spec.entries if len(s) <= 1 or math.prod(s) < 1024}
    records = inspect(blob, spec)
    return {
        "preset": preset,
        "params": spec.total_numel,
        "tensors": len(spec),
        "small_tensors": len(small_names),
        "small_numel": sum(math.prod(spec.shape(n)) for n in small_names),
        "density": density,
        "values": values,
        "small": small,
        "bytes": sizes[-1],
        "bytes_per_step": sizes,
        "small_bytes": sum(r.nbytes for r in records if r.name in small_names),
        "kept": sum(r.nnz for r in records),
        "dense_bytes": spec.dense_bytes,
        "ratio": spec.dense_bytes / sizes[-1],
    }


def print_preset_table(rows: list[dict]) -> None:
    head = f"{'model':<12}{'params':>11}{'small el.':>10}{'density':>9}{'values':>7}{'small':>7}{'kept':>8}"
    head += f"{'bytes':>11}{'small B':>9}{'ratio':>9}"
    print(head)
    print("-" * len(head))
    for r in rows:
        print(
            f"{r['preset']:<12}{r['params']:>11,}{r['small_numel']:>10,}{r['density']:>9.0e}{r['values']:>7}"
            f"{r['small']:>7}{r['kept']:>8}{r['bytes']:>11,}{r['small_bytes']:>9,}{r['ratio']:>9.1f}"
        )


def print_table(rows: list[dict]) -> None:
    head = f"{'case':<28}{'numel':>10}{'density':>9}{'values':>7}{'kept':>8}{'bytes':>10}{'B/kept':>8}"
    head += f"{'ratio':>9}  {'index codings':<20}{'enc ms':>8}{'dec ms':>8}"
    print(head)
    print("-" * len(head))
    for r in rows:
        mix = ",".join(f"{k}:{v}" for k, v in sorted(r["index_codings"].items()))
        print(
            f"{r['case']:<28}{r['numel']:>10}{r['density']:>9.0e}{r['values']:>7}{r['kept']:>8}{r['bytes']:>10}"
            f"{r['bytes_per_kept']:>8.3f}{r['ratio']:>9.1f}  {mix:<20}{r['encode_ms']:>8.2f}{r['decode_ms']:>8.2f}"
        )


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", type=int, nargs="*", default=[1_000_000, 25_000_000])
    ap.add_argument("--densities", type=float, nargs="+", default=[1e-2, 1e-3, 1e-4])
    ap.add_argument("--values", nargs="+", choices=VALUE_CODINGS, default=list(VALUE_CODINGS))
    ap.add_argument("--steps", type=int, default=20, help="SGD steps before the ResNet-20 gradient is taken")
    ap.add_argument("--no-resnet", action="store_true", help="skip the real-gradient case")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", metavar="PATH", help="also write the rows as JSON")
    ap.add_argument("--presets", nargs="*", choices=list(PRESETS), default=None,
                    help="the built-in models table (no names: all of them)")
    ap.add_argument("--preset-densities", type=float, nargs="+", default=[1e-2, 1e-3])
    ap.add_argument("--preset-steps", type=int, default=4, help="updates sent; the last one is reported")
    args = ap.parse_args(argv)

    torch.manual_seed(args.seed)
    cases: list[tuple[str, dict[str, torch.Tensor], bool]] = []
    for n in args.sizes:
        cases.append((f"student-t {n / 1e6:g}M", student_t(n, args.seed), False))
    if not args.no_resnet:
        grads = resnet_grads(args.steps, args.seed)
        cases += [("resnet20/digits all-sparse", grads, False), ("resnet20/digits dgc-rule", grads, True)]
    rows = [
        measure(name, grads, d, coding, dgc_rule, args.reps)
        for name, grads, dgc_rule in cases
        for d in args.densities
        for coding in args.values
    ]
    if rows:
        print_table(rows)
    if args.presets is not None:
        preset_rows = []
        for preset in args.presets or list(PRESETS):
            spec, grads = model_grads(preset, args.preset_steps, args.seed)
            preset_rows += [
                measure_preset(preset, spec, grads, d, values, small)
                for d in args.preset_densities
                for values in PRESET_VALUES
                for small in ("group", "dense")
            ]
            del grads
        print()
        print_preset_table(preset_rows)
        rows = rows + preset_rows
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return rows


if __name__ == "__main__":
    main()

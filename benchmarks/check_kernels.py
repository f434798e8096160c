"""Correctness of the Triton kernel path against the torch reference on one device, at benchmark sizes.

The same inputs go through both backends of each kernel entry point on the same device (fresh random inputs per
case, from ``--seed``): the DGC step in every configuration (momentum, Nesterov with clipping, no masking, plain
error feedback; a threshold given, a sampled threshold, dense; the selection alone), error-feedback quantization
(int8 and int4 to nearest with packing, sign with packing; stochastic int8 and QSGD by their own contract) and the
server's scatter-add (fp32 and int8 sparse, dense); the small-tensor group on flat state; and the device wire encode of
pipeline updates of many compressors.
What is checked, per the kernels' contract (docs/kernels.md):

* DGC: identical indices, values within fp32 tolerance, identical memory state after masking (the fraction of
  bitwise-equal state elements is reported too);
* quantization to nearest / sign: identical codes and packed bytes, scales and residuals within tolerance;
  stochastic: every code is the floor or the ceiling of ``c / scale`` and ``c == code * scale + residual``;
* scatter-add: the aggregate within fp32 tolerance (atomics add in any order);
* the small-tensor group (``fedcomp.kernels.group``): its payloads and memory state bit for bit the torch path's;
* device encode: the blob of a ``backend="triton"`` pipeline is byte for byte ``fedcomp.wire.encode`` of its update.

    python benchmarks/check_kernels.py                         # on the CUDA device: 1M, 25M, 100M
    python benchmarks/check_kernels.py --interpret --sizes 20K # no GPU: Triton's interpreter on the CPU

Exits 1 when a case fails. Poisoned outputs are not needed here: every compared tensor is fully written by
the reference too, and the kernels' state tensors start from the same random values.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

RTOL = 1e-6


@dataclass
class Case:
    name: str
    n: int
    ok: bool
    detail: str


def parse_size(text: str) -> int:
    mult = {"K": 10**3, "M": 10**6, "G": 10**9}
    text = text.strip().upper()
    return int(float(text[:-1]) * mult[text[-1]]) if text[-1] in mult else int(text)


def near(a, b) -> bool:
    """Same shape, values within ``RTOL`` of the largest magnitude (exact zeros may move: for a residual
    ``c - sign * scale`` whose scale differs by the rounding of a sum order, ``c == scale`` can hold in one)."""
    import torch

    if a.shape != b.shape:
        return False
    return a.numel() == 0 or bool(torch.allclose(a, b, rtol=RTOL, atol=RTOL * float(b.abs().max())))


def close(a, b) -> bool:
    """``near``, and the same zeros (the masking pattern)."""
    import torch

    return near(a, b) and bool(torch.equal(a == 0, b == 0))


def _max_rel(a, b) -> float:
    import torch

    if a.numel() == 0:
        return 0.0
    return float(((a - b).abs() / b.abs().clamp_min(torch.finfo(torch.float32).tiny)).max())


def dgc_cases(n: int, device, seed: int) -> list[Case]:
    import torch

    from fedcomp.kernels.dgc import fused_dgc_step
    from fedcomp.memory.dgc_math import accumulate_, clip_scale_tensor

    configs = {
        "plain": dict(momentum=0.9),
        "nesterov-clipped": dict(momentum=0.9, nesterov=True, clip_norm=0.5 * n**0.5),
        "no-masking": dict(momentum=0.5, masking=False),
        "error-feedback": None,  # u = None: plain residual + DGC sparsifier
    }
    k = max(1, n // 1000)
    out = []
    for i, (name, opts) in enumerate(configs.items()):
        for mode in ("threshold", "sampled", "dense"):
            gen = torch.Generator(device=device).manual_seed(seed * 100 + i)
            g, u, v = (torch.randn(n, device=device, generator=gen) * s for s in (1.0, 0.5, 0.3))
            if opts is None:
                u = None
            kw = dict(opts or {})
            if mode == "threshold":  # the k-th largest |v_new| of the reference's own update
                uu, vv = (u.clone() if u is not None else g.clone()), v.clone()
                if u is None:
                    vv.add_(g)
                else:
                    scale = float(clip_scale_tensor(g, kw["clip_norm"])) if "clip_norm" in kw else 1.0
                    accumulate_(g, uu, vv, momentum=kw["momentum"], nesterov=kw.get("nesterov", False),
                                scale=scale)
                kw["threshold"] = float(torch.topk(vv.abs(), k).values[-1])
            if mode == "dense":
                kw["dense"] = True
            results = {}
            for backend in ("torch", "triton"):
                u2 = None if u is None else u.clone()
                v2 = v.clone()
                sample_gen = torch.Generator().manual_seed(seed)
                step = fused_dgc_step(g, u2, v2, k=k, generator=sample_gen, backend=backend, **kw)
                results[backend] = (step, u2, v2)
            (rs, ru, rv), (ts, tu, tv) = results["torch"], results["triton"]
            same_idx = (rs.indices is None and ts.indices is None) or (
                rs.indices is not None and ts.indices is not None and torch.equal(rs.indices, ts.indices))
            vals_ok = same_idx and close(ts.values, rs.values)
            state_ok = close(tv, rv) and (ru is None or close(tu, ru))
            bitwise = float((tv == rv).float().mean()) if ru is None else float(
                ((tv == rv) & (tu == ru)).float().mean())
            sent = "dense" if rs.indices is None else f"{rs.indices.numel()} sent"
            out.append(Case(f"dgc {name} {mode}", n, same_idx and vals_ok and state_ok,
                            f"{sent}; indices {'identical' if same_idx else 'DIFFER'}; values max rel "
                            f"{_max_rel(ts.values, rs.values) if same_idx else float('nan'):.1e}; state bitwise-equal "
                            f"{bitwise:.6f}"))
    return out


def quant_cases(n: int, device, seed: int) -> list[Case]:
    import torch

    from fedcomp.compressors.blockwise import BlockwiseConfig, Int4Quantizer, Int8Quantizer
    from fedcomp.compressors.qsgd import QSGDConfig, QSGDQuantizer
    from fedcomp.compressors.sign import SignConfig, SignQuantizer
    from fedcomp.kernels.quant import ef_quantize

    # name -> (quantizer, residual comparison): absmax scales are exact (identical residuals, zeros included);
    # sign's mean |c| is a sum, the same to the rounding of its order
    deterministic = {
        "int8 nearest": (lambda: Int8Quantizer(BlockwiseConfig(block=256, stochastic=False)), close),
        "int4 nearest": (lambda: Int4Quantizer(BlockwiseConfig(block=64, stochastic=False)), close),
        "sign": (lambda: SignQuantizer(SignConfig(block=512)), near),
    }
    stochastic = {
        "int8 stochastic": lambda: Int8Quantizer(BlockwiseConfig(block=256, seed=seed)),
        "qsgd": lambda: QSGDQuantizer(QSGDConfig(seed=seed)),
    }
    out = []
    gen = torch.Generator(device=device).manual_seed(seed)
    for name, (make, same) in deterministic.items():
        x, e = torch.randn(n, device=device, generator=gen), torch.randn(n, device=device, generator=gen) * 0.01
        ref_e, got_e = e.clone(), e.clone()
        ref = ef_quantize(make(), x, ref_e, pack=True, backend="torch")
        got = ef_quantize(make(), x, got_e, pack=True, backend="triton")
        codes = torch.equal(got.values.data, ref.values.data)
        packed = torch.equal(got.packed, ref.packed)
        scales = close(got.values.scales, ref.values.scales)
        resid = same(got_e, ref_e)
        out.append(Case(f"quant {name}", n, codes and packed and scales and resid,
                        f"codes {'identical' if codes else 'DIFFER'}, packed {'identical' if packed else 'DIFFER'}, "
                        f"scales max rel {_max_rel(got.values.scales, ref.values.scales):.1e}, residual "
                        f"{'ok' if resid else 'DIFFERS'}"))
    for name, make in stochastic.items():
        x, e = torch.randn(n, device=device, generator=gen), torch.randn(n, device=device, generator=gen) * 0.01
        c = x + e
        got_e = e.clone()
        q = ef_quantize(make(), x, got_e, backend="triton").values
        scale = q.scales.repeat_interleave(q.block)[:n]
        r = c / torch.where(scale > 0, scale, torch.ones_like(scale))
        codes = q.data.float()
        bracket = bool(((codes == r.floor()) | (codes == r.ceil())).all())
        identity = close(codes * scale + got_e, c)
        out.append(Case(f"quant {name}", n, bracket and identity,
                        f"codes floor/ceil of c/scale: {'yes' if bracket else 'NO'}; "
                        f"c == code*scale + residual: {'yes' if identity else 'NO'}"))
    return out


def scatter_cases(n: int, device, seed: int) -> list[Case]:
    import torch

    from fedcomp.compressors.blockwise import BlockwiseConfig, Int8Quantizer
    from fedcomp.kernels.scatter import scatter_add
    from fedcomp.payload import TensorPayload, Values

    gen = torch.Generator(device=device).manual_seed(seed)
    k = max(1, n // 1000)
    idx = torch.randperm(n, device=device, generator=gen)[:k].sort().values
    vals = torch.randn(k, device=device, generator=gen)
    payloads = {
        "fp32 sparse": TensorPayload((n,), Values.f32(vals), idx),
        "int8 sparse": TensorPayload((n,), Int8Quantizer(BlockwiseConfig(block=64, stochastic=False)).quantize(
            vals, "t"), idx),
        "dense": TensorPayload((n,), Values.f32(torch.randn(n, device=device, generator=gen))),
    }
    out = []
    for name, p in payloads.items():
        base = torch.randn(n, device=device, generator=gen)
        ref, got = base.clone(), base.clone()
        scatter_add(ref, p, 0.37, backend="torch")
        scatter_add(got, p, 0.37, backend="triton")
        ok = close(got, ref)
        out.append(Case(f"scatter-add {name}", n, ok, f"max rel {_max_rel(got, ref):.1e}"))
    return out


def pipeline_cases(n: int, device, seed: int) -> list[Case]:
    """A client's send path on ``device``: ``build(...).to(device)`` fed device tensors for three steps (the
    second nacked, so a CPU-decoded payload is restored into device state), kernels against the reference: the
    same wire bytes' indices, values within tolerance, the same memory state."""
    import torch

    from fedcomp.client.pipeline import build
    from fedcomp.spec import ModelSpec
    from fedcomp.wire import decode

    spec = ModelSpec((("w", (n // 64, 64)), ("b", (64,))))
    out = []
    for name, memory in (("dgc", "dgc"), ("dgc+int8", "dgc"), ("int8", "residual")):
        opts = {"density": 0.001} if name.startswith("dgc") else {"stochastic": False}
        if name == "dgc+int8":
            opts["stochastic"] = False
        pipes = {b: build(name, spec, memory=memory, backend=b, **opts).to(device) for b in ("torch", "triton")}
        gen = torch.Generator(device=device).manual_seed(seed)
        ok, detail = True, []
        for step in range(3):
            grads = {t: torch.randn(shape, device=device, generator=gen) for t, shape in spec.entries}
            blobs = {b: p.send(grads) for b, p in pipes.items()}
            ref, got = (decode(blobs[b], spec).tensors for b in ("torch", "triton"))
            for t in spec.names:
                same = (ref[t].indices is None) == (got[t].indices is None) and (
                    ref[t].indices is None or torch.equal(ref[t].indices, got[t].indices))
                vals = same and close(got[t].values.dequantize(), ref[t].values.dequantize())
                ok &= same and vals
                if not (same and vals):
                    detail.append(f"step {step} {t}: {'values differ' if same else 'indices differ'}")
            if step == 1:
                for p in pipes.values():
                    p.nack(p.next_seq - 1)
        states = [p.memory.state_dict() for p in pipes.values()]
        for key in states[0]:
            for t in states[0][key]:
                if not close(states[1][key][t].float(), states[0][key][t].float()):
                    ok, detail = False, detail + [f"state {key}/{t} differs"]
        on_device = all(x.device.type == device.type for st in states for d in st.values() for x in d.values())
        out.append(Case(f"pipeline {name} ({memory} memory)", n, ok and on_device,
                        "; ".join(detail) or f"3 steps, one nack: same payloads and state, state on {device.type}"))
    return out


#: The small tensors of the 11M/25M/100M ResNets' group, by size (41 in all, plus an empty one): what
#: ``kernels.group`` sends on flat state.
GROUP_SHAPES = tuple([(64,)] * 10 + [(128,)] * 10 + [(256,)] * 10 + [(512,)] * 10 + [(10,), (0,)])


def select_cases(n: int, device, seed: int) -> list[Case]:
    """The device selection alone (``fedcomp.kernels.dgc.start_select``: marks, cumsum, placement; the small-tensor
    group's selection) against ``fedcomp.compressors.selection.select`` on ``device``: normal values (in band),
    values of four magnitudes (ties: top-k among the candidates); identical indices, passes and exactness."""
    import torch

    from fedcomp.compressors.selection import select
    from fedcomp.kernels.dgc import start_select

    k = max(1, n // 1000)
    gen = torch.Generator(device=device).manual_seed(seed)
    levels = torch.tensor([0.0, 0.5, 1.0, 2.0], device=device)
    inputs = {"normal": torch.randn(n, device=device, generator=gen),
              "tied": levels[torch.randint(4, (n,), device=device, generator=gen)]}
    out = []
    for name, x in inputs.items():
        ref = select(x, k, generator=torch.Generator().manual_seed(seed))
        got, _ = start_select(x, k, generator=torch.Generator().manual_seed(seed)).resolve()
        same = torch.equal(got.indices, ref.indices) and (got.passes, got.exact) == (ref.passes, ref.exact)
        out.append(Case(f"dgc select-only {name}", n, same,
                        f"{ref.indices.numel()} sent, passes {ref.passes}, exact {ref.exact}; indices "
                        f"{'identical' if same else 'DIFFER'}"))
    return out


def group_cases(n: int, device, seed: int) -> list[Case]:
    """The small-tensor group on flat state (``fedcomp.kernels.group``) against the torch path on ``device``: a
    large tensor and 42 small ones (``GROUP_SHAPES``), four sends with a nack of the second; the group's payloads
    and memory state must be the reference's bit for bit (the large tensor's are the pipeline cases'), every blob
    ``fedcomp.wire.encode`` of its update."""
    import torch

    from fedcomp.client.pipeline import build
    from fedcomp.spec import ModelSpec
    from fedcomp.wire import decode, encode

    spec = ModelSpec((("w", (n // 64, 64)), *((f"s{i}", s) for i, s in enumerate(GROUP_SHAPES))))
    out = []
    for name in ("dgc", "dgc+int8"):
        opts = {"density": 0.01, **({"stochastic": False} if "+" in name else {})}
        pipes = {b: build(name, spec, backend=b, **opts).to(device) for b in ("torch", "triton")}
        gen = torch.Generator(device=device).manual_seed(seed)
        ok, sent, detail = True, 0, []
        for step in range(4):
            grads = {t: torch.randn(shape, device=device, generator=gen) for t, shape in spec.entries}
            blobs = {b: p.send(grads) for b, p in pipes.items()}
            ok &= blobs["triton"] == encode(pipes["triton"].pending[pipes["triton"].last_seq], spec)
            ref, got = (decode(blobs[b], spec).tensors for b in ("torch", "triton"))
            for t in pipes["triton"].grouped:
                same = torch.equal(ref[t].indices, got[t].indices) and torch.equal(ref[t].values.data,
                                                                                   got[t].values.data)
                ok &= same
                sent += got[t].nnz
                if not same:
                    detail.append(f"step {step} {t} differs")
            if step == 1:
                for p in pipes.values():
                    p.nack(p.next_seq - 1)
        states = [p.memory.state_dict() for p in pipes.values()]
        for key in states[0]:
            for t in pipes["triton"].grouped:
                if not torch.equal(states[0][key][t], states[1][key][t]):
                    ok, detail = False, detail + [f"state {key}/{t} differs"]
        out.append(Case(f"group {name} (42 small tensors)", n, ok, "; ".join(detail) or
                        f"4 steps, one nack: {sent} group values sent, payloads and state bitwise the reference's"))
    return out


#: Compressors whose updates the encode cases write on the device: every index coding and value coding a pipeline
#: makes (RICE and BITMAP indices, F32/F16/BF16 values, INT8/INT4/SIGN/TERNARY codes, dense quantized records).
ENCODE_COMPRESSORS = ("dgc", "dgc+int8", "dgc+int4", "topk+sign", "randomk+ternary", "topk+fp16", "topk+bf16",
                      "int4", "qsgd")


def encode_cases(n: int, device, seed: int) -> list[Case]:
    """Two sends of a ``backend="triton"`` pipeline per compressor (density 0.001, and 0.5 for a bitmap), each
    blob compared with ``fedcomp.wire.encode`` of the update the pipeline keeps pending. At most 2M elements (the
    CPU encoder is the slow side; benchmarks/bench_send_gpu.py compares the bytes up to 100M)."""
    import torch

    from fedcomp.client.pipeline import build
    from fedcomp.spec import ModelSpec
    from fedcomp.wire import encode

    n = min(n, 2_000_000)
    spec = ModelSpec((("w", (n // 64, 64)), ("b", (64,)), ("s", (3,))))
    out = []
    for name in ENCODE_COMPRESSORS:
        gen = torch.Generator(device=device).manual_seed(seed)
        sizes, same = [], True
        for density in (0.001, 0.5):
            opts = {"density": density} if "+" in name or name == "dgc" else {}
            pipe = build(name, spec, backend="triton", **opts).to(device)
            for _ in range(2):
                blob = pipe.send({t: torch.randn(s, device=device, generator=gen) for t, s in spec.entries})
                same &= blob == encode(pipe.pending[pipe.last_seq], spec)
                sizes.append(len(blob))
            if not opts:
                break
        out.append(Case(f"encode {name}", n, same, f"blobs of {', '.join(map(str, sizes))} B: "
                        + ("the bytes of wire.encode" if same else "bytes differ from wire.encode")))
    return out


def run_checks(sizes: list[int], device, seed: int = 0) -> list[Case]:
    cases = []
    for n in sizes:
        for fn in (dgc_cases, select_cases, quant_cases, scatter_cases, pipeline_cases, group_cases, encode_cases):
            cases += fn(n, device, seed)
    return cases


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="1M,25M,100M", help="comma-separated element counts (K/M suffixes)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", metavar="PATH", help="also write the cases as JSON")
    ap.add_argument("--interpret", action="store_true", help="no GPU: Triton's interpreter on CPU tensors")
    args = ap.parse_args(argv)
    if args.interpret:
        os.environ["TRITON_INTERPRET"] = "1"  # before any kernel module (and so triton) is imported
    import torch

    if not args.interpret and not torch.cuda.is_available():
        print("check_kernels: no CUDA device here; --interpret checks the kernels on the CPU (small sizes)")
        return 0
    device = torch.device("cpu" if args.interpret else "cuda")
    name = "CPU (Triton interpreter)" if args.interpret else torch.cuda.get_device_name(device)
    cases = run_checks([parse_size(s) for s in args.sizes.split(",")], device, args.seed)
    print(f"device: {name}")
    width = max(len(c.name) for c in cases)
    for c in cases:
        print(f"{'ok  ' if c.ok else 'FAIL'} {c.name:<{width}} n={c.n:<11,} {c.detail}")
    failed = sum(not c.ok for c in cases)
    print(f"{len(cases) - failed}/{len(cases)} cases agree with the reference")
    if args.json:
        Path(args.json).write_text(json.dumps({"device": name, "cases": [asdict(c) for c in cases]}, indent=2))
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())

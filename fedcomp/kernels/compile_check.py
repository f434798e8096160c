"""Ahead-of-time compile check of the Triton kernels for an NVIDIA GPU architecture, on a machine without a GPU.

Triton's CPU interpreter (how CI checks the kernels' results) never runs Triton's compiler, so a kernel can pass
every interpreter test and still fail to compile, spill registers or lose its wide loads on a GPU. This module
closes that gap in two steps, in two processes (a process runs Triton either interpreted or compiled):

1. ``recording()``: under ``TRITON_INTERPRET=1``, the real launch code (``fedcomp.kernels``) runs on CPU tensors
   and every launch is recorded as a ``Launch``: the kernel, each argument's type and specialisation exactly as
   Triton's JIT derives them for the same values (pointer dtype, 16-byte alignment, ints divisible by 16, ints
   equal to 1 as constants), the constexprs and the launch options.
2. ``compile_launch(launch, arch)``: in a process without the interpreter, ``triton.compile`` builds the launch for
   ``sm_<arch>`` (PTX, then a cubin with the ptxas that ships with Triton), and the cubin is read with the
   bundled ``cuobjdump``/``nvdisasm``: registers, stack and local memory (spills), shared memory, an occupancy
   estimate and the global-memory instructions by width.

``python -m fedcomp.kernels.compile_check [--arch 90] [--json PATH]`` runs both (the recording in a child
process) over ``representative_launches()``; benchmarks/kernel_compile.py prints the report and a block-size
sweep; tests/test_kernels_compile.py asserts on it. Nothing here runs a kernel on a GPU or measures time.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import math
import os
import re
import subprocess
import sys
import tempfile
from collections import Counter
from collections.abc import Iterator
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

#: Hopper (H100/H200) and Ampere (A100): the datacenter GPUs the kernel path targets.
DEFAULT_ARCHS = (90, 80)
#: Per-SM limits used by the occupancy estimate (sm_80 and sm_90 share these but shared memory).
REGS_PER_SM, MAX_WARPS_PER_SM, MAX_BLOCKS_PER_SM = 65536, 64, 32
SHARED_PER_SM = {80: 164 * 1024, 90: 228 * 1024}


@dataclass(frozen=True)
class Launch:
    """One kernel launch as the JIT would specialise it.

    ``params``: per kernel parameter ``(name, type, spec)``; ``type`` is a Triton type string (``"*fp32"``,
    ``"i32"``, ``"fp32"``...) with ``spec`` its specialisation (``"D"``: divisible by 16 / 16-byte aligned, ``""``:
    none, ``None`` for floats), or ``"constexpr"`` with ``spec`` the value.
    """

    module: str
    kernel: str
    params: tuple[tuple[str, str, Any], ...]
    options: tuple[tuple[str, Any], ...]

    @property
    def constexprs(self) -> dict[str, Any]:
        return {name: spec for name, typ, spec in self.params if typ == "constexpr"}

    def label(self) -> str:
        """Kernel name with its constexprs and options, e.g. ``dgc_fused_kernel[NESTEROV=0 ... num_warps=8]``."""
        flags = [f"{k}={int(v) if isinstance(v, bool) else v}" for k, v in self.constexprs.items() if v is not None]
        flags += [f"{k}={v}" for k, v in self.options if k == "num_warps"]
        return f"{self.kernel}[{' '.join(flags)}]"

    def with_block(self, block: int, num_warps: int) -> Launch:
        """The same launch with another ``BLOCK`` constexpr and ``num_warps`` (for a compile-only sweep)."""
        params = tuple((n, t, block if n == "BLOCK" and t == "constexpr" else s) for n, t, s in self.params)
        options = tuple((k, num_warps if k == "num_warps" else v) for k, v in self.options)
        return replace(self, params=params, options=options)

    def to_json(self) -> dict:
        return {"module": self.module, "kernel": self.kernel, "params": [list(p) for p in self.params],
                "options": [list(o) for o in self.options]}

    @staticmethod
    def from_json(d: dict) -> Launch:
        return Launch(d["module"], d["kernel"], tuple(tuple(p) for p in d["params"]),
                      tuple(tuple(o) for o in d["options"]))


@dataclass(frozen=True)
class CompileReport:
    """What the compiler made of one launch for one architecture."""

    kernel: str
    label: str
    constexprs: dict[str, Any]
    arch: int
    registers: int  # per thread
    stack: int  # bytes per thread; > 0 means spills or a call stack
    local: int  # bytes per thread of local memory (spills)
    shared: int  # bytes per block, static + dynamic
    num_warps: int
    blocks_per_sm: int  # estimate from registers, shared memory and the hardware limits
    global_ops: dict[str, int]  # SASS global loads/stores/atomics by opcode, e.g. {"LDG.E.128": 12}
    flush_to_zero: list[str]  # PTX float instructions that flush subnormals (the torch reference never does)
    float_ops: dict[str, int]  # PTX fp32 fma/mul/add/sub counts: shows whether the compiler fused anything

    @property
    def occupancy(self) -> float:
        """Resident warps per SM over the maximum (an estimate: no driver reservation, no tail effects)."""
        return self.blocks_per_sm * self.num_warps / MAX_WARPS_PER_SM

    def count(self, prefix: str, width: int | None = None) -> int:
        """Number of SASS global ops whose opcode starts with ``prefix`` (``"LDG"``), of ``width`` bits if given."""
        def bits(op: str) -> int:
            m = re.search(r"\.(64|128)\b", op)
            return int(m.group(1)) if m else 32
        return sum(c for op, c in self.global_ops.items()
                   if op.startswith(prefix) and (width is None or bits(op) == width))


# ------------------------------------------------------------------------------------------------ recording


@contextlib.contextmanager
def recording() -> Iterator[list[Launch]]:
    """Record every Triton launch made inside the block (the launches still run, interpreted).

    Needs ``TRITON_INTERPRET=1`` set before triton was imported.
    """
    from triton.backends.nvidia.compiler import CUDABackend
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import native_specialize_impl

    launches: list[Launch] = []
    original = InterpretedFunction.run

    def run(self, *args, grid, warmup, **kwargs):
        launches.append(_describe(self, args, kwargs, CUDABackend, native_specialize_impl))
        return original(self, *args, grid=grid, warmup=warmup, **kwargs)

    InterpretedFunction.run = run
    try:
        yield launches
    finally:
        InterpretedFunction.run = original


def _describe(kernel, args, kwargs, backend, specialize) -> Launch:
    import inspect

    sig = inspect.signature(kernel.fn)
    bound = dict(zip(kernel.arg_names[: len(args)], args, strict=True))
    bound.update({k: v for k, v in kwargs.items() if k in sig.parameters})
    params = []
    for name, p in sig.parameters.items():
        value = bound.get(name, p.default)
        if "constexpr" in str(p.annotation):
            params.append((name, "constexpr", _plain(value)))
        else:
            typ, spec = specialize(backend, value, False, True, True)
            params.append((name, typ, _plain(spec)))
    options = tuple(sorted((k, v) for k, v in kwargs.items() if k not in sig.parameters))
    return Launch(kernel.fn.__module__, kernel.fn.__name__, tuple(params), options)


def _plain(value: Any) -> Any:
    """A JSON-friendly constexpr value (Triton may hand back its own constexpr wrapper)."""
    return getattr(value, "value", value)


def representative_launches() -> list[Launch]:
    """Run the launch code over every branch the dispatch can take, interpreted, and return the distinct
    launches: the DGC step (momentum or plain error feedback, Nesterov, clipping, masking, dense, re-selection,
    select-only; alone and batched), quantize-and-pack (int8, int4, QSGD, sign; stochastic; one tile or a separate
    scale pass; with and without a residual; many tensors at once, aligned or not), the scatter-add (sparse fp32
    and int8, dense), the write into many tensors (``put_many``) and the device wire encode. Sizes are multiples
    of 16, as large tensors are."""
    import torch

    from fedcomp.compressors.blockwise import BlockwiseConfig, Int4Quantizer, Int8Quantizer
    from fedcomp.compressors.qsgd import QSGDConfig, QSGDQuantizer
    from fedcomp.compressors.sign import SignConfig, SignQuantizer
    from fedcomp.kernels.quant import ef_quantize, quantize_all
    from fedcomp.kernels.scatter import put_many, scatter_add
    from fedcomp.payload import TensorPayload, Values

    if os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError("representative_launches() needs TRITON_INTERPRET=1 set before triton is imported")
    gen = torch.Generator().manual_seed(0)
    n, k = 8192, 16
    with recording() as launches:
        _dgc_launches(gen, n, k)
        quantizers = [Int8Quantizer(BlockwiseConfig(block=256, stochastic=False)),
                      Int8Quantizer(BlockwiseConfig(block=256)), Int8Quantizer(BlockwiseConfig(block=8192)),
                      Int4Quantizer(BlockwiseConfig(block=64)), QSGDQuantizer(QSGDConfig()),
                      QSGDQuantizer(QSGDConfig(levels=7)), SignQuantizer(SignConfig()),
                      SignQuantizer(SignConfig(block=512))]
        for q in quantizers:
            x = torch.randn(n, generator=gen)
            for pack in (False, True):
                ef_quantize(q, x, torch.zeros(n), pack=pack, backend="triton")
            ef_quantize(q, x, None, backend="triton")
        for q in (*quantizers[:2], quantizers[4], quantizers[7]):  # many tensors at once: int8, QSGD, sign by blocks
            xs = [torch.randn(n, generator=gen), torch.randn(n, generator=gen)]
            quantize_all(q, xs, [torch.zeros(n), torch.zeros(n)], backend="triton")
            quantize_all(q, xs, backend="triton")
        quantize_all(quantizers[0], list(torch.randn(2 * n + 1, generator=gen)[1:].split(n)), backend="triton")
        target = torch.zeros(n)
        idx = torch.randperm(n, generator=gen)[:k].sort().values
        vals = torch.randn(k, generator=gen)
        scatter_add(target, TensorPayload((n,), Values.f32(vals), idx), 0.5, backend="triton")
        q8 = Int8Quantizer(BlockwiseConfig(block=8)).quantize(vals, "t")
        scatter_add(target, TensorPayload((n,), q8, idx), 0.5, backend="triton")
        scatter_add(target, TensorPayload((n,), Values.f32(torch.randn(n, generator=gen))), 0.5, backend="triton")
        put_many([torch.zeros(n), torch.zeros(n)], [idx, idx], [vals, vals], backend="triton")
        _encode_launches(gen, n, k)
    return list(dict.fromkeys(launches))


def _dgc_launches(gen, n: int, k: int) -> None:
    """The DGC step's launches: every rule, alone and batched, dense, a re-selection, the select-only pass."""
    import torch

    from fedcomp.kernels.dgc import fused_dgc_step, plan_dgc_step, sample_plan, start_select
    from fedcomp.kernels.dgc_batch import start_dgc_steps
    from fedcomp.kernels.pending import resolve_all

    for momentum_state in (True, False):
        for nesterov, clip, masking in [(False, None, True), (True, 1.0, True), (False, None, False)]:
            if not momentum_state and (nesterov or clip or not masking):
                continue
            g = torch.randn(n, generator=gen)
            u = torch.randn(n, generator=gen) if momentum_state else None
            v = torch.randn(n, generator=gen)
            opts = dict(momentum=0.9, nesterov=nesterov, masking=masking, clip_norm=clip) if u is not None else {}
            fused_dgc_step(g, u, v, k=k, generator=gen, backend="triton", **opts)
            fused_dgc_step(g, u, v, k=k, dense=True, backend="triton", **opts)
            plans = [plan_dgc_step(g2, None if u is None else torch.zeros(n), torch.zeros(n), k=k, generator=gen,
                                   backend="triton", **opts) for g2 in (g, g * 2.0)]
            resolve_all(start_dgc_steps(plans))  # two tensors: the batched launches
    g, u, v = (torch.randn(n, generator=gen) for _ in range(3))
    probe = torch.Generator()
    probe.set_state(gen.get_state())  # the sample the step will draw: make it overestimate the threshold
    start, stride, _ = sample_plan(n, probe, 0.002, 16)
    v[start::stride] = 100.0  # the first pass selects too few: the re-selection kernel runs
    fused_dgc_step(g * 0.0, u * 0.0, v, k=n // 4, generator=gen, sample_rate=0.002, min_samples=16,
                   backend="triton", momentum=0.9)
    start_select(torch.randn(n, generator=gen), k, generator=gen).resolve()  # select-only (the group's)


def _encode_launches(gen, n: int, k: int) -> None:
    """The device wire encode of a sparse record: its index statistics and streams (``index_stats_kernel``,
    ``index_streams_kernel``) and the CRC (``crc32_chunks_kernel``)."""
    import torch

    from fedcomp.kernels.encode import device_encode
    from fedcomp.payload import TensorPayload, Update, Values
    from fedcomp.spec import ModelSpec

    idx = torch.randperm(n, generator=gen)[:k].sort().values
    payload = TensorPayload((n,), Values.f32(torch.randn(k, generator=gen)), idx)
    device_encode(Update({"w": payload}), ModelSpec([("w", (n,))]))


# ------------------------------------------------------------------------------------------------ compiling


def _tool(name: str) -> str:
    """Path of a CUDA binary tool shipped with Triton (``cuobjdump``, ``nvdisasm``)."""
    import triton

    path = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / name
    return str(path) if path.exists() else name


def compile_launch(launch: Launch, arch: int) -> CompileReport:
    """Compile ``launch`` for ``sm_<arch>`` and read the cubin. Raises whatever Triton's compiler raises.

    Needs a process without ``TRITON_INTERPRET`` (the kernels must be Triton JIT functions)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, make_backend

    fn = getattr(importlib.import_module(launch.module), launch.kernel)
    if not isinstance(fn, triton.runtime.jit.JITFunction):
        raise RuntimeError("compile_launch() needs a process without TRITON_INTERPRET=1")
    target = GPUTarget("cuda", arch, 32)
    backend = make_backend(target)
    signature = {name: typ for name, typ, _ in launch.params}
    constexprs = {(i,): spec for i, (_, typ, spec) in enumerate(launch.params) if typ == "constexpr"}
    attrs = {(i,): backend.parse_attr(spec) for i, (_, typ, spec) in enumerate(launch.params)
             if typ != "constexpr" and isinstance(spec, str)}
    options = dict(launch.options)
    kernel = triton.compile(ASTSource(fn, signature, constexprs, attrs), target=target, options=options)
    with tempfile.TemporaryDirectory() as tmp:
        cubin = Path(tmp) / "kernel.cubin"
        cubin.write_bytes(kernel.asm["cubin"])
        usage = subprocess.run([_tool("cuobjdump"), "--dump-resource-usage", str(cubin)],
                               capture_output=True, text=True, check=True).stdout
        sass = subprocess.run([_tool("nvdisasm"), "-c", str(cubin)], capture_output=True, text=True, check=True).stdout
    res = {k: int(v) for k, v in re.findall(r"\b(REG|STACK|SHARED|LOCAL):(\d+)", usage)}
    shared = res.get("SHARED", 0) + int(getattr(kernel.metadata, "shared", 0))
    num_warps = int(kernel.metadata.num_warps)
    ftz = sorted(set(re.findall(r"\b[a-z]+(?:\.[a-z0-9]+)*\.ftz(?:\.[a-z0-9]+)*", kernel.asm["ptx"])))
    flops = Counter(re.findall(r"\b((?:fma|mul|add|sub)\.rn\.f32)\b", kernel.asm["ptx"]))
    ops = Counter(re.findall(r"\b((?:LDG|STG|ATOMG|REDG|RED)(?:\.[A-Z0-9_]+)*)(?![A-Z0-9_])", sass))
    regs = res.get("REG", 0)
    return CompileReport(
        kernel=launch.kernel, label=launch.label(), constexprs=launch.constexprs, arch=arch, registers=regs,
        stack=res.get("STACK", 0), local=res.get("LOCAL", 0), shared=shared, num_warps=num_warps,
        blocks_per_sm=blocks_per_sm(regs, num_warps, shared, arch), global_ops=dict(sorted(ops.items())),
        flush_to_zero=ftz, float_ops=dict(sorted(flops.items())),
    )


def blocks_per_sm(registers: int, num_warps: int, shared: int, arch: int) -> int:
    """Resident blocks per SM: register file (allocated per warp in units of 256), shared memory (1 KiB
    reserved per block), warp and block limits."""
    per_warp = math.ceil(max(registers, 1) * 32 / 256) * 256
    by_regs = (REGS_PER_SM // per_warp) // num_warps
    by_shared = SHARED_PER_SM.get(arch, SHARED_PER_SM[90]) // (shared + 1024)
    return max(0, min(by_regs, by_shared, MAX_WARPS_PER_SM // num_warps, MAX_BLOCKS_PER_SM))


# ------------------------------------------------------------------------------------------------ command line


def record_in_child() -> list[Launch]:
    """``representative_launches()`` in a child process with the interpreter on (this process stays compiled)."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    code = ("import json, sys; from fedcomp.kernels.compile_check import representative_launches as r; "
            "json.dump([x.to_json() for x in r()], sys.stdout)")
    root = Path(__file__).resolve().parents[2]
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(root), env.get("PYTHONPATH")]))
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    if proc.returncode:
        raise RuntimeError(f"recording the launches failed:\n{proc.stderr[-4000:]}")
    out = proc.stdout
    return [Launch.from_json(d) for d in json.loads(out)]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m fedcomp.kernels.compile_check", description=__doc__.splitlines()[0])
    ap.add_argument("--arch", default=",".join(map(str, DEFAULT_ARCHS)),
                    help="comma-separated compute capabilities, e.g. 90 (H100/H200) or 80 (A100)")
    ap.add_argument("--launches", metavar="PATH", help="read recorded launches (JSON) instead of recording them")
    ap.add_argument("--json", metavar="PATH", help="also write the reports as JSON")
    args = ap.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET") == "1":
        ap.error("run without TRITON_INTERPRET=1: the compile step needs Triton's compiler")
    launches = ([Launch.from_json(d) for d in json.loads(Path(args.launches).read_text())]
                if args.launches else record_in_child())
    reports = [compile_launch(x, int(a)) for a in args.arch.split(",") for x in launches]
    print_reports(reports)
    if args.json:
        Path(args.json).write_text(json.dumps([asdict(r) for r in reports], indent=2))
    return 0


def print_reports(reports: list[CompileReport]) -> None:
    width = max(len(r.label) for r in reports)
    print(f"{'kernel':<{width}}  {'sm':>3} {'regs':>5} {'spill':>6} {'smem':>7} {'occ':>5}  global memory ops (SASS)")
    for r in reports:
        ops = ", ".join(f"{op} x{c}" for op, c in r.global_ops.items())
        ftz = f"  FTZ: {', '.join(r.flush_to_zero)}" if r.flush_to_zero else ""
        print(f"{r.label:<{width}}  {r.arch:>3} {r.registers:>5} {r.stack + r.local:>6} {r.shared:>7} "
              f"{r.occupancy:>5.0%}  {ops}{ftz}")


if __name__ == "__main__":
    raise SystemExit(main())

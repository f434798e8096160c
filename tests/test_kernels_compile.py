"""The Triton kernels compiled for Hopper (sm_90) with Triton's compiler, on this GPU-less machine.

The interpreter tests (tests/test_kernels.py) check the kernels' results but never run Triton's compiler. Here
every launch the dispatch makes (recorded under the interpreter, see fedcomp/kernels/compile_check.py) is compiled
for sm_90 in a child process and the cubin is checked: it compiles, nothing spills, the streaming loads are
128-bit, the DGC kernels take no atomics, and no float instruction flushes subnormals
(the torch reference keeps them). The only skip is triton not being installed.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402

triton = pytest.importorskip("triton", reason="triton not installed")

from fedcomp.kernels import compile_check  # noqa: E402
from fedcomp.kernels.compile_check import blocks_per_sm, recording  # noqa: E402
from fedcomp.kernels.scatter import scatter_add  # noqa: E402
from fedcomp.payload import TensorPayload, Values  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
KERNEL_FILES = sorted((ROOT / "fedcomp" / "kernels").glob("_triton_*.py"))


@pytest.fixture(scope="module")
def reports(tmp_path_factory) -> list[dict]:
    """``python -m fedcomp.kernels.compile_check --arch 90`` in a process without the interpreter."""
    out = tmp_path_factory.mktemp("compile") / "reports.json"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(ROOT)
    proc = subprocess.run([sys.executable, "-m", "fedcomp.kernels.compile_check", "--arch", "90", "--json", str(out)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(out.read_text())


def by_kernel(reports: list[dict], kernel: str, **constexprs) -> list[dict]:
    return [r for r in reports if r["kernel"] == kernel
            and all(r["constexprs"].get(k) == v for k, v in constexprs.items())]


def count(report: dict, prefix: str, width: int) -> int:
    return compile_check.CompileReport(**report).count(prefix, width)


def test_every_kernel_and_branch_is_compiled(reports):
    defined = {line.split("(")[0].removeprefix("def ").strip()
               for f in KERNEL_FILES for line in f.read_text().splitlines()
               if line.startswith("def ") and line.split("(")[0].endswith("_kernel")}
    assert defined == {r["kernel"] for r in reports}
    fused = by_kernel(reports, "dgc_fused_kernel")
    for flag in ("NESTEROV", "HAS_SCALE", "HAS_U", "DENSE", "MARK"):
        assert {r["constexprs"][flag] for r in fused} == {False, True}, flag
    multi = by_kernel(reports, "dgc_multi_fused_kernel")
    for flag in ("NESTEROV", "HAS_SCALE", "HAS_U"):
        assert {r["constexprs"][flag] for r in multi} == {False, True}, flag
    assert {r["constexprs"]["MASKING"] for r in by_kernel(reports, "dgc_multi_place_kernel")} == {False, True}
    place = by_kernel(reports, "dgc_place_kernel")
    assert {(r["constexprs"]["TAKE"], r["constexprs"]["MASKING"]) for r in place} == {(True, True), (True, False),
                                                                                       (False, False)}
    quant = by_kernel(reports, "quant_tile_kernel") + by_kernel(reports, "quant_1d_kernel")
    assert {r["constexprs"]["MODE"] for r in quant} == {0, 1, 2}
    assert {r["constexprs"]["PACK_BITS"] for r in quant} == {0, 1, 4}
    assert {r["constexprs"]["STOCHASTIC"] for r in quant} == {False, True}
    many = by_kernel(reports, "quant_many_kernel")
    for flag, seen in (("MODE", {0, 1, 2}), ("STOCHASTIC", {False, True}), ("READ_E", {False, True}),
                       ("ALIGNED", {False, True})):
        assert {r["constexprs"][flag] for r in many} == seen, flag
    assert {(r["constexprs"]["SPARSE"], r["constexprs"]["QUANT"]) for r in by_kernel(reports, "scatter_add_kernel")} \
        == {(True, False), (True, True), (False, False)}


def test_nothing_spills(reports):
    spilled = [(r["label"], r["stack"], r["local"]) for r in reports if r["stack"] or r["local"]]
    assert spilled == []


def test_no_float_instruction_flushes_subnormals(reports):
    assert [(r["label"], r["flush_to_zero"]) for r in reports if r["flush_to_zero"]] == []


def test_float_arithmetic_is_compiled_as_written(reports):
    """``enable_fp_fusion=False`` holds: the DGC update has exactly its explicit fmas (plain momentum: one fma and
    one add per element; Nesterov with clipping: four fmas and one multiply), and the quantizer's error
    ``c - q * scale`` is a multiply and a subtract (two roundings, as the reference), never an fma."""
    for r in by_kernel(reports, "dgc_fused_kernel"):
        c = r["constexprs"]
        per_thread = c["BLOCK"] // (32 * r["num_warps"])
        if c["HAS_U"] and not c["NESTEROV"] and not c["HAS_SCALE"]:
            expect = {"fma.rn.f32": per_thread, "add.rn.f32": per_thread}
        elif c["NESTEROV"] and c["HAS_SCALE"]:
            expect = {"fma.rn.f32": 4 * per_thread, "mul.rn.f32": per_thread}
        elif not c["HAS_U"]:
            expect = {"add.rn.f32": per_thread}
        else:
            continue
        assert r["float_ops"] == expect, r["label"]
    for r in by_kernel(reports, "dgc_multi_fused_kernel"):  # the batch: the same update, written twice (full
        c = r["constexprs"]                                    # blocks and a tensor's last block)
        alone = by_kernel(reports, "dgc_fused_kernel", DENSE=False, **{k: c[k] for k in ("NESTEROV", "HAS_SCALE",
                                                                                          "HAS_U", "BLOCK")})
        assert alone and r["float_ops"] == {op: 2 * n for op, n in alone[0]["float_ops"].items()}, r["label"]
    for r in (by_kernel(reports, "quant_tile_kernel", HAS_E=True) + by_kernel(reports, "quant_1d_kernel", WRITE_E=True)
              + by_kernel(reports, "quant_many_kernel")):
        assert "fma.rn.f32" not in r["float_ops"] and r["float_ops"].get("sub.rn.f32", 0) > 0, r["label"]


def test_streaming_passes_load_128_bits(reports):
    """g, u, v (and x, e, the dense aggregate) are read with 16-byte loads, one per 4 elements a thread holds;
    32-bit loads are only the scalars (threshold, clip scale), the per-element scale gather of the
    large-block quantizer and the batched DGC pass's masked last block of a tensor."""

    def vectors(r):  # 16-byte accesses per streamed tensor
        return r["constexprs"]["BLOCK"] // (32 * r["num_warps"]) // 4

    for r in by_kernel(reports, "dgc_fused_kernel", HAS_U=True):  # g, u, v
        assert count(r, "LDG", 128) >= 3 * vectors(r) and count(r, "LDG", 32) <= 2, r["label"]
    for r in by_kernel(reports, "dgc_fused_kernel", HAS_U=False):  # g, v
        assert count(r, "LDG", 128) >= 2 * vectors(r) and count(r, "LDG", 32) <= 2, r["label"]
    for r in by_kernel(reports, "dgc_multi_fused_kernel"):  # the batch's full blocks: pointers from its table
        streams = 3 if r["constexprs"]["HAS_U"] else 2
        assert count(r, "LDG", 128) >= streams * vectors(r) and count(r, "STG", 128) >= (streams - 1) * vectors(r), \
            r["label"]
    for r in by_kernel(reports, "quant_tile_kernel") + by_kernel(reports, "scatter_add_kernel", SPARSE=False):
        assert count(r, "LDG", 128) > 0 and count(r, "LDG", 32) == 0, r["label"]
    for r in by_kernel(reports, "quant_many_kernel", ALIGNED=True):  # many tensors: full tiles, pointers from the table
        assert count(r, "LDG", 128) > 0, r["label"]
    for r in by_kernel(reports, "dgc_fused_kernel", DENSE=True):  # the values and v
        assert count(r, "STG", 128) >= 2 * vectors(r) and count(r, "STG", 32) == 0, r["label"]


def test_the_dgc_kernels_take_no_atomics(reports):
    """The selection is placed by block counts, a cumsum and the place kernel: no atomic anywhere in the DGC
    kernels (the same input gives the same buffer); the mark kernel reads x with 16-byte loads."""
    dgc = [r for r in reports if r["kernel"].startswith("dgc_")]
    assert {r["kernel"] for r in dgc} == {"dgc_sample_kernel", "dgc_fused_kernel", "dgc_mark_kernel",
                                          "dgc_place_kernel", "dgc_multi_sample_kernel", "dgc_multi_fused_kernel",
                                          "dgc_multi_place_kernel"}
    for r in dgc:
        assert not any(op.startswith(("ATOMG", "RED")) for op in r["global_ops"]), r["label"]
    for r in by_kernel(reports, "dgc_mark_kernel"):
        vectors = r["constexprs"]["BLOCK"] // (32 * r["num_warps"]) // 4
        assert count(r, "LDG", 128) >= vectors, r["label"]
    for r in by_kernel(reports, "scatter_add_kernel", SPARSE=True):  # one fire-and-forget float add per element
        per_thread = r["constexprs"]["BLOCK"] // (32 * r["num_warps"])
        assert sum(c for op, c in r["global_ops"].items() if op.startswith("REDG.E.ADD.F32")) == per_thread, r["label"]


def test_recording_specialises_like_the_jit():
    """Aligned tensors and ints divisible by 16 get "D", an offset view and other ints get "", an int equal
    to 1 becomes a constant, floats are not specialised: the rules of Triton's JIT for the same values."""
    target = torch.zeros(64)
    payload = TensorPayload((63,), Values.f32(torch.ones(3)), torch.tensor([0, 5, 62]))
    with recording() as launches:
        scatter_add(target, TensorPayload((64,), Values.f32(torch.ones(3)), torch.tensor([0, 5, 63])), 0.5,
                    backend="triton")
        scatter_add(target[1:], payload, 0.5, backend="triton")
    assert len(launches) == 2
    first, second = ({name: (typ, spec) for name, typ, spec in x.params} for x in launches)
    assert first["t_ptr"] == ("*fp32", "D") and second["t_ptr"] == ("*fp32", "")
    assert first["idx_ptr"] == ("*i64", "D")
    assert first["nnz"] == ("i32", "") and first["block"] == ("constexpr", 1)
    assert first["weight"] == ("fp32", None)
    assert first["SPARSE"] == ("constexpr", True) and dict(launches[0].options)["num_warps"] == 4
    # recorded launches still run: the second one adds at 1 + (0, 5, 62)
    assert target[[0, 1, 5, 6, 63]].tolist() == [0.5, 0.5, 0.5, 0.5, 1.0] and target.sum() == 3.0


def test_occupancy_estimate_by_hand():
    # 138 registers: 18 units of 256 per warp = 4,608 -> 14 warps of the 65,536 -> one block of 8 warps
    assert blocks_per_sm(138, 8, 17408, 90) == 1
    # 32 registers: 1,024 per warp -> 64 warps -> 8 blocks of 8 warps (the warp limit, too)
    assert blocks_per_sm(32, 8, 0, 90) == 8
    # shared memory bound: 100 KiB per block (+1 KiB reserved) -> 2 blocks in 228 KiB, 1 in sm_80's 164 KiB
    assert blocks_per_sm(32, 4, 100 * 1024, 90) == 2 and blocks_per_sm(32, 4, 100 * 1024, 80) == 1

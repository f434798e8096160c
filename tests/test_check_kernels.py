"""benchmarks/check_kernels.py and benchmarks/bench_kernels.py, the scripts a GPU session runs, exercised here
under Triton's interpreter at small sizes: the checks pass on the real kernels and catch a broken one."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402

triton = pytest.importorskip("triton", reason="triton not installed")

import fedcomp.kernels.quant as kquant  # noqa: E402
import fedcomp.kernels.scatter as kscatter  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def load(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_every_case_agrees_with_the_reference():
    cases = load("check_kernels").run_checks([20_000, 70_001], torch.device("cpu"), seed=3)
    assert len(cases) == 2 * (25 + 2 + 9)
    assert [c.name for c in cases if not c.ok] == []
    assert not any(c.detail.startswith("0 sent") for c in cases)  # every thresholded case selects something


def test_a_wrong_kernel_is_reported(monkeypatch):
    real_scatter, real_quant = kscatter.scatter_add, kquant.ef_quantize

    def scatter(target, payload, weight=1.0, *, backend=None):
        real_scatter(target, payload, weight * (1.001 if backend == "triton" else 1.0), backend=backend)

    def quant(q, x, residual=None, **kw):
        out = real_quant(q, x, residual, **kw)
        if kw.get("backend") == "triton":
            out.values.data[0] = -out.values.data[0] if out.values.data[0] != 0 else 1
        return out

    monkeypatch.setattr(kscatter, "scatter_add", scatter)
    monkeypatch.setattr(kquant, "ef_quantize", quant)
    cases = load("check_kernels").run_checks([20_000], torch.device("cpu"))
    failed = {c.name for c in cases if not c.ok}
    assert {"scatter-add fp32 sparse", "scatter-add int8 sparse", "scatter-add dense"} <= failed
    assert {"quant int8 nearest", "quant int4 nearest", "quant sign", "quant int8 stochastic", "quant qsgd"} <= failed
    assert not any(name.startswith("dgc") for name in failed)


def test_scripts_run_end_to_end(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    check = subprocess.run([sys.executable, "benchmarks/check_kernels.py", "--interpret", "--sizes", "5K",
                            "--json", str(tmp_path / "check.json")], cwd=ROOT, env=env, capture_output=True, text=True)
    assert check.returncode == 0, check.stdout + check.stderr
    assert all(c["ok"] for c in json.loads((tmp_path / "check.json").read_text())["cases"])
    bench = subprocess.run([sys.executable, "benchmarks/bench_kernels.py", "--interpret", "--sizes", "5K", "--reps",
                            "1", "--sweep", "--json", str(tmp_path / "bench.json")], cwd=ROOT, env=env,
                           capture_output=True, text=True)
    assert bench.returncode == 0, bench.stdout + bench.stderr
    out = json.loads((tmp_path / "bench.json").read_text())
    assert [row["n"] for row in out["sizes"]] == [5000]
    assert {"dgc", "int8_ef", "scatter_add", "copy"} <= set(out["sizes"][0])
    assert len(out["sweep"]) == 2 and all(r["step_s"] > 0 for r in out["sweep"])

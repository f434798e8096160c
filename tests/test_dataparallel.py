"""The in-process data-parallel runner and the `fedcomp dp` command, on tiny budgets."""

import json

import pytest

from fedcomp.tools.cli import main
from fedcomp.tools.dataparallel import DPConfig, run


def tiny(**kw):
    return DPConfig(**{"epochs": 2, "workers": 2, "batch_size": 64, "model": "mlp", "warmup_epochs": 1.0, **kw})


def test_same_seed_same_result_and_learning():
    a, b = run(tiny(method="dgc")), run(tiny(method="dgc"))
    assert a.history == b.history and a.uplink_bytes == b.uplink_bytes
    assert a.accuracy > 30.0  # 10 classes: chance is 10%
    assert run(tiny(method="dgc", seed=1)).history != a.history


def test_byte_accounting():
    dense, dgc = run(tiny(method="dense")), run(tiny(method="dgc"))
    # dense messages are the fp32 model plus a small header
    assert 0.95 < dense.compression < 1.0
    assert dgc.uplink_bytes < dense.uplink_bytes / 3
    # warm-up is the first epoch of two; the rest runs at 0.1% density so it must be much cheaper per step
    assert dgc.steady_compression > 2 * dgc.compression
    assert dgc.warmup_steps == dgc.steps // 2


def test_bad_config():
    with pytest.raises(ValueError, match="unknown method"):
        DPConfig(method="gzip")
    with pytest.raises(ValueError, match="lr_schedule"):
        DPConfig(lr_schedule="step")


def test_cli_writes_outputs(tmp_path, capsys):
    rc = main(["dp", "--methods", "dense,dgc+int8", "--epochs", "1", "--model", "mlp", "--workers", "2",
               "--out", str(tmp_path)])
    assert rc == 0
    out = capsys.readouterr().out
    assert "dgc+int8" in out and "compression" in out
    def no_nan(constant: str):  # standard JSON has no NaN or Infinity: other readers refuse them
        raise AssertionError(f"summary.json holds {constant}")

    summary = json.loads((tmp_path / "summary.json").read_text(), parse_constant=no_nan)
    assert [r["method"] for r in summary["runs"]] == ["dense", "dgc+int8"]
    assert summary["runs"][1]["steady_compression"] is None  # one epoch is all warm-up: no steady figure
    assert (tmp_path / "summary.csv").read_text().startswith("method,")
    assert (tmp_path / "accuracy.png").stat().st_size > 10_000


def test_cli_rejects_bad_method(capsys):
    assert main(["dp", "--methods", "nope", "--epochs", "1"]) == 2
    assert "unknown method" in capsys.readouterr().err

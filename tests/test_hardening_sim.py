"""Simulation CLI traps (issue 14, item 9): a folder named like a built-in scenario, a ``--set run.KEY`` that every
method shadows, kebab-case keys in errors about snake_case scenario keys, ``sim --bogus`` and ``None`` in tables."""

from __future__ import annotations

import pytest

from fedcomp.tools.cli import main
from simulations import scenario as scenarios
from simulations.report import summary_table
from simulations.runner import MethodResult


def test_a_folder_named_like_a_built_in_scenario_does_not_hide_it(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "tiny").mkdir()  # what an earlier `fedcomp sim tiny --out tiny` leaves
    assert scenarios.scenario_path("tiny") == scenarios.SCENARIO_DIR / "tiny.toml"
    assert scenarios.load("tiny").name == "tiny"


def test_a_run_override_that_every_method_shadows_is_an_error(capsys, tmp_path):
    code = main(["sim", "tiny", "--quiet", "--out", str(tmp_path / "o"), "--set", "run.compressor=nosuch"])
    err = capsys.readouterr().err
    assert code == 2 and "run.compressor" in err and "method.fedavg" in err, err
    assert not (tmp_path / "o").exists()
    scenarios.load("tiny", ["run.local_steps=3"])  # a key the methods leave alone is fine


def test_errors_name_scenario_keys_as_the_scenario_spells_them(capsys, tmp_path):
    code = main(["sim", "tiny", "--quiet", "--out", str(tmp_path / "o"), "--set", "run.task_timeout=-1"])
    err = capsys.readouterr().err
    assert code == 2 and "task_timeout" in err and "task-timeout" not in err, err
    with pytest.raises(scenarios.ConfigError, match="compressor_options"):
        scenarios.load("tiny", ["method.fedavg.compressor_options=bogus"])


def test_an_unknown_flag_shows_the_subcommand_usage(capsys):
    with pytest.raises(SystemExit) as info:
        main(["sim", "tiny", "--bogus"])
    err = capsys.readouterr().err
    assert info.value.code == 2 and "usage: fedcomp sim" in err and "--bogus" in err, err


def test_tables_show_a_dash_not_none():
    summary = {"method": "m", "mode": "async", "compressor": "dgc", "versions": 3, "accuracy": 0.5,
               "delta_accuracy": 0.0, "time_to_target_s": None, "speedup": None, "up_bytes": 1, "down_bytes": 2,
               "virtual_s": 1.0, "wall_s": 0.1}
    text = summary_table([MethodResult("m", [], summary)])
    assert "None" not in text and " - " in f"{text} ", text

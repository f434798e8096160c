"""``--help`` tells what a newcomer needs: every value flag's default, every model and scenario by name."""

from __future__ import annotations

import argparse

import pytest

from fedcomp.task.models import MODELS
from fedcomp.tools.cli import all_commands
from server_app import launcher
from simulations import scenario as scenarios


def _parser(command: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=f"fedcomp {command}")
    all_commands()[command].setup(p)
    return p


def _value_flags(p: argparse.ArgumentParser) -> list[argparse.Action]:
    return [a for a in p._actions if a.option_strings and a.nargs != 0 and a.dest not in ("help", "overrides")]


@pytest.mark.parametrize("command", ["dp", "inspect"])
def test_every_value_flag_of_a_command_shows_its_default(command):
    p = _parser(command)
    flags = _value_flags(p)
    assert flags
    for action in flags:
        shown = p._get_formatter()._expand_help(action)
        assert f"default: {action.default}" in shown, (action.dest, shown)


def test_flower_server_shows_the_apps_run_config_defaults_and_every_model():
    p = launcher.parser()
    defaults = launcher.app_defaults(launcher.default_app_dir())
    run_flags = [a for a in p._actions if a.dest in launcher.SHORTCUTS]
    assert len(run_flags) == len(launcher.SHORTCUTS)
    for action in run_flags:
        want = str(defaults[launcher.SHORTCUTS[action.dest]]) or "''"
        assert f"(default: {want})" in p._get_formatter()._expand_help(action), action.dest
    model = next(a for a in run_flags if a.dest == "model")
    assert all(name in model.help for name in MODELS.names()), model.help


def test_fedcomp_sim_names_every_built_in_scenario():
    text = _parser("sim").format_help()
    names = scenarios.built_in_names()
    assert "main" in names and len(names) >= 3
    assert all(name in text for name in names), text

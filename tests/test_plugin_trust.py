"""A run config is data: it makes a client node import only the plug-in modules the node's operator allowed.

Run-config overrides are not covered by Flower's FAB signatures, so anyone who may submit a run could otherwise
name ``os:system`` as a dataset and have every client call it. These tests give the node's side of that contract:
nothing of a module that is not allowed is imported (a module with an import-time side effect proves it), an
allowed module cannot be used as a door to another (attributes that are modules, objects defined elsewhere,
private names), plug-in options are plain values, and the refusal names the flag that allows it.
"""

from __future__ import annotations

import shlex
import sys
import textwrap

import pytest
from flwr.app import Context, RecordDict
from hypothesis import given
from hypothesis import strategies as st

from fedcomp.registry import ConfigError
from fedcomp.task.config import NodeConfig, RunConfig, parse_options
from fedcomp.task.plugins import NODE_DEFAULT, TRUSTED, PluginNotAllowed, PluginPolicy

SIDE_EFFECT_MODULE = textwrap.dedent('''
    import pathlib, torch
    from torch.utils.data import TensorDataset
    pathlib.Path(__file__).with_name("IMPORTED").write_text("imported")


    def make_net(hidden=8):
        return torch.nn.Linear(4, hidden)
''')


@pytest.fixture
def marker_module(tmp_path, monkeypatch):
    """``evilmod`` on sys.path: importing it writes ``IMPORTED`` beside it."""
    (tmp_path / "evilmod.py").write_text(SIDE_EFFECT_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield tmp_path
    sys.modules.pop("evilmod", None)


def test_the_issue_reproduction_runs_nothing(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(PluginNotAllowed, match="--allow-plugin os"):
        RunConfig.from_flower({"dataset": "os:system", "dataset-options": "command='touch F'"})
    assert not (tmp_path / "F").exists()


@pytest.mark.parametrize("key", ["model", "dataset", "loss"])
def test_a_module_the_node_did_not_allow_is_never_imported(marker_module, key):
    with pytest.raises(PluginNotAllowed, match="flower-client --allow-plugin evilmod") as err:
        RunConfig.from_flower({key: "evilmod:make_net"})
    assert "\n" not in str(err.value)  # one line, naming the flag
    assert "evilmod" not in sys.modules and not (marker_module / "IMPORTED").exists()
    with pytest.raises(PluginNotAllowed):  # another allowed module is no door to this one
        RunConfig.from_flower({key: "evilmod:make_net"}, plugins=PluginPolicy.parse("evil other"))
    assert "evilmod" not in sys.modules


def test_the_client_task_reads_the_allow_list_from_its_node(marker_module):
    from clients.bench import configs

    run_config = {"model": "evilmod:make_net"}
    with pytest.raises(PluginNotAllowed, match="--allow-plugin evilmod"):
        configs(Context(1, 7, {"partition-id": 0, "num-partitions": 1}, RecordDict(), run_config))
    assert not (marker_module / "IMPORTED").exists()
    node = {"partition-id": 0, "num-partitions": 1, "allow-plugins": "evilmod"}
    run, _ = configs(Context(1, 7, node, RecordDict(), run_config))
    assert run.model == "evilmod:make_net" and (marker_module / "IMPORTED").exists()


def test_an_allowed_module_is_no_door_to_other_code(marker_module):
    allowed = PluginPolicy.parse("evilmod")
    for name, match in [
        ("evilmod:torch.load", "modules are not plug-ins"),  # through an imported module
        ("evilmod:TensorDataset", "defined in 'torch.utils.data.dataset'"),  # imported into the allowed module
        ("evilmod:make_net.__globals__", "public names only"),
        ("evilmod:_private", "public names only"),
        (".evilmod:make_net", "public names only"),
    ]:
        with pytest.raises(ConfigError, match=match):
            RunConfig(model=name, plugins=allowed)
    assert RunConfig(model="evilmod:make_net", plugins=allowed).plugins == allowed


def test_the_policy_allows_a_module_and_its_submodules_only():
    policy = PluginPolicy.parse("pkg, other.nets")
    assert policy.allows("pkg") and policy.allows("pkg.sub.mod") and policy.allows("other.nets.resnet")
    assert not policy.allows("pkgx") and not policy.allows("other") and not policy.allows("os")
    assert not NODE_DEFAULT.allows("pkg") and TRUSTED.allows("os") and PluginPolicy.parse("*") == TRUSTED
    assert PluginPolicy.parse(policy.to_text()) == policy
    with pytest.raises(ConfigError, match="not module names: a/b"):
        PluginPolicy.parse("ok a/b")
    with pytest.raises(ConfigError, match="allow-plugins"):
        NodeConfig.from_flower({"allow-plugins": "x;rm"})
    assert NodeConfig.from_flower({"allow-plugins": "a b"}).plugins == PluginPolicy(frozenset({"a", "b"}))


def test_the_node_process_environment_allows_too(monkeypatch):
    monkeypatch.setenv("FEDCOMP_ALLOW_PLUGINS", "envpkg")
    both = PluginPolicy(frozenset({"flagpkg", "envpkg"}))
    assert NodeConfig.from_flower({"allow-plugins": "flagpkg"}).plugins == both
    monkeypatch.delenv("FEDCOMP_ALLOW_PLUGINS")
    assert not NodeConfig().plugins.allows("envpkg")


def test_the_allow_list_is_no_run_config_key():
    with pytest.raises(ConfigError, match="unknown run config key 'plugins'"):
        RunConfig.from_flower({"plugins": "*", "model": "os:system"})


def test_the_launcher_passes_allow_plugin_to_its_node(capsys):
    from clients.launcher import node_config, parser

    args = parser().parse_args(["--server", "h:1", "--allow-plugin", "mypkg", "--allow-plugin", "other.nets"])
    assert 'allow-plugins="mypkg other.nets"' in node_config(args)
    assert "allow-plugins" not in node_config(parser().parse_args(["--server", "h:1"]))


def _is_number(word: str) -> bool:
    try:
        float(word)
    except ValueError:
        return False
    return True


def _spell(value: object) -> str:
    """A value as a run config writes it: ``true``, ``0.1``, ``12``, ``name``."""
    return str(value).lower() if isinstance(value, bool) else repr(value) if isinstance(value, float) else str(value)


_WORDS = st.text("abcxyz/._-", min_size=1, max_size=8).filter(
    lambda w: not _is_number(w) and w.lower() not in ("true", "false"))
_VALUES = st.one_of(st.integers(-10**12, 10**12), st.floats(allow_nan=False, allow_infinity=False), st.booleans(),
                    _WORDS, st.lists(_WORDS, min_size=2, max_size=3).map(" ".join))


@given(st.dictionaries(st.from_regex(r"[a-z_][a-z0-9_]{0,6}", fullmatch=True), _VALUES, max_size=5),
       st.sampled_from([" ", ",", " , "]))
def test_plugin_options_are_plain_values(options, sep):
    """Options come back as the plain values they spell (int, float, bool or str), never another type, so a plug-in
    receives nothing a run config could not write; anything else is refused."""
    text = sep.join(f"{k}={shlex.quote(_spell(v))}" for k, v in options.items())
    opts = parse_options(text, "dataset-options")
    assert opts == options and all(type(opts[k]) is type(v) for k, v in options.items()), (text, opts)


@given(st.text(max_size=60))
def test_any_option_text_is_plain_values_or_a_config_error(text):
    try:
        opts = parse_options(text, "dataset-options")
    except ConfigError:
        return
    assert all(type(v) in (int, float, bool, str) for v in opts.values())

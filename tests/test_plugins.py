"""Bring your own model, dataset and loss: selected only by config, nothing registered in fedcomp's source.

The user module is written into the test's temporary folder: a model factory, a dataset factory over a
scikit-learn table (wine: 178 rows x 13 features, 3 classes) returning plain ``TensorDataset``s, and a loss.
"""

from __future__ import annotations

import json
import textwrap

import pytest
import torch
from torch.utils.data import TensorDataset

from fedcomp.registry import ConfigError
from fedcomp.task.config import NodeConfig, RunConfig
from fedcomp.task.data import Split, load_dataset
from fedcomp.task.plugins import LOSSES, TRUSTED, build_loss, resolve
from fedcomp.task.training import (
    datasets,
    evaluate,
    input_shape,
    labels,
    loader,
    make_model,
    node_partition,
    num_classes,
    run_loss,
)

USER_MODULE = textwrap.dedent('''
    import torch
    from sklearn.datasets import load_wine
    from torch.utils.data import TensorDataset

    CALLS = []


    def make_data(test_fraction=0.25, seed=0):
        x, y = load_wine(return_X_y=True)
        x = torch.tensor((x - x.mean(0)) / x.std(0), dtype=torch.float32)
        y = torch.tensor(y, dtype=torch.long)
        perm = torch.randperm(len(x), generator=torch.Generator().manual_seed(seed))
        cut = int(len(x) * (1 - test_fraction))
        return TensorDataset(x[perm[:cut]], y[perm[:cut]]), TensorDataset(x[perm[cut:]], y[perm[cut:]])


    def make_net(hidden=32):
        return torch.nn.Sequential(torch.nn.Linear(13, hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, 3))


    def smooth_ce(output, target):
        CALLS.append(len(target))
        return torch.nn.functional.cross_entropy(output, target, label_smoothing=0.05)


    NOT_CALLABLE = 3
''')

PLUGIN = {"model": "winemod:make_net", "dataset": "winemod:make_data", "loss": "winemod:smooth_ce"}


@pytest.fixture
def winemod(tmp_path, monkeypatch):
    (tmp_path / "winemod.py").write_text(USER_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield tmp_path
    import sys

    sys.modules.pop("winemod", None)


def test_a_user_module_is_resolved_by_import_path(winemod):
    import winemod as mod

    run = RunConfig(**PLUGIN, model_options="hidden=16", dataset_options="test_fraction=0.5", plugins=TRUSTED)
    train, test = datasets(run)
    assert isinstance(train, TensorDataset) and len(train) == 89 and len(test) == 89
    model = make_model(run, train)
    assert model[0].out_features == 16
    torch.testing.assert_close(make_model(run, train)[0].weight, model[0].weight)  # seeded by run.seed
    part = node_partition(run, NodeConfig(1, 3))
    assert 25 <= len(part) <= 35 and set(labels(part)) <= {0, 1, 2}
    assert input_shape(part) == (1, 1, 13) and num_classes(part) == 3
    res = evaluate(model, test, torch.device("cpu"), loss=run_loss(run))
    assert mod.CALLS and res["num_examples"] == 89.0 and 0.0 <= res["accuracy"] <= 1.0


def test_unknown_or_broken_plugins_fail_when_the_config_is_built(winemod):
    for key, value, match in [
        ("model", "nosuch", "unknown model 'nosuch'; known: cnn, cnn1d, mlp"),
        ("model", "winemod:nowhere", "has no attribute"),
        ("model", "winemod:NOT_CALLABLE", "not callable"),
        ("dataset", "nomodule_xyz:make", "cannot import"),
        ("loss", "hinge2", "unknown loss"),
    ]:
        with pytest.raises(ConfigError, match=match):
            RunConfig(**{key: value}, plugins=TRUSTED)
    with pytest.raises(ConfigError, match=r"model-options: unknown option\(s\) \['depthh'\]"):
        RunConfig(model="mlp", model_options="depthh=3")
    for option in ("num_classes=3", "in_shape=5"):  # the dataset's: passed, they were a TypeError mid-build
        with pytest.raises(ConfigError, match=r"model-options: unknown option"):
            RunConfig(model="mlp", model_options=option)
    with pytest.raises(ConfigError, match="dataset-options"):
        RunConfig(dataset="digits", dataset_options="rot=3")
    with pytest.raises(ConfigError, match="must return a torch.nn.Module"):
        make_model(RunConfig(model="winemod:make_data", plugins=TRUSTED), load_dataset("digits")[0])


def test_installed_entry_points_are_found(winemod):
    dist = winemod / "winemod_plugin-0.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: winemod-plugin\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text(
        "[fedcomp.models]\nwine-net = winemod:make_net\n[fedcomp.datasets]\nwine = winemod:make_data\n"
    )
    run = RunConfig(model="wine-net", dataset="wine")
    assert len(datasets(run)[0]) == 133 and make_model(run, datasets(run)[0])[0].in_features == 13
    with pytest.raises(ConfigError, match="wine-net"):
        resolve("nosuch", LOSSES, "fedcomp.models")  # the error lists the installed plug-ins too


def test_builtin_datasets_meet_the_plugin_contract():
    train, test = load_dataset("digits")
    x, y = train[3]
    assert isinstance(train, torch.utils.data.Dataset) and x.shape == (1, 8, 8) and int(y) == int(train.y[3])
    batches = list(loader(train, 500, torch.Generator().manual_seed(0)))
    assert [len(b[1]) for b in batches] == [500, 500, 437] and isinstance(batches[0][0], torch.Tensor)
    seen = torch.cat([b[1] for b in batches]).sort().values
    assert torch.equal(seen, train.y.sort().values)  # one epoch: every sample once
    assert isinstance(node_partition(RunConfig(), NodeConfig(0, 2)), Split)


def test_loader_gives_a_generic_dataset_the_same_order_as_a_split():
    train, _ = load_dataset("digits")
    plain = TensorDataset(train.x, train.y)
    a = [yb for _, yb in loader(train, 64, torch.Generator().manual_seed(3))]
    b = [yb for _, yb in loader(plain, 64, torch.Generator().manual_seed(3))]
    assert all(torch.equal(p, q) for p, q in zip(a, b, strict=True))


def test_losses():
    out, y = torch.randn(4, 3), torch.tensor([0, 2, 1, 1])
    torch.testing.assert_close(build_loss("cross_entropy")(out, y), torch.nn.functional.cross_entropy(out, y))
    torch.testing.assert_close(build_loss("mse")(out[:, 0], y), torch.nn.functional.mse_loss(out[:, 0], y.float()))


def test_user_module_through_fedcomp_sim(winemod, tmp_path, capsys):
    from fedcomp.tools.cli import main

    out = tmp_path / "sim"
    sets = [f"run.{k}={v}" for k, v in PLUGIN.items()] + ["run.model_options=hidden=16", "methods=dgc-async",
                                                          "method.dgc-async.num_versions=10"]
    argv = ["sim", "tiny", "--quiet", "--no-plot", "--out", str(out)]
    for s in sets:
        argv += ["--set", s]
    assert main(argv) == 0, capsys.readouterr().err
    (method,) = json.loads((out / "summary.json").read_text())["methods"]
    assert method["method"] == "dgc-async" and method["versions"] == 10 and method["accuracy"] > 0.60
    params = 13 * 16 + 16 + 16 * 3 + 3  # the user's model, as the summary reports it
    assert (method["model"], method["num_parameters"]) == (PLUGIN["model"], params)
    assert method["dense_fp32_bytes"] == 4 * params
    import winemod as mod

    assert len(mod.CALLS) > 20  # the user's loss trained the clients and scored the server's evaluation

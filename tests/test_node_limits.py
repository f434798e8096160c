"""What one task may ask of a node: its operator's caps on the training examples per task and on the model's size.

A run config comes from whoever submits the run; without these caps it could make every node take millions of
local steps or build a model that does not fit its memory. The node refuses such a task (``TaskRefused``, one
line naming the flag that raises the cap) before it trains or builds anything: the examples from the run config
alone, the parameters counted on torch's meta device (a plug-in model that cannot be built there is counted
once built).
"""

from __future__ import annotations

import sys
import textwrap

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import clients.bench
from clients.launcher import node_config, parser
from clients.trainer import LOCAL_TRAINERS
from fedcomp.registry import ConfigError
from fedcomp.task.config import NodeConfig, RunConfig, TaskRefused
from fedcomp.task.data import Split
from fedcomp.task.models import MODELS
from fedcomp.task.training import make_model, parameter_count
from tests.clientkit import BASE, RUNS, drive

DGC = {**BASE, **RUNS["dgc-delta"]}  # mlp on digits: 9,610 parameters, 2 x 32 examples per task


def test_the_caps_are_node_config_keys_with_finite_defaults():
    node = NodeConfig.from_flower({"max-task-examples": 500, "max-parameters": 0, "max-dataset-values": 7})
    assert (node.max_task_examples, node.max_parameters, node.max_dataset_values) == (500, 0, 7)
    default = NodeConfig()
    assert min(default.max_task_examples, default.max_parameters, default.max_dataset_values) > 0  # capped
    for key in ("max-task-examples", "max-parameters", "max-dataset-values"):
        with pytest.raises(ConfigError, match=f"{key} must be >= 0, got -1"):
            NodeConfig.from_flower({key: -1})
    with pytest.raises(ConfigError, match="unknown run config key 'max-task-examples'"):
        RunConfig.from_flower({"max-task-examples": 0})  # the node's to say, never the run's


@given(steps=st.integers(1, 10_000), batch=st.integers(1, 4096), cap=st.integers(0, 1_000_000),
       params=st.integers(0, 10**9), pcap=st.integers(0, 10**9), values=st.integers(0, 10**12),
       vcap=st.integers(0, 10**12))
def test_admit_refuses_exactly_what_is_over_a_cap(steps, batch, cap, params, pcap, values, vcap):
    node = NodeConfig(max_task_examples=cap, max_parameters=pcap, max_dataset_values=vcap)
    over = (cap and steps * batch > cap) or (pcap and params > pcap) or (vcap and values > vcap)
    run = RunConfig(local_steps=steps, batch_size=batch)
    if over:
        with pytest.raises(TaskRefused) as err:
            node.admit(run, params, values)
        assert "\n" not in str(err.value) and "flower-client --max-" in str(err.value)
    else:
        node.admit(run, params, values)


def test_a_task_over_the_examples_cap_is_refused_before_a_step(monkeypatch):
    calls = []
    monkeypatch.setattr(LOCAL_TRAINERS.get("delta"), "__call__", lambda *a, **k: calls.append(a))
    monkeypatch.setattr(clients.bench, "make_model", lambda *a, **k: calls.append(a))
    with pytest.raises(TaskRefused, match=r"at most 63 for max-task-examples; the run asks 64 \(local-steps 2 x "
                       r"batch-size 32\)\. The node's operator may raise it: flower-client --max-task-examples N"):
        drive(DGC, {"max-task-examples": 63}, monkeypatch)
    assert calls == []


def test_a_model_over_the_parameter_cap_is_refused_before_it_is_built(monkeypatch):
    built = []
    monkeypatch.setattr(clients.bench, "make_model", lambda *a, **k: built.append(a))
    with pytest.raises(TaskRefused, match=r"at most 9,609 for max-parameters; the run asks 9,610 \(model 'mlp'\)"):
        drive(DGC, {"max-parameters": 9_609}, monkeypatch)
    assert built == []


MNIST1D = {**DGC, "dataset": "mnist1d", "model": "cnn1d"}


def test_a_dataset_over_the_values_cap_is_refused_before_it_is_made(monkeypatch):
    """A run choosing mnist1d's size: num_samples x length input values, counted from the options before the
    generator runs (a spy on it stays empty); at the cap the node makes it, and a task through the ClientApp
    trains."""
    pytest.importorskip("mnist1d")
    from fedcomp.task import data

    made = []
    real = data.Mnist1D.load
    monkeypatch.setattr(data.Mnist1D, "load", lambda self: made.append(self) or real(self))
    options = "num_samples=400 length=40 seed=11"  # 16,000 values; a seed no other test loads (loads are cached)
    run = RunConfig.from_flower({**MNIST1D, "dataset-options": options})
    with pytest.raises(TaskRefused, match=r"at most 15,999 for max-dataset-values; the run asks 16,000 \(dataset "
                       r"'mnist1d' with 'num_samples=400 length=40 seed=11'\)\. .*--max-dataset-values N"):
        clients.bench.Bench().training(run, NodeConfig(max_dataset_values=15_999), torch.device("cpu"))
    assert made == []
    clients.bench.Bench().training(run, NodeConfig(max_dataset_values=16_000), torch.device("cpu"))
    assert len(made) == 1
    with pytest.raises(TaskRefused, match="max-dataset-values"):
        drive({**MNIST1D, "dataset-options": options}, {"max-dataset-values": 15_999}, monkeypatch)
    out = drive({**MNIST1D, "dataset-options": options}, {"max-dataset-values": 16_000}, monkeypatch)
    assert len(out.blobs) == 3 and all(out.blobs)


def test_datasets_of_a_fixed_size_count_nothing():
    from fedcomp.task.training import dataset_values

    assert dataset_values(RunConfig(dataset="digits")) == 0
    assert dataset_values(RunConfig(dataset="mnist1d", dataset_options="num_samples=1000 length=64")) == 64_000


def test_tasks_exactly_at_both_caps_train_and_reply(monkeypatch):
    out = drive(DGC, {"max-task-examples": 64, "max-parameters": 9_610}, monkeypatch)
    assert len(out.blobs) == 3 and all(out.blobs)


UNMETA_MODULE = textwrap.dedent('''
    import torch


    def make_net(width=8):
        scale = float(torch.ones(1).sum())  # reads a value while it builds: not on the meta device
        return torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(64, int(width * scale)),
                                   torch.nn.Linear(int(width * scale), 10))
''')


def test_a_plugin_model_the_meta_device_cannot_build_is_counted_once_built(tmp_path, monkeypatch):
    (tmp_path / "unmeta.py").write_text(UNMETA_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        node = NodeConfig(allow_plugins="unmeta", max_parameters=7_510)  # 64 x 100 + 100 + 100 x 10 + 10 = 7,510
        run = RunConfig.from_flower({**DGC, "model": "unmeta:make_net", "model-options": "width=100"}, node.plugins)
        data = Split(torch.zeros(4, 1, 8, 8), torch.zeros(4, dtype=torch.int64), 10, "toy")
        assert parameter_count(run, data) is None
        bench = clients.bench.Bench()
        with pytest.raises(TaskRefused, match="at most 7,509 for max-parameters; the run asks 7,510"):
            bench.training(run, NodeConfig(allow_plugins="unmeta", max_parameters=7_509), torch.device("cpu"))
        _, model = bench.training(run, node, torch.device("cpu"))
        assert sum(p.numel() for p in model.parameters()) == 7_510
    finally:
        sys.modules.pop("unmeta", None)


IMAGE = Split(torch.zeros(4, 3, 32, 32), torch.zeros(4, dtype=torch.int64), 10, "image")
SIGNAL = Split(torch.zeros(4, 1, 1, 40), torch.zeros(4, dtype=torch.int64), 10, "signal")


@pytest.mark.parametrize("name", MODELS.names())
def test_the_meta_count_of_every_built_in_model_is_its_real_count(name):
    data = SIGNAL if name == "cnn1d" else IMAGE
    run = RunConfig(model=name)
    assert parameter_count(run, data) == sum(p.numel() for p in make_model(run, data).parameters())


@settings(max_examples=25, deadline=None)
@given(hidden=st.lists(st.integers(1, 300), min_size=1, max_size=3), seed=st.integers(0, 3))
def test_counting_builds_nothing_and_leaves_the_random_state(hidden, seed):
    run = RunConfig(model="mlp", model_options=f"hidden={','.join(map(str, hidden))}", seed=seed)
    data = Split(torch.zeros(4, 1, 8, 8), torch.zeros(4, dtype=torch.int64), 10, "digits")
    state = torch.get_rng_state()
    count = parameter_count(run, data)
    assert torch.equal(state, torch.get_rng_state())
    widths = [64, *hidden, 10]
    assert count == sum(a * b + b for a, b in zip(widths, widths[1:], strict=False))


def test_flower_client_passes_the_caps_to_its_node():
    args = parser().parse_args(["--server", "h:1", "--max-task-examples", "5000", "--max-parameters", "0",
                                "--max-dataset-values", "9", "--allow-dataset", "cifar10", "--allow-dataset", "hf"])
    text = node_config(args)
    assert "max-task-examples=5000" in text and "max-parameters=0" in text and "max-dataset-values=9" in text
    assert NodeConfig.from_flower({"allow-datasets": "cifar10 hf"}).allow_datasets.split() == ["cifar10", "hf"]
    assert 'allow-datasets="cifar10 hf"' in text
    assert "max-" not in node_config(parser().parse_args(["--server", "h:1"]))  # unset: the node's default


def test_a_simulated_node_trusts_its_own_users_scenario():
    from simulations.engines import node_config as simulated

    node = NodeConfig.from_flower(simulated(1, 4, {"model": "mypkg.nets:make_net"}))
    assert (node.max_task_examples, node.max_parameters, node.max_dataset_values, node.partition_id) == (0, 0, 0, 1)
    assert node.plugins.allows("mypkg.nets") and not node.plugins.allows("os")
    node.admit(RunConfig(local_steps=10_000, batch_size=4096), 10**12, 10**15)  # nothing capped
    node.admit(RunConfig(dataset="cifar10"))  # its own files


@pytest.mark.parametrize("dataset", ["cifar10", "hf:uoft-cs/cifar10"])
def test_a_dataset_that_reads_the_node_s_files_or_the_network_needs_its_leave(dataset):
    """cifar10 reads a folder the run names, hf the hub: refused unless ``allow-datasets`` names them (or ``*``);
    datasets that are generated or shipped need nothing; the allow-list takes only those names."""
    run = RunConfig(dataset=dataset)
    name = dataset.split(":")[0]
    with pytest.raises(TaskRefused, match=f"reads .*flower-client --allow-dataset {name}$"):
        NodeConfig().admit(run)
    NodeConfig(allow_datasets=name).admit(run)
    NodeConfig(allow_datasets="*").admit(run)
    for shipped in ("digits", "mnist1d"):
        NodeConfig().admit(RunConfig(dataset=shipped))
    with pytest.raises(ConfigError, match="allow-datasets: 'digits' is not a dataset that reads"):
        NodeConfig(allow_datasets="digits")


def test_an_evaluate_task_is_admitted_before_the_node_loads_anything(tmp_path, monkeypatch):
    """The ClientApp's evaluate: a run naming a folder of the node's is refused before the test split is read
    (it was read before the node's checks)."""
    import time

    from flwr.app import Context, Message, Metadata, RecordDict

    import clients.task
    from fedcomp.task import data

    read = []
    monkeypatch.setattr(data.Cifar10, "load", lambda self: read.append(self))
    monkeypatch.setattr(clients.task, "datasets", lambda run: read.append(run))
    run_config = {**DGC, "dataset": "cifar10", "dataset-options": f"root={tmp_path}"}
    ctx = Context(7, 70, {"partition-id": 0, "num-partitions": 2}, RecordDict(), run_config)
    meta = Metadata(run_id=7, message_id="e1", src_node_id=1, dst_node_id=70, reply_to_message_id="", group_id="0",
                    created_at=time.time(), ttl=60.0, message_type="evaluate")
    msg = Message(content=RecordDict(), metadata=meta)
    with pytest.raises(TaskRefused, match="--allow-dataset cifar10"):
        clients.task.evaluate_model(msg, ctx)
    assert read == []

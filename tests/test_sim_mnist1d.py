"""The second workload's scenario (simulations/scenarios/mnist1d.toml): main.toml's links, devices and six methods
on generated MNIST-1D signals with the 1-D CNN."""

from __future__ import annotations

import dataclasses

from fedcomp.task.models import num_parameters
from fedcomp.task.training import datasets, make_model
from simulations import scenario as scenarios

#: What the second workload may change against main.toml: its data, model, local training and budgets.
WORKLOAD_KEYS = {"dataset", "dataset_options", "model", "model_options", "local_steps", "local_lr", "num_versions"}


def _differences(a, b) -> set[str]:
    return {f.name for f in dataclasses.fields(a) if getattr(a, f.name) != getattr(b, f.name)}


def test_same_links_devices_and_methods_as_the_main_job():
    main, m1d = scenarios.load("main"), scenarios.load("mnist1d")
    assert m1d.name == "mnist1d" and 0 < m1d.target_accuracy <= 1
    assert m1d.clients == main.clients and m1d.num_clients == 10
    assert dict(m1d.links) == dict(main.links) and dict(m1d.devices) == dict(main.devices)
    assert (m1d.baseline, m1d.compare_to, m1d.seed) == (main.baseline, main.compare_to, main.seed)
    assert [m.name for m in m1d.methods] == [m.name for m in main.methods]
    assert len(m1d.methods) == 6
    for ours, theirs in zip(m1d.methods, main.methods, strict=True):
        assert ours.worker == theirs.worker, ours.name
        assert _differences(ours.run, theirs.run) <= WORKLOAD_KEYS, ours.name
        assert (ours.run.dataset, ours.run.model, ours.run.partitioner) == ("mnist1d", "cnn1d", "dirichlet")
        ours.run.check_plugins()


def test_the_scenario_builds_its_data_and_a_1m_model():
    sc = scenarios.load("mnist1d", ['run.dataset_options="num_samples=400"'])
    run = sc.methods[0].run
    train, test = datasets(run)
    assert (len(train), len(test)) == (320, 80) and train.in_shape == (1, 1, 40)
    model = make_model(run, train)
    assert num_parameters(model) >= 1_000_000
    assert model(train.x[:4]).shape == (4, 10)
    full = scenarios.load("mnist1d").methods[0].run
    assert "num_samples=10000" in full.dataset_options  # 10,000 signals: between 4,000 and 40,000


"""The product's train function on the public path (``clients.task.app`` = train function + ``compression_mod``):
a stock ``Compressed(FedAvg)`` drives it on the in-process federation of ``benchmarks/flowerkit.py``, sync and
async. Checked: it learns, every update is applied, the replies carry no model arrays (the pseudo-gradient was
handed to the mod as tensors), the node's data and model are kept per node between tasks, and the client state
goes to the node's ``state-dir``.
"""

from __future__ import annotations

from pathlib import Path

import torch
from flwr.app import ArrayRecord, ConfigRecord, MetricRecord
from flwr.serverapp.strategy import FedAvg
from test_worker import endpoint, workers  # noqa: F401  (fixtures)

from benchmarks.flowerkit import LocalGrid, server_identity
from clients import task
from fedcomp.flower import Compressed, records
from fedcomp.flower.statedir import STATE_FILE
from fedcomp.task.config import NodeConfig, RunConfig
from fedcomp.task.training import datasets, evaluate, make_model, node_partition

RUN = {"model": "mlp", "dataset": "digits", "local-steps": 10, "batch-size": 32}
NODES = 2


def initial() -> torch.nn.Module:
    run = RunConfig.from_flower(RUN)
    return make_model(run, node_partition(run, NodeConfig(0, NODES)))


def central(_round: int, arrays: ArrayRecord) -> MetricRecord:
    model = initial()
    model.load_state_dict(arrays.to_torch_state_dict())
    _, test = datasets(RunConfig.from_flower(RUN))
    return MetricRecord({"accuracy": evaluate(model, test, torch.device("cpu"))["accuracy"]})


def run(strategy, grid: LocalGrid, rounds: int):
    with server_identity():
        return strategy.start(grid, ArrayRecord(initial().state_dict()), num_rounds=rounds,
                              train_config=ConfigRecord({"lr": 0.1}), evaluate_fn=central)


def federation(tmp_path) -> LocalGrid:
    task.BENCHES.clear()
    nodes = {100 + i: (task.app, {"partition-id": i, "num-partitions": NODES, "state-dir": str(tmp_path / f"n{i}")})
             for i in range(NODES)}
    return LocalGrid(nodes, RUN)


def test_the_product_train_function_learns_under_compressed_fedavg(tmp_path):
    grid = federation(tmp_path)
    result = run(Compressed(FedAvg(fraction_evaluate=0.0, min_train_nodes=NODES, min_available_nodes=NODES),
                            "dgc+int8", density=0.05), grid, 8)
    accuracy = {r: m["accuracy"] for r, m in result.evaluate_metrics_serverapp.items()}
    assert accuracy[8] > 0.6 and accuracy[8] > accuracy[0] + 0.4, accuracy
    assert all(result.train_metrics_clientapp[r]["fedcomp-applied"] == NODES for r in range(1, 9))
    train = [r for r in grid.replies if r.metadata.message_type == "train"]
    assert len(train) == 8 * NODES and not any(r.has_error() for r in train)
    assert all(not r.content.array_records and records.CONTROL in r.content.config_records for r in train)
    assert set(task.BENCHES) == {100, 101}  # one kept bench per node
    assert all((tmp_path / f"n{i}" / STATE_FILE).exists() for i in range(NODES))


def test_the_product_train_function_runs_async(tmp_path):
    grid = federation(tmp_path)
    strategy = Compressed(FedAvg(fraction_evaluate=0.0, min_available_nodes=NODES), "dgc+int8", density=0.05,
                          mode="async", buffer_size=2, max_staleness=4)
    result = run(strategy, grid, 8)
    accuracy = result.evaluate_metrics_serverapp
    assert accuracy[max(accuracy)]["accuracy"] > accuracy[0]["accuracy"] + 0.3, accuracy


def test_the_thin_app_hands_public_messages_to_the_worker(tmp_path, endpoint, workers):  # noqa: F811
    """``clients.app.app`` (the FAB's thin forwarder, torch-free) with a real worker: the public layout's tasks
    run in the worker, on ``clients.task.app``, and the run learns."""
    from clients import app as thin
    from clients import channel

    worker = workers(endpoint)
    keys = {channel.SOCKET_KEY: endpoint.socket, channel.KEY_KEY: endpoint.key_file, channel.WAIT_KEY: endpoint.wait}
    nodes = {100 + i: (thin.app, {"partition-id": i, "num-partitions": NODES, "state-dir": str(tmp_path / f"n{i}"),
                                  **keys}) for i in range(NODES)}
    task.BENCHES.clear()
    result = run(Compressed(FedAvg(fraction_evaluate=0.0, min_train_nodes=NODES, min_available_nodes=NODES),
                            "dgc+int8", density=0.05), LocalGrid(nodes, RUN), 4)
    accuracy = result.evaluate_metrics_serverapp
    assert accuracy[4]["accuracy"] > accuracy[0]["accuracy"] + 0.2, accuracy
    assert not task.BENCHES  # nothing trained in this process
    log = Path(worker.log.name).read_text()
    assert log.count("train message") == 4 * NODES, log[-2000:]

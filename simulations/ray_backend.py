"""The Ray-backed simulation: Flower's simulation engine runs the fedcomp ClientApps, the virtual clock orders
their replies.

``run_on_ray`` starts one ``flwr.simulation.run_simulation`` per method (Ray, ``sim.ray_cpus_per_client`` CPUs
per ClientApp). Its ServerApp asks every node for its partition id (a ``query`` message), then runs the same
``simulations.runner.drive`` as the in-process engine over a ``GridEngine`` (``fedcomp.flower.transport.GridTransport``
on the simulation Grid). ``run_simulation`` hands the apps an empty run config, so both apps are built by
factories that close over the method's run config. Flower's simulation runtime could run two messages to one node
at once (prefetch), so ``GridEngine`` keeps one task per node in it and holds the rest in dispatch order.

Determinism: the timeline depends on the real reply sizes; Flower's random node ids (in every message) and the
clients' random incarnation ids make those vary by a few bytes between runs, so Ray runs repeat up to that
jitter. The in-process engine repeats exactly.
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from flwr.app import ConfigRecord, Context, Message, RecordDict
from flwr.clientapp import ClientApp
from flwr.serverapp import Grid, ServerApp

from simulations.engines import GridEngine, SimulationError, scenario_trust
from simulations.runner import MethodResult, drive
from simulations.scenario import Method, Scenario

QUERY = "query"


def make_client_app(run_config: Mapping[str, Any]) -> ClientApp:
    """The fedcomp ClientApp with ``run_config`` put into ``context.run_config``; answers ``query`` with its
    partition id."""
    from clients import app as fedcomp_client

    app = ClientApp()
    config = dict(run_config)

    def with_config(context: Context) -> Context:
        # the same node state (one RecordDict, so updates persist), the scenario's run config
        node = {**context.node_config, **scenario_trust(config)}
        return Context(context.run_id, context.node_id, node, context.state, dict(config))

    @app.train()
    def train(msg: Message, context: Context) -> Message:
        return fedcomp_client.train(msg, with_config(context))

    @app.evaluate()
    def evaluate(msg: Message, context: Context) -> Message:
        return fedcomp_client.evaluate_model(msg, with_config(context))

    @app.query()
    def query(msg: Message, context: Context) -> Message:
        pid = int(context.node_config.get("partition-id", -1))
        return Message(RecordDict({"node": ConfigRecord({"partition-id": pid})}), reply_to=msg)

    return app


def discover(grid: Grid, expected: int, timeout: float = 600.0) -> dict[int, int]:
    """Node id -> partition id of the ``expected`` simulated nodes (a generous deadline: Ray starts its actors slowly
    on a loaded machine)."""
    end = time.monotonic() + timeout
    nodes: list[int] = []
    while time.monotonic() < end:
        nodes = sorted(int(n) for n in grid.get_node_ids())
        if len(nodes) >= expected:
            break
        time.sleep(0.2)
    msgs = [Message(RecordDict(), n, QUERY) for n in nodes]
    index: dict[int, int] = {}
    for reply in grid.send_and_receive(msgs, timeout=max(1.0, end - time.monotonic())):
        if not reply.has_error():
            index[int(reply.metadata.src_node_id)] = int(reply.content.config_records["node"]["partition-id"])
    if len(index) != expected or sorted(index.values()) != list(range(expected)):
        got = sorted(index.values())
        raise SimulationError(f"expected partitions 0..{expected - 1} from {expected} nodes, got {got}")
    return index


def ray_cpus() -> float:
    """CPUs of the running Ray cluster (what its ClientApp actors share)."""
    import ray

    return float(ray.cluster_resources().get("CPU", 1.0)) if ray.is_initialized() else float(os.cpu_count() or 1)


def make_server_app(scenario: Scenario, method: Method, out_dir: Path | None, box: list[Any]) -> ServerApp:
    from fedcomp.flower.transport import GridTransport
    from simulations.engines import task_format

    app = ServerApp()

    @app.main()
    def main(grid: Grid, context: Context) -> None:
        try:
            index = discover(grid, scenario.num_clients)
            tasks, _ = task_format(method.flat)
            engine = GridEngine(GridTransport(grid, node_refresh=1e9, pull_interval=0.01, tasks=tasks))

            def times() -> dict[str, float]:
                engine.finish_times(workers=max(1, int(ray_cpus() // scenario.sim.ray_cpus_per_client)))
                return engine.times.to_dict()

            box.append(drive(scenario, method, engine, index, out_dir, times=times))
        except BaseException as exc:  # surface it to run_on_ray: Flower only logs ServerApp errors
            box.append(exc)
            raise

    return app


def run_on_ray(scenario: Scenario, method: Method, out_dir: Path | None) -> MethodResult:
    """One ``run_simulation`` for ``method``; returns its result or raises ``SimulationError``."""
    from flwr.simulation import run_simulation

    box: list[Any] = []
    backend_config = {
        "client_resources": {"num_cpus": scenario.sim.ray_cpus_per_client, "num_gpus": 0.0},
        "init_args": {"logging_level": "ERROR", "log_to_driver": False},
    }
    run_simulation(
        server_app=make_server_app(scenario, method, out_dir, box),
        client_app=make_client_app(method.flat),
        num_supernodes=scenario.num_clients,
        backend_config=backend_config,
    )
    if not box:
        raise SimulationError(f"{method.name}: the simulation ended without a result (see Flower's log above)")
    if isinstance(box[0], BaseException):
        raise SimulationError(f"{method.name}: {type(box[0]).__name__}: {box[0]}") from box[0]
    return box[0]

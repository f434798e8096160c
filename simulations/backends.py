"""The simulation engines by name, and the whole scenario run: which engine runs the ClientApps of a method
(``sim.engine``: ``inprocess`` or ``ray``), how many methods at once (``sim.workers``), and the comparison of the
methods' results. ``runner.drive`` is what every engine ends in; this module sits above it and above the Ray
backend, so neither imports the other.

    >>> sorted(BACKENDS.names())
    ['inprocess', 'ray']
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from fedcomp.registry import ConfigError, Registry
from simulations.public import drive_strategy
from simulations.runner import NODE_ID_BASE, MethodResult, add_comparisons, drive
from simulations.scenario import Method, Scenario

BACKENDS: Registry[Any] = Registry("simulation engine")


@BACKENDS.register("inprocess")
class InProcessBackend:
    """The fedcomp ClientApp called in this process (no Ray): the main job's default."""

    def run(self, scenario: Scenario, method: Method, out_dir: Path | None) -> MethodResult:
        from clients.app import app
        from simulations.engines import InProcessEngine

        node_index = {NODE_ID_BASE + i: i for i in range(scenario.num_clients)}
        engine = InProcessEngine(app, method.flat, node_index)
        run = drive_strategy if method.server == "strategy" else drive  # fedcomp's public strategy, or the loops
        return run(scenario, method, engine, node_index, out_dir, times=engine.times.to_dict)


@BACKENDS.register("ray")
class RayBackend:
    """Flower's simulation engine (Ray) runs the ClientApps; one ``run_simulation`` per method."""

    def run(self, scenario: Scenario, method: Method, out_dir: Path | None) -> MethodResult:
        from simulations.ray_backend import run_on_ray

        return run_on_ray(scenario, method, out_dir)


def run_scenario(scenario: Scenario, out_dir: Path | None = None) -> list[MethodResult]:
    """Run every method of ``scenario`` (``sim.workers`` at a time, each in its own process, for the in-process
    engine); add speedup and accuracy delta vs the baseline. Results come in the scenario's method order."""
    strategy_runs = [m.name for m in scenario.methods if m.server == "strategy"]
    if strategy_runs and scenario.sim.engine != "inprocess":
        raise ConfigError(f"methods {strategy_runs}: server = \"strategy\" runs on the in-process engine")
    workers = min(scenario.sim.workers, len(scenario.methods))
    if workers > 1 and scenario.sim.engine == "inprocess":
        import multiprocessing
        from concurrent.futures import ProcessPoolExecutor

        ctx = multiprocessing.get_context("spawn")  # a fresh interpreter: no torch state shared with the parent
        pool = ProcessPoolExecutor(workers, mp_context=ctx)
        try:
            futures = {m.name: pool.submit(_run_one, scenario, m.name, out_dir) for m in start_order(scenario)}
            results = [futures[m.name].result() for m in scenario.methods]
        except BaseException:  # a failed method, Ctrl-C or SIGTERM: the other methods' processes stop too
            _stop_workers(pool)
            raise
        pool.shutdown()
    else:
        backend = BACKENDS.build(scenario.sim.engine)
        results = [backend.run(scenario, m, out_dir) for m in scenario.methods]
    add_comparisons(results, scenario.baseline, scenario.compare_to)
    return results


def _stop_workers(pool: Any) -> None:
    """Terminate ``pool``'s worker processes now (a ``ProcessPoolExecutor`` would wait for their methods to end;
    Python 3.11 has no public call for this)."""
    for proc in list(getattr(pool, "_processes", {}).values()):
        proc.terminate()
    pool.shutdown(wait=True, cancel_futures=True)


def start_order(scenario: Scenario) -> list[Method]:
    """The order the worker processes take the methods in: ``sim.order``'s (those that run), then the rest by
    ``expected_work``, the longest first (a shorter last makespan). ``sim.order`` is for what ``expected_work``
    cannot see: which compressor's tasks cost more wall time (the main job's is measured, main.toml says so)."""
    running = {m.name for m in scenario.methods}
    listed = [n for n in scenario.sim.order if n in running]
    rest = sorted((m for m in scenario.methods if m.name not in listed), key=lambda m: -expected_work(scenario, m))
    return [scenario.method(n) for n in listed] + rest


def expected_work(scenario: Scenario, method: Method) -> float:
    """Local steps a method's budget asks for (versions x updates per version x steps): how ``start_order`` orders
    the methods ``sim.order`` does not list (what runs longest starts first)."""
    run = method.run
    per_version = run.buffer_size if run.mode == "async" else max(1, round(run.fraction * scenario.num_clients))
    return run.num_versions * per_version * run.local_steps


def _run_one(scenario: Scenario, method: str, out_dir: Path | None) -> MethodResult:
    """One method in a worker process (``run_scenario`` with ``sim.workers > 1``)."""
    return BACKENDS.build(scenario.sim.engine).run(scenario, scenario.method(method), out_dir)

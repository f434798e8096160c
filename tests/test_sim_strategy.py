"""A method run by fedcomp's public strategy in the simulator (``server = "strategy"``: ``Compressed(FedAvg(),
mode=...)`` on fedcomp's loop with the simulator's runtime) against the same method on the product's
loops: both reach their versions, the strategy's messages are the one layout (uplink Flower bytes per reply the
loops' within 5%), its tasks are charged their compute (virtual time near the loops'), and what the strategy has
no counterpart of is refused before anything runs."""

from __future__ import annotations

import dataclasses

import pytest

from fedcomp.registry import ConfigError
from simulations import scenario as scenarios
from simulations.backends import run_scenario
from simulations.public import compressed_for

OVER = ["sim.progress=false", "methods=dgc-async", "baseline=dgc-async", "method.dgc-async.num_versions=8"]


def _run(server: str, *more: str) -> dict:
    sc = scenarios.load("tiny", [*OVER, f"method.dgc-async.server={server}", *more])
    (result,) = run_scenario(sc)
    return result.summary | {"rows": result.rows}


def test_the_public_strategy_runs_an_async_method_as_the_loops_do():
    loops, strategy = _run("loops"), _run("strategy")
    assert (loops["server"], strategy["server"]) == ("loops", "strategy")
    for s in (loops, strategy):
        assert s["completed"] and s["versions"] == 8 and s["applied"] >= 8 * 2, s
        assert s["accuracy"] > s["initial_accuracy"] + 0.1, s
        assert [r["version"] for r in s["rows"]] == list(range(1, 9))
    up = strategy["flower_bytes_up_per_reply"] / loops["flower_bytes_up_per_reply"]
    assert 0.95 < up < 1.05, (strategy["flower_bytes_up_per_reply"], loops["flower_bytes_up_per_reply"])
    # the strategy's task keeps its own config record beside fedcomp's: a few hundred bytes more, never less
    down = strategy["flower_bytes_down_per_task"] / loops["flower_bytes_down_per_task"]
    assert 1.0 <= down < 1.1, (strategy["flower_bytes_down_per_task"], loops["flower_bytes_down_per_task"])
    # compute is charged by the reply's example count: a strategy run charged none would take far less time
    assert 0.8 < strategy["virtual_s"] / loops["virtual_s"] < 1.25, (strategy["virtual_s"], loops["virtual_s"])


def test_normalize_sum_runs_through_the_strategy_as_on_the_loops():
    """``normalize = "sum"`` (a run-config value) was refused by the public strategy after the run had started;
    it now makes the loops' versions: the same accuracy version by version, and not count's."""
    runs = {(server, norm): _run(server, f"method.dgc-async.normalize={norm}")
            for server in ("loops", "strategy") for norm in ("sum", "count")}
    acc = {k: [r["accuracy"] for r in v["rows"]] for k, v in runs.items()}
    assert acc["strategy", "sum"] == acc["loops", "sum"] and len(acc["loops", "sum"]) == 8
    assert acc["strategy", "sum"] != acc["strategy", "count"]


def test_a_dense_method_sends_the_model_as_one_blob_as_the_loops_do():
    """Dense FedBuff through the strategy: the model travels as the loops' one fp32 blob, not as the strategy's
    ArrayRecord of one Flower object per array (4.8% more Flower bytes per task on this model, and more
    objects for the clock to charge); only the strategy's config record is added."""
    dense = ("method.dgc-async.compressor=identity", "method.dgc-async.compressor_options=")
    loops, strategy = _run("loops", *dense), _run("strategy", *dense)
    assert strategy["completed"] and strategy["versions"] == 8, strategy
    down = strategy["flower_bytes_down_per_task"] / loops["flower_bytes_down_per_task"]
    assert 1.0 <= down < 1.01, (strategy["flower_bytes_down_per_task"], loops["flower_bytes_down_per_task"])
    assert strategy["virtual_s"] <= loops["virtual_s"] * 1.001, (strategy["virtual_s"], loops["virtual_s"])


def test_the_public_strategy_runs_sync_rounds_as_the_loops_do():
    """FedAvg's rounds through ``Compressed(FedAvg(), loop="fedcomp")``: the same versions, accuracy and bytes as
    the product's sync loop on the same clients (a strategy that aggregated or selected otherwise would differ)."""
    runs = {}
    for server in ("loops", "strategy"):
        sc = scenarios.load("tiny", ["sim.progress=false", "methods=fedavg", "baseline=fedavg",
                                     "method.fedavg.num_versions=4", f"method.fedavg.server={server}"])
        (result,) = run_scenario(sc)
        runs[server] = result.summary | {"rows": result.rows}
    loops, strategy = runs["loops"], runs["strategy"]
    assert strategy["completed"] and strategy["versions"] == 4 and strategy["server"] == "strategy"
    assert [r["version"] for r in strategy["rows"]] == [1, 2, 3, 4]
    assert [r["accuracy"] for r in strategy["rows"]] == [r["accuracy"] for r in loops["rows"]]
    assert strategy["applied"] == loops["applied"]
    up = strategy["flower_bytes_up_per_reply"] / loops["flower_bytes_up_per_reply"]
    assert 0.99 < up < 1.01, (strategy["flower_bytes_up_per_reply"], loops["flower_bytes_up_per_reply"])


def test_what_the_strategy_cannot_run_is_refused_before_it_starts():
    with pytest.raises(ConfigError, match="server must be one of"):
        scenarios.load("tiny", ["method.dgc-async.server=grid"])
    ray = scenarios.load("tiny", ["sim.engine=ray", "method.dgc-async.server=strategy"])
    with pytest.raises(ConfigError, match="in-process engine"):
        run_scenario(ray)


@pytest.mark.parametrize(("options", "history"), [
    (["method.dgc-async.downlink_options=history=3"], 3),
    (["method.dgc-async.downlink_history=8"], 8),
    (["method.dgc-async.downlink_history=8", "method.dgc-async.downlink_options=history=5"], 5),
    ([], 16),
])
def test_the_downlink_history_reaches_the_strategy(options, history):
    """``downlink-history`` and ``downlink_options history=`` both reach the strategy's delta downlink (they were
    refused under it); the default adds nothing to the tasks' config."""
    run = scenarios.load("tiny", ["method.dgc-async.downlink=delta", *options]).method("dgc-async").run
    strategy = compressed_for(run)
    assert strategy.options.downlink_kwargs.get("history", 16) == history
    assert ("history" in strategy.compression.downlink_options) == bool(options)


@pytest.mark.parametrize(("options", "wrapped", "rules"), [
    (["method.dgc-async.server_lr=1.0"], "FedAvg", {}),
    (["method.dgc-async.server_lr=0.5", "method.dgc-async.server_momentum=0.9"], "FedAvgM",
     {"server_learning_rate": 0.5, "server_momentum": 0.9}),
    (["method.dgc-async.server_optimizer=adam", "method.dgc-async.server_lr=0.01"], "FedAdam",
     {"eta": 0.01, "beta_1": 0.9, "beta_2": 0.99, "tau": 1e-3}),
    (["method.dgc-async.server_optimizer=yogi", "method.dgc-async.server_lr=0.02"], "FedYogi", {"eta": 0.02}),
])
def test_the_server_optimizer_picks_the_wrapped_flower_strategy(options, wrapped, rules):
    strategy = compressed_for(scenarios.load("tiny", options).method("dgc-async").run).strategy
    assert type(strategy).__name__ == wrapped
    assert {k: getattr(strategy, k) for k in rules} == rules


def test_the_strategy_takes_the_methods_rules():
    run = scenarios.load("tiny", ["method.dgc-async.prefetch=1"]).method("dgc-async").run
    strategy = compressed_for(run)
    cfg = strategy.options.loop_options
    assert (cfg.buffer_size, cfg.max_staleness, cfg.prefetch) == (run.buffer_size, run.max_staleness, 1)
    assert (cfg.staleness, cfg.normalize, cfg.eval_every) == (run.staleness, "count", run.eval_every)
    assert strategy.compression.compressor == run.compressor and strategy.compression.downlink == run.downlink
    # the run's poll-interval bounds the loop's waits; replies are read every 0.25 s, as the sync loop reads them
    assert run.poll_interval > 0.25 and cfg.poll_interval == 0.25
    assert compressed_for(dataclasses.replace(run, poll_interval=0.1)).options.loop_options.poll_interval == 0.1


@pytest.mark.parametrize("name", ["dgc-async", "int8-async", "auto-async", "fedbuff"])
def test_the_strategy_asks_the_clients_for_the_methods_compression(name):
    """The nodes' client state is made for the method's compression: the strategy must ask for exactly that (a
    downlink option more, such as the delta history, and every task fails on the state's check)."""
    run = scenarios.load("main").method(name).run
    assert compressed_for(run).compression.to_flat() == run.compression.to_flat()

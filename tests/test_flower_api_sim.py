"""The example app (mod + wrapper) on Flower's own simulation engine (Ray), as a user would run it."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples" / "compressed-digits"))


@pytest.mark.slow
@pytest.mark.parametrize("loop", ["flower", "fedcomp"])
def test_example_app_on_run_simulation(tmp_path, loop):
    from digits_app import client_app, server_app
    from digits_app.task import Net
    from flwr.app import ArrayRecord, ConfigRecord, Context
    from flwr.serverapp import Grid, ServerApp
    from flwr.simulation import run_simulation

    out = tmp_path / "result.json"
    app = ServerApp()

    @app.main()
    def main(grid: Grid, context: Context) -> None:
        strategy = server_app.make_strategy({"compressor": "dgc+int8", "density": 0.01, "loop": loop})
        assert (strategy.options.loop_options is not None) == (loop == "fedcomp")
        strategy.strategy.min_train_nodes = strategy.strategy.min_available_nodes = 3
        result = strategy.start(grid, ArrayRecord(Net().state_dict()), num_rounds=4,
                                train_config=ConfigRecord({"lr": 0.1}), evaluate_fn=server_app.central_evaluate)
        metrics = result.train_metrics_clientapp
        out.write_text(json.dumps({
            "accuracy": [result.evaluate_metrics_serverapp[r]["accuracy"] for r in range(5)],
            "applied": [metrics[r]["fedcomp-applied"] for r in range(1, 5)],
            "payload_up": [metrics[r]["fedcomp-payload-bytes-up"] for r in range(1, 5)],
            "dense": metrics[4]["fedcomp-dense-bytes"],
        }))

    run_simulation(app, client_app.app, num_supernodes=3,
                   backend_config={"client_resources": {"num_cpus": 1}, "init_args": {"num_cpus": 2}})
    res = json.loads(out.read_text())
    assert res["applied"] == [3, 3, 3, 3]
    assert res["accuracy"][-1] > res["accuracy"][0] + 0.3
    assert all(p * 10 < 3 * res["dense"] for p in res["payload_up"])


@pytest.mark.parametrize("key", ["mode", "loop"])
def test_the_example_app_refuses_a_mode_or_loop_it_does_not_know(key):
    from digits_app import server_app

    from fedcomp.registry import ConfigError

    with pytest.raises(ConfigError, match=f"{key} must be one of"):
        server_app.make_strategy({"compressor": "dgc+int8", "density": 0.01, key: "bogus"})
    assert server_app.make_strategy({"compressor": "dgc+int8", "density": 0.01}).options.loop_options is None
    run = {"compressor": "dgc+int8", "density": 0.01, "buffer-size": 2, "max-staleness": 4}
    assert server_app.make_strategy({**run, "mode": "async", "loop": "flower"}).options.mode == "async"  # pyproject's

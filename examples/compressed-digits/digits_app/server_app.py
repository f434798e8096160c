"""The ServerApp: a stock FedAvg. fedcomp wraps it."""

from __future__ import annotations

from flwr.app import ArrayRecord, ConfigRecord, Context, MetricRecord
from flwr.serverapp import Grid, ServerApp
from flwr.serverapp.strategy import FedAvg

from digits_app.task import Net, load_data, settings, test
from fedcomp.flower import Compressed

app = ServerApp()


def make_strategy(run_config: dict) -> FedAvg | Compressed:
    fedavg = FedAvg(fraction_evaluate=0.0, min_train_nodes=2, min_available_nodes=2)
    files = {"out_dir": run_config.get("out-dir") or None,  # run files for `fedcomp check OUT` (fedcomp's loop)
             "checkpoint_every": int(run_config.get("checkpoint-every", 0))}
    # Compressed checks mode and loop: sync rounds by Flower's Strategy.start (num-server-rounds counts rounds)
    timing = {"mode": run_config.get("mode", "sync")}
    if timing["mode"] == "async":  # FedBuff on fedcomp's loop; num-server-rounds then counts model versions
        timing |= {"buffer_size": int(run_config["buffer-size"]), "max_staleness": int(run_config["max-staleness"]),
                   "prefetch": int(run_config.get("prefetch", 0)),  # deployment: each node's next task queued
                   **files}
    else:
        timing["loop"] = run_config.get("loop", "flower")
        if timing["loop"] == "fedcomp":  # sync rounds on fedcomp's loop: over-selection, run files
            timing |= {"over_selection": float(run_config.get("over-selection", 0.0)), **files}
    if run_config.get("compressor", "default") == "default":
        return Compressed(fedavg, **timing)  # the plain app: fedavg; fedcomp's defaults (dgc+int4, 10%, warm-up)
    return Compressed(fedavg, run_config["compressor"], density=run_config["density"], **timing)


def central_evaluate(server_round: int, arrays: ArrayRecord) -> MetricRecord:
    model = Net()
    model.load_state_dict(arrays.to_torch_state_dict())
    loss, acc = test(model, load_data(0, 1)[1])
    return MetricRecord({"loss": loss, "accuracy": acc})


@app.main()
def main(grid: Grid, context: Context) -> None:
    cfg = settings(context.run_config)
    strategy = make_strategy(cfg)
    result = strategy.start(
        grid,
        ArrayRecord(Net().state_dict()),
        num_rounds=int(cfg["num-server-rounds"]),
        train_config=ConfigRecord({"lr": float(cfg["lr"])}),
        evaluate_fn=central_evaluate,
    )
    print(f"final accuracy {result.evaluate_metrics_serverapp[max(result.evaluate_metrics_serverapp)]['accuracy']:.4f}")

"""An ordinary Flower app (MLP on digits, its own train function, ``compression_mod``) with
``Compressed(FedAvg(...), mode="async")`` on Flower's own simulation engine (``run_simulation``, Ray), one node
slower than the others: the versions are reached, the staleness bound holds, ``evaluate_fn`` runs per version,
and every node's ``Σ applied + Σ residuals + Σ pending = Σ computed``.

The ClientApps run in Ray's worker processes, so each node writes its state (the fedcomp session and the sum of
the updates its train function computed, both kept in ``context.state``) to a file after every task."""

from __future__ import annotations

import os
import time
from pathlib import Path

import numpy as np
import pytest
import torch

SLOW_S = 1.5  # extra seconds per task on partition 0


def _client_app(folder: Path):
    from flwr.app import Array, ArrayRecord

    from benchmarks import compatkit
    from fedcomp.flower import compression_mod, records
    from fedcomp.flower.session import STATE_KEY

    def slow(msg, ctx, call_next):  # outermost: the node is slower per task, as a phone among laptops
        if msg.metadata.message_type == "train" and int(ctx.node_config["partition-id"]) == 0:
            time.sleep(SLOW_S)
        return call_next(msg, ctx)

    def dump(msg, ctx, call_next):  # outside compression_mod: its state is saved when the reply comes back here
        reply = call_next(msg, ctx)
        if msg.metadata.message_type == "train" and STATE_KEY in ctx.state.array_records:
            state = {"node": int(ctx.node_id), "session": bytes(ctx.state[STATE_KEY]["state"].data),
                     "computed": {k: a.numpy() for k, a in ctx.state["test-computed"].items()}}
            path = folder / f"{ctx.node_config['partition-id']}.pt"
            torch.save(state, path.with_suffix(".tmp"))
            os.replace(path.with_suffix(".tmp"), path)
        return reply

    def computed(msg, ctx, call_next):  # inside compression_mod: what the train function moved, summed
        reply = call_next(msg, ctx)
        if msg.metadata.message_type != "train" or reply.has_error():
            return reply
        got, out = msg.content["arrays"], reply.content["arrays"]
        total = ctx.state.array_records.get("test-computed")
        sums = {k: (total[k].numpy() if total is not None else 0.0)
                + got[k].numpy().astype(np.float32) - out[k].numpy().astype(np.float32)
                for k in got if records.ArrayLayout.is_float(got[k].dtype)}
        ctx.state["test-computed"] = ArrayRecord({k: Array(np.asarray(v, np.float32)) for k, v in sums.items()})
        return reply

    return compatkit.client_app(compatkit.FAMILIES["mlp"], [slow, dump, compression_mod, computed])


@pytest.mark.slow
def test_async_fedavg_on_run_simulation_with_a_slow_node(tmp_path):
    from flwr.app import ConfigRecord, Context, MetricRecord
    from flwr.serverapp import Grid, ServerApp
    from flwr.serverapp.strategy import FedAvg
    from flwr.simulation import run_simulation

    from benchmarks import compatkit
    from fedcomp.flower import ClientSession, Compressed

    family = compatkit.FAMILIES["mlp"]
    out: dict = {}
    versions, staleness_bound = 10, 2

    class Audited(Compressed):
        def audit(self, update, staleness):
            out.setdefault("applied", {}).setdefault(update.client_id, {})[update.seq] = update.to_dense()
            out.setdefault("staleness", []).append(staleness)

    app = ServerApp()

    @app.main()
    def main(grid: Grid, context: Context) -> None:
        strategy = Audited(FedAvg(min_available_nodes=4), "dgc+int8", density=0.05, mode="async", buffer_size=2,
                           max_staleness=staleness_bound)
        seen: list[int] = []

        def evaluate(version, arrays):
            seen.append(version)
            return MetricRecord({"accuracy": compatkit.accuracy(family, arrays)})

        result = strategy.start(grid, family.record(family.build()), num_rounds=versions,
                                train_config=ConfigRecord({"lr": compatkit.LR}), evaluate_fn=evaluate)
        out.update(seen=seen, version=strategy.proto.version, totals=strategy.totals.to_dict(),
                   accuracy={v: float(m["accuracy"]) for v, m in result.evaluate_metrics_serverapp.items()},
                   compression=strategy.compression, spec=strategy.spec)

    run_simulation(app, _client_app(tmp_path), num_supernodes=4,
                   backend_config={"client_resources": {"num_cpus": 1}, "init_args": {"num_cpus": 2}})
    assert out["version"] == versions and out["seen"] == list(range(versions + 1))
    assert out["accuracy"][versions] > out["accuracy"][0] + 0.3, out["accuracy"]
    assert out["totals"]["accepted"] == 2 * versions
    assert max(out["staleness"]) <= staleness_bound
    spec, worst = out["spec"], 0.0
    files = sorted(tmp_path.glob("*.pt"))
    assert len(files) == 4  # every node trained, the slow one too
    for path in files:
        state = torch.load(path, weights_only=False)
        session = ClientSession.from_bytes(state["session"], out["compression"], spec)
        applied = out.get("applied", {}).get(state["node"] % (1 << 64), {})
        for n in spec.names:
            total = sum((u[n] for u in applied.values()), torch.zeros(spec.shape(n)))
            try:
                total = total + session.pipeline.memory.residual(n).reshape(spec.shape(n))
            except KeyError:  # no residual yet
                pass
            for seq, update in session.pipeline.pending.items():
                if seq not in applied:
                    total = total + update.to_dense()[n]
            want = torch.from_numpy(state["computed"][n]).reshape(spec.shape(n))
            worst = max(worst, float((want - total).norm()) / max(float(want.norm()), 1e-12))
    assert worst < 1e-5


@pytest.mark.slow
def test_flwr_run_of_the_example_app_in_async_mode(tmp_path_factory):
    """``flwr run examples/compressed-digits`` with ``mode="async"`` on the simulation engine: the run completes;
    the same run with ``buffer-size = 0`` (refused by async mode only) fails, so the mode reached ``Compressed``."""
    from fedcomp.tools.processes import (
        ManagedProcess,
        flower_env,
        free_port,
        submit_run,
        superlink_argv,
        wait_http_ready,
        write_flower_config,
        write_overrides,
    )
    from tests.test_flower_sim import CONN, ROOT, wait_finished

    home = tmp_path_factory.mktemp("flwr-home")
    port = free_port()
    write_flower_config(home, CONN, f"127.0.0.1:{port}")
    env = flower_env(home)
    link = ManagedProcess("superlink", superlink_argv(port, simulation=True, extra=["--insecure"]),
                          home / "superlink.log", env)
    try:
        wait_http_ready(f"127.0.0.1:{port}", 600, link)
        statuses = []
        for k in (2, 0):
            run = {"num-server-rounds": 4, "mode": "async", "buffer-size": k, "max-staleness": 4,
                   "compressor": "dgc+int8", "density": 0.05}
            run_id = submit_run(ROOT / "examples" / "compressed-digits", CONN, env,
                                write_overrides(home / f"async-{k}.toml", run),
                                "num-supernodes=2 client-resources-num-cpus=1 init-args-num-cpus=2")
            statuses.append(wait_finished(run_id, env, 1500))
    finally:
        link.stop()
    log_text = (home / "superlink.log").read_text()
    assert statuses == ["finished:completed", "finished:failed"], f"{statuses}\n{log_text[-3000:]}"

"""Flower simulation end to end: ``flwr run`` of this app on a private simulation SuperLink, sync and async.

The SuperLink runs on a free port with a private FLWR_HOME whose config.toml names it; it is stopped by PID
(with its flower-superexec / flwr-serverapp / Ray children) in the fixture's finalizer.
"""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

import pytest

from fedcomp.tools.processes import (
    FlwrCliError,
    ManagedProcess,
    flower_env,
    free_port,
    run_status,
    submit_run,
    superlink_argv,
    wait_http_ready,
    write_flower_config,
    write_overrides,
)

ROOT = Path(__file__).resolve().parents[1]
CONN = "fedcomp-sim"


@pytest.fixture(scope="module")
def sim_link(tmp_path_factory):
    home = tmp_path_factory.mktemp("flwr-home")
    port = free_port()
    write_flower_config(home, CONN, f"127.0.0.1:{port}")
    env = flower_env(home)
    link = ManagedProcess(
        "superlink", superlink_argv(port, simulation=True, extra=["--insecure"]), home / "superlink.log", env
    )
    try:
        wait_http_ready(f"127.0.0.1:{port}", 600, link)
        yield env, home
    finally:
        link.stop()


def status_of(run_id: int, env) -> str:
    """The run's status; "" when ``flwr ls`` times out or fails (a loaded machine): the caller asks again."""
    try:
        return run_status(CONN, run_id, env)
    except (subprocess.TimeoutExpired, FlwrCliError):
        return ""


def wait_finished(run_id: int, env, timeout: float) -> str:
    """Poll the run's status every 2 s until it finishes; ``timeout`` bounds a hang, not a slow run."""
    end, status = time.monotonic() + timeout, ""
    while time.monotonic() < end and not status.startswith("finished"):
        time.sleep(2)
        status = status_of(run_id, env)
    return status


def run_app(env, home: Path, name: str, overrides: dict, supernodes: int, timeout: float = 1500.0) -> dict:
    out = home / name
    overrides = {"out-dir": str(out), "min-clients": supernodes, "node-wait": 900.0, **overrides}
    run_id = submit_run(
        ROOT,
        CONN,
        env,
        write_overrides(home / f"{name}.toml", overrides),
        f"num-supernodes={supernodes} client-resources-num-cpus=1 init-args-num-cpus=2",
    )
    status = wait_finished(run_id, env, timeout)
    assert status == "finished:completed", f"run {run_id}: {status}\n{(home / 'superlink.log').read_text()[-3000:]}"
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return {"rows": rows, "summary": json.loads((out / "summary.json").read_text())}


BASE = {"model": "mlp", "local-steps": 10, "local-lr": 0.1, "compressor": "dgc", "compressor-options": "density=0.05"}


@pytest.mark.slow
def test_async_simulation_learns(sim_link):
    env, home = sim_link
    res = run_app(env, home, "async", {**BASE, "mode": "async", "num-versions": 6, "buffer-size": 2}, supernodes=3)
    rows, summary = res["rows"], res["summary"]
    assert [r["version"] for r in rows] == list(range(1, 7))
    assert rows[-1]["accuracy"] > 0.5 and rows[-1]["accuracy"] > summary["initial_accuracy"] + 0.3
    assert summary["payload_bytes_up_per_reply"] < summary["dense_fp32_bytes"] / 4
    assert summary["flower_objects_up_per_reply"] == 3  # Message, RecordDict, one ConfigRecord (blob inline)
    assert all(max(map(int, r["staleness_hist"] or {"0": 0})) <= 4 for r in rows)
    assert summary["totals"]["accepted"] >= 12 and summary["totals"]["rejected"] == 0


@pytest.mark.slow
def test_sync_simulation_learns(sim_link):
    env, home = sim_link
    res = run_app(
        env,
        home,
        "sync",
        {**BASE, "mode": "sync", "num-versions": 3, "fraction": 1.0, "fed-eval": True, "eval-every": 2},
        supernodes=2,
    )
    rows, summary = res["rows"], res["summary"]
    assert [r["version"] for r in rows] == [1, 2, 3]
    assert all(r["accepted"] == 2 and r["staleness_hist"] == {"0": 2} for r in rows)
    assert "accuracy" not in rows[0] and rows[1]["accuracy"] > 0.5  # eval-every 2, and at the end
    assert rows[-1]["accuracy"] > summary["initial_accuracy"] + 0.3
    assert summary["messages_per_applied_update"] == pytest.approx(2.0)
    fed = summary["federated_evaluation"]  # after version 2 and at the end (version 3), both nodes answer
    assert [(f["version"], f["clients"]) for f in fed] == [(2, 2), (3, 2)] and fed[-1]["fed_accuracy"] > 0.5


# ---- fast checks of the Flower glue (no processes) ------------------------------------------------------------


def test_run_config_defaults_and_errors():
    import tomllib

    from fedcomp.registry import ConfigError
    from fedcomp.task.config import NodeConfig, RunConfig

    with open(ROOT / "pyproject.toml", "rb") as f:
        defaults = tomllib.load(f)["tool"]["flwr"]["app"]["config"]
    run = RunConfig.from_flower(defaults)
    assert run == RunConfig()  # the pyproject and the dataclass agree
    assert RunConfig.from_flower({"compressor-options": "density=0.1, warmup-epochs=2"}).compressor_kwargs == {
        "density": 0.1,
        "warmup_epochs": 2,
    }
    for bad, msg in [
        ({"num-version": 3}, "unknown run config key"),
        ({"num-versions": "many"}, "num-versions"),
        ({"mode": "lockstep"}, "mode"),
        ({"compressor-options": "density"}, "compressor-options"),
    ]:
        with pytest.raises(ConfigError, match=msg):
            RunConfig.from_flower(bad)
    assert NodeConfig.from_flower({"partition-id": 1, "num-partitions": 3, "gpu": False}).partition_id == 1
    with pytest.raises(ConfigError, match="partition-id"):
        NodeConfig.from_flower({"partition-id": 3, "num-partitions": 3})


def test_record_layout_roundtrip(monkeypatch):
    """The product loops' task (``TaskFormat``) and a mod reply read back whole; blobs inline in one ConfigRecord,
    or as a chunked Array when over Flower's chunk size."""
    from flwr.app import ConfigRecord, MetricRecord, RecordDict

    from fedcomp.flower import records
    from fedcomp.protocol import Outcome, ReplyMeta, Resolution, Task
    from fedcomp.spec import ModelSpec

    res = [Resolution(3, 2, Outcome.APPLIED, "in version 4"), Resolution(4, 0, Outcome.TIMEOUT, "no reply")]
    fmt = records.TaskFormat({"compressor": "dgc"}, records.ArrayLayout.of_spec(ModelSpec((("w", (2, 3)),))))
    content = fmt.content(Task(5, 17, 7, 0.0, 60.0, round=1, resolutions=res, run_key=9), b"model-bytes")
    task = records.read_mod_task(content)
    assert (task.task_id, task.base_version, task.resolutions, task.run_key) == (5, 7, res, 9)
    assert task.compression == {"compressor": "dgc"} and task.layout == fmt.layout
    assert records.model_blob(content) == b"model-bytes"
    assert (len(content.array_records), len(content.config_records)) == (0, 1)  # fewest Flower objects
    records.unfold(content)  # what compression_mod does first: the product's train config, a record again
    assert dict(content.config_records[records.CONFIG]) == {records.SERVER_ROUND: 1}
    user = RecordDict({"metrics": MetricRecord({"num-examples": 32, "train-loss": 0.1 + 0.2, "v": [1.5, 2.0]})})
    reply = records.add_mod_reply(user, fmt.layout, "arrays", b"\x01\x02", ReplyMeta(5, 3, 1, 99, (4,)))
    reply[records.CONTROL][records.PENDING_KEY] = [4]
    assert (len(reply.metric_records), len(reply.config_records)) == (0, 1)  # the metrics folded in
    assert records.read_mod_reply(reply) == (b"\x01\x02", ReplyMeta(5, 3, 1, 99, (4,)))
    assert dict(reply.metric_records["metrics"]) == dict(user.metric_records["metrics"])  # back, exactly
    assert records.FOLDED not in reply.config_records[records.CONTROL]
    with pytest.raises(records.RecordError):
        records.read_mod_reply(RecordDict({"config": ConfigRecord({"x": 1})}))
    monkeypatch.setattr(records, "INLINE_MAX", 1)  # a blob over Flower's chunk size goes as a chunked Array
    big = fmt.content(Task(5, 17, 7, 0.0, 60.0), b"model-bytes")
    assert (len(big.array_records), len(big.config_records)) == (1, 1)
    assert records.model_blob(big) == b"model-bytes"


@pytest.mark.parametrize("folded", [
    "not json", "[1, 2]", '{"array": {}}', '{"metric": {"m": {"x": "text"}}}', '{"metric": {"m": 3}}',
    '{"metric": {"metrics": {"x": 1}}, "config": {"metrics": {"y": 2}}}',
])
def test_a_malformed_folded_record_is_a_record_error(folded):
    """What a hostile or broken client folds into its reply is a counted rejection (RecordError), never a crash
    and never a record that overwrites another."""
    from flwr.app import RecordDict

    from fedcomp.flower import records
    from fedcomp.protocol import ReplyMeta
    from fedcomp.spec import ModelSpec

    layout = records.ArrayLayout.of_spec(ModelSpec((("w", (2,)),)))
    reply = records.add_mod_reply(RecordDict(), layout, "arrays", b"\x01", ReplyMeta(1, 1))
    reply[records.CONTROL][records.FOLDED] = folded
    with pytest.raises(records.RecordError, match="records"):
        records.read_mod_reply(reply)


def test_client_state_survives_serialization_and_gpu_is_never_faked():
    import torch

    from clients.trainer import GpuUnavailableError, select_device
    from fedcomp.flower.session import ClientSession
    from fedcomp.spec import ModelSpec
    from fedcomp.task.config import NodeConfig, RunConfig
    from fedcomp.wire import encode

    spec = ModelSpec((("w", (40, 30)), ("b", (30,))))
    run = RunConfig(compressor="topk", compressor_options="density=0.1")
    state = ClientSession.fresh(run.compression, spec)
    blob, seq = state.send(11, {"w": torch.randn(40, 30), "b": torch.randn(30)}, base_version=0, client_id=1)
    assert seq == 1 and blob == encode(state.pipeline.pending[1], spec)
    back = ClientSession.from_bytes(state.to_bytes(), run.compression, spec)
    assert back.incarnation == state.incarnation and back.task_seqs == {11: 1}
    assert {s: encode(u, spec) for s, u in back.pipeline.pending.items()} == {
        s: encode(u, spec) for s, u in state.pipeline.pending.items()
    }
    assert torch.equal(back.pipeline.memory.residual("w"), state.pipeline.memory.residual("w"))
    if torch.cuda.is_available():
        assert select_device(NodeConfig(gpu=True)).type == "cuda"
    else:
        with pytest.raises(GpuUnavailableError, match="refusing to fall back"):
            select_device(NodeConfig(gpu=True))
    assert select_device(NodeConfig()).type == "cpu"


@pytest.mark.parametrize(
    "module, argv, needle",
    [
        ("server_app.launcher", ["--versions", "x"], "invalid int value"),
        ("server_app.launcher", ["--insecure", "-c", "nope=1"], "unknown run-config key 'nope'"),
        ("server_app.launcher", ["--insecure", "--mode", "sync", "-c", "buffer-size=0"], "buffer-size"),
        ("server_app.launcher", [], "--insecure"),
        ("clients.launcher", ["--server", "nohostport", "--insecure"], "HOST:PORT"),
        ("clients.launcher", ["--server", "h:1", "--partition-id", "2"], "go together"),
        ("clients.launcher", ["--server", "h:1", "--partition-id", "2", "--num-partitions", "2"], "[0, 2)"),
    ],
)
def test_launchers_reject_bad_flags_in_one_line(module, argv, needle, capsys, tmp_path):
    import importlib

    main = importlib.import_module(module).main
    with pytest.raises(SystemExit) as exc:
        main([*argv, *(["--out", str(tmp_path)] if module.startswith("server") else [])])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and needle in err and err.count("\n") == 1, err


def test_server_resumes_from_a_checkpoint(tmp_path):
    import torch

    from fedcomp.server.loops import Reporter
    from fedcomp.task.config import RunConfig
    from fedcomp.task.serverside import build_server

    run = RunConfig()
    _, proto, _ = build_server(run)
    with torch.no_grad():
        for p in proto.params.values():
            p.add_(0.5)
    proto.version, proto.next_task_id = 7, 40
    proto.dispatch(123, now=0.0)  # open at checkpoint time -> nacked "lost" after the resume
    Reporter(tmp_path, checkpoint_every=1).save_checkpoint(proto)
    _, resumed, _ = build_server(RunConfig(resume=str(tmp_path / "checkpoint.pt")))
    assert resumed.version == 7 and resumed.next_task_id == 41
    assert all(torch.equal(resumed.params[n], proto.params[n]) for n in proto.params)
    assert resumed.dispatch(123, now=1.0).resolutions[-1].reason == "lost: server restarted"


@pytest.mark.slow
def test_flwr_run_of_the_example_app(sim_link):
    """``flwr run examples/compressed-digits``: the README's example, with compression, on the simulation engine."""
    env, home = sim_link
    overrides = write_overrides(home / "example.toml", {"num-server-rounds": 3})
    run_id = submit_run(ROOT / "examples" / "compressed-digits", CONN, env, overrides,
                        "num-supernodes=2 client-resources-num-cpus=1 init-args-num-cpus=2")
    status = wait_finished(run_id, env, 1500)
    assert status == "finished:completed", f"run {run_id}: {status}\n{(home / 'superlink.log').read_text()[-3000:]}"


def test_the_async_serverapp_evaluates_on_the_nodes_with_fed_eval(tmp_path):
    """``fed-eval`` in async mode: the ServerApp's ``Compressed`` sends the wrapped strategy's evaluate messages to
    the nodes every ``eval-every`` versions and at the last; each evaluation is a row of ``summary.json``."""
    from flwr.app import Context, RecordDict

    import server_app.app as app_mod
    from benchmarks.flowerkit import LocalGrid, server_identity
    from clients.app import app as client_app

    run_config = {"num-versions": 3, "mode": "async", "buffer-size": 1, "concurrency": 2, "node-wait": 60.0,
                  "poll-interval": 0.05, "fed-eval": True, "eval-every": 2, "out-dir": str(tmp_path / "out")}
    apps = {11 + i: (client_app, {"partition-id": i, "num-partitions": 2, "state-dir": str(tmp_path / f"c{i}")})
            for i in range(2)}
    with server_identity():
        app_mod.main(LocalGrid(apps, run_config), Context(1, 0, {}, RecordDict(), dict(run_config)))
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    fed = summary["federated_evaluation"]
    assert [(f["version"], f["clients"]) for f in fed] == [(2, 2), (3, 2)], fed
    assert 0.0 < fed[-1]["fed_accuracy"] <= 1.0 and fed[-1]["fed_loss"] > 0

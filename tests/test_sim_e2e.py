"""Simulations end to end, in-process engine: the CLI on the tiny scenario and its output files, seeded
determinism (two runs, identical summaries), and conservation through the real ClientApp on lossy links
(a lost update is nacked and restored into the client's residual)."""

from __future__ import annotations

import csv
import json
import re
from pathlib import Path

import pytest
import torch

from clients.app import app as client_app
from clients.trainer import LOCAL_TRAINERS, DeltaTrainer
from fedcomp.flower.session import ClientSession
from fedcomp.protocol import Outcome
from fedcomp.server.loops import LOOPS, Reporter
from fedcomp.sim.virtual import VirtualClock, VirtualTransport
from fedcomp.spec import ModelSpec
from fedcomp.task.serverside import build_server, loop_config
from fedcomp.task.training import datasets, make_model
from fedcomp.tools.cli import main
from simulations import scenario as scenarios
from simulations.backends import run_scenario
from simulations.engines import InProcessEngine
from simulations.runner import NODE_ID_BASE

TIMING_KEYS = {"wall_s", "flower_s", "fedcomp_s", "engine_wall_s", "flower_ms_per_update", "fedcomp_ms_per_update"}


@pytest.fixture(autouse=True)
def one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def test_cli_tiny_scenario_writes_every_output(tmp_path, capsys):
    out = tmp_path / "tiny"
    assert main(["sim", "tiny", "--quiet", "--out", str(out), "--set", "method.fedavg.num_versions=4",
                 "--set", "method.dgc-async.num_versions=10"]) == 0
    captured = capsys.readouterr()
    printed = captured.out
    assert "fedavg" in printed and "dgc-async" in printed and "time_to_target_s" in printed
    assert "stopped at version" not in captured.err  # both completed
    assert "wire_bytes_up_per_reply" in printed and "latency_s" in printed  # the per-update and time-split tables
    doc = json.loads((out / "summary.json").read_text())
    methods = {m["method"]: m for m in doc["methods"]}
    assert set(methods) == {"fedavg", "dgc-async"}
    assert methods["fedavg"]["versions"] == 4 and methods["dgc-async"]["versions"] == 10
    assert methods["fedavg"]["speedup"] == 1.0
    dgc, avg = methods["dgc-async"], methods["fedavg"]
    for fig in ("payload", "flower", "wire"):  # three byte figures, each named, per applied update and per reply
        assert dgc[f"{fig}_bytes_up_per_applied_update"] < avg[f"{fig}_bytes_up_per_applied_update"]
        assert dgc[f"{fig}_bytes_up_per_reply"] > 0 and dgc[f"{fig}_bytes_down"] > 0
    for m in (dgc, avg):  # wire = Flower objects + protocol; Flower objects = payload + records
        assert m["wire_bytes_up"] > m["flower_bytes_up"] > m["payload_bytes_up"] > 0
        assert m["wire_bytes_total"] == m["wire_bytes_up"] + m["wire_bytes_down"]
        parts = ("compute", "codec", "transfer", "latency", "queue")
        assert m["task_total_s"] == pytest.approx(sum(m[f"task_{p}_s"] for p in parts), abs=2e-3)
        assert m["task_latency_s"] > 0 and m["task_compute_s"] > 0 and m["task_codec_s"] > 0
    assert dgc["task_codec_s"] > avg["task_codec_s"]  # DGC's compress + encode costs more than a dense copy's
    assert set(doc["task_split_by_link"]["fedavg"]) == {"datacenter", "wifi", "lte", "flaky3g"}
    assert len(doc["nodes"]["fedavg"]) == 4
    assert all(n["wire_bytes_down"] >= n["bundle_down"] > 0 for n in doc["nodes"]["fedavg"])
    for name, m in methods.items():  # whose updates the model holds: the ledger's per-node counts add up
        assert sum(n["applied"] for n in doc["nodes"][name]) == m["applied"] > 0
        assert all(n["nacked"] >= 0 for n in doc["nodes"][name])
    with (out / "summary.csv").open() as f:
        rows = list(csv.DictReader(f))
    assert [r["method"] for r in rows] == ["fedavg", "dgc-async"] and "accuracy" in rows[0]
    for name, versions in (("fedavg", 4), ("dgc-async", 10)):
        lines = [json.loads(x) for x in (out / f"{name}.jsonl").read_text().splitlines()]
        assert [r["version"] for r in lines] == list(range(1, versions + 1))
        times = [r["time"] for r in lines]
        assert times == sorted(times) and all("accuracy" in r and "wire_bytes_total" in r for r in lines)
        totals = [r["wire_bytes_total"] for r in lines]
        assert totals == sorted(totals) and totals[0] > 0
    for png in ("accuracy_vs_time", "accuracy_vs_wire_bytes", "bytes_per_client", "staleness"):
        assert (out / f"{png}.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert json.loads((out / "scenario.json").read_text())["method"]["fedavg"]["num_versions"] == 4


def test_a_method_that_stops_short_says_why(tmp_path, capsys):
    assert main(["sim", "tiny", "--quiet", "--out", str(tmp_path), "--set", "method.fedavg.num_versions=3",
                 "--set", "method.dgc-async.run_timeout=2"]) == 0  # a stopped method is a result, not an error
    err = capsys.readouterr().err
    assert "fedavg stopped" not in err
    assert re.search(r"dgc-async stopped at version \d+ of 200: run timeout \(2s\) at version \d+", err), err


def test_a_run_whose_every_client_call_fails_is_an_error_not_a_timeout(tmp_path, capsys):
    """``SimulationError`` used to be a ``RuntimeError``, which the server loop takes from a transport as a node it
    cannot reach: the run backed off until its timeout and exited 0, the cause never shown."""
    code = main(["sim", "tiny", "--quiet", "--no-plot", "--out", str(tmp_path), "--set", "methods=dgc-async",
                 "--set", "run.local_lr=1e30"])
    err = capsys.readouterr().err
    assert code == 1, err
    assert "every ClientApp call failed" in err and "NonFiniteUpdate" in err and "run timeout" not in err


def test_a_target_the_starting_model_meets_is_reached_at_0_and_gives_no_speedup(tmp_path, capsys):
    """Only evaluated versions were scanned: a target below the starting model's accuracy was 'reached' at each
    method's first version, and their ratio made up a speedup."""
    assert main(["sim", "tiny", "--quiet", "--no-plot", "--out", str(tmp_path), "--set", "target_accuracy=0.01",
                 "--set", "method.fedavg.num_versions=2", "--set", "method.dgc-async.num_versions=2"]) == 0
    rows = json.loads((tmp_path / "summary.json").read_text())["methods"]
    assert {r["method"] for r in rows} == {"fedavg", "dgc-async"}
    for r in rows:
        assert r["initial_accuracy"] >= 0.01 and r["time_to_target_s"] == 0.0 and r["speedup"] is None, r


def test_totals_hold_what_the_server_read_and_the_rows_add_up_to_them(tmp_path, capsys):
    """A reply was counted (replies, its bytes, its time split) when it was scheduled, not when the server read
    it: a run that ended first counted replies nobody got (a 0.5 s run: 4 replies, a mean task 11x the run), the
    last row was charged traffic ahead of time, and a task lost on its way down left its Flower bytes out of the
    rows (payload above Flower object bytes there)."""
    assert main(["sim", "tiny", "--quiet", "--no-plot", "--out", str(tmp_path / "short"), "--set",
                 "method.fedavg.run_timeout=0.5", "--set", "method.dgc-async.run_timeout=0.5"]) == 0
    for m in json.loads((tmp_path / "short" / "summary.json").read_text())["methods"]:
        assert m["versions"] == 0 and m["replies"] == 0 and m["payload_bytes_up"] == 0, m
    assert main(["sim", "tiny", "--quiet", "--no-plot", "--out", str(tmp_path / "five"), "--set",
                 "method.fedavg.num_versions=5", "--set", "method.dgc-async.num_versions=5"]) == 0
    for m in json.loads((tmp_path / "five" / "summary.json").read_text())["methods"]:
        rows = [json.loads(line) for line in (tmp_path / "five" / f"{m['method']}.jsonl").read_text().splitlines()]
        heard = m["applied"] + m["stale"] + m["rejected"]
        assert heard <= m["replies"] <= heard + m["timeout"], m  # a reply read after its deadline: a timeout
        for key in ("payload_bytes_up", "flower_bytes_up", "payload_bytes_down", "flower_bytes_down"):
            assert sum(r[key] for r in rows) == m[key], (m["method"], key)
        for r in rows:
            assert r["payload_bytes_down"] <= r["flower_bytes_down"] and r["payload_bytes_up"] <= r["flower_bytes_up"]


def one_client(path: Path, *, timeouts: tuple[float, float], versions: int, client: str, more: str = "") -> Path:
    """A scenario of one client training dense FedAvg (``identity``) on digits' MLP over a 10 Mbit/s link without
    delay: ``timeouts`` the round's and the task's, ``client`` the rest of its ``[[clients]]`` table (its device,
    availability), ``more`` the rest of the link's table and further tables."""
    path.write_text(f"""name = "one"
methods = ["fedavg"]
target_accuracy = 0.3
[run]
dataset = "digits"
model = "mlp"
local_steps = 2
compressor_options = ""
round_timeout = {timeouts[0]}
task_timeout = {timeouts[1]}
[method.fedavg]
mode = "sync"
compressor = "identity"
num_versions = {versions}
[[clients]]
count = 1
link = "ten"
{client}
[links.ten]
up_mbps = 10
down_mbps = 10
rtt_ms = 0
{more}""")
    return path


def test_a_node_that_leaves_before_its_reply_is_charged_no_reply_bytes(tmp_path, capsys):
    """One client, online 5 s of every 100: it leaves during tasks. Their replies were counted as sent, so dense
    FedAvg showed half the dense bytes per reply (uplink_vs_dense_fp32 = 0.5)."""
    scenario = one_client(tmp_path / "one.toml", timeouts=(30.0, 60.0), versions=4,
                          client='device = "laptop"\navailability = {period_s = 100, online_s = 5}')
    assert main(["sim", str(scenario), "--quiet", "--no-plot", "--out", str(tmp_path / "out"),
                 "--set", "method.fedavg.run_timeout=200"]) == 0
    [m] = json.loads((tmp_path / "out" / "summary.json").read_text())["methods"]
    assert m["disconnects"] >= 1 and m["replies"] >= 1, m
    per_reply = m["payload_bytes_up"] / m["replies"]  # one dense update and its few header bytes
    assert m["uplink_vs_dense_fp32"] == 1.0 and m["dense_fp32_bytes"] <= per_reply < 1.01 * m["dense_fp32_bytes"], m


def test_a_reply_lost_after_the_run_ended_is_not_counted(tmp_path, capsys):
    """One client, 64 s of training a task, a link that loses half the messages (seed 1: the first reply), a 20 s
    run: that reply would be lost at about 100 s. It was counted when scheduled, at 0 s: a link loss and its bytes
    in a run that had ended. The same run given 400 s counts it."""
    scenario = one_client(tmp_path / "lost.toml", timeouts=(300.0, 300.0), versions=2, client='device = "slow"',
                          more="loss = 0.5\n[devices.slow]\ns_per_sample = 1.0\n")
    runs = {}
    for seconds in (20, 400):
        out = tmp_path / f"out{seconds}"
        assert main(["sim", str(scenario), "--quiet", "--no-plot", "--out", str(out),
                     "--set", "seed=1", "--set", f"method.fedavg.run_timeout={seconds}"]) == 0
        [runs[seconds]] = json.loads((out / "summary.json").read_text())["methods"]
    short, long = runs[20], runs[400]
    assert short["link_losses"] == 0 and short["payload_bytes_up"] == short["flower_bytes_up"] == 0, short
    assert long["link_losses"] >= 1 and long["replies"] == 0, long
    assert long["payload_bytes_up"] >= long["dense_fp32_bytes"], long  # the lost reply crossed: its bytes count


def test_module_entry_runs_a_scenario_without_the_installed_command(tmp_path, capsys):
    """``python -m simulations.cli`` is ``fedcomp sim`` for a checkout that is not installed (no entry point)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    from simulations.cli import main as sim_main

    out = tmp_path / "tiny"
    assert sim_main(["tiny", "--quiet", "--no-plot", "--out", str(out), "--set", "methods=fedavg",
                     "--set", "method.fedavg.num_versions=2"]) == 0
    assert [m["method"] for m in json.loads((out / "summary.json").read_text())["methods"]] == ["fedavg"]
    assert "fedavg" in capsys.readouterr().out
    root = Path(__file__).resolve().parents[1]
    res = subprocess.run([sys.executable, "-m", "simulations.cli", "--help"], capture_output=True, text=True,
                         cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(root)}, timeout=300)
    assert res.returncode == 0 and "--set KEY=VALUE" in res.stdout and "python -m simulations.cli" in res.stdout
    capsys.readouterr()
    assert sim_main(["nosuch-scenario", "--quiet"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("fedcomp sim: error:") and "nosuch-scenario" in err[0]


def test_same_seed_same_numbers():
    def once() -> list[tuple[dict, list[dict]]]:
        sc = scenarios.load("tiny", ["sim.progress=false", "method.fedavg.num_versions=3",
                                     "method.dgc-async.num_versions=10"])
        res = run_scenario(sc)
        return [
            ({k: v for k, v in r.summary.items() if k not in TIMING_KEYS},
             [{k: v for k, v in row.items() if k != "wall_s"} for row in r.rows])
            for r in res
        ]

    first, second = once(), once()
    assert first == second
    assert first[0][0]["tasks"] > 0 and first[1][0]["versions"] == 10


def test_bad_scenarios_fail_with_clear_errors():
    with pytest.raises(scenarios.ConfigError, match="unknown scenario key"):
        scenarios.from_dict({"methodz": []})
    with pytest.raises(scenarios.ConfigError, match="unknown link"):
        scenarios.load("tiny", ["clients.0.link=fiber"])
    with pytest.raises(scenarios.ConfigError, match="num_versions"):  # as the scenario spells it
        scenarios.load("tiny", ["method.fedavg.num_versions=0"])
    with pytest.raises(scenarios.ConfigError, match="unknown run key"):
        scenarios.load("tiny", ["run.local_stepz=3"])
    with pytest.raises(scenarios.ConfigError, match="set by the simulator"):
        scenarios.load("tiny", ["run.seed=3"])
    with pytest.raises(scenarios.ConfigError, match="no \\[method.NAME\\] table"):
        scenarios.load("tiny", ["methods=fedavg,nope"])
    with pytest.raises(scenarios.ConfigError, match="sim.engine"):
        scenarios.load("tiny", ["sim.engine=gpu"])
    with pytest.raises(scenarios.ConfigError, match="unknown key"):
        scenarios.load("tiny", ["links.flaky3g.jitter=3"])
    with pytest.raises(scenarios.ConfigError, match="key=value"):
        scenarios.load("tiny", ["seed"])
    with pytest.raises(scenarios.ConfigError, match="target_accuracy"):  # True is an int to Python
        scenarios.load("tiny", ["target_accuracy=true"])
    for link, words in (("up_mbps=1e-300", "1 kbit/s"), ("down_mbps=0.0009", "1 kbit/s"), ("rtt_ms=1e308", "rtt_ms")):
        with pytest.raises(scenarios.ConfigError, match=words):  # a transfer of years: the run would hang
            scenarios.load("tiny", [f"links.x={{base='lte',{link}}}", "clients.3.link=x"])
    with pytest.raises(FileNotFoundError, match="built-in"):
        scenarios.load("no-such-scenario")
    assert main(["sim", "tiny", "--set", "clients.9.count=1"]) == 2


def test_overrides_and_custom_profiles():
    sc = scenarios.load("tiny", ["clients.0.count=3", "methods=dgc-async", "links.flaky3g.loss=0.2", "seed=7"])
    assert sc.num_clients == 6 and [m.name for m in sc.methods] == ["dgc-async"] and sc.baseline == "dgc-async"
    profiles = sc.node_profiles()
    assert [p.link.name for p in profiles][:3] == ["datacenter"] * 3
    assert profiles[-1].link.loss == 0.2 and profiles[-1].link.rtt_s == pytest.approx(0.25)
    assert profiles[4].availability.period_s == 40.0
    assert sc.methods[0].run.seed == 7 and sc.timing().seed == 7


# ---- conservation through the ClientApp on lossy links ------------------------------------------------------

COMPUTED: list[dict[str, torch.Tensor]] = []


@LOCAL_TRAINERS.register("test-recording-delta")
class RecordingDelta(DeltaTrainer):
    """The delta trainer, recording every pseudo-gradient it hands to the pipeline."""

    def __call__(self, model, split, run, device, generator):
        result = super().__call__(model, split, run, device, generator)
        COMPUTED.append({k: v.detach().double().clone() for k, v in result.pseudo_grad.items()})
        return result


def test_lost_updates_are_nacked_and_restored_sum_is_conserved(monkeypatch):
    """Σ applied + Σ residuals = Σ computed after a lossy async run (30% loss, disconnects, availability)."""
    from fedcomp.task import config

    monkeypatch.setattr(config, "LOCAL_MODES", (*config.LOCAL_MODES, "test-recording-delta"))  # a test's own trainer
    COMPUTED.clear()
    sc = scenarios.load(
        "tiny",
        [
            "methods=dgc-async",
            "links.flaky3g.loss=0.3",
            "links.flaky3g.disconnect=0.1",
            "clients.1.link=flaky3g",
            "links.lossy_dc.base=datacenter",
            "links.lossy_dc.loss=0.25",
            "clients.0.link=lossy_dc",
            "run.local_mode=\"test-recording-delta\"",
            "method.dgc-async.compressor=\"topk\"",
            "method.dgc-async.compressor_options=\"density=0.05\"",
            "method.dgc-async.staleness=\"constant\"",
            "method.dgc-async.normalize=\"sum\"",
            "method.dgc-async.buffer_size=1",
            "method.dgc-async.max_staleness=2",
            "method.dgc-async.num_versions=40",
            "method.dgc-async.task_timeout=3.0",
            "method.dgc-async.run_timeout=0",
            "sim.count_bytes=\"flower\"",  # no transport model: 3 s tasks on the links above, as this test assumes
            "sim.progress=false",
        ],
    )
    method = sc.methods[0]
    run = method.run
    model, proto, _ = build_server(run)
    start = {n: p.detach().double().clone() for n, p in proto.params.items()}
    node_index = {NODE_ID_BASE + i: i for i in range(sc.num_clients)}
    engine = InProcessEngine(client_app, method.flat, node_index)
    profiles = sc.node_profiles()
    clock = VirtualClock()
    transport = VirtualTransport(engine, {n: profiles[i] for n, i in node_index.items()}, clock, sc.timing())
    loop = LOOPS.get("async")(proto, transport, loop_config(run), Reporter(None, clock=clock), clock=clock)
    loop.run()
    assert proto.version == 40 and proto.buffered == 0
    lost = sum(s.lost_down + s.lost_up + s.disconnects for s in transport.stats.values())
    assert lost >= 5, "the scenario should lose some messages"

    # end of run: what is still in flight is lost; every client hears about every one of its updates
    for t in list(proto.tasks.values()):
        proto.fail_task(t.client, t.task_id, Outcome.LOST, "run ended", clock.now())
    train, _ = datasets(run)
    spec = ModelSpec.from_module(make_model(run, train))
    residual = {n: torch.zeros(s, dtype=torch.float64) for n, s in spec.entries}
    pending_at_end = 0
    for nid, ctx in engine.contexts.items():
        state = ClientSession.load(ctx, run.compression, spec)
        before = len(state.pipeline.pending)
        state.apply(proto.ledger(nid).outbox)
        pending_at_end += before
        assert state.pipeline.pending == {}, "every update must be acked or nacked"
        for n in spec.names:
            if n in state.pipeline.memory.errors:
                residual[n] += state.pipeline.memory.errors[n].double()
    assert pending_at_end > 0, "some updates should still wait for their ack or nack at the end"
    assert proto.totals.timeout + proto.totals.lost + proto.stats.timeout + proto.stats.lost > 0

    applied = {n: start[n] - proto.params[n].double() for n in spec.names}  # SGD lr 1, weight 1, sum
    for n in spec.names:
        computed = sum(c[n] for c in COMPUTED)
        torch.testing.assert_close(applied[n] + residual[n], computed, atol=2e-4, rtol=1e-4)
    assert len(COMPUTED) == sum(s.tasks - s.lost_down for s in transport.stats.values())


def test_tiny_is_a_fair_smoke_test_every_method_reaches_its_target():
    sc = scenarios.load("tiny", ["sim.progress=false"])
    budgets = {m.run.run_timeout for m in sc.methods}
    assert len(budgets) == 1 and budgets.pop() > 0  # the same budget of virtual time for every method
    results = run_scenario(sc)
    for r in results:
        assert r.summary["time_to_target_s"] is not None, (r.method, r.summary["accuracy"])
        assert r.summary["virtual_s"] <= sc.methods[0].run.run_timeout + 60.0


@pytest.mark.slow
def test_methods_in_worker_processes_give_the_same_numbers(tmp_path):
    def once(workers: int) -> list[dict]:
        sc = scenarios.load("tiny", ["sim.progress=false", "method.fedavg.num_versions=2",
                                     "method.dgc-async.num_versions=4", f"sim.workers={workers}"])
        return [{k: v for k, v in r.summary.items() if k not in TIMING_KEYS} for r in run_scenario(sc, tmp_path)]

    assert once(2) == once(1)


def test_the_clocks_read_interval_grows_with_the_replies_awaited_as_a_deployments_does():
    """The main job's 10 nodes (x 2 with a queued task) stay within 200 reads a second: 0.25 s, as before. 1,000
    async nodes with a queued task each: 2,000 replies awaited, a read every 10 s; a sync round of half of them:
    every 2.5 s; a higher bound or server_pull_s = 0 (the charge off) as the options say."""
    main = scenarios.load("main")
    assert {m.name: main.timing(m).server_pull_s for m in main.methods} == dict.fromkeys(
        [m.name for m in main.methods], 0.25)
    every = ["clients.3.count=992", "method.auto-async.concurrency=0", "method.fedbuff-today.concurrency=0"]
    big = scenarios.load("main", every)  # 2 + 3 + 3 + 992 clients, all of them busy
    by_name = {m.name: m for m in big.methods}
    assert big.num_clients == 1000
    assert big.open_tasks(by_name["auto-async"]) == 2000 and big.timing(by_name["auto-async"]).server_pull_s == 10.0
    assert big.open_tasks(by_name["fedbuff-today"]) == 1000  # prefetch 0
    assert big.open_tasks(by_name["fedbuff"]) == 20 and big.timing(by_name["fedbuff"]).server_pull_s == 0.25  # 10 busy
    half = scenarios.load("main", ["clients.3.count=992", "method.fedavg.fraction=0.5"])
    assert half.timing(next(m for m in half.methods if m.name == "fedavg")).server_pull_s == 2.5
    fast = scenarios.load("main", [*every, "method.auto-async.max_reads_per_s=1000"])
    assert fast.timing(next(m for m in fast.methods if m.name == "auto-async")).server_pull_s == 2.0
    off = scenarios.load("main", ["clients.3.count=992", "sim.server_pull_s=0"])
    assert all(off.timing(m).server_pull_s == 0 for m in off.methods)

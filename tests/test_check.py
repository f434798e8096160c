"""``fedcomp check``: the pipeline's running totals, and the check of a run's outputs and client states.

The run checked is real: the product's ServerApp (async, checkpoint every version) and ClientApp over the
in-process ``LocalGrid`` (benchmarks/flowerkit.py), three clients with ``state-dir``, two replies lost on the way back
(timeouts) and one ClientApp call that raises (lost)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import fedcomp
from fedcomp import tensortree
from fedcomp.client.pipeline import Pipeline
from fedcomp.compressors.base import COMPRESSORS
from fedcomp.memory.base import MEMORIES
from fedcomp.tools.check import STATE_FILE, STRANDED, CheckInputError, check, check_client
from fedcomp.tools.cli import main as fedcomp_main
from fedcomp.wire import decode

SPEC = fedcomp.ModelSpec((("conv", (8, 3, 3, 3)), ("fc", (40, 30)), ("b", (40,))))


def balance(pipe: Pipeline) -> float:
    """max |outstanding - residual - Σ pending| relative to the outstanding mass (+1)."""
    t = pipe.totals
    assert t is not None
    worst = 0.0
    for name, shape in SPEC.entries:
        held = [decode(u, SPEC) if isinstance(u, bytes) else u for u in pipe.pending.values()]  # either form
        pending = sum((u.to_dense()[name].double() for u in held), torch.zeros(shape))
        gap = t.outstanding[name] - pipe.memory.residual(name).double() - pending
        worst = max(worst, float(gap.abs().max()) / (float(t.outstanding[name].abs().max()) + 1.0))
    return worst


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    compressor=st.sampled_from([("dgc", None), ("dgc+int8", "residual"), ("topk+int4", None), ("randomk", None)]),
    answers=st.lists(st.sampled_from(["ack", "nack", "wait"]), min_size=1, max_size=12),
    seed=st.integers(0, 2**16),
)
def test_totals_balance_over_acks_and_nacks_and_a_reload(compressor, answers, seed):
    name, memory = compressor
    gen = torch.Generator().manual_seed(seed)
    opts = {"seed": seed % 100} if name.startswith(("dgc", "randomk")) else {}
    pipe = fedcomp.build(name, SPEC, memory=memory, density=0.05, **opts)
    for answer in answers:
        pipe.send({n: torch.randn(s, generator=gen) * 3 for n, s in SPEC.entries})
        oldest = min(pipe.pending)
        if answer == "ack":
            assert pipe.ack(oldest)
        elif answer == "nack":
            assert pipe.nack(oldest)
    again = fedcomp.build(name, SPEC, memory=memory, density=0.05, **opts)
    again.load_state_dict(pipe.state_dict())
    assert again.totals is not None
    assert again.totals.acked + again.totals.nacked + len(again.pending) == again.last_seq
    assert balance(again) < 1e-6


def test_totals_saved_as_computed_and_applied_load_as_their_difference():
    """States of earlier releases kept two float64 sums; they load (and check) as ``computed - applied``."""
    pipe = fedcomp.build("topk", SPEC, density=0.1)
    gen = torch.Generator().manual_seed(5)
    for _ in range(3):
        pipe.send({n: torch.randn(s, generator=gen) for n, s in SPEC.entries})
    assert pipe.ack(1) and pipe.nack(2)
    state = pipe.state_dict()
    outstanding = state["totals"].pop("outstanding")
    applied = {n: torch.randn(s, dtype=torch.float64, generator=gen) for n, s in SPEC.entries}
    state["totals"] |= {"computed": {n: t + applied[n] for n, t in outstanding.items()}, "applied": applied}
    old = fedcomp.build("topk", SPEC, density=0.1)
    old.load_state_dict(state)
    assert old.totals is not None and (old.totals.acked, old.totals.nacked) == (1, 1)
    for name in SPEC.names:
        assert torch.allclose(old.totals.outstanding[name], outstanding[name], rtol=0, atol=1e-12)
    assert balance(old) < 1e-6
    del state["totals"]["applied"]
    with pytest.raises(KeyError):
        fedcomp.build("topk", SPEC, density=0.1).load_state_dict(state)


@pytest.mark.parametrize(
    "key, bad",
    [
        ("outstanding", {"conv": "not a tensor"}),
        ("outstanding", {"conv": torch.zeros(3)}),  # a tensor of another shape than the rest of the state
        ("outstanding", [1, 2]),
        ("acked", "x"),
        ("nacked", None),
    ],
)
def test_malformed_running_totals_are_bad_input_not_a_crash(tmp_path, key, bad):
    from fedcomp.flower.session import ClientSession
    from fedcomp.task.config import RunConfig

    session = ClientSession.fresh(RunConfig(compressor="topk", compressor_options="density=0.25").compression, SPEC)
    session.send(1, {n: torch.randn(s) for n, s in SPEC.entries}, 0, 1)
    (tmp_path / STATE_FILE).write_bytes(session.to_bytes())
    assert check_client(tmp_path).conservation.conserved  # the state as saved checks
    state = tensortree.loads(session.to_bytes())
    state["pipeline"]["totals"][key] = bad
    (tmp_path / STATE_FILE).write_bytes(tensortree.dumps(state))
    with pytest.raises(CheckInputError, match=str(tmp_path)):
        check_client(tmp_path)


def test_a_state_saved_before_totals_loads_with_totals_not_recorded():
    pipe = fedcomp.build("topk", SPEC, density=0.1)
    pipe.send({n: torch.ones(s) for n, s in SPEC.entries})
    state = pipe.state_dict()
    del state["totals"]
    old = fedcomp.build("topk", SPEC, density=0.1)
    old.load_state_dict(state)
    assert old.totals is None and list(old.pending) == [1]
    old.send({n: torch.ones(s) for n, s in SPEC.entries})  # keeps working, still not recorded
    assert old.totals is None and old.ack(1) and old.nack(2)


def test_a_memory_without_residual_records_no_totals():
    pipe = fedcomp.build("topk", SPEC, memory="none", density=0.1)
    pipe.send({n: torch.ones(s) for n, s in SPEC.entries})
    assert pipe.totals is None and pipe.state_dict()["totals"] is None


# ---- a real run ---------------------------------------------------------------------------------------------------
CLIENTS = 3


@pytest.fixture(scope="module")
def real_run(tmp_path_factory) -> Path:
    """OUT (``out``) and the client state folders (``c0``..) of a finished run with injected losses."""
    from flwr.app import Context, RecordDict

    from benchmarks.flowerkit import LocalGrid, server_identity
    from clients.app import app as client_app
    from server_app.app import main

    root = tmp_path_factory.mktemp("run")
    run_config = {"num-versions": 3, "mode": "async", "buffer-size": 2, "concurrency": 3, "checkpoint-every": 1,
                  "task-timeout": 1.0, "poll-interval": 0.05, "node-wait": 60.0, "out-dir": str(root / "out")}
    replies = {"n": 0}

    def drop(node: int, reply) -> bool:  # the 2nd and 5th replies are lost on the way back: timeouts
        replies["n"] += 1
        return replies["n"] in (2, 5)

    calls = {"n": 0}

    def flaky(msg, context):  # the 4th ClientApp call raises before training: the server sees it lost
        calls["n"] += 1
        if calls["n"] == 4:
            raise RuntimeError("injected crash")
        return client_app(msg, context)

    apps = {
        11 + i: (flaky, {"partition-id": i, "num-partitions": CLIENTS, "state-dir": str(root / f"c{i}")})
        for i in range(CLIENTS)
    }
    with server_identity():
        main(LocalGrid(apps, run_config, drop=drop), Context(1, 0, {}, RecordDict(), dict(run_config)))
    return root


def states(root: Path) -> list[Path]:
    return [root / f"c{i}" for i in range(CLIENTS)]


def copy_run(real_run: Path, tmp_path: Path) -> Path:
    shutil.copytree(real_run, tmp_path / "run")
    return tmp_path / "run"


def test_a_run_with_lost_replies_and_a_crashed_clientapp_is_accounted_for(real_run):
    report = check(real_run / "out", states(real_run))
    assert report.exit_code == 0, report.text()
    run = report.runs[0]
    # the two lost replies: timed out, or still open when the run ended (a queued task behind them, prefetch)
    lost_replies = run.nacked["timeout"] + run.open_at_end
    assert run.versions == 3 and lost_replies >= 2 and run.nacked["lost"] >= 1, report.text()
    assert report.checkpoint_final is True and len(report.ledgers) == CLIENTS
    for c in report.clients:
        assert c.unaccounted == 0 and c.conservation is not None and c.conservation.conserved, report.text()
        assert c.fates is not None and sum(c.fates.values()) == c.pending and not c.stranded, report.text()
        assert c.known_applied == c.server_applied, report.text()
    # every update the server applied is known to its client: acked, or its ack waits in the server's outbox
    known = sum(c.acked + c.fates["ack waiting"] for c in report.clients)
    assert known == run.applied == sum(led.applied for led in report.ledgers), report.text()
    # the two timed-out updates came back into the residuals, or their nacks wait in the server's outbox
    nacks = sum(c.nacked + c.fates["nack waiting"] for c in report.clients)
    assert nacks + run.open_at_end >= 2 and sum(c.pending for c in report.clients) >= run.open_at_end, report.text()


def test_the_command_prints_a_table_or_json_and_exits_0(real_run, capsys):
    args = ["check", str(real_run / "out"), *(f"--client-state={d}" for d in states(real_run))]
    assert fedcomp_main(args) == 0
    text = capsys.readouterr().out
    assert "everything accounted for" in text and "timeout" in text and "pending fate" in text, text
    assert fedcomp_main([*args, "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["exit_code"] == 0 and len(doc["clients"]) == CLIENTS and doc["clients"][0]["unaccounted"] == 0


def _load(path: Path) -> dict:
    return tensortree.loads((path / STATE_FILE).read_bytes())


def _save(path: Path, state: dict) -> None:
    (path / STATE_FILE).write_bytes(tensortree.dumps(state))


def test_a_state_dir_that_served_another_run_since_is_checked_on_this_runs_session(real_run, tmp_path):
    """A node's state dir keeps each run's session (``fedcomp.flower.statedir``): after a task of another run, this
    run's is ``client-state.run-<key>.pt`` and the current file is the other run's. The check takes this run's
    (the checkpoint's run key), not the current file, whose residual is not this run's."""
    run = copy_run(real_run, tmp_path)
    key = int(torch.load(run / "out" / "checkpoint.pt", weights_only=True)["protocol"]["run_key"])
    assert key
    state = _load(run / "c0")
    (run / "c0" / STATE_FILE).rename(run / "c0" / f"client-state.run-{key:x}.pt")
    other = state | {"run_key": key + 1}
    errors = state["pipeline"]["memory"]["errors"]
    other["pipeline"] = state["pipeline"] | {"memory": {"errors": {n: t + 1.0 for n, t in errors.items()}}}
    _save(run / "c0", other)  # another run's session, current: its residual would not balance this run's totals
    report = check(run / "out", states(run))
    assert report.exit_code == 0 and report.clients[0].conservation.conserved, report.text()


def test_a_client_state_with_computed_and_applied_totals_is_checked_as_before(real_run, tmp_path):
    """An earlier release's state (two float64 sums) checks as conserved; one with a sum torn off is bad input."""
    run = copy_run(real_run, tmp_path)
    state = _load(run / "c0")
    totals = state["pipeline"]["totals"]
    outstanding = totals.pop("outstanding")
    totals["applied"] = {n: torch.full_like(t, 0.25) for n, t in outstanding.items()}
    totals["computed"] = {n: t + 0.25 for n, t in outstanding.items()}
    _save(run / "c0", state)
    report = check(run / "out", states(run))
    assert report.exit_code == 0 and all(c.conservation.conserved for c in report.clients), report.text()
    del totals["applied"]
    _save(run / "c0", state)
    with pytest.raises(CheckInputError, match="running totals are malformed"):
        check(run / "out", states(run))


def test_a_tampered_residual_is_not_conserved(real_run, tmp_path, capsys):
    run = copy_run(real_run, tmp_path)
    state = _load(run / "c0")
    flat = state["compression"]
    name = flat["memory"] or COMPRESSORS.get(flat["compressor"].split("+")[0]).default_memory
    memory = MEMORIES.build(name)
    memory.load_state_dict(state["pipeline"]["memory"])
    first = next(iter(state["pipeline"]["totals"]["outstanding"]))
    residual = memory.residual(first)
    residual.view(-1)[0] += 0.01 * float(residual.abs().max()) + 1e-3  # mass that was never computed
    state["pipeline"]["memory"] = memory.state_dict()
    _save(run / "c0", state)
    report = check(run / "out", states(run))
    assert report.exit_code == 1 and "NOT conserved" in report.problems[0] and len(report.problems) == 1
    assert fedcomp_main(["check", str(run / "out"), "--client-state", str(run / "c0")]) == 1
    assert "NOT conserved" in capsys.readouterr().out


def test_an_update_dropped_from_pending_is_unaccounted(real_run, tmp_path):
    run = copy_run(real_run, tmp_path)
    victim = next(d for d in states(run) if _load(d)["pipeline"]["pending"])
    state = _load(victim)
    seq = next(iter(state["pipeline"]["pending"]))
    del state["pipeline"]["pending"][seq]  # neither acked nor nacked: its mass is gone
    _save(victim, state)
    report = check(run / "out", [victim])
    assert report.exit_code == 1, report.text()
    assert any("neither acked, nacked nor pending" in p for p in report.problems)
    assert any("NOT conserved" in p for p in report.problems)


def test_a_pending_update_the_final_checkpoint_does_not_know_is_stranded(real_run, tmp_path):
    run = copy_run(real_run, tmp_path)
    ckpt = torch.load(run / "out" / "checkpoint.pt", weights_only=True)
    for led in ckpt["protocol"]["clients"].values():
        led["outbox"] = []  # the server forgot what it owes: nothing will ever ack or nack those updates
    torch.save(ckpt, run / "out" / "checkpoint.pt")
    report = check(run / "out", states(run))
    pending = sum(c.pending for c in report.clients)
    assert pending > 0 and sum(c.fates[STRANDED] for c in report.clients) == pending
    assert report.exit_code == 1 and any("stranded" in p for p in report.problems)


def test_an_ack_the_server_never_counted_is_a_loss(real_run, tmp_path):
    run = copy_run(real_run, tmp_path)
    report = check(run / "out", states(run))
    client = next(c for c in report.clients if c.known_applied)
    ckpt = torch.load(run / "out" / "checkpoint.pt", weights_only=True)
    ckpt["protocol"]["clients"][str(client.nodes[0])]["applied"] -= 1  # one ack the model does not hold
    torch.save(ckpt, run / "out" / "checkpoint.pt")
    report = check(run / "out", states(run))
    assert report.exit_code == 1 and any("not in the model" in p for p in report.problems), report.text()


def test_a_crashed_run_is_read_from_metrics_and_the_checkpoint(real_run, tmp_path):
    run = copy_run(real_run, tmp_path)
    (run / "out" / "summary.json").unlink()  # as if the server died before writing it
    rows = (run / "out" / "metrics.jsonl").read_text().splitlines()
    # a resumed run wrote versions 2 and 3 again: each version is counted once
    (run / "out" / "metrics.jsonl").write_text("\n".join(rows + rows[1:]) + "\n")
    report = check(run / "out", states(run))
    assert report.exit_code == 0, report.text()
    assert report.runs[0].source == "metrics.jsonl" and report.runs[0].redone_versions == 2
    assert report.runs[0].applied == check(real_run / "out").runs[0].applied
    # a --resume continues from the checkpoint: what has no waiting resolution is nacked at the resync
    assert all(c.fates and not c.stranded for c in report.clients)


def test_a_state_without_totals_is_not_recorded_but_accounted(real_run, tmp_path):
    run = copy_run(real_run, tmp_path)
    state = _load(run / "c1")
    state["pipeline"].pop("totals")  # as saved before the pipeline kept totals
    _save(run / "c1", state)
    report = check(run / "out", [run / "c1"])
    (c,) = report.clients
    assert c.acked is None and c.conservation is None and c.unaccounted is None and report.exit_code == 0
    assert any("not recorded" in n for n in report.notes)


@pytest.mark.parametrize(
    "breakage",
    ["no folder", "no outputs", "bad summary", "random checkpoint", "no state", "random state", "torn state"],
)
def test_bad_input_is_one_line_and_exit_2(real_run, tmp_path, capsys, breakage):
    run = copy_run(real_run, tmp_path)
    out, state = run / "out", run / "c0"
    if breakage == "no folder":
        out = run / "nosuch"
    elif breakage == "no outputs":
        out = run / "c2"  # a folder, but not a run's
    elif breakage == "bad summary":
        (out / "summary.json").write_text("{not json")
    elif breakage == "random checkpoint":
        (out / "checkpoint.pt").write_bytes(bytes(range(256)) * 8)
    elif breakage == "no state":
        state = run / "c9"
    elif breakage == "random state":
        (state / STATE_FILE).write_bytes(b"\x00garbage" * 100)
    else:
        data = (state / STATE_FILE).read_bytes()
        (state / STATE_FILE).write_bytes(data[: len(data) // 2])
    assert fedcomp_main(["check", str(out), "--client-state", str(state)]) == 2
    captured = capsys.readouterr()
    err = captured.err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("fedcomp check: error:"), err
    assert "Traceback" not in captured.err + captured.out
    with pytest.raises(CheckInputError):
        check(out, [state])


def test_a_simulation_output_folder(tmp_path):
    """``fedcomp sim --out`` writes summary.json with one row per method and ``<method>.jsonl``."""
    out = tmp_path / "sim"
    out.mkdir()
    summary = {"methods": [{"method": "dgc", "versions": 4, "stopped_reason": "budget", "tasks": 12, "applied": 8,
                            "stale": 1, "timeout": 1, "lost": 1}]}
    (out / "summary.json").write_text(json.dumps(summary))
    rows = [{"version": v, "accepted": 2, "duplicate": 0, "late": 1, "rejected": int(v == 4)} for v in (1, 2, 3, 4)]
    (out / "dgc.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    report = check(out)
    (run,) = report.runs
    assert report.kind == "simulation" and report.exit_code == 0
    assert (run.applied, run.late, run.nacked["rejected"], run.open_at_end) == (8, 4, 1, 0)


def test_a_simulations_rows_cut_short_or_counts_that_cannot_add_up_are_not_accounted_for(tmp_path):
    """A per-version file missing a row (torn, cut) leaves duplicate and late unknown, with a note, never a sum of
    the rows that are there; more outcomes than tasks is a problem (exit 1), not "everything accounted for"."""
    out = tmp_path / "sim"
    out.mkdir()
    row = {"method": "dgc", "versions": 4, "tasks": 12, "applied": 8, "stale": 1, "timeout": 1, "lost": 1,
           "rejected": 0}
    (out / "summary.json").write_text(json.dumps({"methods": [row]}))
    rows = [{"version": v, "accepted": 2, "duplicate": 0, "late": 1} for v in (1, 2, 4)]  # version 3's row is gone
    (out / "dgc.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    report = check(out)
    (run,) = report.runs
    assert run.late is None and run.duplicate is None and report.exit_code == 0
    assert any("1 of its 4 versions have no row" in n for n in report.notes)
    (out / "summary.json").write_text(json.dumps({"methods": [{**row, "applied": 20}]}))
    report = check(out)
    assert report.exit_code == 1 and report.runs[0].open_at_end == -11  # 12 tasks, 20 applied, 3 nacked
    assert report.problems == ["dgc: 11 more outcome(s) (applied + nacked) than tasks: the counts do not add up"]


@pytest.mark.parametrize("versions", [[1, 2, 3, 4, 5, 6], [1, 2, 1, 3, 2, 4]], ids=["past-the-summary", "twice"])
def test_a_simulations_rows_of_another_run_are_not_accounted_for(tmp_path, versions):
    """Rows past the summary's last version (a later run into the folder that stopped early) or versions written
    twice (two runs at once) are another run's: exit 1 naming the file, never their sums taken for this run's."""
    out = tmp_path / "sim"
    out.mkdir()
    row = {"method": "dgc", "versions": 4, "tasks": 12, "applied": 8, "stale": 1, "timeout": 1, "lost": 1,
           "rejected": 0}
    (out / "summary.json").write_text(json.dumps({"methods": [row]}))
    (out / "dgc.jsonl").write_text("".join(json.dumps({"version": v, "accepted": 2, "late": 1}) + "\n"
                                           for v in versions))
    report = check(out)
    assert report.exit_code == 1 and report.runs[0].late is None, report.problems
    assert len(report.problems) == 1 and "dgc.jsonl is not this summary's run" in report.problems[0]


def test_a_simulation_stopped_before_its_summary_or_a_file_is_named_for_what_it_is(tmp_path):
    out = tmp_path / "sim"
    out.mkdir()
    (out / "dgc.jsonl").write_text(json.dumps({"version": 1, "accepted": 2}) + "\n")
    with pytest.raises(CheckInputError, match="dgc.jsonl but no summary.json: a simulation that did not finish"):
        check(out)
    (tmp_path / "afile").write_text("x")
    with pytest.raises(CheckInputError, match="a file, not a folder"):
        check(tmp_path / "afile")


def test_a_simulation_counts_the_replies_rejected_after_its_last_version(tmp_path):
    """A method whose every reply was rejected makes no version, so no row: the summary's count accounts for them
    (the rows' left 40 of 44 tasks without an outcome, and the verdict could not see it)."""
    out = tmp_path / "sim"
    out.mkdir()
    row = {"method": "dgc", "versions": 0, "tasks": 44, "applied": 0, "stale": 0, "timeout": 1, "lost": 3}
    (out / "summary.json").write_text(json.dumps({"methods": [{**row, "rejected": 40,
                                                               "reject_reasons": {"records": 40}}]}))
    (out / "dgc.jsonl").write_text("")
    (run,) = check(out).runs
    assert (run.nacked["rejected"], run.reject_reasons, run.open_at_end) == (40, {"records": 40}, 0)
    (out / "summary.json").write_text(json.dumps({"methods": [row]}))  # a summary from before the count
    (run,) = check(out).runs
    assert run.nacked["rejected"] is None and run.open_at_end is None


def test_the_simulators_summary_counts_rejected_replies(tmp_path):
    from fedcomp.tools.cli import main

    assert main(["sim", "tiny", "--quiet", "--out", str(tmp_path), "--set", "method.fedavg.num_versions=2",
                 "--set", "method.dgc-async.num_versions=3"]) == 0
    for m in json.loads((tmp_path / "summary.json").read_text())["methods"]:
        assert m["rejected"] == sum(m["reject_reasons"].values()) >= 0
        assert m["applied"] + m["stale"] + m["timeout"] + m["lost"] + m["rejected"] <= m["tasks"]


def test_a_simulation_over_seeds_is_checked_seed_by_seed(tmp_path):
    """``fedcomp sim --seeds`` writes means at the top and each seed's counts in ``seed-N/``: the check reads those,
    and a seed that lost a task is named."""
    out = tmp_path / "sim"
    for seed, applied in ((0, 8), (3, 7)):
        (out / f"seed-{seed}").mkdir(parents=True)
        row = {"method": "dgc", "versions": 4, "tasks": 9, "applied": applied, "stale": 1, "timeout": 0, "lost": 0}
        (out / f"seed-{seed}" / "summary.json").write_text(json.dumps({"methods": [row]}))
        rows = [{"version": v, "accepted": 2, "rejected": 0} for v in range(1, 5)]  # a row per version, as sim's
        (out / f"seed-{seed}" / "dgc.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    mean = {"mean": 7.5, "min": 7, "max": 8, "n": 2, "per_seed": [8, 7]}
    (out / "summary.json").write_text(json.dumps({"seeds": [0, 3], "methods": [{"method": "dgc", "applied": mean}]}))
    report = check(out)
    assert [(r.name, r.applied, r.open_at_end) for r in report.runs] == [("seed 0: dgc", 8, 0), ("seed 3: dgc", 7, 1)]
    assert "seed 3: dgc: 1 task(s) had no outcome" in report.text(), report.text()
    (out / "seed-3" / "summary.json").unlink()
    with pytest.raises(CheckInputError, match="seed-3"):
        check(out)


def test_a_command_that_fails_to_load_does_not_break_the_others(monkeypatch, capsys, tmp_path):
    class Broken:
        name = "broken"

        def load(self):
            raise ImportError("cannot import name 'X' from 'somewhere'")

    monkeypatch.setattr("importlib.metadata.entry_points", lambda group: [Broken()])
    assert fedcomp_main(["check", str(tmp_path / "nosuch")]) == 2
    assert capsys.readouterr().err.startswith("fedcomp check: error:")
    assert fedcomp_main(["broken"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == "fedcomp broken: unavailable: ImportError: cannot import name 'X' from 'somewhere'", err


def test_pending_updates_saved_as_encoded_blobs_are_read(real_run, tmp_path):
    """States saved when the pipeline kept its pending updates as encoded blobs are checked the same way."""
    run = copy_run(real_run, tmp_path)
    victim = next(d for d in states(run) if _load(d)["pipeline"]["pending"])
    state = _load(victim)
    ckpt = torch.load(run / "out" / "checkpoint.pt", weights_only=True)
    spec = fedcomp.ModelSpec.from_tensors(ckpt["protocol"]["params"])
    reader = Pipeline(spec, COMPRESSORS.build("identity"), MEMORIES.build("none"))
    reader.load_state_dict({"compressor": {}, "memory": {}, "next_seq": 1, "pending": state["pipeline"]["pending"],
                            "totals": None})
    blobs = {seq: u if isinstance(u, bytes) else fedcomp.encode(u, spec) for seq, u in reader.pending.items()}
    state["pipeline"]["pending"] = blobs
    _save(victim, state)
    before = check(real_run / "out", [real_run / victim.name]).clients[0]
    (after,) = check(run / "out", [victim]).clients
    assert after.pending == before.pending == len(blobs) and after.fates == before.fates
    assert after.conservation.conserved and after.unaccounted == 0


def test_pipelines_without_totals_record_none_and_send_the_same_bytes():
    """``totals=False`` (the data-parallel runner) skips the sums; the blobs are unchanged."""
    spec = fedcomp.ModelSpec.from_tensors({"w": torch.zeros(64, 32), "b": torch.zeros(32)})
    g = torch.Generator().manual_seed(0)
    grad = {"w": torch.randn(64, 32, generator=g), "b": torch.randn(32, generator=g)}
    on, off = (fedcomp.build("dgc", spec, density=0.05, totals=t) for t in (True, False))
    assert on.send(grad) == off.send(grad)
    assert on.totals is not None and off.totals is None and off.state_dict()["totals"] is None

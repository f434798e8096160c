"""Bad configuration fails fast and clearly (issue 14, item 2): every value is checked before any process starts,
in every entry point (``flower-server``, ``flower-client``, ``fedcomp sim``, ``fedcomp dp``, the ServerApp that
``flwr run`` starts), with one line on stderr and exit code 2."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest
import torch

from fedcomp.registry import ConfigError
from fedcomp.task.config import RunConfig
from fedcomp.tools.processes import free_port

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize(
    "key, value",
    [
        ("task-timeout", -1),
        ("round-timeout", 0),
        ("checkpoint-every", -1),
        ("local-lr", -0.1),
        ("local-lr", float("nan")),
        ("server-lr", 0),
        ("fraction", 1.5),
        ("eval-every", -1),
        ("max-failures", -1),
        ("node-wait", -5),
        ("max-reads-per-s", 0),
        ("max-reads-per-s", float("inf")),
        ("local-momentum", 1.0),
        ("staleness", "nosuch"),
        ("server-optimizer", "nosuch"),
        ("compressor-options", "density=2.0"),
        ("compressor-options", "density=-0.1"),
        ("compressor", "nosuch"),
        ("partitioner", "nosuch"),
        ("local-mode", "nosuch"),
        ("task-timeout", float("inf")),
        ("round-timeout", float("inf")),
        # integer keys: a whole number within int64, nothing rounded or wrapped on the way
        ("num-versions", float("inf")),
        ("buffer-size", float("nan")),
        ("seed", 10**400),
        ("seed", 2**63),
        ("seed", 2.5),
        ("local-steps", True),
    ],
)
def test_run_config_rejects_out_of_range_values(key, value):
    with pytest.raises(ConfigError) as info:
        RunConfig.from_flower({key: value})
    words = str(value).split("=")[0] if isinstance(value, str) else key
    assert words in str(info.value) and len(str(info.value).splitlines()) == 1, info.value


@pytest.mark.parametrize("value", [2**60 + 1, str(2**60 + 1), "12", 7.0, "1e3"])
def test_integer_keys_keep_whole_numbers_exactly(value):
    """An int key takes a whole number as it is written: never through a float, which rounds 2**60 + 1."""
    from fedcomp.task.config import NodeConfig

    expected = int(float(value)) if isinstance(value, float) or "e" in str(value) else int(value)
    assert RunConfig.from_flower({"max-update-bytes": value}).max_update_bytes == expected
    with pytest.raises(ConfigError, match="max-parameters: expected an integer"):
        NodeConfig.from_flower({"max-parameters": float("inf")})


@pytest.mark.parametrize("normalize", ["sum", "count"])
def test_run_config_refuses_another_mean_for_sync_rounds(normalize):
    """Sync rounds take FedAvg's example-weighted mean on every server; another normalisation is refused up front."""
    with pytest.raises(ConfigError, match="async option"):
        RunConfig.from_flower({"mode": "sync", "normalize": normalize})
    assert RunConfig.from_flower({"mode": "sync", "normalize": "weights"}).effective_normalize == "weights"
    assert RunConfig.from_flower({"mode": "async", "normalize": normalize}).effective_normalize == normalize


def free() -> list[str]:
    return ["--port", str(free_port())]


def one_line_exit_2(capsys, fn, argv) -> str:
    with pytest.raises(SystemExit) as info:
        fn(argv)
    err = capsys.readouterr().err.strip()
    assert info.value.code == 2, err
    assert len(err.splitlines()) == 1, err
    return err


def checkpoint(tmp_path: Path, **run) -> Path:
    """A real checkpoint of the default run (model mlp on digits), at version 0."""
    from fedcomp.server.loops import Reporter
    from fedcomp.task.serverside import build_server

    _, proto, _ = build_server(RunConfig(**run))
    Reporter(tmp_path / "ck", checkpoint_every=1).save_checkpoint(proto)
    return tmp_path / "ck" / "checkpoint.pt"


def bad_resume_files(tmp_path: Path) -> dict[str, Path]:
    good = checkpoint(tmp_path)
    truncated = tmp_path / "truncated.pt"
    truncated.write_bytes(good.read_bytes()[: good.stat().st_size // 2])
    noise = tmp_path / "noise.pt"
    noise.write_bytes(bytes(torch.randint(0, 256, (4096,), generator=torch.Generator().manual_seed(0)).tolist()))
    folder = tmp_path / "folder"
    folder.mkdir()
    other = tmp_path / "other.pt"
    torch.save({"weights": torch.zeros(3)}, other)
    missing = tmp_path / "missing.pt"
    return {"missing": missing, "folder": folder, "noise": noise, "truncated": truncated, "other": other}


SERVER_CASES = [
    (["--compressor-options", "density=2.0"], "density"),
    (["-c", "compressor-options='density=-0.1'"], "density"),
    (["--compressor", "nosuch"], "nosuch"),
    (["--task-timeout", "-1"], "task-timeout"),
    (["--checkpoint-every", "-1"], "checkpoint-every"),
    (["--local-lr", "-0.1"], "local-lr"),
    (["--local-lr", "inf"], "local-lr must be finite"),
    (["-c", "seed=-1"], "seed must be in [0, 2**32)"),
    (["--out", "/dev/null"], "--out /dev/null is a file"),
    (["--server-lr", "0"], "server-lr"),
    (["--port", "70000"], "--port"),
    (["--ssl-certfile", "nosuch.pem", "--ssl-keyfile", "nosuch.key"], "no such file"),
]


@pytest.mark.parametrize("extra, words", SERVER_CASES)
def test_flower_server_bad_values_one_line_exit_2_before_any_process(tmp_path, capsys, extra, words):
    from server_app.launcher import main

    out = tmp_path / "out"
    argv = [*(["--insecure"] if "--ssl-certfile" not in extra else []), "--out", str(out), *free(), *extra]
    err = one_line_exit_2(capsys, main, argv)
    assert words in err, err
    assert not (out / "superlink.log").exists() and not (out / "flwr-home").exists()


def test_flower_server_checks_the_strategy_options_before_any_process(tmp_path, capsys, monkeypatch):
    """The launcher builds the ServerApp's ``Compressed`` for the run before the SuperLink starts, so what only
    the strategy refuses is one line and exit 2, not a failed run after its submission (``normalize = "sum"``
    and a ``downlink-history`` other than 16 were such options; here a refusal is stood in for)."""
    import server_app.app
    from server_app.launcher import main

    def refuse(*args, **kwargs):
        raise ConfigError("the strategy refuses this run")

    monkeypatch.setattr(server_app.app, "Compressed", refuse)
    out = tmp_path / "out"
    err = one_line_exit_2(capsys, main, ["--insecure", "--out", str(out), *free(), "-c", "normalize='sum'"])
    assert "the strategy refuses this run" in err, err
    assert not (out / "superlink.log").exists() and not (out / "flwr-home").exists()


@pytest.mark.parametrize("case", ["missing", "folder", "noise", "truncated", "other"])
def test_flower_server_bad_resume_file_one_line_exit_2(tmp_path, capsys, case):
    from server_app.launcher import main

    path = bad_resume_files(tmp_path)[case]
    out = tmp_path / "out"
    err = one_line_exit_2(capsys, main, ["--insecure", *free(), "--out", str(out), "--resume", str(path)])
    assert "resume" in err and str(path.name) in err, err
    assert "weights_only" not in err, err  # torch's advice to load the file unsafely is not passed on
    assert not (out / "superlink.log").exists()


def test_flower_server_resume_of_another_model_is_refused(tmp_path, capsys):
    from server_app.launcher import main

    path = checkpoint(tmp_path, model="cnn")
    err = one_line_exit_2(capsys, main, ["--insecure", *free(), "--out", str(tmp_path / "o"), "--resume", str(path)])
    assert "does not fit this run" in err, err


def test_flower_server_resume_with_no_version_left_is_refused(tmp_path, capsys):
    from server_app.launcher import main

    path = checkpoint(tmp_path)
    state = torch.load(path, weights_only=True)
    state["protocol"]["version"] = 5
    torch.save(state, path)
    argv = ["--insecure", *free(), "--out", str(tmp_path / "o"), "--resume", str(path)]
    err = one_line_exit_2(capsys, main, [*argv, "--versions", "5"])
    assert "is at version 5 and the run stops at version 5" in err, err
    assert not (tmp_path / "o" / "superlink.log").exists()


def test_flower_server_port_in_use_is_one_line(tmp_path, capsys):
    from server_app.launcher import main

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        err = one_line_exit_2(capsys, main, ["--insecure", "--port", str(port), "--out", str(tmp_path / "o")])
    assert "in use" in err and str(port) in err, err


@pytest.mark.parametrize("host", ["192.0.2.1", "nosuchhost.invalid"])  # TEST-NET-1: an address of no machine here
def test_flower_server_on_a_host_it_cannot_listen_on_says_why_not_in_use(tmp_path, capsys, host):
    from server_app.launcher import main

    err = one_line_exit_2(capsys, main, ["--insecure", "--host", host, "--out", str(tmp_path / "o")])
    assert f"--host {host}: cannot listen there" in err and "in use" not in err, err


@pytest.mark.parametrize(
    "extra, words",
    [
        (["--max-retries", "-1"], "--max-retries"),
        (["--max-wait-time", "0"], "--max-wait-time"),
        (["--port", "99999"], "--port"),
        (["--node-config", 'kernels="nosuch"'], "kernels"),
        (["--node-config", "kernels=nosuch"], "invalid format"),  # unquoted text: Flower's parser raises click's error
        (["--node-config", "bogus-key=1"], "bogus-key"),
        (["--node-config", "max-parameters=1e400"], "max-parameters: expected an integer"),
        (["--node-config", "gpu=false foo"], "'foo' has no '='"),  # Flower's parser would drop it
        (["--node-config", 'kernels="torch'], "No closing quotation"),
        (["--root-certificates", "nosuch-ca.pem"], "no such file"),
        (["--server", "127.0.0.1:0"], "--server"),
        (["--app", "no-colon"], "--app"),
        (["--app", "fab", "--worker", "cold"], "--app needs"),
        (["--app", "mod:app", "--no-prestart"], "--app needs"),
        (["--log", "/dev/null/x.log"], "--log /dev/null/x.log: cannot make its folder"),
    ],
)
def test_flower_client_bad_values_one_line_exit_2(tmp_path, capsys, extra, words):
    from clients.launcher import main

    argv = ["--server", "127.0.0.1:9092", *(["--insecure"] if "--root-certificates" not in extra else []), *extra]
    err = one_line_exit_2(capsys, main, argv)
    assert words in err, err


def test_flower_client_state_dir_that_is_a_file(tmp_path, capsys):
    from clients.launcher import main

    f = tmp_path / "state"
    f.write_text("x")
    err = one_line_exit_2(capsys, main, ["--server", "127.0.0.1:9092", "--insecure", "--state-dir", str(f)])
    assert "--state-dir" in err, err


@pytest.mark.parametrize(
    "argv, words",
    [
        (["dp", "--model", "nosuch"], "nosuch"),
        (["dp", "--lr", "-1"], "lr"),
        (["dp", "--lr", "inf"], "lr must be finite"),
        (["dp", "--workers", "0"], "workers must be >= 1, got 0"),
        (["dp", "--dataset", "nosuch"], "nosuch"),
        (["dp", "--threads", "0"], "--threads"),
        (["dp", "--seed", "-1"], "seed must be in [0, 2**32), got -1"),
        (["dp", "--methods", "dense,dgc,dense"], "--methods names a method twice"),
        (["sim", "tiny", "--set", "run.partitioner=nosuch"], "unknown partitioner 'nosuch'"),
        (["sim", "tiny", "--set", "run.local_mode=nosuch"], "local_mode must be one of delta, gradient"),
        (["sim", "tiny", "--set", "run.local_lr=-1"], "local_lr"),
        (["sim", "tiny", "--set", "run.local_lr=inf"], "local_lr must be finite"),
        (["sim", "tiny", "--set", "run.max_update_bytes=-5"], "max_update_bytes must be >= 0, got -5"),
        (["sim", "tiny", "--set", "method.fedavgg.local_lr=1"], "'fedavgg' is not among the methods run"),
        (["sim", "tiny", "--set", "run.locall_lr=1"], "run: unknown run key(s) ['locall_lr'] (did you mean local_lr?)"),
        (["sim", "tiny", "--set", "seed=-1"], "seed must be an integer in [0, 2**32)"),
        (["sim", "tiny", "--set", "seed=9223372036854775807"], "seed must be an integer in [0, 2**32)"),
        (["sim", "tiny", "--set", "method.fedavg.seed=5"], "are set by the simulator"),
        (["sim", "tiny", "--seeds", "0,1", "--set", "method.fedavg.local_lr=-1"], "local_lr"),
        (["sim", "tiny", "--set", "run.task_timeout=-1"], "task_timeout"),
        (["sim", "tiny", "--set", "method.fedavg.buffer_size=4"], "method.fedavg: buffer_size read only in async mode"),
        (["sim", "tiny", "--set", "method.dgc-async.mode=sync"],
         "method.dgc-async: buffer_size, max_staleness read only in async mode; this method is sync"),
        (["sim", "tiny", "--set", "method.dgc-async.over_selection=0.5"], "over_selection read only in sync mode"),
        (["sim", "tiny", "--set", "run.local_steps=1e400"], "local_steps: expected an integer"),
        (["sim", "tiny", "--set", "methods.0.x=1"], "'0' is a value, not a table"),
        (["sim", "tiny", "--set", "baseline=[1]"], "baseline must be a method's name"),
        (["sim", "tiny", "--set", "baseline=dgc-async", "--set", "methods=fedavg"], "--set baseline=dgc-async has no"),
        (["sim", "tiny", "--set", "links.flaky3g.up_mbps=1" + "0" * 400], "int too large"),
        (["sim", "tiny", "--set", "links.flaky3g.rtt_ms=nan"], "rtt_ms must be in [0, 600000], got nan"),
        (["sim", "tiny", "--set", "clients.2.availability.phase_s=inf"], "phase_s must be finite"),
    ],
)
def test_fedcomp_bad_values_one_line_exit_2_and_no_progress_bar(capsys, argv, words, tmp_path):
    from fedcomp.tools.cli import main

    code = main([*argv, "--out", str(tmp_path / "o")])
    err = capsys.readouterr().err.strip()
    lines = [ln for ln in err.splitlines() if not ln.startswith("scenario ")]  # sim's banner
    assert code == 2 and len(lines) == 1 and words in lines[0], err
    assert "epoch" not in err and "ver/s" not in err  # no progress bar was shown
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("case", ["missing", "folder", "noise", "truncated"])
def test_serverapp_under_flwr_run_refuses_a_bad_resume_file_in_one_line(tmp_path, case):
    """What ``flwr run`` starts: ``main(grid, context)`` raises ``ConfigError`` (Flower shows it as the run's
    status details) before it touches the grid."""
    from flwr.app import Context, RecordDict

    from server_app.app import main

    path = bad_resume_files(tmp_path)[case]
    ctx = Context(1, 0, {}, RecordDict(), {"resume": str(path), "out-dir": str(tmp_path / "o")})
    with pytest.raises(ConfigError, match="resume") as info:
        main(None, ctx)
    assert len(str(info.value).splitlines()) == 1


def test_a_serverapp_refused_at_its_checks_leaves_no_earlier_runs_summary_beside_its_config(tmp_path, monkeypatch):
    """An earlier run finished in OUT; a second run there is refused before any work. It wrote its run_config.json
    beside the earlier run's summary.json and metrics.jsonl, and ``fedcomp check OUT`` read the earlier run as this
    one (exit 0). A fresh run's refusal clears the earlier summary and metrics and moves its checkpoint aside; a
    resumed one keeps the metrics and checkpoint it goes on from, never the summary."""
    from flwr.app import Context, RecordDict

    import server_app.app

    def refuse(*args, **kwargs):
        raise ConfigError("refused at the checks")

    cases = (("", {"checkpoint.earlier.pt"}), (str(tmp_path / "none.pt"), {"metrics.jsonl", "checkpoint.pt"}))
    for resume, kept in cases:
        out = tmp_path / f"o{bool(resume)}"
        out.mkdir()
        for name, text in (("summary.json", "{}"), ("metrics.jsonl", '{"version": 1}\n'), ("checkpoint.pt", "x")):
            (out / name).write_text(text)
        monkeypatch.setattr(server_app.app, "Compressed", refuse)
        ctx = Context(1, 0, {}, RecordDict(), {"out-dir": str(out), "resume": resume})
        with pytest.raises(ConfigError):
            server_app.app.main(None, ctx)
        assert {p.name for p in out.iterdir()} == kept | {"run_config.json", "server.log"}, resume


@pytest.mark.parametrize("tls", [[], ["--insecure", "--ssl-certfile", "F", "--ssl-keyfile", "F"]],
                         ids=["neither", "both"])
def test_flower_server_refuses_its_tls_flags_before_making_the_out_folder(tmp_path, capsys, tls):
    from server_app.launcher import main

    pem, out = tmp_path / "cert.pem", tmp_path / "out"
    pem.write_text("not read: the flags are refused first")
    err = one_line_exit_2(capsys, main, [*(str(pem) if a == "F" else a for a in tls), *free(), "--out", str(out)])
    assert "--insecure" in err, err
    assert not out.exists()


def test_flower_server_database_must_be_a_file_path(tmp_path, capsys):
    from server_app.launcher import main

    folder = tmp_path / "db"
    folder.mkdir()
    argv = ["--insecure", *free(), "--out", str(tmp_path / "o"), "--database", str(folder)]
    err = one_line_exit_2(capsys, main, argv)
    assert "--database" in err, err


@pytest.mark.parametrize("option", ["totals=false", "backend=torch", "memory=none", "spec=1", "name=topk"])
def test_a_server_cannot_pass_the_nodes_own_build_keywords_as_compressor_options(option):
    """A task's compression reaches ``fedcomp.client.pipeline.build`` as keywords: ``totals=false`` from a server
    turned off the node's running totals (what ``fedcomp check`` audits the node's sends with). Each of build's
    own keywords is refused, on the server's side and when the node reads the task."""
    from fedcomp.task.config import Compression

    with pytest.raises(ConfigError, match="is not a compressor or memory option"):
        Compression("dgc", options=f"density=0.1 {option}")
    flat = Compression("dgc", options="density=0.1").to_flat() | {"options": f"density=0.1 {option}"}
    with pytest.raises(ConfigError, match="is not a compressor or memory option"):
        Compression.from_flat(flat)


def test_the_run_configs_local_modes_are_the_client_apps_trainers():
    from clients.trainer import LOCAL_TRAINERS
    from fedcomp.task.config import LOCAL_MODES

    assert set(LOCAL_MODES) <= set(LOCAL_TRAINERS.names())  # a test may register more; every checked name trains


def test_fedcomp_sim_into_a_pipe_closed_early_still_writes_its_files(tmp_path):
    """``fedcomp sim ... | head -1``: the run's files are written before the tables are printed; the closed
    stdout ends it with 141 (a shell's SIGPIPE code), not a traceback or a bad-input 2."""
    import os
    import subprocess
    import sys

    out = tmp_path / "o"
    cmd = [sys.executable, "-m", "fedcomp.tools.cli", "sim", "tiny", "--out", str(out), "--quiet", "--no-plot",
           "--set", "methods=fedavg"]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}  # the first line leaves at once: the tables come after the close
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    assert proc.stdout.readline().startswith(b"seed 0")
    proc.stdout.close()  # as head -1 does
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=600) == 141, err
    assert {"summary.json", "summary.csv", "fedavg.jsonl"} <= {f.name for f in out.iterdir()}
    assert "Traceback" not in err


def test_fedcomp_sim_over_seeds_into_a_closed_pipe_still_writes_the_seeds_summary(tmp_path):
    """``--seeds`` printed each seed's table as it finished: a closed stdout ended the run before the summary over
    the seeds was written (both seeds' folders complete, ``fedcomp check``: no run outputs). Every file is written
    before the first table now."""
    import subprocess
    import sys

    out = tmp_path / "o"
    cmd = [sys.executable, "-m", "fedcomp.tools.cli", "sim", "tiny", "--out", str(out), "--quiet", "--no-plot",
           "--seeds", "0,1", "--set", "methods=fedavg", "--set", "method.fedavg.num_versions=2"]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    proc.stdout.close()  # as a reader that went away does
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=600) == 141, err
    assert {"summary.json", "summary.csv"} <= {f.name for f in out.iterdir()}, err
    assert all((out / f"seed-{s}" / "summary.json").exists() for s in (0, 1))
    assert "Traceback" not in err


def test_fedcomp_sim_into_a_folder_another_run_writes_is_refused_and_an_earlier_summary_is_cleared(tmp_path):
    """Two runs into one ``--out`` at once mixed their rows in one file, and a run that stopped early left its rows
    beside an earlier run's summary: ``fedcomp check`` took them for that run. The folder is locked while a run
    writes, and an earlier summary goes before the first row."""
    import os
    import subprocess
    import sys

    from simulations.cli import claim

    out = tmp_path / "o"
    out.mkdir()
    (out / "summary.json").write_text('{"totals": {}}')  # a deployment's: another tool's folder, kept
    with pytest.raises(ValueError, match="no simulation's"):
        claim(out)
    assert (out / "summary.json").read_text() == '{"totals": {}}'
    (out / "summary.json").write_text('{"methods": []}')
    (out / "scenario.json").write_text("{}")
    assert claim(out) == out and not (out / "summary.json").exists() and not (out / "scenario.json").exists()
    assert claim(Path(os.path.relpath(out))) == Path(os.path.relpath(out))  # this process's already, by any name
    code = f"from simulations.cli import claim; from pathlib import Path; claim(Path({str(out)!r}))"
    res = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert res.returncode != 0 and "another fedcomp sim writes there now" in res.stderr, res.stderr


def test_fedcomp_sim_names_an_earlier_runs_files_left_in_its_out_folder(tmp_path, capsys):
    """A reused ``--out`` is never emptied: the rows and plots of a method this run did not run are named as an
    earlier run's, so nobody reads them as this run's."""
    from fedcomp.tools.cli import main

    short = ["--quiet", "--no-plot", "--out", str(tmp_path), "--set", "method.fedavg.num_versions=2"]
    assert main(["sim", "tiny", *short, "--set", "method.dgc-async.num_versions=2"]) == 0
    capsys.readouterr()
    assert main(["sim", "tiny", *short, "--set", "methods=fedavg"]) == 0
    err = capsys.readouterr().err
    assert f"note: {tmp_path} also holds an earlier run's dgc-async.jsonl: not this run's" in err, err


def test_a_state_dir_or_flower_home_under_a_file_is_one_line_and_exit_2(tmp_path, capsys):
    """A folder the launcher must create under a file (or a missing parent): one line and exit 2, not a traceback."""
    from clients.launcher import main as client
    from server_app.launcher import main as server

    (tmp_path / "afile").write_text("x")
    under = str(tmp_path / "afile" / "sub")
    assert client(["--server", "127.0.0.1:9092", "--insecure", "--state-dir", under]) == 2  # before any SuperNode
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--state-dir" in err and "cannot create the folder" in err, err
    err = one_line_exit_2(capsys, server, ["--insecure", "--out", str(tmp_path / "out"), *free(), "--flwr-home", under])
    assert "--flwr-home" in err and "cannot write Flower's config" in err, err


def test_fedcomp_sim_seeds_past_what_the_batches_seed_takes_are_refused_before_any_run(tmp_path, capsys):
    """``--seeds 0,20000000000000`` ran seed 0 in full, then every task of the next failed (an int64 overflow in
    the batches' seed): refused by the parser now, before anything runs."""
    from fedcomp.tools.cli import main

    with pytest.raises(SystemExit) as exc:
        main(["sim", "tiny", "--seeds", "0,20000000000000", "--out", str(tmp_path / "o")])
    assert exc.value.code == 2 and "--seeds expects distinct integers in [0, 2**32)" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()

"""How ``fedcomp`` commands end when something outside the config goes wrong: a file or folder that cannot be
used, a missing optional package, Ctrl-C or SIGTERM. Each is one line on stderr and an honest exit code, never a
traceback; a simulation's worker processes stop with it."""

from __future__ import annotations

import argparse
import os
import signal
import time
from concurrent.futures import ProcessPoolExecutor

import pytest

from fedcomp.tools.cli import Command, main, run_command
from simulations.backends import _stop_workers
from simulations.cli import seed_list


def _run(capsys, fn) -> tuple[int, str]:
    code = run_command("x", Command("test", lambda p: None, fn), argparse.Namespace())
    return code, capsys.readouterr().err.strip()


@pytest.mark.parametrize(
    "exc, words",
    [
        (ImportError("dataset 'hf:x' needs flwr-datasets"), "needs flwr-datasets"),
        (ModuleNotFoundError("No module named 'datasets'"), "No module named"),
        (IsADirectoryError(21, "Is a directory", "ck"), "Is a directory"),
        (PermissionError(13, "Permission denied", "out"), "Permission denied"),
        (ValueError("bad"), "bad"),
    ],
)
def test_an_error_outside_the_config_is_one_line_and_exit_2(capsys, exc, words):
    def fail(args):
        raise exc

    code, err = _run(capsys, fail)
    assert code == 2 and err.startswith("fedcomp x: error: ") and words in err and len(err.splitlines()) == 1, err


def test_a_bug_is_still_a_traceback(capsys):
    def fail(args):
        raise KeyError("a bug")

    with pytest.raises(KeyError):
        _run(capsys, fail)


def test_ctrl_c_is_one_line_and_exit_130(capsys):
    def interrupted(args):
        raise KeyboardInterrupt

    assert _run(capsys, interrupted) == (130, "fedcomp x: interrupted (SIGINT)")


def test_sigterm_runs_the_commands_cleanup_and_exits_143(capsys):
    cleaned = []

    def terminated(args):
        try:
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(60)  # the handler raises in here
        finally:
            cleaned.append(True)
        return 0

    before = signal.getsignal(signal.SIGTERM)
    assert _run(capsys, terminated) == (143, "fedcomp x: interrupted (SIGTERM)")
    assert cleaned == [True]
    assert signal.getsignal(signal.SIGTERM) is before  # the command's handler does not outlive it


def test_inspect_of_a_folder_and_outputs_into_a_file_are_one_line(capsys, tmp_path):
    afile = tmp_path / "afile"
    afile.write_text("keep")
    for argv, words in [
        (["inspect", str(tmp_path)], "Is a directory"),
        (["sim", "tiny", "--quiet", "--out", str(afile)], "is a file, not a folder"),
        (["dp", "--epochs", "1", "--out", str(afile)], "is a file, not a folder"),
    ]:
        code = main(argv)
        err = capsys.readouterr().err.strip().splitlines()
        lines = [ln for ln in err if not ln.startswith("scenario ")]
        assert code == 2 and len(lines) == 1 and words in lines[0], (argv, err)
    assert afile.read_text() == "keep"


def test_seeds_must_be_distinct_and_not_negative():
    assert seed_list("0,1,2") == [0, 1, 2]
    for bad in ("-1", "0,0", "a", ""):
        with pytest.raises(argparse.ArgumentTypeError):
            seed_list(bad)


def test_stopping_a_simulation_stops_its_worker_processes():
    pool = ProcessPoolExecutor(2)
    futures = [pool.submit(time.sleep, 3600) for _ in range(3)]  # each submit starts a worker, up to 2
    procs = list(pool._processes.values())
    assert len(procs) == 2
    _stop_workers(pool)  # returns without waiting out the hour-long sleeps
    for proc in procs:
        proc.join(timeout=900)  # returns once the process has ended (terminated: its sleep lasts an hour)
        assert not proc.is_alive()
    assert futures[2].cancelled() or futures[2].exception() is not None

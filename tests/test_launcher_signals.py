"""A stop (SIGTERM, Ctrl-C) that comes while a launcher starts a process stops that process too.

The stop used to be raised inside the process's start, after ``Popen`` and before the launcher recorded the
process: the launcher then exited and the SuperNode (or the SuperLink, or a warm node's helper) ran on alone,
orphaned. Now the stop is held back until the process is recorded (``fedcomp.tools.processes.StopSignals``).
"""

from __future__ import annotations

import os
import signal

import pytest

#: Bounds a hang only (a loaded machine starts Python processes slowly), never times anything.
HANG_S = 600


class StartedThenStopped:
    """A process whose start is interrupted by a SIGTERM to the launcher itself."""

    started: list[StartedThenStopped] = []

    def __init__(self, name, argv, log, env, cwd=None) -> None:
        self.name, self.pid, self.stopped, self.log_path = name, 4242, False, log
        StartedThenStopped.started.append(self)
        os.kill(os.getpid(), signal.SIGTERM)  # the stop arrives while the process starts

    def poll(self):
        return None

    def stop(self) -> None:
        self.stopped = True

    def remember_children(self) -> None:
        pass


@pytest.fixture
def interrupted(monkeypatch):
    StartedThenStopped.started = []
    yield StartedThenStopped.started
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.default_int_handler if sig == signal.SIGINT else signal.SIG_DFL)


def test_flower_client_stops_a_supernode_whose_start_a_sigterm_interrupted(monkeypatch, interrupted):
    from clients import launcher

    monkeypatch.setattr(launcher, "ManagedProcess", StartedThenStopped)
    assert launcher.main(["--server", "127.0.0.1:9092", "--insecure", "--worker", "cold"]) == 128 + signal.SIGTERM
    assert [(p.name, p.stopped) for p in interrupted] == [("flower-supernode", True)]


def test_flower_server_stops_a_superlink_whose_start_a_sigterm_interrupted(monkeypatch, interrupted, tmp_path):
    from fedcomp.tools.processes import free_port
    from server_app import launcher

    monkeypatch.setattr(launcher, "ManagedProcess", StartedThenStopped)
    code = launcher.main(["--insecure", "--port", str(free_port()), "--out", str(tmp_path / "out")])
    assert code == 128 + signal.SIGTERM
    assert [(p.name, p.stopped) for p in interrupted] == [("flower-superlink", True)]


class KilledBySignal(StartedThenStopped):
    """A SuperNode that a signal killed while it ran (the OOM killer, a ``kill -9``)."""

    def __init__(self, name, argv, log, env, cwd=None) -> None:
        self.name, self.pid, self.stopped, self.log_path = name, 4242, False, log
        StartedThenStopped.started.append(self)

    def poll(self):
        return -signal.SIGKILL


def test_flower_client_whose_supernode_a_signal_killed_exits_128_plus_it_in_one_line(monkeypatch, interrupted,
                                                                                      capsys):
    """``Popen`` says -9; the launcher exited with it (``sys.exit(-9)``: status 247) and printed nothing."""
    from clients import launcher

    monkeypatch.setattr(launcher, "ManagedProcess", KilledBySignal)
    assert launcher.main(["--server", "127.0.0.1:9092", "--insecure", "--worker", "cold"]) == 128 + signal.SIGKILL
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("flower-client:")]
    assert err == ["flower-client: error: the SuperNode was killed by SIGKILL; exit 137"], err


@pytest.mark.slow
def test_a_flower_client_killed_with_sigkill_leaves_no_process_running(tmp_path):
    """A launcher SIGKILLed (the OOM killer, ``kill -9``) cannot stop its processes: they ran on, the SuperNode
    still taking tasks on a node the operator thought gone, beside a relaunched one on the same state dir. Each
    now ends with its launcher (``PR_SET_PDEATHSIG``)."""
    import contextlib
    import shutil
    import subprocess
    import sys
    import time
    from pathlib import Path

    import psutil

    root = Path(__file__).resolve().parents[1]
    code = "import sys; from clients.launcher import main; sys.exit(main(sys.argv[1:]))"
    argv = [sys.executable, "-c", code, "--server", "127.0.0.1:1", "--insecure", "--log", str(tmp_path / "c.log")]
    launcher = subprocess.Popen(argv, cwd=root, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        end, names, folders = time.monotonic() + HANG_S, {}, set()
        while not {"supernode", "worker", "prestart"} <= set(names.values()):  # a hang bound only
            assert time.monotonic() < end and launcher.poll() is None, names
            for kid in psutil.Process(launcher.pid).children():
                with contextlib.suppress(psutil.Error):
                    program = " ".join(kid.cmdline()[:3])  # python, then the SuperNode's script or -m module
                    names[kid.pid] = next((n for n in ("supernode", "worker", "prestart") if n in program), "other")
                    folders.update(Path(a).parent for a in kid.cmdline() if a.endswith("worker.sock"))  # the worker's
            time.sleep(0.2)
        launcher.kill()
        launcher.wait(timeout=HANG_S)
        end = time.monotonic() + HANG_S  # a hang bound only: the processes end as soon as they read the SIGTERM
        while alive := [p for p in names if psutil.pid_exists(p) and psutil.Process(p).status() != "zombie"]:
            assert time.monotonic() < end, f"still running after their launcher died: {[names[p] for p in alive]}"
            time.sleep(0.2)
    finally:
        if launcher.poll() is None:
            launcher.kill()
        for pid in names:
            with contextlib.suppress(psutil.Error):
                psutil.Process(pid).kill()
        for folder in folders:  # the launcher's private folder (its worker's socket and key), left by the SIGKILL
            shutil.rmtree(folder, ignore_errors=True)

"""The launchers give Flower's SuperExec a task-poll interval (``FLWR_SUPEREXEC_TASK_POLL_INTERVAL``), unless the
user set one. No deployment: the process each launcher starts is replaced by a recorder of its environment.
benchmarks/latency_calibration.py measured the value."""

from __future__ import annotations

import math
import signal

import pytest
from flwr.supercore.superexec import run_superexec as flower_superexec

import clients.launcher as client_launcher
import server_app.launcher as server_launcher
from fedcomp.tools import processes
from fedcomp.tools.processes import (
    SUPEREXEC_POLL_BOUNDS,
    SUPEREXEC_POLL_ENV,
    SUPEREXEC_POLL_INTERVAL,
    flower_env,
    superexec_poll_env,
)


@pytest.fixture(autouse=True)
def keep_signal_handlers():
    """The launchers' ``main`` installs and then resets SIGINT/SIGTERM handlers; give pytest its own back."""
    saved = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    yield
    for sig, handler in saved.items():
        signal.signal(sig, handler)


class Started(Exception):
    """Raised by the recorder in place of starting a process."""


def recorder(seen: list[dict[str, str]]):
    class Recorder:
        def __init__(self, name, argv, log_path, env=None, cwd=None):
            seen.append({"name": name, **dict(env or {})})
            raise Started(name)

    return Recorder


def client_env(monkeypatch, tmp_path) -> dict[str, str]:
    seen: list[dict[str, str]] = []
    monkeypatch.setattr(client_launcher, "ManagedProcess", recorder(seen))
    with pytest.raises(Started):
        client_launcher.main(["--server", "127.0.0.1:9092", "--insecure", "--flwr-home", str(tmp_path / "home")])
    assert [e["name"] for e in seen] == ["flower-supernode"]
    return seen[0]


def server_env(monkeypatch, tmp_path) -> dict[str, str]:
    seen: list[dict[str, str]] = []
    monkeypatch.setattr(server_launcher, "ManagedProcess", recorder(seen))
    argv = ["--insecure", "--port", str(processes.free_port()), "--versions", "2", "--out", str(tmp_path / "out")]
    with pytest.raises(Started):
        server_launcher.main(argv)
    assert [e["name"] for e in seen] == ["flower-superlink"]
    return seen[0]


@pytest.mark.parametrize("env_of", [client_env, server_env], ids=["flower-client", "flower-server"])
def test_the_launchers_child_gets_the_interval(env_of, monkeypatch, tmp_path):
    monkeypatch.delenv(SUPEREXEC_POLL_ENV, raising=False)
    env = env_of(monkeypatch, tmp_path)
    assert float(env[SUPEREXEC_POLL_ENV]) == SUPEREXEC_POLL_INTERVAL


@pytest.mark.parametrize("env_of", [client_env, server_env], ids=["flower-client", "flower-server"])
def test_a_user_set_interval_is_kept(env_of, monkeypatch, tmp_path):
    monkeypatch.setenv(SUPEREXEC_POLL_ENV, "2.5")
    env = env_of(monkeypatch, tmp_path)
    assert env[SUPEREXEC_POLL_ENV] == "2.5"


def test_the_rule_in_one_place(monkeypatch):
    assert superexec_poll_env({})[SUPEREXEC_POLL_ENV] == f"{SUPEREXEC_POLL_INTERVAL:g}"
    assert superexec_poll_env({SUPEREXEC_POLL_ENV: "7"})[SUPEREXEC_POLL_ENV] == "7"
    monkeypatch.setenv(SUPEREXEC_POLL_ENV, "0.5")
    assert flower_env()[SUPEREXEC_POLL_ENV] == "0.5"
    monkeypatch.delenv(SUPEREXEC_POLL_ENV)
    assert flower_env()[SUPEREXEC_POLL_ENV] == f"{SUPEREXEC_POLL_INTERVAL:g}"


def test_the_interval_is_within_flowers_bounds_and_faster_than_its_default(monkeypatch):
    lo, hi = SUPEREXEC_POLL_BOUNDS
    assert SUPEREXEC_POLL_ENV == flower_superexec._TASK_POLL_INTERVAL_ENV
    assert (lo, hi) == (
        flower_superexec._MIN_TASK_POLL_INTERVAL_SECONDS,
        flower_superexec._MAX_TASK_POLL_INTERVAL_SECONDS,
    )
    assert math.isfinite(SUPEREXEC_POLL_INTERVAL) and lo <= SUPEREXEC_POLL_INTERVAL <= hi
    assert SUPEREXEC_POLL_INTERVAL < flower_superexec._DEFAULT_TASK_POLL_INTERVAL_SECONDS
    monkeypatch.setenv(SUPEREXEC_POLL_ENV, flower_env()[SUPEREXEC_POLL_ENV])
    assert flower_superexec._get_task_poll_interval() == SUPEREXEC_POLL_INTERVAL  # Flower's own parser accepts it


def test_the_launchers_document_it():
    for p in (client_launcher.parser(), server_launcher.parser()):
        assert SUPEREXEC_POLL_ENV in p.format_help().replace("\n", "").replace(" ", "")

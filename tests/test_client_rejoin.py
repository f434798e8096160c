"""``flower-client`` starts its SuperNode again when the SuperNode stops by itself with exit 0.

Flower's SuperNode answers a 401 from the SuperLink (a SuperLink restarted without ``--database`` knows no node
ids from before) by sending itself SIGINT and exiting 0. The launcher used to pass that 0 on: the client was gone
and reported success. The end-to-end case (a real SuperLink restarted without a database, the run resumed and
accounted for) is ``tests/test_restart.py::test_deployment_server_sigkill_and_resume[no-database]``.
"""

from __future__ import annotations

import pytest

from clients import launcher


class Exits:
    """A SuperNode that has already exited with the next code of ``codes``."""

    codes: list[int] = []
    started: list[Exits] = []

    def __init__(self, name, argv, log, env, cwd=None) -> None:
        self.name, self.pid, self.code, self.stopped = name, 4242, Exits.codes.pop(0), False
        Exits.started.append(self)

    def poll(self):
        return self.code

    def stop(self) -> None:
        self.stopped = True

    def remember_children(self) -> None:
        pass


@pytest.fixture
def supernodes(monkeypatch):
    monkeypatch.setattr(launcher, "ManagedProcess", Exits)
    monkeypatch.setattr(launcher.Backoff, "FIRST_S", 0.01)
    Exits.started = []
    return Exits


def run(*flags: str) -> int:
    return launcher.main(["--server", "127.0.0.1:9092", "--insecure", "--worker", "cold", *flags])


def test_a_supernode_that_stops_itself_with_0_is_started_again_and_its_next_code_is_the_launchers(supernodes, capsys):
    supernodes.codes = [0, 0, 7]
    assert run() == 7
    assert [p.stopped for p in supernodes.started] == [True, True, True]
    assert capsys.readouterr().err.count("starting it again") == 2


def test_max_retries_bounds_the_starts_in_a_row_and_the_launcher_then_fails(supernodes, capsys):
    supernodes.codes = [0, 0, 0, 0]
    assert run("--max-retries", "2") == 1
    assert len(supernodes.started) == 3
    assert "3 in a row" in capsys.readouterr().err


def test_a_supernode_that_ran_a_minute_resets_the_count():
    rejoins = launcher.Rejoins(max_retries=1)
    assert rejoins.after(0, ran_s=1.0) == launcher.Backoff.FIRST_S
    assert rejoins.after(0, ran_s=launcher.Backoff.STABLE_S) == launcher.Backoff.FIRST_S  # ran a minute: afresh
    assert rejoins.after(0, ran_s=1.0) is None


def test_the_back_off_doubles_up_to_its_cap():
    rejoins = launcher.Rejoins(max_retries=None)
    waits = [rejoins.after(0, ran_s=1.0) for _ in range(7)]
    assert waits == [1.0, 2.0, 4.0, 8.0, 16.0, 30.0, 30.0]
    assert rejoins.after(1, ran_s=1.0) is None  # an error is the launcher's exit code, never a restart

"""Process trees through psutil, not by walking ``/proc`` (issue 14, item 12): ``descendants`` finds grandchildren,
``ManagedProcess.stop`` ends the whole tree, and ``fedcomp.tools.processes`` never reads ``/proc`` itself."""

from __future__ import annotations

import inspect
import sys
import time

import fedcomp.tools.processes as processes
from fedcomp.tools.processes import ManagedProcess, _alive, command_line, descendants

TREE = (
    "import subprocess, sys, time\n"
    "kid = [sys.executable, '-c', 'import time; time.sleep(300)']\n"
    "subprocess.Popen([sys.executable, '-c', "
    "'import subprocess, sys, time; subprocess.Popen(%r); time.sleep(300)' % (kid,)])\n"
    "time.sleep(300)\n"
)


def test_the_module_reads_no_proc_folder():
    assert "/proc" not in inspect.getsource(processes)


def test_descendants_and_stop_cover_grandchildren(tmp_path):
    proc = ManagedProcess("tree", [sys.executable, "-c", TREE], tmp_path / "tree.log")
    try:
        end = time.monotonic() + 900  # a bound on a hang only
        while len(descendants(proc.pid)) < 2:  # child and grandchild (started on a loaded machine: be patient)
            assert time.monotonic() < end and proc.poll() is None, proc.tail()
            time.sleep(0.1)
        kids = descendants(proc.pid)
        assert all("python" in command_line(k).lower() or "sleep" in command_line(k) for k in kids), kids
        proc.stop()
        assert proc.poll() is not None
        end = time.monotonic() + 900
        while any(_alive(k) for k in kids):
            assert time.monotonic() < end, [k for k in kids if _alive(k)]
            time.sleep(0.1)
    finally:
        proc.stop()
    assert descendants(proc.pid) == [] and command_line(proc.pid) == ""


def test_a_log_path_that_is_another_users_symlink_is_refused_and_its_target_untouched(tmp_path, monkeypatch):
    """A launcher's log in a shared folder: a symlink another user planted there made the process append to the
    file it points at. Such a link is refused; the user's own links (and root's, ``/dev/stderr``) are followed,
    and a new log is 0600."""
    import os

    import pytest

    target = tmp_path / "notes.txt"
    target.write_text("precious")
    link = tmp_path / "node.log"
    link.symlink_to(target)
    if os.getuid() == 0:
        os.lchown(link, 4242, 4242)
    else:  # the user's own link, seen by a process of another uid
        monkeypatch.setattr(os, "getuid", lambda: 4242)
    with pytest.raises(PermissionError, match="is a symlink of uid"):
        ManagedProcess("echo", [sys.executable, "-c", "print('x')"], link)
    assert target.read_text() == "precious"
    monkeypatch.undo()
    proc = ManagedProcess("echo", [sys.executable, "-c", "print('x')"], tmp_path / "fresh.log")
    proc.proc.wait(timeout=120)
    assert os.stat(tmp_path / "fresh.log").st_mode & 0o777 == 0o600


def test_a_log_file_of_another_user_is_refused_and_left_as_it_was(tmp_path, monkeypatch):
    """A log path where another user planted a file (0666, in a shared folder): the node's output went into it,
    for that user to read and change. Refused, by the launcher's checks and by the process that opens it."""
    import os

    import pytest

    from clients.launcher import _log_problem

    planted = tmp_path / "node.log"
    planted.write_text("theirs")
    os.chmod(planted, 0o666)
    if os.getuid() == 0:
        os.chown(planted, 4242, 4242)
    else:
        monkeypatch.setattr(os, "getuid", lambda: 4242)
    assert "is a file of uid" in _log_problem(planted)
    with pytest.raises(PermissionError, match="is a file of uid"):
        ManagedProcess("echo", [sys.executable, "-c", "print('x')"], planted)
    assert planted.read_text() == "theirs"

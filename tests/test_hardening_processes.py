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

"""Starting and stopping Flower's own processes (SuperLink, SuperNode) and talking to the ``flwr`` CLI.

Every process is started in its own session; ``ManagedProcess.stop`` signals it **and every descendant by PID**
(found with psutil before signalling, so it works wherever psutil does), so a SuperLink's
``flower-superexec``/``flwr-serverapp`` and a SuperNode's ``flwr-clientapp`` children go too. ``flwr`` reads its
SuperLink connections from ``$FLWR_HOME/config.toml``; ``write_flower_config`` writes one connection there (the
committed pyproject has no ``[tool.flwr.federations]``). On Linux each process also gets a SIGTERM when the process
that started it dies (``PR_SET_PDEATHSIG``): a launcher killed with SIGKILL leaves no SuperNode or SuperLink
running on alone, still taking tasks or holding the port.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import json
import os
import shutil
import signal
import socket
import stat
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import IO, Any

import httpx
import psutil


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def listen_problem(host: str, port: int) -> str | None:
    """Why nothing could listen on ``host:port``, or None when it can: ``"in use"`` when something already
    listens there (a bind with ``SO_REUSEADDR`` fails; connections of a process that just died, in TIME_WAIT, do
    not count), else the reason (an address this machine does not have, a name that does not resolve).

    >>> listen_problem("127.0.0.1", 0) is None
    True
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as exc:
            return "in use" if exc.errno == errno.EADDRINUSE else (exc.strerror or str(exc))
    return None


def flower_executable(name: str) -> str:
    """Path of a Flower console script next to this interpreter (falls back to ``PATH``)."""
    local = Path(sys.executable).with_name(name)
    if local.exists():
        return str(local)
    found = shutil.which(name)
    if not found:
        raise FileNotFoundError(f"{name} not found next to {sys.executable} or on PATH; is flwr installed?")
    return found


def descendants(pid: int) -> list[int]:
    """PIDs of every live descendant of ``pid`` (psutil: Linux, macOS, Windows); empty if ``pid`` is gone."""
    try:
        return [c.pid for c in psutil.Process(pid).children(recursive=True)]
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return []


def _alive(pid: int) -> bool:
    """True while ``pid`` runs (a zombie, dead but not yet reaped, is not alive)."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
    except psutil.AccessDenied:
        return True


def command_line(pid: int) -> str:
    """The command line of ``pid`` as one string (empty if it is gone)."""
    try:
        return " ".join(psutil.Process(pid).cmdline())
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return ""


def signal_pids(pids: Sequence[int], sig: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except (ProcessLookupError, PermissionError):
            pass


def _check_not_planted(path: Path) -> None:
    """``PermissionError`` when ``path`` is a symlink of another user's (root's, such as ``/dev/stderr``, and the
    user's own are followed)."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if stat.S_ISLNK(st.st_mode) and st.st_uid not in (0, os.getuid()):
        raise PermissionError(f"{path} is a symlink of uid {st.st_uid}, not of this user: not written through")


def _open_log(path: Path) -> IO[bytes]:
    """``path`` opened for appending (made 0600 if new); ``PermissionError`` for a regular file of another user's
    (one planted in a shared folder: that user could read the node's output and change it). Devices such as
    ``/dev/null`` or a terminal are written to."""
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    st = os.fstat(fd)
    if stat.S_ISREG(st.st_mode) and st.st_uid != os.getuid():
        os.close(fd)
        raise PermissionError(f"{path} is a file of uid {st.st_uid}, not of this user: not written to")
    return os.fdopen(fd, "ab")


class StopSignals:
    """SIGINT and SIGTERM raised as ``make(signum)`` in a launcher's main thread, held back while a process
    starts (``starting()``): a stop that comes during a start is raised once the process is recorded, so a
    launcher never leaves a process it started running on its own.

    >>> stops = StopSignals(lambda signum: SystemExit(128 + signum))
    >>> with stops.starting():
    ...     stops.handle(signal.SIGTERM, None)  # as if the signal came now
    ...     started = "the process, recorded"
    Traceback (most recent call last):
    SystemExit: 143
    >>> started
    'the process, recorded'
    """

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self, make: Any) -> None:
        self.make, self.holding, self.pending = make, 0, None

    def install(self) -> None:
        for sig in self.SIGNALS:
            signal.signal(sig, self.handle)

    def uninstall(self) -> None:
        for sig in self.SIGNALS:
            signal.signal(sig, signal.SIG_DFL)

    def handle(self, signum: int, frame: Any) -> None:
        if self.holding:
            self.pending = signum
            return
        raise self.make(signum)

    @contextlib.contextmanager
    def starting(self) -> Iterator[None]:
        self.holding += 1
        try:
            yield
        finally:
            self.holding -= 1
            if not self.holding and self.pending is not None:
                signum, self.pending = self.pending, None
                raise self.make(signum)


#: Linux's ``prctl`` (None elsewhere), loaded before any fork: a child calls it between fork and exec.
_LIBC = ctypes.CDLL(None, use_errno=True) if sys.platform.startswith("linux") else None
_PR_SET_PDEATHSIG = 1


def _ends_with(parent: int) -> Any:
    """A ``preexec_fn`` that has the child SIGTERMed when ``parent`` (this process) dies, or None off Linux. (The
    signal follows the thread that forked: launchers start their processes from their main thread.)"""
    if _LIBC is None:
        return None

    def preexec() -> None:
        _LIBC.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
        if os.getppid() != parent:  # the parent died before prctl took effect
            os.kill(os.getpid(), signal.SIGTERM)

    return preexec


class ManagedProcess:
    """A started process with its log file; ``stop()`` ends it and its descendants, by PID."""

    def __init__(
        self,
        name: str,
        argv: Sequence[str],
        log_path: Path | None,
        env: dict[str, str] | None = None,
        cwd: Path | None = None,
    ):
        """``log_path``: file for stdout+stderr (appended; made 0600; ``PermissionError`` for a symlink of another
        user's, as one planted in a shared folder would make the process write into another file); ``None`` =
        inherit this process's terminal."""
        self.name, self.argv, self.log_path = name, list(argv), log_path
        self._log = None
        if log_path is not None:
            log_path.parent.mkdir(parents=True, exist_ok=True)
            _check_not_planted(log_path)
            self._log = _open_log(log_path)
        self.proc = subprocess.Popen(
            self.argv,
            stdout=self._log,
            stderr=subprocess.STDOUT if self._log else None,
            stdin=subprocess.DEVNULL,
            env=env,
            cwd=cwd,
            start_new_session=True,
            preexec_fn=_ends_with(os.getpid()),
        )
        self.known: set[int] = set()

    @property
    def pid(self) -> int:
        return self.proc.pid

    def poll(self) -> int | None:
        return self.proc.poll()

    def remember_children(self) -> list[int]:
        """Record the current descendants (call it while the process lives: orphans lose their parent link)."""
        kids = descendants(self.pid)
        self.known.update(kids)
        return kids

    def kill(self) -> None:
        """SIGKILL the process only, like a crashed node: its children are left as they are (a launcher's own
        ``ManagedProcess`` children get a SIGTERM as it dies)."""
        self.remember_children()
        signal_pids([self.pid], signal.SIGKILL)
        self.proc.wait()

    def stop(self, timeout: float = 8.0) -> None:
        """SIGTERM the process and every descendant seen, wait up to ``timeout``, then SIGKILL what is left."""
        pids = [self.pid, *self.remember_children()] if self.poll() is None else list(self.known)
        pids += [d for p in list(self.known) for d in descendants(p)]
        pids = list(dict.fromkeys(pids))
        signal_pids(pids, signal.SIGTERM)
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if self.poll() is not None and not any(_alive(p) for p in pids if p != self.pid):
                break
            time.sleep(0.1)
        signal_pids([p for p in pids if _alive(p)], signal.SIGKILL)
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass
        if self._log:
            self._log.close()

    def tail(self, n: int = 40) -> str:
        if self.log_path is None:
            return ""
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""


def wait_http_ready(address: str, timeout: float, proc: ManagedProcess | None = None, tls: bool = False) -> None:
    """Wait until ``GET /health`` on ``address`` answers (the SuperLink's HTTP API is up)."""
    end = time.monotonic() + timeout
    url = f"{'https' if tls else 'http'}://{address}/health"
    while time.monotonic() < end:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"{proc.name} exited with code {proc.poll()}:\n{proc.tail()}")
        try:
            if httpx.get(url, timeout=0.5, verify=False).is_success:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise TimeoutError(f"nothing answered on {url} within {timeout:.0f}s")


def write_flower_config(
    flwr_home: Path, name: str, address: str, insecure: bool = True, root_certificates: str | None = None
) -> Path:
    """Write ``$FLWR_HOME/config.toml`` with one SuperLink connection ``name`` (made the default)."""
    flwr_home.mkdir(parents=True, exist_ok=True)
    lines = ["[superlink]", f'default = "{name}"', "", f"[superlink.{name}]", f'address = "{address}"']
    lines.append(f"insecure = {'true' if insecure else 'false'}")
    if root_certificates:
        lines.append(f'root-certificates = "{Path(root_certificates).resolve()}"')
    path = flwr_home / "config.toml"
    path.write_text("\n".join(lines) + "\n")
    return path


def superlink_argv(
    port: int, host: str = "127.0.0.1", simulation: bool = False, extra: Sequence[str] = ()
) -> list[str]:
    argv = [flower_executable("flower-superlink"), "--host", host, "--port", str(port)]
    argv += ["--disable-runtime-dependency-installation"]
    if simulation:
        argv.append("--simulation")
    return argv + list(extra)


#: The environment variable Flower 1.41's SuperExec reads (``flwr/supercore/superexec/run_superexec.py``): seconds
#: between its ``AcquireTask`` polls, Flower's default 1.0, allowed 0.01 to 60. The SuperLink and every SuperNode
#: start their own ``flower-superexec`` with their environment; on a SuperNode it is the process that launches one
#: ``flwr-clientapp`` per task message, so each task waits for the next poll (half an interval on average).
SUPEREXEC_POLL_ENV = "FLWR_SUPEREXEC_TASK_POLL_INTERVAL"
SUPEREXEC_POLL_BOUNDS = (0.01, 60.0)  # Flower's _MIN/_MAX_TASK_POLL_INTERVAL_SECONDS
#: The interval the launchers give the SuperExec. benchmarks/latency_calibration.py (2-core loopback, mlp): a task
#: waits 0.54 s (median) for the SuperExec at 1.0, 0.09 s at 0.2, 0.03 s at 0.05; an idle flower-client uses 0.8%,
#: 2.2% and 7.1% of one core. 0.2 takes most of the wait away for a small idle cost.
SUPEREXEC_POLL_INTERVAL = 0.2


def superexec_poll_env(env: dict[str, str]) -> dict[str, str]:
    """Set ``SUPEREXEC_POLL_ENV`` to ``SUPEREXEC_POLL_INTERVAL`` in ``env`` unless it is already there (a user's
    value wins); returns ``env``."""
    env.setdefault(SUPEREXEC_POLL_ENV, f"{SUPEREXEC_POLL_INTERVAL:g}")
    return env


def flower_env(flwr_home: Path | None = None) -> dict[str, str]:
    """Environment for Flower's processes. The SuperLink and SuperNode start further Flower console scripts
    (``flower-superexec``, ``flwr-clientapp``) by name, so this interpreter's script folder goes first on
    ``PATH``: a launcher run as ``.venv/bin/flower-server`` works without an activated virtual environment.
    The SuperExec's task-poll interval is set (``superexec_poll_env``) unless the caller's environment has one."""
    env = dict(os.environ)
    scripts = str(Path(sys.executable).parent)
    env["PATH"] = os.pathsep.join([scripts, *(p for p in env.get("PATH", "").split(os.pathsep) if p and p != scripts)])
    if flwr_home is not None:
        env["FLWR_HOME"] = str(flwr_home)
    env["FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION"] = "1"
    env.setdefault("FLWR_DISABLE_UPDATE_CHECK", "1")
    env.setdefault("RAY_DEDUP_LOGS", "0")
    return superexec_poll_env(env)


class FlwrCliError(RuntimeError):
    """The ``flwr`` CLI failed; the message holds its output."""


def _flwr(args: Sequence[str], env: dict[str, str], timeout: float = 120.0) -> str:
    res = subprocess.run(
        [flower_executable("flwr"), *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        stdin=subprocess.DEVNULL,
    )
    if res.returncode != 0:
        raise FlwrCliError(f"flwr {' '.join(args[:1])} failed ({res.returncode}):\n{res.stdout}\n{res.stderr}")
    return res.stdout


def _json_tail(text: str) -> dict:
    start = text.find("{")
    if start < 0:
        raise FlwrCliError(f"no JSON in flwr output:\n{text}")
    return json.loads(text[start:])


def submit_run(
    app_dir: Path,
    connection: str,
    env: dict[str, str],
    overrides_toml: Path | None = None,
    federation_config: str | None = None,
) -> int:
    """``flwr run APP CONNECTION`` with a TOML file of run-config overrides; returns the run id."""
    args = ["run", str(app_dir), connection, "--format", "json"]
    if overrides_toml is not None:
        args += ["--run-config", str(overrides_toml)]
    if federation_config:
        args += ["--federation-config", federation_config]
    out = _json_tail(_flwr(args, env))
    if not out.get("success") or not out.get("run-id"):
        raise FlwrCliError(f"run not started: {out}")
    return int(out["run-id"])


def run_info(connection: str, run_id: int, env: dict[str, str], timeout: float = 30.0) -> dict[str, str]:
    """``{"status": ..., "details": ...}`` of a run (``flwr ls --run-id``): status is ``pending``, ``starting``,
    ``running`` or ``finished:completed|failed|stopped``; details hold a failed ServerApp's exception text.
    Raises ``subprocess.TimeoutExpired`` when ``flwr`` does not answer within ``timeout`` seconds."""
    out = _json_tail(_flwr(["ls", connection, "--run-id", str(run_id), "--format", "json"], env, timeout=timeout))
    runs = out.get("runs") or []
    if not runs:
        return {"status": "unknown", "details": ""}
    return {"status": str(runs[0].get("status", "unknown")), "details": str(runs[0].get("status-details") or "")}


def run_status(connection: str, run_id: int, env: dict[str, str]) -> str:
    """Status text of a run (``pending``, ``starting``, ``running``, ``finished:completed|failed|stopped``)."""
    return run_info(connection, run_id, env)["status"]


def register_supernode(public_key: Path, connection: str, env: dict[str, str]) -> None:
    """``flwr supernode register KEY CONNECTION`` (SuperNode authentication); a key that is already registered
    (a restarted SuperLink with a persistent ``--database``) is fine."""
    try:
        _flwr(["supernode", "register", str(Path(public_key).resolve()), connection], env, timeout=60)
    except FlwrCliError as exc:
        if "already" not in str(exc).lower():
            raise


def stop_run(connection: str, run_id: int, env: dict[str, str]) -> None:
    _flwr(["stop", str(run_id), connection], env, timeout=30)


def write_overrides(path: Path, values: dict) -> Path:
    """A TOML file of run-config overrides (``flwr run --run-config FILE``)."""
    import tomli_w

    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(tomli_w.dumps(values))
    return path

"""``flower-client``: start Flower's own SuperNode with the fedcomp node config.

    flower-client --server 10.0.0.5:9092 --insecure --partition-id 0 --num-partitions 4 [--gpu]

The node config it sets (read by the ClientApp from ``context.node_config``): ``partition-id``,
``num-partitions``, ``gpu``, ``device-class``, ``state-dir``, ``kernels``, ``allow-plugins`` (``--allow-plugin``:
the only modules a run config may make this node import; ``fedcomp.task.plugins``), ``max-task-examples`` and
``max-parameters`` (what one task may ask of the node: a run over them has its tasks refused, one line each).
``--gpu`` on a machine where torch sees no CUDA device is an error at start-up (never a silent CPU fallback); with
``--gpu`` the send step takes the fused Triton kernels unless ``--kernels torch``. TLS (``--root-certificates``)
and SuperNode authentication (``--auth-supernode-private-key``) are passed through. Ctrl-C / SIGTERM stop the
SuperNode and its ``flwr-clientapp`` children by PID. Every flag and the node config are checked before the
SuperNode starts. Exit code: the SuperNode's, 2 on bad flags or a state dir another node holds (one line),
128+signal when stopped. A SuperNode that stops by itself with exit 0 (Flower's answer to a SuperLink that no longer
knows its node id) is started again to register anew (``Rejoins``); 1 when ``--max-retries`` such starts in a row
fail.

The SuperNode's own ``flower-superexec`` (it launches one ``flwr-clientapp`` process per task) polls for tasks
every ``FLWR_SUPEREXEC_TASK_POLL_INTERVAL`` seconds; Flower's default is 1.0, this launcher sets
``fedcomp.tools.processes.SUPEREXEC_POLL_INTERVAL`` unless the variable is already set in its environment.

``--worker warm`` (the default) also starts one long-lived ``clients.worker`` process that runs the tasks the
thin ``flwr-clientapp`` processes forward to it (torch, data, model, session and CUDA context made once), and a
fork server (``clients.prestart``) that has imported Flower once: a shim first on the SuperNode's ``PATH``
hands each ``flwr-clientapp`` start to it, so Flower's own per-task process starts without Python's and
Flower's imports (``--no-prestart``: Flower starts it from scratch). Both live in a private folder of the
node's (mode 0700: sockets, key file, shim, and the state dir when ``--state-dir`` is not given); the node config
gets ``worker-socket``, ``worker-key`` and ``state-dir``. A helper that dies is restarted after a back-off (1 s,
doubling up to 30 s; meanwhile tasks run in-process or start cold: none is lost); both are stopped, and the
folder removed, with the SuperNode. ``--worker cold`` runs every task in its own ``flwr-clientapp`` process, as
Flower does.

``--app fab`` serves any Flower app's own ``ClientApp`` (the run's FAB's ``clientapp`` component) the same way:
each forked ``flwr-clientapp`` hands the message to the worker, which keeps the app object, and its module-level
state, across tasks and always runs the run's FAB code (``clients.forward``); ``--app module:attr`` names another
app object, looked up in the run's FAB first.
"""

from __future__ import annotations

import argparse
import math
import os
import re
import shlex
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path

from click import ClickException
from flwr.common.config import parse_config_args

from clients.channel import KEY_KEY, SOCKET_KEY, node_settings, private_dir, write_key
from clients.prestart import write_shim
from fedcomp.flower.statedir import StateDir, StateDirInUse
from fedcomp.registry import ConfigError
from fedcomp.task.config import KERNELS, NodeConfig
from fedcomp.tools.launchcli import OneLineParser
from fedcomp.tools.processes import (
    SUPEREXEC_POLL_ENV,
    SUPEREXEC_POLL_INTERVAL,
    ManagedProcess,
    StopSignals,
    flower_env,
    flower_executable,
    free_port,
)

DEVICE_CLASSES = ("phone", "laptop", "cpu", "gpu-server")
POLL_HELP = (
    f"The SuperNode's SuperExec polls for tasks every {SUPEREXEC_POLL_ENV} seconds: {SUPEREXEC_POLL_INTERVAL:g} "
    "unless set in the environment (Flower's default: 1.0)."
)


def parser() -> argparse.ArgumentParser:
    p = OneLineParser(
        prog="flower-client",
        description="Start a Flower SuperNode that runs the fedcomp ClientApp for a flower-server.",
        epilog=POLL_HELP,
    )
    p.add_argument("--server", required=True, metavar="HOST:PORT", help="the flower-server (SuperLink) address")
    p.add_argument("--gpu", action="store_true", help="train on CUDA (fails if there is none)")
    p.add_argument("--device-class", default=None, choices=DEVICE_CLASSES,
                   help="what this node is (for metrics; default: cpu, gpu-server with --gpu)")
    p.add_argument("--partition-id", type=int, help="this node's data partition (with --num-partitions)")
    p.add_argument("--num-partitions", type=int, help="number of data partitions")
    p.add_argument("--state-dir", help="keep the client state (residual, pending updates) here; survives a server "
                   "restart (default: a private temporary folder with the warm worker, none with --worker cold)")
    p.add_argument(
        "--kernels",
        choices=tuple(KERNELS),
        help="send-step kernels: auto (default: Triton on the GPU, torch on the CPU), torch, triton",
    )
    p.add_argument(
        "--worker",
        choices=("warm", "cold"),
        default="warm",
        help="warm (default): one long-lived worker process runs the tasks; cold: a fresh process per task",
    )
    p.add_argument(
        "--no-prestart",
        dest="prestart",
        action="store_false",
        help="with --worker warm: let Flower start each flwr-clientapp from scratch (default: forked from a "
        "process that has imported Flower once)",
    )
    p.add_argument(
        "--app",
        default="",
        metavar="REF",
        help="serve any Flower ClientApp from the warm worker: 'fab' (each run's FAB's own clientapp) or "
        "module:attr (looked up in the run's FAB first); its module-level state lives across tasks",
    )
    add_allowances(p)
    p.add_argument("--node-config", default="", metavar='"k=v ..."', help="extra node config, passed through")
    tls = p.add_argument_group("security")
    tls.add_argument("--insecure", action="store_true", help="plain HTTP, no TLS")
    tls.add_argument("--root-certificates", help="CA certificate (PEM) to verify the server")
    tls.add_argument("--auth-supernode-private-key", help="private key for SuperNode authentication")
    p.add_argument("--port", type=int, default=0, help="local port of the SuperNode's own API (default: a free one)")
    p.add_argument("--max-retries", type=int, help="reconnect attempts before giving up, and SuperNode restarts in a "
                   "row after the SuperLink forgot this node (default: unlimited)")
    p.add_argument("--max-wait-time", type=float, help="seconds to keep trying to connect (default: unlimited)")
    p.add_argument("--flwr-home", help="FLWR_HOME of the SuperNode (where it installs the app)")
    p.add_argument("--log", help="write the SuperNode's output to this file instead of the terminal")
    return p


def _log_problem(path: Path) -> str:
    """Why the SuperNode's output cannot go to ``path`` ("" when it can; its folder is made if missing)."""
    if path.is_dir():
        return "is a folder, not a file"
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        return f"cannot make its folder ({exc.strerror or exc})"
    if not os.access(path.parent, os.W_OK) or (path.exists() and not os.access(path, os.W_OK)):
        return "not writable"
    if path.is_file() and (owner := path.stat().st_uid) != os.getuid():
        return f"is a file of uid {owner}, not of this user (another user could read the node's output)"
    return ""


def _check(args: argparse.Namespace, p: argparse.ArgumentParser) -> None:
    if not re.fullmatch(r"\[?[\w.:-]+\]?:\d{1,5}", args.server):
        p.error(f"--server must be HOST:PORT, got {args.server!r}")
    if (args.partition_id is None) != (args.num_partitions is None):
        p.error("--partition-id and --num-partitions go together")
    if args.num_partitions is not None and not 0 <= args.partition_id < args.num_partitions:
        p.error(f"--partition-id must be in [0, {args.num_partitions}), got {args.partition_id}")
    if args.insecure and args.root_certificates:
        p.error("--insecure cannot be combined with --root-certificates")
    if not 1 <= int(args.server.rsplit(":", 1)[1]) <= 65535:
        p.error(f"--server port must be in 1..65535, got {args.server!r}")
    if not 0 <= args.port <= 65535:
        p.error(f"--port must be in 0..65535 (0: a free one), got {args.port}")
    if args.max_retries is not None and args.max_retries < 0:
        p.error(f"--max-retries must be >= 0, got {args.max_retries}")
    if args.max_wait_time is not None and not args.max_wait_time > 0:
        p.error(f"--max-wait-time must be > 0, got {args.max_wait_time}")
    for flag in ("root_certificates", "auth_supernode_private_key"):
        path = getattr(args, flag)
        if path and not Path(path).is_file():
            p.error(f"--{flag.replace('_', '-')} {path}: no such file")
    for flag in ("state_dir", "flwr_home"):
        path = getattr(args, flag)
        if path and Path(path).exists() and not Path(path).is_dir():
            p.error(f"--{flag.replace('_', '-')} {path} is a file, not a folder")
    if args.app and (args.worker != "warm" or not args.prestart):
        p.error("--app needs the warm worker and its fork server (not --worker cold or --no-prestart)")
    if args.app and args.app != "fab" and not re.fullmatch(r"[\w.]+:[\w.]+", args.app):
        p.error(f"--app must be 'fab' or module:attr, got {args.app!r}")
    if args.log and (problem := _log_problem(Path(args.log))):
        p.error(f"--log {args.log}: {problem}")
    try:
        loose = [t for t in shlex.split(args.node_config) if "=" not in t]
    except ValueError as exc:  # an unclosed quote
        p.error(f"--node-config {args.node_config!r}: {exc}")
    if loose:  # Flower's parser drops them without a word
        p.error(f"--node-config expects key=value pairs separated by spaces; {loose[0]!r} has no '='")
    try:
        NodeConfig.from_flower(node_settings(parse_config_args([node_config(args)])))
    except (ConfigError, ValueError, ClickException) as exc:  # Flower's parser raises click's
        p.error(str(exc).strip().splitlines()[0] if str(exc).strip() else f"bad --node-config {args.node_config!r}")
    if args.gpu:
        import torch

        if not torch.cuda.is_available():
            p.error(f"--gpu given but torch {torch.__version__} sees no CUDA device here; not falling back to CPU")


def add_allowances(p: argparse.ArgumentParser) -> None:
    """The flags that say what a run may ask of this node: plug-in modules, examples per task, model size."""
    limits, group = NodeConfig(), p.add_argument_group("what a run may ask of this node")
    group.add_argument(
        "--allow-plugin",
        action="append",
        default=[],
        metavar="MODULE",
        help="let a run config name plug-ins (model, dataset, loss) from MODULE and its submodules (repeatable; "
        "default: none, only built-ins and entry points installed here). A run config is not signed: allow only "
        "code you would run yourself",
    )
    group.add_argument("--allow-dataset", action="append", default=[], metavar="NAME",
                       help="let a run config name built-in dataset NAME that reads this node's files or the network "
                       "(cifar10: a folder the run names; hf: the Hugging Face hub; repeatable; '*' = all; default: "
                       "none, only datasets that are generated or shipped)")
    group.add_argument("--max-task-examples", type=int, metavar="N",
                       help="refuse a task asking more training examples (local-steps x batch-size) than N "
                       f"(default: {limits.max_task_examples:,}; 0 = no cap)")
    group.add_argument("--max-parameters", type=int, metavar="N",
                       help=f"refuse a run whose model has more parameters than N, before building it (default: "
                       f"{limits.max_parameters:,}; 0 = no cap)")
    group.add_argument("--max-dataset-values", type=int, metavar="N",
                       help="refuse a run asking a dataset whose size the run chooses (mnist1d's num_samples x "
                       f"length) of more input values than N, before making it (default: "
                       f"{limits.max_dataset_values:,}; 0 = no cap)")


def node_config(args: argparse.Namespace, worker: WarmNode | None = None) -> str:
    """The SuperNode's ``--node-config`` text; with ``worker``, its channel and (unless ``--state-dir``) its
    default state dir."""
    items = []
    if args.partition_id is not None:
        items += [f"partition-id={args.partition_id}", f"num-partitions={args.num_partitions}"]
    items.append(f"gpu={'true' if args.gpu else 'false'}")
    items.append(f'device-class="{args.device_class or ("gpu-server" if args.gpu else "cpu")}"')
    state_dir = args.state_dir or (worker.default_state_dir if worker else "")
    if state_dir:
        items.append(f'state-dir="{Path(state_dir).resolve()}"')
    if worker is not None:
        items += [f'{SOCKET_KEY}="{worker.socket}"', f'{KEY_KEY}="{worker.key_file}"']
    if args.kernels:
        items.append(f'kernels="{args.kernels}"')
    if args.allow_plugin:
        items.append(f'allow-plugins="{" ".join(args.allow_plugin)}"')
    if args.allow_dataset:
        items.append(f'allow-datasets="{" ".join(args.allow_dataset)}"')
    caps = (("max-task-examples", args.max_task_examples), ("max-parameters", args.max_parameters),
            ("max-dataset-values", args.max_dataset_values))
    items += [f"{key}={value}" for key, value in caps if value is not None]
    return " ".join(items + ([args.node_config] if args.node_config else []))


def supernode_argv(args: argparse.Namespace, worker: WarmNode | None = None) -> list[str]:
    argv = [flower_executable("flower-supernode"), "--superlink", args.server]
    argv += ["--node-config", node_config(args, worker)]
    argv += ["--port", str(args.port or free_port())]
    if args.insecure:
        argv.append("--insecure")
    if args.root_certificates:
        argv += ["--root-certificates", args.root_certificates]
    if args.auth_supernode_private_key:
        argv += ["--auth-supernode-private-key", args.auth_supernode_private_key]
    if args.max_retries is not None:
        argv += ["--max-retries", str(args.max_retries)]
    if args.max_wait_time is not None:
        argv += ["--max-wait-time", str(args.max_wait_time)]
    return argv


class Backoff:
    """The wait before a process that ended is started again: 1 s, doubling up to 30 s; back to 1 s after a run
    of a minute (``STABLE_S``).

    >>> b = Backoff()
    >>> b.next(ran_s=5.0), b.next(ran_s=5.0), b.next(ran_s=60.0)
    (1.0, 2.0, 1.0)
    """

    FIRST_S, MAX_S, STABLE_S = 1.0, 30.0, 60.0

    def __init__(self) -> None:
        self.wait = self.FIRST_S

    def next(self, ran_s: float) -> float:
        """Seconds to wait after a run of ``ran_s`` seconds."""
        if ran_s >= self.STABLE_S:
            self.wait = self.FIRST_S
        wait, self.wait = self.wait, min(2 * self.wait, self.MAX_S)
        return wait


class Kept:
    """One helper process of the node, (re)started by ``check()`` after a ``Backoff`` when it died, stopped with
    the SuperNode."""

    def __init__(self, name: str, argv: list[str], log: Path | None, env: dict[str, str]) -> None:
        self.name, self.argv, self.log, self.env = name, argv, log, env
        self.proc: ManagedProcess | None = None
        self.started, self.backoff, self.next_start, self.starts = 0.0, Backoff(), 0.0, 0

    def check(self) -> None:
        """Start the process if none runs and its back-off has passed."""
        now = time.monotonic()
        if self.proc is not None and self.proc.poll() is not None:
            code = self.proc.poll()
            self.proc.stop()
            self.proc = None
            self.next_start = now + self.backoff.next(ran_s=now - self.started)
            print(f"{self.name} exited with code {code}; restarting in {self.next_start - now:.0f} s", flush=True)
        if self.proc is None and now >= self.next_start:
            with STOPS.starting():
                self.proc = ManagedProcess(self.name, self.argv, self.log, self.env)
            self.started, self.starts = now, self.starts + 1
            print(f"{self.name} pid {self.proc.pid}", flush=True)

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.stop()
            self.proc = None


class WarmNode:
    """A warm node's helpers, in a private folder (0700): the worker (``clients.worker``: its socket and key
    file, the default state dir) and, unless ``prestart=False``, the fork server for Flower's ``flwr-clientapp``
    (``clients.prestart``: its socket, and the shim the SuperNode finds first on its ``PATH``, ``supernode_env``).

    >>> node = WarmNode(gpu=False, log=None, env=env)  # doctest: +SKIP
    >>> node.check()  # in the launcher's loop: (re)starts whichever helper is not running  # doctest: +SKIP
    """

    def __init__(
        self, gpu: bool, log: Path | None, env: dict[str, str], prestart: bool = True, app: str = ""
    ) -> None:
        self.folder = private_dir(Path(tempfile.mkdtemp(prefix="fedcomp-node-")))
        self.socket, self.key_file = self.folder / "worker.sock", self.folder / "worker.key"
        self.default_state_dir = self.folder / "state"
        write_key(self.key_file)
        argv = [sys.executable, "-m", "clients.worker", "--socket", str(self.socket), "--key-file", str(self.key_file)]
        self.worker = Kept("worker", argv + (["--gpu"] if gpu else []), log, env)
        self.helpers = [self.worker]
        self.shim_dir: Path | None = None
        self.prestart: Kept | None = None
        if prestart:
            sock = self.folder / "clientapp.sock"
            self.shim_dir = self.folder / "bin"
            write_shim(self.shim_dir, sock, flower_executable("flwr-clientapp"))
            argv = [sys.executable, "-m", "clients.prestart", "--socket", str(sock)]
            self.prestart = Kept("prestart", argv + (["--warm-app", app] if app else []), log,
                                 self.supernode_env(env))
            self.helpers.append(self.prestart)

    def supernode_env(self, env: dict[str, str]) -> dict[str, str]:
        """``env`` with the shim's folder first on ``PATH`` (unchanged without the fork server)."""
        if self.shim_dir is None:
            return env
        return {**env, "PATH": os.pathsep.join([str(self.shim_dir), env.get("PATH", "")])}

    def check(self) -> None:
        for helper in self.helpers:
            helper.check()

    def stop(self) -> None:
        """Stop the helpers and remove the folder (sockets, key, shim, default state dir)."""
        for helper in self.helpers:
            helper.stop()
        shutil.rmtree(self.folder, ignore_errors=True)


class Rejoins:
    """When the SuperNode stopped by itself with exit 0, start it again: it registers a new node id.

    Flower's SuperNode stops itself, exit 0, when the SuperLink answers it 401: a SuperLink restarted without
    ``--database`` knows no node ids from before. The client's state dir and warm worker stay, so its pending
    updates reach the new server run (or the resumed one) under the new id. The wait: a ``Backoff``; with
    ``--max-retries N``, N starts in a row that ran less than a minute are the last. Any other exit code ends the
    launcher with it.

    >>> r = Rejoins(max_retries=1)
    >>> r.after(0, ran_s=5.0), r.after(0, ran_s=5.0), r.after(3, ran_s=5.0)
    (1.0, None, None)
    """

    def __init__(self, max_retries: int | None) -> None:
        self.max_retries, self.backoff, self.in_a_row = max_retries, Backoff(), 0

    def after(self, code: int, ran_s: float) -> float | None:
        """Seconds to wait before the next start, ``None`` to end (an exit code other than 0, or too many)."""
        if code != 0:
            return None
        if ran_s >= Backoff.STABLE_S:
            self.in_a_row = 0
        if self.max_retries is not None and self.in_a_row >= self.max_retries:
            return None
        wait, self.in_a_row = self.backoff.next(ran_s), self.in_a_row + 1
        print(f"flower-client: the SuperNode stopped by itself (exit 0; Flower's SuperNode does when the SuperLink "
              f"no longer knows its node, as after a restart without --database); starting it again in {wait:.0f} s "
              "to register anew", file=sys.stderr, flush=True)
        return wait

    def gave_up(self) -> int:
        print(f"flower-client: error: the SuperNode stopped by itself, {self.in_a_row + 1} in a row within a minute "
              f"each (--max-retries {self.max_retries}); the SuperLink refuses this node", file=sys.stderr, flush=True)
        return 1


def supernode_ended(code: int, log: Path | None) -> int:
    """The launcher's exit status for a SuperNode that ended on its own with ``code`` != 0 (``Popen``'s: negative
    when a signal killed it, as the shell's 128 + signal then), said in one line.

    >>> supernode_ended(-9, None), supernode_ended(3, None)  # says so on stderr too
    (137, 3)
    """
    if code < 0:
        try:
            how = f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            how = f"was killed by signal {-code}"
        code = 128 - code
    else:
        how = f"exited with {code}"
    where = f" (its log: {log})" if log else ""
    print(f"flower-client: error: the SuperNode {how}{where}; exit {code}", file=sys.stderr, flush=True)
    return code


def _serve(warm: WarmNode | None, node: ManagedProcess | None = None, until: float = math.inf) -> None:
    """While ``node`` runs (if given) and until the monotonic time ``until``: remember the SuperNode's children and
    keep the warm node's helpers running."""
    while (node is None or node.poll() is None) and time.monotonic() < until:
        if node is not None:
            node.remember_children()
        if warm is not None:
            warm.check()
        time.sleep(0.5)


class _Stop(Exception):
    def __init__(self, signum: int) -> None:
        self.signum = signum


STOPS = StopSignals(_Stop)  # SIGINT/SIGTERM as _Stop, held back while a helper or the SuperNode starts


def main(argv: list[str] | None = None) -> int:
    p = parser()
    args = p.parse_args(argv)
    _check(args, p)

    env = flower_env(Path(args.flwr_home).resolve() if args.flwr_home else None)
    env["FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION"] = "1"
    log = Path(args.log).resolve() if args.log else None
    STOPS.install()
    node = claim = None
    warm = WarmNode(args.gpu, log, env, args.prestart, args.app) if args.worker == "warm" else None
    try:
        state_dir = args.state_dir or (warm.default_state_dir if warm else "")
        if state_dir:  # one node per state dir, for this launcher's life (0700, its files 0600)
            try:
                claim = StateDir(state_dir).claim()
            except (FileNotFoundError, NotADirectoryError) as exc:  # a parent that is missing or a file
                print(f"flower-client: error: --state-dir {state_dir}: cannot create the folder ({exc.strerror})",
                      file=sys.stderr, flush=True)
                return 2
        node_env = warm.supernode_env(env) if warm is not None else env
        rejoins = Rejoins(args.max_retries)
        while True:
            with STOPS.starting():
                node = ManagedProcess("flower-supernode", supernode_argv(args, warm), log, node_env)
            print(f"SuperNode pid {node.pid} -> {args.server} ({node_config(args, warm)})", flush=True)
            started = time.monotonic()
            _serve(warm, node)
            code = int(node.poll() or 0)
            wait = rejoins.after(code, time.monotonic() - started)
            if wait is None:
                return supernode_ended(code, log) if code else rejoins.gave_up()
            node.stop()
            node = None
            _serve(warm, until=time.monotonic() + wait)
    except _Stop as stop:
        print(f"\n{signal.Signals(stop.signum).name}: stopping the SuperNode", file=sys.stderr, flush=True)
        return 128 + stop.signum
    except (StateDirInUse, PermissionError) as exc:
        print(f"flower-client: {exc}", file=sys.stderr, flush=True)
        return 2
    finally:
        STOPS.uninstall()
        if node is not None:
            node.stop()
        if warm is not None:
            warm.stop()
        if claim is not None:
            claim.release()


if __name__ == "__main__":
    sys.exit(main())

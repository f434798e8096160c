"""``flower-server``: start Flower's own SuperLink, submit the fedcomp run, show progress, write results.

    flower-server --insecure --port 9092 --mode async --versions 30 --out results/deploy

Clients connect with ``flower-client --server HOST:9092``. The SuperLink runs with runtime dependency
installation disabled; TLS (``--ssl-certfile/--ssl-keyfile/--ssl-ca-certfile``) and SuperNode authentication
(``--enable-supernode-auth``; ``--auth-supernode-key PUB`` registers a SuperNode's public key with
``flwr supernode register``) are passed through; ``--database`` keeps the SuperLink's state (node ids) in a file so
a restarted server (``--resume``) finds its nodes again. The ``flwr`` CLI talks to it through a private FLWR_HOME
(``--flwr-home``, default ``OUT/flwr-home``). Ctrl-C / SIGTERM stop the run and the SuperLink (by PID, with
its children) and exit 130 / 143. Exit code 0 when the run produced all its versions; 1 when it stopped short
(run timeout, no clients, every task failing) or failed, with one line on stderr saying why; 2 on bad flags.

The SuperLink's own ``flower-superexec`` (it launches the ServerApp) polls for tasks every
``FLWR_SUPEREXEC_TASK_POLL_INTERVAL`` seconds; Flower's default is 1.0, this launcher sets
``fedcomp.tools.processes.SUPEREXEC_POLL_INTERVAL`` unless the variable is already set in its environment.
"""

from __future__ import annotations

import argparse
import json
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib  # type: ignore[no-redef]

from fedcomp.registry import ConfigError
from fedcomp.server.loops import mend_tail
from fedcomp.task.config import RunConfig
from fedcomp.task.models import MODELS
from fedcomp.task.plugins import TRUSTED
from fedcomp.task.serverside import build_server
from fedcomp.tools.launchcli import OneLineParser
from fedcomp.tools.processes import (
    SUPEREXEC_POLL_ENV,
    SUPEREXEC_POLL_INTERVAL,
    FlwrCliError,
    ManagedProcess,
    StopSignals,
    flower_env,
    listen_problem,
    register_supernode,
    run_info,
    stop_run,
    submit_run,
    superlink_argv,
    wait_http_ready,
    write_flower_config,
    write_overrides,
)
from fedcomp.tools.report import output_dir

CONNECTION = "fedcomp"

#: launcher flag -> run-config key (every other key goes through --run-config KEY=VALUE)
SHORTCUTS = {
    "mode": "mode",
    "versions": "num-versions",
    "compressor": "compressor",
    "compressor_options": "compressor-options",
    "max_staleness": "max-staleness",
    "buffer_size": "buffer-size",
    "concurrency": "concurrency",
    "prefetch": "prefetch",
    "min_clients": "min-clients",
    "server_lr": "server-lr",
    "local_steps": "local-steps",
    "local_lr": "local-lr",
    "model": "model",
    "task_timeout": "task-timeout",
    "run_timeout": "run-timeout",
    "checkpoint_every": "checkpoint-every",
    "resume": "resume",
}


def default_app_dir() -> Path:
    return Path(__file__).resolve().parents[1]


def parser() -> argparse.ArgumentParser:
    p = OneLineParser(
        prog="flower-server",
        description="Start Flower's SuperLink and run fedcomp (compressed federated training) on it.",
        epilog="Clients: flower-client --server HOST:PORT [--gpu] [--partition-id I --num-partitions N]. "
        "Run-config keys: docs/protocol.md. "
        f"The SuperLink's SuperExec polls for tasks every {SUPEREXEC_POLL_ENV} seconds: {SUPEREXEC_POLL_INTERVAL:g} "
        "unless set in the environment (Flower's default: 1.0).",
    )
    _superlink_args(p.add_argument_group("SuperLink"))
    run = p.add_argument_group("run", "each flag defaults to the app's run config (pyproject.toml), shown here "
                                      "for this project's app")
    _run_args(run)
    _show_app_defaults(run, default_app_dir())
    out = p.add_argument_group("output")
    out.add_argument("--out", default="results/flower-server",
                     help="results folder (metrics.jsonl, summary.json; default: %(default)s)")
    out.add_argument("--flwr-home", help="FLWR_HOME for the SuperLink and CLI (default OUT/flwr-home)")
    out.add_argument("--app", type=Path, default=None, help="Flower app folder (default: this project)")
    out.add_argument("--quiet", action="store_true", help="no per-version progress lines")
    return p


def _superlink_args(net: Any) -> None:
    """The SuperLink's address, TLS and SuperNode authentication, passed to ``flower-superlink``."""
    net.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1; 0.0.0.0 for all)")
    net.add_argument("--port", type=int, default=9092, help="SuperLink HTTP port for SuperNodes and the CLI (9092)")
    net.add_argument("--insecure", action="store_true", help="plain HTTP, no TLS (loopback / trusted networks only)")
    net.add_argument("--ssl-certfile", help="server TLS certificate (PEM)")
    net.add_argument("--ssl-keyfile", help="server TLS private key (PEM)")
    net.add_argument("--ssl-ca-certfile", help="CA certificate (PEM) that signed the server certificate")
    net.add_argument("--enable-supernode-auth", action="store_true", help="accept only authenticated SuperNodes")
    net.add_argument(
        "--database",
        help="SuperLink state file (SQLite); keeps node ids across a SuperLink restart (default: in memory)",
    )
    net.add_argument(
        "--auth-supernode-key",
        action="append",
        default=[],
        metavar="PUBKEY",
        help="OpenSSH EC public key of a SuperNode to register (flwr supernode register); repeatable, "
        "implies --enable-supernode-auth",
    )
    net.add_argument(
        "--superlink-arg",
        action="append",
        default=[],
        metavar="ARG",
        help="extra argument passed to flower-superlink verbatim (repeatable)",
    )


def _run_args(run: Any) -> None:
    """The run-config keys with flags of their own (any other through ``--run-config``)."""
    run.add_argument("--mode", choices=["async", "sync"], help="async (FedBuff) or sync rounds")
    run.add_argument("--versions", type=int, help="model versions to produce (num-versions)")
    run.add_argument("--compressor", help="compressor name, e.g. dgc, dgc+int8, qsgd")
    run.add_argument("--compressor-options", help='e.g. "density=0.01"')
    run.add_argument("--max-staleness", type=int, help="async: apply iff V - v <= this")
    run.add_argument("--buffer-size", type=int, help="async: K updates per server step")
    run.add_argument("--concurrency", type=int, help="async: clients kept busy (0 = all)")
    run.add_argument("--prefetch", type=int, help="async: tasks queued per node behind the one it runs (0 = none)")
    run.add_argument("--min-clients", type=int, help="wait for this many clients before starting")
    run.add_argument("--server-lr", type=float, help="server optimizer learning rate")
    run.add_argument("--local-steps", type=int, help="local steps per task")
    run.add_argument("--local-lr", type=float, help="client learning rate")
    run.add_argument("--model", help=f"model name ({', '.join(MODELS.names())}) or module:attr")
    run.add_argument("--task-timeout", type=float, help="seconds before an unanswered task is nacked")
    run.add_argument("--run-timeout", type=float, help="give up after this many seconds (0 = never)")
    run.add_argument("--checkpoint-every", type=int, help="checkpoint every N versions (0 = never)")
    run.add_argument("--resume", help="checkpoint.pt to resume from")
    run.add_argument(
        "--run-config",
        "-c",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="any run-config key (repeatable), e.g. -c staleness=hinge",
    )


def _show_app_defaults(group: Any, app_dir: Path) -> None:
    """Append ``(default: V)`` to the help of each run flag, V from ``app_dir``'s run config (none if unreadable)."""
    try:
        defaults = app_defaults(app_dir)
    except (OSError, KeyError, tomllib.TOMLDecodeError):
        return
    for action in group._group_actions:
        key = SHORTCUTS.get(action.dest)
        if key in defaults and action.help:
            shown = str(defaults[key]).replace("%", "%%") or "''"
            action.help += f" (default: {shown})"


def app_defaults(app_dir: Path) -> dict[str, Any]:
    with open(app_dir / "pyproject.toml", "rb") as f:
        return dict(tomllib.load(f)["tool"]["flwr"]["app"]["config"])


def overrides_from(args: argparse.Namespace, p: argparse.ArgumentParser, defaults: dict[str, Any]) -> dict[str, Any]:
    """Run-config overrides from the flags, validated against ``RunConfig`` (one-line error otherwise)."""
    values: dict[str, Any] = {}
    for item in args.run_config:
        key, eq, raw = item.partition("=")
        if not eq:
            p.error(f"--run-config expects KEY=VALUE, got {item!r}")
        if key not in defaults:
            p.error(f"unknown run-config key {key!r}")
        try:
            values[key] = tomllib.loads(f"v = {raw}")["v"]
        except tomllib.TOMLDecodeError:
            values[key] = raw
    for attr, key in SHORTCUTS.items():
        value = getattr(args, attr)
        if value is not None:
            values[key] = value
    if values.get("resume"):
        values["resume"] = str(Path(values["resume"]).resolve())
    values["out-dir"] = str(Path(args.out).resolve())
    try:
        # names, ranges, plug-ins (the server trusts its own run config), the --resume file, and the options of
        # the strategy the ServerApp will build
        run = RunConfig.from_flower({**defaults, **values}, plugins=TRUSTED)
        build_server(run)
        from server_app.app import public_strategy  # flwr's ServerApp only when a run is checked

        public_strategy(run, Path(values["out-dir"]))
    except ConfigError as exc:
        p.error(str(exc).removeprefix("run config: "))
    except Exception as exc:  # noqa: BLE001 - a plug-in model or dataset may raise anything
        p.error(f"cannot build the server's model and data: {type(exc).__name__}: {str(exc).strip()[:200]}")
    return values


def check_args(args: argparse.Namespace, p: argparse.ArgumentParser) -> None:
    """Ports, files and folders named on the command line, checked before any process starts."""
    if not 1 <= args.port <= 65535:
        p.error(f"--port must be in 1..65535, got {args.port}")
    tls_args(args, p)  # the TLS flags' combination, before any folder is made
    for flag in ("ssl_certfile", "ssl_keyfile", "ssl_ca_certfile"):
        path = getattr(args, flag)
        if path and not Path(path).is_file():
            p.error(f"--{flag.replace('_', '-')} {path}: no such file")
    for key in args.auth_supernode_key:
        if not Path(key).is_file():
            p.error(f"--auth-supernode-key {key}: no such file")
    if args.database:
        db = Path(args.database).resolve()
        if db.is_dir() or any(d.exists() and not d.is_dir() for d in db.parents):
            p.error(f"--database {args.database}: must be a file path (its folder is made if missing)")
    for flag in ("out", "flwr_home"):
        path = getattr(args, flag)
        if path and Path(path).exists() and not Path(path).is_dir():
            p.error(f"--{flag.replace('_', '-')} {path} is a file, not a folder")
    problem = listen_problem(args.host, args.port)
    if problem == "in use":
        p.error(f"port {args.port} on {args.host} is in use (another flower-server or SuperLink?); pick --port")
    if problem:
        p.error(f"--host {args.host}: cannot listen there on port {args.port} ({problem})")


def tls_args(args: argparse.Namespace, p: argparse.ArgumentParser) -> list[str]:
    if args.insecure:
        if args.ssl_certfile or args.ssl_keyfile:
            p.error("--insecure cannot be combined with --ssl-certfile/--ssl-keyfile")
        return ["--insecure"]
    if not (args.ssl_certfile and args.ssl_keyfile):
        p.error("give --ssl-certfile and --ssl-keyfile (and --ssl-ca-certfile), or --insecure")
    extra = ["--ssl-certfile", args.ssl_certfile, "--ssl-keyfile", args.ssl_keyfile]
    if args.ssl_ca_certfile:
        extra += ["--ssl-ca-certfile", args.ssl_ca_certfile]
    return extra


class Stop(Exception):
    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


STOPS = StopSignals(Stop)  # SIGINT/SIGTERM as Stop, held back while the SuperLink starts


def follow(metrics: Path, pos: int, quiet: bool) -> int:
    """Print new metrics rows; returns the new file position."""
    if not metrics.exists():
        return pos
    with open(metrics, encoding="utf-8") as f:
        f.seek(pos)
        for line in f:
            if not line.endswith("\n"):
                break
            pos += len(line.encode())
            if not quiet:
                r = json.loads(line)
                acc = f"{r['accuracy']:.3f}" if "accuracy" in r else "  -  "
                print(
                    f"version {r['version']:4d}  t={r['time']:7.1f}s  acc {acc}  accepted {r['accepted']} "
                    f"stale {r['stale']} rejected {r['rejected']} dup {r['duplicate']} late {r['late']} "
                    f"timeout {r['timeout']} lost {r['lost']}  up {r['payload_bytes_up']} B "
                    f"(flower {r['flower_bytes_up']} B)",
                    flush=True,
                )
    return pos


#: ``flwr ls`` status checks: one every STATUS_EVERY seconds; each failed or timed-out check doubles the gap (at
#: most STATUS_MAX); after STATUS_GIVE_UP failures in a row the launcher stops waiting. Metrics rows are printed
#: every second regardless.
STATUS_EVERY, STATUS_MAX, STATUS_TIMEOUT, STATUS_GIVE_UP = 5, 60, 30.0, 30


#: ``server.log`` lines that say how the run ended (the ServerApp's error, ``Compressed``'s warning).
RUN_END = ("RunStoppedShort:", "async run stopped at version")


def follow_log(path: Path, pos: int) -> int:
    """Print the ServerApp's new WARNING and ERROR lines from ``server.log`` (on stderr); returns the new position."""
    if not path.exists():
        return pos
    with open(path, "rb") as f:
        f.seek(pos)
        for raw in f:
            if not raw.endswith(b"\n"):
                break
            pos += len(raw)
            line = raw.decode(errors="replace").rstrip()
            parts = line.split(" ", 3)  # date time LEVEL message
            if parts[-1].removeprefix("[fedcomp] ").startswith(RUN_END):
                continue  # how the run ended: the launcher says it once, in its own last line
            if len(parts) == 4 and parts[2] in ("WARNING", "ERROR", "CRITICAL"):
                print(f"server {parts[2].lower()}: {parts[3].removeprefix('[fedcomp] ')}", file=sys.stderr, flush=True)
    return pos


def watch(
    run_id: int,
    env: dict[str, str],
    link: ManagedProcess,
    metrics: Path,
    quiet: bool,
    sleep: Any = time.sleep,
    start: int = 0,
    log_start: int = 0,
) -> tuple[str, str]:
    """Print metrics rows as they come and check the run's status until it finishes or the SuperLink exits;
    returns ``(status, details)``. Rows before byte ``start`` (those of the run being resumed) are not progress
    and are not printed; the ServerApp's warnings and errors (``server.log`` from byte ``log_start``) are printed
    on stderr as they come. A status check that times out or fails (a loaded machine, a stalled
    SuperLink) is retried with back-off, never fatal."""
    pos = start
    server_log, log_pos = metrics.parent / "server.log", log_start
    gap, wait, failures = STATUS_EVERY, 0, 0
    while True:
        pos = follow(metrics, pos, quiet)
        log_pos = follow_log(server_log, log_pos)
        if link.poll() is not None:
            follow(metrics, pos, quiet)
            follow_log(server_log, log_pos)
            return f"SuperLink exited with code {link.poll()}", ""
        if wait <= 0:
            try:
                info = run_info(CONNECTION, run_id, env, timeout=STATUS_TIMEOUT)
            except (subprocess.TimeoutExpired, FlwrCliError) as exc:
                failures += 1
                why = "timed out" if isinstance(exc, subprocess.TimeoutExpired) else "failed"
                if failures >= STATUS_GIVE_UP:
                    return f"status unknown: {failures} status checks (flwr ls) {why} in a row", ""
                gap = min(2 * gap, STATUS_MAX)
                print(f"flower-server: status check (flwr ls) {why}; next in {gap}s", file=sys.stderr, flush=True)
            else:
                failures, gap = 0, STATUS_EVERY
                if info["status"].startswith("finished"):
                    follow(metrics, pos, quiet)
                    follow_log(server_log, log_pos)
                    return info["status"], info["details"]
            wait = gap
        sleep(1.0)
        wait -= 1


def read_summary(path: Path) -> dict[str, Any] | None:
    try:
        return dict(json.loads(path.read_text()))
    except (OSError, ValueError):
        return None


def verdict(status: str, details: str, summary: dict[str, Any] | None) -> tuple[int, str]:
    """Exit code and, when the run did not produce all its versions, the one line that says why."""
    if summary is not None and summary.get("versions", 0) < summary.get("target_versions", 0):
        reason = summary.get("stopped_reason") or details or status
        return 1, f"stopped at version {summary['versions']} of {summary['target_versions']}: {reason}"
    if status == "finished:completed" and summary is not None:
        return 0, ""
    if status == "error":  # the launcher's own error, already printed
        return 1, ""
    if status == "finished:completed":
        return 1, "the run finished without writing summary.json"
    if details:
        return 1, f"run {status}: {details.strip().splitlines()[0]}"
    return 1, f"run {status}"


def bytes_line(summary: dict[str, Any]) -> str:
    """One status line with the three byte figures, each named (empty without wire figures): per reply up, per
    task down (``fedcomp.tools.summary`` names).

    Example:
        >>> line = bytes_line({"payload_bytes_up_per_reply": 1580, "flower_bytes_up_per_reply": 2857.0,
        ...                    "wire_bytes_up_per_reply": 9000.4, "wire_bytes_down_per_task": 50000,
        ...                    "wire_bytes_up": 90004, "wire_bytes_down": 500000})
        >>> line.split("; ")[2]
        'wire 9,000 up per reply, 50,000 down per task (wire total: 90,004 up, 500,000 down)'
    """
    keys = ("payload_bytes_up_per_reply", "flower_bytes_up_per_reply", "wire_bytes_up_per_reply",
            "wire_bytes_down_per_task", "wire_bytes_up", "wire_bytes_down")
    if any(summary.get(k) is None for k in keys):
        return ""
    return (
        f"bytes: payload {summary['payload_bytes_up_per_reply']:,.0f} up per reply; "
        f"Flower objects {summary['flower_bytes_up_per_reply']:,.0f} up per reply; "
        f"wire {summary['wire_bytes_up_per_reply']:,.0f} up per reply, {summary['wire_bytes_down_per_task']:,.0f} "
        f"down per task (wire total: {summary['wire_bytes_up']:,} up, {summary['wire_bytes_down']:,} down)"
    )


def main(argv: list[str] | None = None) -> int:
    p = parser()
    args = p.parse_args(argv)
    app_dir = (args.app or default_app_dir()).resolve()
    if not (app_dir / "pyproject.toml").exists():
        p.error(f"no pyproject.toml in app folder {app_dir}")
    defaults = app_defaults(app_dir)
    check_args(args, p)
    values = overrides_from(args, p, defaults)
    try:
        out = output_dir(Path(args.out).resolve())
    except ValueError as exc:
        p.error(str(exc))
    extra = _superlink_extra(args, p)  # after every check: it creates the database's folder
    home = Path(args.flwr_home).resolve() if args.flwr_home else out / "flwr-home"
    env = flower_env(home)
    address = f"{'127.0.0.1' if args.host in ('0.0.0.0', '::') else args.host}:{args.port}"
    try:
        write_flower_config(home, CONNECTION, address, insecure=args.insecure, root_certificates=args.ssl_ca_certfile)
    except OSError as exc:  # a --flwr-home under a file, or not writable
        p.error(f"--flwr-home {home}: cannot write Flower's config there ({exc.strerror or exc})")
    metrics = out / "metrics.jsonl"
    start, log_start = _fresh_outputs(out, resumed=bool(values.get("resume")))
    STOPS.install()
    link: ManagedProcess | None = None
    run_id: int | None = None
    status, details = "not started", ""
    try:
        with STOPS.starting():
            link = ManagedProcess("flower-superlink",
                                  superlink_argv(args.port, host=args.host, extra=[*extra, *args.superlink_arg]),
                                  out / "superlink.log", env)
        wait_http_ready(address, 300, link, tls=not args.insecure)  # returns at once if the SuperLink exits
        print(f"SuperLink listening on {args.host}:{args.port} (pid {link.pid}); log: {link.log_path}", flush=True)
        for key in args.auth_supernode_key:
            register_supernode(Path(key), CONNECTION, env)
            print(f"registered SuperNode key {key}", flush=True)
        run_id = submit_run(app_dir, CONNECTION, env, write_overrides(out / "run-config.toml", values))
        print(f"submitted run {run_id}; waiting for clients (flower-client --server HOST:{args.port})", flush=True)
        status, details = watch(run_id, env, link, metrics, args.quiet, start=start, log_start=log_start)
    except Stop as stop:
        print(f"\n{stop}: stopping run and SuperLink", file=sys.stderr, flush=True)
        if run_id is not None:
            try:
                stop_run(CONNECTION, run_id, env)
            except (FlwrCliError, OSError):
                pass
        if link:
            link.stop()
        return 128 + stop.signum
    except (FlwrCliError, RuntimeError, TimeoutError, OSError) as exc:
        where = f" (SuperLink log: {link.log_path})" if link else ""
        print(f"flower-server: error: {str(exc).strip().splitlines()[0]}{where}", file=sys.stderr)
        status = "error"
    finally:
        STOPS.uninstall()
        if link and link.poll() is None:
            link.stop()
    return _report(out, run_id, status, details)


def _superlink_extra(args: argparse.Namespace, p: argparse.ArgumentParser) -> list[str]:
    """``flower-superlink`` arguments for TLS (checked), SuperNode authentication and a state database."""
    extra = tls_args(args, p)
    if args.enable_supernode_auth or args.auth_supernode_key:
        extra.append("--enable-supernode-auth")
    if args.database:
        Path(args.database).resolve().parent.mkdir(parents=True, exist_ok=True)
        extra += ["--database", str(Path(args.database).resolve())]
    return extra


def _fresh_outputs(out: Path, resumed: bool) -> tuple[int, int]:
    """Clear what an earlier run left in ``out`` that could pass for this one's (its summary; its metrics unless
    this run resumes, when the earlier rows are history); the byte offsets where this run's metrics and server
    log start."""
    metrics, server_log = out / "metrics.jsonl", out / "server.log"
    if metrics.exists() and not resumed:
        metrics.unlink()
    if resumed:
        mend_tail(metrics)  # a line a crash tore off: this run's rows start on a line of their own
    (out / "summary.json").unlink(missing_ok=True)
    start = metrics.stat().st_size if metrics.exists() else 0
    return start, server_log.stat().st_size if server_log.exists() else 0


def _report(out: Path, run_id: int | None, status: str, details: str) -> int:
    """Print the run's summary and status; the exit code (``verdict``)."""
    summary = read_summary(out / "summary.json")
    if summary is not None:
        print("summary: " + json.dumps({k: v for k, v in summary.items() if k != "totals"}), flush=True)
        if line := bytes_line(summary):
            print(line, flush=True)
    print(f"run {run_id}: {status}; results in {out}", flush=True)
    code, why = verdict(status, details, summary)
    if why:
        print(f"flower-server: error: {why}", file=sys.stderr, flush=True)
    return code


if __name__ == "__main__":
    sys.exit(main())

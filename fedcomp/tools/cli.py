"""The ``fedcomp`` command: ``fedcomp sim`` (the main job, from the simulations package), ``fedcomp dp``
(data-parallel comparison), ``fedcomp inspect`` (look inside a blob), ``fedcomp check`` (did a run lose anything).

Each subcommand is a ``Command`` (help, argument setup, run) in ``COMMANDS`` or, from another package, under the
``fedcomp.commands`` entry point group.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Command:
    help: str
    setup: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]


def _setup_dp(p: argparse.ArgumentParser) -> None:
    from fedcomp.tools.dataparallel import METHODS, DPConfig

    d = DPConfig()
    p.add_argument("--methods", default="dense,dgc",
                   help=f"comma-separated, from: {', '.join(METHODS)} (default: %(default)s)")
    p.add_argument("--dataset", default=d.dataset, help="default: %(default)s (ships with scikit-learn)")
    p.add_argument("--model", default=d.model, help="mlp | cnn | resnet20 (default: %(default)s)")
    p.add_argument("--workers", type=int, default=d.workers, help="data-parallel workers (default: %(default)s)")
    p.add_argument("--batch-size", type=int, default=d.batch_size, help="per worker (default: %(default)s)")
    p.add_argument("--epochs", type=int, default=d.epochs, help="default: %(default)s")
    p.add_argument("--lr", type=float, default=d.lr, help="SGD learning rate (default: %(default)s)")
    p.add_argument("--lr-schedule", default=d.lr_schedule, help="constant | cosine (default: %(default)s)")
    p.add_argument("--warmup-epochs", type=float, default=d.warmup_epochs,
                   help="DGC sparsity warm-up length (default: %(default)s)")
    p.add_argument("--seed", type=int, default=d.seed, help="default: %(default)s")
    p.add_argument("--threads", type=int, default=1,
                   help="torch CPU threads (small models run fastest on 1; default: %(default)s)")
    p.add_argument("--out", type=Path, default=Path("results/dp"), help="output folder (default: %(default)s)")
    p.add_argument("--no-plot", action="store_true", help="no accuracy.png")


def _run_dp(args: argparse.Namespace) -> int:
    import torch
    from tqdm import tqdm

    from fedcomp.tools.dataparallel import DPConfig, run
    from fedcomp.tools.report import output_dir, table, write_csv, write_json

    if args.threads < 1:
        raise ValueError(f"--threads must be >= 1, got {args.threads}")
    torch.set_num_threads(args.threads)
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    if not methods:
        raise ValueError("--methods names no method")
    if len(set(methods)) < len(methods):
        raise ValueError(f"--methods names a method twice: {args.methods}")
    configs = [  # every value is checked before the first run starts
        DPConfig(
            method=method,
            dataset=args.dataset,
            model=args.model,
            workers=args.workers,
            batch_size=args.batch_size,
            epochs=args.epochs,
            lr=args.lr,
            warmup_epochs=args.warmup_epochs,
            lr_schedule=args.lr_schedule,
            seed=args.seed,
        )
        for method in methods
    ]
    output_dir(args.out)  # once every value is checked, before the first run
    results = []
    for cfg in configs:
        bars: list[tqdm] = []  # made at the first epoch: a run that fails at start shows no bar

        def tick(row: dict[str, float], cfg: DPConfig = cfg, bars: list[tqdm] = bars) -> None:
            if not bars:
                bars.append(tqdm(total=cfg.epochs, desc=f"{cfg.method:>10}", unit="epoch", file=sys.stderr))
            bars[0].update(1)
            bars[0].set_postfix(acc=f"{row['accuracy']:.1f}", MB=f"{row['uplink_bytes'] / 1e6:.2f}")

        try:
            results.append(run(cfg, progress=tick))
        finally:
            for bar in bars:
                bar.close()
    rows = [r.summary() for r in results]
    base = rows[0]["accuracy"]
    for r in rows:
        r["delta_accuracy"] = r["accuracy"] - base
    print(table(rows, ["method", "accuracy", "delta_accuracy", "steps", "bytes_per_step", "compression",
                       "steady_compression", "wall_s"]))
    write_json(args.out / "summary.json", {"runs": rows, "history": {r.config["method"]: r.history for r in results}})
    write_csv(args.out / "summary.csv", rows)
    if not args.no_plot:
        from fedcomp.tools.plots import plot_dp

        plot_dp(results, args.out)
    print(f"results: {args.out}/summary.json, summary.csv" + ("" if args.no_plot else ", accuracy.png"))
    return 0


def _setup_inspect(p: argparse.ArgumentParser) -> None:
    p.add_argument("blob", type=Path, help="file with one encoded update")
    p.add_argument("--model", default="cnn", help="the model the update is for (default: %(default)s)")
    p.add_argument("--dataset", default="digits",
                   help="gives the input shape and classes of the model (default: %(default)s)")


def _run_inspect(args: argparse.Namespace) -> int:
    from fedcomp.spec import ModelSpec
    from fedcomp.task.data import load_dataset
    from fedcomp.task.models import build_model
    from fedcomp.tools.report import table
    from fedcomp.wire import WireError, decode

    train, _ = load_dataset(args.dataset)
    spec = ModelSpec.from_module(build_model(args.model, in_shape=tuple(train.x.shape[1:]),
                                             num_classes=train.num_classes))
    try:
        update = decode(args.blob.read_bytes(), spec)
    except WireError as exc:
        print(f"invalid update: {exc}", file=sys.stderr)
        return 1
    print(f"client {update.client_id}  seq {update.seq}  base version {update.base_version}  nnz {update.nnz:,}")
    rows = [{"tensor": n, "shape": "x".join(map(str, p.shape)), "nnz": p.nnz, "coding": p.values.coding.name,
             "indices": "dense" if p.is_dense else "sparse"} for n, p in update.tensors.items()]
    print(table(rows))
    return 0


def _setup_check(p: argparse.ArgumentParser) -> None:
    p.add_argument("out", type=Path, help="the run's output folder (flower-server --out, or fedcomp sim --out)")
    p.add_argument("--client-state", action="append", default=[], metavar="DIR",
                   help="a client's --state-dir (holds client-state.pt); repeat for every client you have")
    p.add_argument("--json", action="store_true", help="print the report as JSON instead of tables")
    p.epilog = ("Exit code: 0 every update is accounted for (applied, nacked back into the residual, or pending) "
                "and gradient mass is conserved; 1 something is lost or not conserved; 2 bad input.")


def _run_check(args: argparse.Namespace) -> int:
    import json

    from fedcomp.tools.check import CheckInputError, check

    try:
        report = check(args.out, args.client_state)
    except CheckInputError as exc:
        print(f"fedcomp check: error: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(report.to_dict(), indent=1) if args.json else report.text())
    return report.exit_code


COMMANDS: dict[str, Command] = {
    "dp": Command("in-process data-parallel training: dense SGD vs compressed methods (accuracy, bytes)",
                  _setup_dp, _run_dp),
    "inspect": Command("decode an update blob against a model and print what is inside", _setup_inspect, _run_inspect),
    "check": Command("account for every update of a finished or crashed run: applied, duplicate, nacked, pending; "
                     "with client states, whether gradient mass is conserved", _setup_check, _run_check),
}


def all_commands() -> dict[str, Command]:
    """Built-in commands plus those other installed packages register under the ``fedcomp.commands`` entry
    point group (``fedcomp sim`` comes from the ``simulations`` package this way; fedcomp never imports it)."""
    from importlib.metadata import entry_points

    found = dict(COMMANDS)
    for ep in entry_points(group="fedcomp.commands"):
        if ep.name in found:
            continue
        try:
            found[ep.name] = ep.load()
        except Exception as exc:  # noqa: BLE001 - a broken plug-in must not take the other commands down
            found[ep.name] = _unavailable(ep.name, exc)
    return found


def _unavailable(name: str, exc: BaseException) -> Command:
    """A command whose entry point failed to load: listed, and running it says why in one line (exit 2)."""
    why = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}".rstrip(": ")

    def run(args: argparse.Namespace) -> int:
        print(f"fedcomp {name}: unavailable: {why}", file=sys.stderr)
        return 2

    return Command(f"(unavailable: {why})", lambda p: None, run)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="fedcomp", description="Compressed federated training over slow links.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    commands = all_commands()
    parsers = {}
    for name, cmd in commands.items():
        parsers[name] = sub.add_parser(name, help=cmd.help, description=cmd.help)
        cmd.setup(parsers[name])
    args, unknown = parser.parse_known_args(argv)
    if unknown:  # the subcommand's usage, not the top-level one
        (parsers[args.command] if args.command else parser).error(f"unrecognized arguments: {' '.join(unknown)}")
    if args.command is None:
        parser.print_help()
        return 2
    return run_command(args.command, commands[args.command], args)


def run_command(name: str, command: Command, args: argparse.Namespace) -> int:
    """``command``'s exit code. A bad value (``ValueError``, which ``ConfigError`` is), a file or folder that
    cannot be read or written (``OSError``) or a missing optional package (``ImportError``) is one line on stderr
    and exit 2; Ctrl-C (or SIGTERM) is one line and exit 130 (143), not a traceback; a closed stdout (a pipe into
    ``head``) is exit 141, as a shell reports SIGPIPE, with the command's files written."""
    in_main_thread = threading.current_thread() is threading.main_thread()  # only it may set a signal handler
    previous = signal.signal(signal.SIGTERM, _interrupt) if in_main_thread else None
    try:
        return command.run(args)
    except BrokenPipeError:  # stdout closed early (``| head``): what was written stays; no more output
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 128 + signal.SIGPIPE
    except (ValueError, OSError, ImportError) as exc:
        print(f"fedcomp {name}: error: {str(exc) or type(exc).__name__}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as exc:
        signum = exc.args[0] if exc.args and isinstance(exc.args[0], int) else signal.SIGINT
        print(f"fedcomp {name}: interrupted ({signal.Signals(signum).name})", file=sys.stderr)
        return 128 + signum
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


def _interrupt(signum: int, frame: object) -> None:
    """SIGTERM as a ``KeyboardInterrupt`` carrying its number: the command's ``finally`` blocks (worker processes,
    progress bars) run as on Ctrl-C."""
    raise KeyboardInterrupt(signum)


if __name__ == "__main__":
    sys.exit(main())

"""``fedcomp sim``: load a scenario, run its methods, print the summary table, write the output folder."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from fedcomp.tools.cli import Command, run_command
from simulations import scenario as scenarios
from simulations.backends import run_scenario
from simulations.engines import SimulationError
from simulations.report import DETAIL_COLUMNS, split_table, summary_table, write_outputs


def run_sim(name: str | None, overrides: list[str], out: Path | None, plots: bool = True, quiet: bool = False) -> int:
    """Returns the process exit code (0 on success)."""
    overrides = list(overrides)
    if quiet:
        overrides.append("sim.progress=false")
    sc = scenarios.load(name, overrides)
    out = out or Path("results") / "sim" / sc.name
    print(f"scenario {sc.name}: {sc.num_clients} clients, methods {', '.join(m.name for m in sc.methods)}, "
          f"engine {sc.sim.engine}, target {100 * sc.target_accuracy:.1f}%", file=sys.stderr)
    t0 = time.perf_counter()
    try:
        results = run_scenario(sc, out)
    except SimulationError as exc:
        print(f"fedcomp sim: error: {exc}", file=sys.stderr)
        return 1
    wall = time.perf_counter() - t0
    print(summary_table(results))
    print("\nper update (bytes) and per delivered task (mean virtual seconds):")
    print(summary_table(results, DETAIL_COLUMNS))
    print("\nwhere a task's time goes, by link (mean virtual seconds per delivered task):")
    print(split_table(results))
    files = write_outputs(sc, results, out, wall, plots=plots)
    print(f"wall {wall:.1f} s; results in {out}/: {', '.join(f.name for f in files)}")
    return 0


def _setup_sim(p: argparse.ArgumentParser) -> None:
    p.add_argument("scenario", nargs="?", default=None,
                   help="a scenario name from simulations/scenarios (default: main, the main job) or a .toml path")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a scenario key (dotted: run.local_steps=5, method.fedavg.num_versions=50, "
                        "clients.0.count=3, methods=fedavg,dgc-async); repeatable")
    p.add_argument("--out", type=Path, default=None, help="output folder (default: results/sim/SCENARIO)")
    p.add_argument("--no-plot", action="store_true")
    p.add_argument("--quiet", action="store_true", help="no progress bars")


def _run_sim(args: argparse.Namespace) -> int:
    return run_sim(args.scenario, args.overrides, args.out, plots=not args.no_plot, quiet=args.quiet)


#: ``fedcomp sim``, registered through the ``fedcomp.commands`` entry point (pyproject.toml).
COMMAND = Command(
    "one-machine simulation of a scenario in virtual time (throttled, flaky links; several methods)",
    _setup_sim,
    _run_sim,
)


def main(argv: list[str] | None = None) -> int:
    """``python -m simulations.cli [scenario] [options]``: ``fedcomp sim`` from a checkout that is not installed
    (the ``fedcomp`` command finds ``sim`` through the installed package's entry point)."""
    parser = argparse.ArgumentParser(prog="python -m simulations.cli", description=COMMAND.help)
    COMMAND.setup(parser)
    return run_command("sim", COMMAND, parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())

"""``fedcomp sim``: load a scenario, run its methods, print the summary table, write the output folder; with
``--seeds 0,1,2``, once per seed (``OUT/seed-N/``), then every figure as mean (min–max) over the seeds."""

from __future__ import annotations

import argparse
import fcntl
import sys
import time
from pathlib import Path
from typing import IO

from fedcomp.registry import ConfigError
from fedcomp.task.config import SEED_END
from fedcomp.tools.cli import Command, run_command
from fedcomp.tools.report import output_dir
from simulations import scenario as scenarios
from simulations.backends import run_scenario
from simulations.engines import SimulationError
from simulations.report import (
    DETAIL_COLUMNS,
    clear_run_files,
    earlier_files,
    seeds_split_table,
    seeds_table,
    split_table,
    stop_notes,
    summary_table,
    write_outputs,
    write_seed_outputs,
)
from simulations.seeds import aggregate, split_by_link

#: The output folders this process writes to, each locked while it runs (``claim``).
_CLAIMED: dict[Path, IO[str]] = {}


def claim(out: Path) -> Path:
    """Lock ``out`` for this process (``ConfigError`` when another ``fedcomp sim`` writes there now: two runs' rows
    would mix in one file) and clear an earlier run's summary from it (``clear_run_files``). Returns ``out``."""
    key = out.resolve()
    if key not in _CLAIMED:
        lock = open(out / ".fedcomp-sim.lock", "a+", encoding="utf-8")  # noqa: SIM115 - held until the process ends
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            lock.close()
            raise ConfigError(f"{out}: another fedcomp sim writes there now; wait for it or pick another "
                              "--out") from None
        _CLAIMED[key] = lock
    clear_run_files(out)
    return out


def run_sim(name: str | None, overrides: list[str], out: Path | None, plots: bool = True, quiet: bool = False,
            seeds: list[int] | None = None) -> int:
    """Returns the process exit code (0 on success). ``seeds``: run once per seed (``run_seeds``)."""
    overrides = list(overrides)
    if quiet:
        overrides.append("sim.progress=false")
    if seeds:
        return run_seeds(name, overrides, out, seeds, plots)
    sc = scenarios.load(name, overrides)
    out = claim(output_dir(out or Path("results") / "sim" / sc.name))
    print(f"scenario {sc.name}: {sc.num_clients} clients, methods {', '.join(m.name for m in sc.methods)}, "
          f"engine {sc.sim.engine}, target {100 * sc.target_accuracy:.1f}%, seed {sc.seed} (one seed; "
          f"--seeds 0,1,2 for mean (min–max) over seeds)", file=sys.stderr)
    print(f"seed {sc.seed}")
    t0 = time.perf_counter()
    try:
        results = run_scenario(sc, out)
    except SimulationError as exc:
        print(f"fedcomp sim: error: {exc}", file=sys.stderr)
        return 1
    wall = time.perf_counter() - t0
    files = write_outputs(sc, results, out, wall, plots=plots)  # first: the files stay whatever becomes of stdout
    if stale := earlier_files(out, files):
        print(f"note: {out} also holds an earlier run's {', '.join(stale)}: not this run's", file=sys.stderr)
    print(summary_table(results))
    for note in stop_notes(results):
        print(note, file=sys.stderr)
    print("\nper update (bytes) and per delivered task (mean virtual seconds):")
    print(summary_table(results, DETAIL_COLUMNS))
    print("\nwhere a task's time goes, by link (mean virtual seconds per delivered task):")
    print(split_table(results))
    print(f"wall {wall:.1f} s; results in {out}/: {', '.join(f.name for f in files)}")
    return 0


def run_seeds(name: str | None, overrides: list[str], out: Path | None, seeds: list[int], plots: bool) -> int:
    """The scenario once per seed (outputs in ``OUT/seed-N/``, each seed's tables printed), then each figure as
    mean (min–max) over the seeds (``OUT/summary.json``, ``OUT/summary.csv``). Ratios are per seed, then
    averaged."""
    sc = scenarios.load(name, overrides)
    per_seed = {seed: scenarios.load(name, [*overrides, f"seed={seed}"]) for seed in seeds}  # all checked first
    out = claim(output_dir(out or Path("results") / "sim" / sc.name))
    print(f"scenario {sc.name}: {sc.num_clients} clients, methods {', '.join(m.name for m in sc.methods)}, "
          f"engine {sc.sim.engine}, target {100 * sc.target_accuracy:.1f}%, seeds {seeds}", file=sys.stderr)
    t0 = time.perf_counter()
    summaries, splits, tables = {}, {}, []
    for seed, sc_s in per_seed.items():
        folder, t_seed = claim(output_dir(out / f"seed-{seed}")), time.perf_counter()
        try:
            results = run_scenario(sc_s, folder)
        except SimulationError as exc:
            print(f"fedcomp sim: error (seed {seed}): {exc}", file=sys.stderr)
            return 1
        write_outputs(sc_s, results, folder, time.perf_counter() - t_seed, plots=plots)
        tables.append(f"seed {seed}:\n{summary_table(results)}\n")
        print(f"seed {seed}: done in {time.perf_counter() - t_seed:.1f} s", file=sys.stderr, flush=True)
        for note in stop_notes(results):
            print(f"seed {seed}: {note}", file=sys.stderr)
        summaries[seed], splits[seed] = [r.summary for r in results], {r.method: r.split for r in results}
    wall = time.perf_counter() - t0
    rows, split = aggregate(summaries), split_by_link(splits)
    files = write_seed_outputs(sc, rows, split, out, wall)  # first: the files stay whatever becomes of stdout
    stale = earlier_files(out, files) + sorted(f"{p.name}/" for p in out.glob("seed-*")
                                               if p.is_dir() and p.name not in {f"seed-{s}" for s in seeds})
    if stale:
        print(f"note: {out} also holds an earlier run's {', '.join(stale)}: not this run's", file=sys.stderr)
    print("\n".join(tables))
    print(f"over seeds {', '.join(map(str, seeds))}: mean (min–max); ratios per seed, then averaged")
    print(seeds_table(rows))
    print("\nwhere a task's time goes, by link (mean virtual seconds per delivered task, mean over the seeds):")
    print(seeds_split_table(split))
    print(f"wall {wall:.1f} s; results in {out}/: {', '.join(f.name for f in files)} and seed-N/")
    return 0


def seed_list(text: str) -> list[int]:
    """``"0,1,2"`` -> ``[0, 1, 2]`` (distinct integers)."""
    try:
        seeds = [int(s) for s in text.split(",") if s.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--seeds expects integers like 0,1,2, got {text!r}") from None
    if not seeds or len(set(seeds)) != len(seeds) or min(seeds) < 0 or max(seeds) >= SEED_END:
        raise argparse.ArgumentTypeError(f"--seeds expects distinct integers in [0, 2**32) like 0,1,2, got {text!r}")
    return seeds


def _setup_sim(p: argparse.ArgumentParser) -> None:
    p.add_argument("scenario", nargs="?", default=None,
                   help=f"a built-in scenario ({', '.join(scenarios.built_in_names())}; default: main, the main "
                        "job) or a .toml path")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a scenario key (dotted: run.local_steps=5, method.fedavg.num_versions=50, "
                        "clients.0.count=3, methods=fedavg,dgc-async); repeatable")
    p.add_argument("--out", type=Path, default=None, help="output folder (default: results/sim/SCENARIO)")
    p.add_argument("--no-plot", action="store_true", help="no plots (PNG)")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    p.add_argument("--seeds", type=seed_list, default=None, metavar="S,S,...",
                   help="run every method once per seed (results in OUT/seed-N/) and report each figure as "
                        "mean (min–max) over the seeds (default: the scenario's one seed)")


def _run_sim(args: argparse.Namespace) -> int:
    return run_sim(args.scenario, args.overrides, args.out, plots=not args.no_plot, quiet=args.quiet,
                   seeds=args.seeds)


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

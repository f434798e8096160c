"""``fedcomp sim``: load a scenario, run its methods, print the summary table, write the output folder."""

from __future__ import annotations

import sys
import time
from pathlib import Path

from simulations import scenario as scenarios
from simulations.engines import SimulationError
from simulations.report import summary_table, write_outputs
from simulations.runner import run_scenario


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
    files = write_outputs(sc, results, out, wall, plots=plots)
    print(f"wall {wall:.1f} s; results in {out}/: {', '.join(f.name for f in files)}")
    return 0

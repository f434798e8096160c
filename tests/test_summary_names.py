"""One summary builder, one set of names (``fedcomp.tools.summary``): a simulation's method row and a deployment's
``summary.json`` carry every ``FIGURES`` name and nothing undeclared; no other module builds the run figures; the
old second names of the same figures appear nowhere."""

from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest
import torch

from fedcomp.tools.summary import DEPLOYMENT_FIGURES, FIGURES, SIMULATION_FIGURES

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("fedcomp", "server_app", "clients", "simulations", "benchmarks", "examples")
#: Second names the same figures had before there was one builder (they must not come back).
OLD_NAMES = ("final_acc", "best_acc", "delta_acc", "down_payload_per_task", "down_vs_dense_fp32",
             "payload_bytes_per_task", "payload_bytes_per_update", "flower_bytes_per_update",
             "flower_objects_per_update", "flower_bytes_per_task", "wall_seconds", "compression_ratio",
             "downlink_totals", "target_accuracy_pct", "wire_bytes_down_per_reply")
#: Figures only a run summary holds: a dict literal naming several of them is a second builder.
RUN_ONLY = {"target_versions", "completed", "stopped_reason", "initial_accuracy", "mean_staleness",
            "num_parameters", "dense_fp32_bytes", "prefetched_mean_staleness", "uplink_vs_dense_fp32",
            "downlink_vs_dense_fp32", "messages_per_applied_update"}


def sources() -> list[Path]:
    return [p for pkg in PACKAGES for p in sorted((ROOT / pkg).rglob("*.py")) if ".venv" not in p.parts]


def test_every_name_is_declared_once():
    assert not set(FIGURES) & set(DEPLOYMENT_FIGURES), set(FIGURES) & set(DEPLOYMENT_FIGURES)
    assert not set(FIGURES) & set(SIMULATION_FIGURES), set(FIGURES) & set(SIMULATION_FIGURES)
    assert not set(DEPLOYMENT_FIGURES) & set(SIMULATION_FIGURES)
    assert not set(OLD_NAMES) & (set(FIGURES) | set(DEPLOYMENT_FIGURES) | set(SIMULATION_FIGURES))


def test_no_module_builds_the_run_figures_but_the_summary_module():
    builders = []
    for path in sources():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Dict):
                keys = {k.value for k in node.keys if isinstance(k, ast.Constant) and isinstance(k.value, str)}
                if len(keys & RUN_ONLY) >= 3:
                    builders.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    # the detector finds the one builder, and nothing else
    assert {b.split(":")[0] for b in builders} == {"fedcomp/tools/summary.py"}, builders


def test_the_old_second_names_are_gone():
    texts = [*sources(), *sorted((ROOT / "tests").glob("*.py")), *sorted((ROOT / "docs").glob("*.md")),
             ROOT / "README.md"]
    found = []
    for path in texts:
        if path == Path(__file__).resolve():
            continue
        text = path.read_text()
        found += [f"{path.relative_to(ROOT)}: {name}" for name in OLD_NAMES if f'"{name}"' in text
                  or f"'{name}'" in text or f"`{name}`" in text]
    assert not found, found


def check_keys(summary: dict, extra: dict[str, str], what: str) -> None:
    keys = set(summary)
    assert set(FIGURES) <= keys, (what, sorted(set(FIGURES) - keys))
    undeclared = {k for k in keys - set(FIGURES) - set(extra) if not k.startswith("speedup_vs_")}
    assert not undeclared, (what, sorted(undeclared))
    assert 0.0 <= summary["accuracy"] <= 1.0 and 0.0 <= summary["initial_accuracy"] <= 1.0, what
    assert summary["applied"] > 0 and summary["payload_bytes_up_per_reply"] > 0, what


@pytest.fixture(autouse=True)
def one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def test_a_simulation_and_a_deployment_summary_have_the_same_names(tmp_path):
    from flwr.app import Context, RecordDict

    from benchmarks.flowerkit import LocalGrid, server_identity
    from clients.app import app as client_app
    from server_app.app import main
    from simulations import scenario as scenarios
    from simulations.backends import run_scenario

    sc = scenarios.load("tiny", ["sim.progress=false", "method.fedavg.num_versions=2",
                                 "method.dgc-async.num_versions=3"])
    results = run_scenario(sc)
    for r in results:
        check_keys(r.summary, SIMULATION_FIGURES, f"simulation {r.method}")

    run_config = {"num-versions": 2, "mode": "async", "buffer-size": 1, "concurrency": 1, "node-wait": 60.0,
                  "poll-interval": 0.05, "out-dir": str(tmp_path / "out")}
    apps = {11: (client_app, {"partition-id": 0, "num-partitions": 1, "state-dir": str(tmp_path / "c0")})}
    with server_identity():
        main(LocalGrid(apps, run_config), Context(1, 0, {}, RecordDict(), dict(run_config)))
    deployed = json.loads((tmp_path / "out" / "summary.json").read_text())
    check_keys(deployed, DEPLOYMENT_FIGURES, "deployment")
    assert deployed["wire_bytes_up_per_reply"] > deployed["flower_bytes_up_per_reply"] > 0

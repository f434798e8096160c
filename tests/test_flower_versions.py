"""The two Flower releases the Flower path is tested on: 1.41.0 (constraints.txt, ``make test``) and 1.42.0
(``make test-flwr142``: constraints.txt with the lines of constraints-flwr142.txt in their place).

``FEDCOMP_CONSTRAINTS`` names the constraints file the running environment was built from (constraints.txt unless
set), so the second run fails here if its environment imports any other flwr than the one it claims to test.
"""

from __future__ import annotations

import os
import re
from importlib.metadata import version
from pathlib import Path

import tomllib
from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[1]
PIN = re.compile(r"^([A-Za-z0-9_.-]+)==(\S+)$")


def pins(path: Path) -> dict[str, str]:
    """``{name (lower case): version}`` of a constraints file's ``name==version`` lines."""
    found = {}
    for line in path.read_text().splitlines():
        m = PIN.match(line.strip())
        if m:
            found[m.group(1).lower()] = m.group(2)
    return found


def flwr_requirement() -> Requirement:
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    (req,) = [Requirement(d) for d in deps if Requirement(d).name == "flwr"]
    return req


def test_the_imported_flwr_is_the_pinned_one():
    import flwr

    path = Path(os.environ.get("FEDCOMP_CONSTRAINTS", ROOT / "constraints.txt"))
    pinned = pins(path)["flwr"]
    assert flwr.__version__ == version("flwr") == pinned, f"flwr {flwr.__version__} imported, {path} pins {pinned}"


def test_the_second_environment_changes_only_flwr_and_what_it_requires():
    """constraints-flwr142.txt replaces pins (it adds none) and moves flwr to 1.42.0; pyproject admits both."""
    base, other = pins(ROOT / "constraints.txt"), pins(ROOT / "constraints-flwr142.txt")
    assert other["flwr"] == "1.42.0" and base["flwr"] == "1.41.0"
    assert set(other) <= set(base), f"not in constraints.txt: {set(other) - set(base)}"
    assert sorted(other) == ["certifi", "flwr", "uv"]
    req = flwr_requirement()
    assert "simulation" in req.extras
    assert req.specifier.contains(base["flwr"]) and req.specifier.contains(other["flwr"]), req

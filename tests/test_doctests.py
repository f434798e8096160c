"""Every docstring example of the packages runs as written (``doctest``), so none drifts from the code it shows.

Two of them had: a record list and a name tuple that the code had since changed, unseen because only some modules'
examples ran in a test. The downlink's examples share a model their test builds (``tests/test_downlink.py``).
"""

from __future__ import annotations

import doctest
import importlib
import pkgutil

import pytest

PACKAGES = ("fedcomp", "simulations", "clients", "server_app")
ELSEWHERE = {"fedcomp.downlink", "fedcomp.downlink.model", "fedcomp.downlink.replica"}  # tests/test_downlink.py


def module_names() -> list[str]:
    names = []
    for package in PACKAGES:
        names.append(package)
        names += [m.name for m in pkgutil.walk_packages(importlib.import_module(package).__path__, package + ".")]
    return sorted(set(names) - ELSEWHERE)


@pytest.mark.parametrize("name", module_names())
def test_the_docstring_examples_run_as_written(name):
    result = doctest.testmod(importlib.import_module(name), optionflags=doctest.ELLIPSIS, report=False)
    assert result.failed == 0, f"{result.failed} of {result.attempted} examples in {name} fail (python -m doctest)"

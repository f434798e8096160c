"""The order in which ``sim.workers`` processes start the methods (``sim.order``, then the most local steps)."""

from __future__ import annotations

import pytest

from fedcomp.tools.cli import main
from simulations import scenario as scenarios
from simulations.backends import expected_work, start_order


def names(sc: scenarios.Scenario) -> list[str]:
    return [m.name for m in start_order(sc)]


def test_listed_methods_start_first_in_their_order():
    sc = scenarios.load("main", ['sim.order=["auto-async", "fedavg"]', "method.int8-async.num_versions=80"])
    order = names(sc)
    assert order[:2] == ["auto-async", "fedavg"]
    rest = [sc.method(n) for n in order[2:]]
    assert [expected_work(sc, m) for m in rest] == sorted((expected_work(sc, m) for m in rest), reverse=True)
    assert order[2] == "int8-async"  # 80 versions: the most local steps of the rest
    assert sorted(order) == sorted(m.name for m in sc.methods)


def test_without_an_order_the_most_local_steps_start_first():
    sc = scenarios.load("main", ["sim.order=[]", "method.dgc-async.num_versions=80"])
    order = names(sc)
    assert order[0] == "dgc-async" and order[-1] == "fedavg"  # 2,400 local steps asked ... 1,200
    tied = names(scenarios.load("main", ["sim.order=[]"]))  # the four 50-version async methods tie: scenario order
    assert tied[:4] == ["fedbuff-today", "fedbuff", "dgc-async", "int8-async"] and tied[-1] == "fedavg"


def test_listed_methods_that_do_not_run_are_skipped():
    sc = scenarios.load("main", ["methods=fedavg,fedbuff,int8-async"])
    assert names(sc) == ["int8-async", "fedbuff", "fedavg"]


@pytest.mark.parametrize("bad", ['["nosuch"]', '["fedavg", "fedavg"]', '"fedavg"', "[1]"])
def test_a_bad_order_is_a_config_error_before_any_work(bad, capsys, tmp_path):
    with pytest.raises(scenarios.ConfigError, match="sim.order"):
        scenarios.load("main", [f"sim.order={bad}"])
    code = main(["sim", "tiny", "--quiet", "--out", str(tmp_path / "o"), "--set", f"sim.order={bad}"])
    assert code == 2 and "sim.order" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()

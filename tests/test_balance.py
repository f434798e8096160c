"""Participation balance (``balance``): updates of nodes applied less often than the average count more."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from fedcomp.protocol import Outcome, ProtocolConfig
from fedcomp.registry import ConfigError
from fedcomp.server.balance import balance_factor
from fedcomp.task.config import RunConfig
from tests.test_protocol import make_proto, reply


@given(st.integers(0, 10_000), st.floats(0, 10_000), st.floats(1, 100))
def test_factor_is_bounded_and_falls_as_a_node_is_applied_more(applied, mean, bound):
    f = balance_factor(applied, mean, bound)
    assert 1 / bound - 1e-12 <= f <= bound + 1e-12
    assert balance_factor(applied + 1, mean, bound) <= f
    raw = (mean + 1) / (applied + 1)
    if 1 / bound <= raw <= bound:
        assert f == pytest.approx(raw)


@given(st.integers(0, 10_000), st.floats(0, 10_000))
def test_bound_one_is_off(applied, mean):
    assert balance_factor(applied, mean, 1.0) == 1.0


def _weights(balance: float) -> dict[int, float]:
    """Node 1 has 4 updates applied, nodes 2 and 3 none; then one more reply each (all at staleness 0: a buffer
    of 100 never steps)."""
    p = make_proto(buffer_size=100, max_staleness=10, balance=balance)
    for seq in range(1, 5):
        assert reply(p, 1, p.dispatch(1, now=0.0), seq=seq).outcome is Outcome.APPLIED
    tasks = {c: p.dispatch(c, now=0.0) for c in (1, 2, 3)}
    assert p.book.mean_applied() == pytest.approx(4 / 3)
    return {c: reply(p, c, tasks[c], seq=5 if c == 1 else 1).weight for c in (1, 2, 3)}


def test_the_server_weights_rarely_applied_nodes_up_and_often_applied_ones_down():
    off, on = _weights(1.0), _weights(4.0)
    assert off == {1: 1.0, 2: 1.0, 3: 1.0}  # constant staleness weight, no balancing
    assert on[1] == pytest.approx((4 / 3 + 1) / 5)  # 4 applied against a mean of 4/3
    # node 2 sees the ledger with node 1 at 5 applied: mean 5/3; node 3 then also node 2's: mean 6/3
    assert on[2] == pytest.approx(5 / 3 + 1) and on[3] == pytest.approx(6 / 3 + 1)


def test_a_node_that_moved_is_not_counted_twice():
    p = make_proto(buffer_size=100, max_staleness=10, balance=4.0)
    for seq in (1, 2):
        reply(p, 1, p.dispatch(1, now=0.0), seq=seq)
    p.dispatch(2, now=0.0)
    assert p.book.mean_applied() == 1.0  # (2 + 0) / 2
    p.book.get(2).moved_to = 3
    assert p.book.mean_applied() == 2.0  # node 2's state lives on under node 3's id, not yet seen here


@pytest.mark.parametrize("bad", [0.5, 0.0, -1.0, math.nan, math.inf])
def test_a_bad_balance_is_a_config_error(bad):
    with pytest.raises(ConfigError, match="balance"):
        ProtocolConfig(balance=bad)
    with pytest.raises(ConfigError, match="balance"):
        RunConfig(balance=bad)

"""The wire model is a pure, monotone function of counts (fedcomp.wirecost)."""

import doctest

import pytest
from hypothesis import given
from hypothesis import strategies as st

from fedcomp import wirecost
from fedcomp.wirecost import FLOWER_1_41, WireCost

sizes = st.integers(min_value=0, max_value=10**9)
counts = st.integers(min_value=0, max_value=1000)


def test_docstring_examples():
    assert doctest.testmod(wirecost).failed == 0


@given(b=sizes, extra=sizes, n=counts)
def test_task_and_reply_carry_the_flower_bytes_and_are_monotone(b, extra, n):
    for fn, carried in ((FLOWER_1_41.task, 1), (FLOWER_1_41.reply, 0)):
        up, down = fn(b, n)
        up2, down2 = fn(b + extra, n + 1)
        assert up >= 0 and down >= 0
        assert up2 >= up and down2 >= down
        # the Flower object bytes travel down for a task, up for a reply; protocol rides on top
        assert (down if carried else up) >= b
        assert (down2 - down if carried else up2 - up) >= extra


@given(s=st.floats(min_value=0, max_value=1e6), more=st.floats(min_value=0, max_value=1e6))
def test_idle_is_monotone_in_time(s, more):
    up, down = FLOWER_1_41.idle(s)
    up2, down2 = FLOWER_1_41.idle(s + more)
    assert 0 <= up <= up2 and 0 <= down <= down2


def test_idle_rates_follow_the_constants():
    c = WireCost(poll_up=300, poll_down=100, poll_interval_s=3.0, heartbeat_up=600, heartbeat_interval_s=30.0)
    assert c.idle(30.0) == (10 * 300 + 600, 10 * 100)


def test_round_trips_count_one_request_per_object():
    c = WireCost(task_round_trips=2, reply_round_trips=1)
    assert c.task_requests(3) == 5 and c.reply_requests(3) == 4


def test_bundle_is_downloaded():
    up, down = FLOWER_1_41.bundle()
    assert down > up >= 0


@pytest.mark.parametrize("field", ["request_up", "poll_down", "bundle_down"])
def test_negative_constants_are_rejected(field):
    with pytest.raises(ValueError):
        WireCost(**{field: -1})


def test_zero_interval_is_rejected():
    with pytest.raises(ValueError):
        WireCost(poll_interval_s=0.0)

"""The wire model is a pure, monotone function of counts (fedcomp.sim.wirecost)."""

import doctest

import pytest
from hypothesis import given
from hypothesis import strategies as st

from fedcomp.sim import wirecost
from fedcomp.sim.wirecost import FLOWER_1_41, RunCounts, TaskClock, WireCost, run_wire_bytes

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


@pytest.mark.parametrize("field", ["task_up", "poll_down", "bundle_down"])
def test_negative_constants_are_rejected(field):
    with pytest.raises(ValueError):
        WireCost(**{field: -1})


def test_zero_interval_is_rejected():
    with pytest.raises(ValueError):
        WireCost(poll_interval_s=0.0)


@given(b1=sizes, b2=sizes, k1=counts, k2=counts)
def test_messages_add_up(b1, b2, k1, k2):
    for fn in (FLOWER_1_41.task, FLOWER_1_41.reply):
        a, b = fn(b1, k1), fn(b2, k2)
        assert fn(b1 + b2, k1 + k2, messages=2) == (a[0] + b[0], a[1] + b[1])


def test_run_parts_sum_to_the_total_and_carry_the_flower_bytes():
    c = RunCounts(
        tasks=4,
        task_flower_bytes=40_000,
        task_objects=12,
        replies=3,
        reply_flower_bytes=9_000,
        reply_objects=9,
        clients=2,
        connected_s=60.0,
        waiting_s=20.0,
    )
    parts = run_wire_bytes(FLOWER_1_41, c)
    total = parts.pop("total")
    assert total == (sum(p[0] for p in parts.values()), sum(p[1] for p in parts.values()))
    assert parts["tasks"][1] > 40_000 and parts["replies"][0] > 9_000
    assert parts["bundle"] == (2 * FLOWER_1_41.bundle_up, 2 * FLOWER_1_41.bundle_down)


def test_task_clock_counts_held_time_and_open_tasks():
    clock = TaskClock(start=0.0)
    clock.sent(1, 10, now=0.0)
    clock.sent(2, 11, now=2.0)
    clock.replied(10, now=4.0)
    clock.replied(99, now=5.0)  # unknown task: ignored
    assert clock.clients == 2
    assert clock.connected_s(10.0) == 20.0
    assert clock.waiting_s(10.0) == 20.0 - 4.0 - 8.0  # client 2's task is still open at t = 10


def test_open_tasks_younger_than_a_poll_are_not_charged_as_fetched():
    clock = TaskClock(start=0.0)
    clock.sent(1, 10, now=0.0, flower_bytes=40_000, objects=3)  # fetched long ago, answered
    clock.replied(10, now=5.0)
    clock.sent(1, 11, now=9.0, flower_bytes=40_000, objects=3)  # 1 s old at the end: 2/3 likely not fetched yet
    clock.sent(2, 12, now=0.0, flower_bytes=40_000, objects=3)  # 10 s old: fetched
    n, b, k = clock.unfetched(10.0, poll_interval_s=3.0)
    assert (round(n, 6), round(b), round(k, 6)) == (round(2 / 3, 6), round(40_000 * 2 / 3), 2.0)
    totals = {"messages_down": 3, "flower_bytes_down": 120_000, "flower_objects_down": 9}
    charged = run_wire_bytes(FLOWER_1_41, clock.counts(totals, 10.0))["tasks"]
    full = FLOWER_1_41.task(120_000, 9, 3)
    one = FLOWER_1_41.task(40_000, 3, 1)
    assert charged == (round(full[0] - one[0] * 2 / 3), round(full[1] - one[1] * 2 / 3))


@given(task=sizes, reply=sizes, n=st.integers(1, 50), unfetched=st.floats(0, 1), wait=st.floats(0, 1e4))
def test_protocol_bytes_are_never_negative(task, reply, n, unfetched, wait):
    """The deployment summary's protocol figure (wire - the Flower object bytes the wire carried): a large task
    nobody fetched before the run ended (a dense downlink's last round) once made it negative."""
    c = RunCounts(tasks=n, task_flower_bytes=task * n, task_objects=3 * n, replies=n, reply_flower_bytes=reply * n,
                  reply_objects=3 * n, clients=2, connected_s=wait, waiting_s=wait, unfetched_tasks=unfetched * n,
                  unfetched_flower_bytes=unfetched * task * n, unfetched_objects=3 * unfetched * n)
    parts = run_wire_bytes(FLOWER_1_41, c)
    protocol = wirecost.protocol_wire_bytes(c, parts)
    assert protocol >= 0
    carried = task * n * (1 - unfetched) + reply * n
    assert protocol <= sum(parts["total"]) - sum(parts["bundle"]) - carried + 2  # rounding of the parts


def test_the_reported_negative_case_is_positive():
    """2 clients, a 1.1M-parameter model with a dense downlink (4.4 MB tasks), the last task never fetched."""
    c = RunCounts(tasks=10, task_flower_bytes=10 * 4_400_000, task_objects=30, replies=9, reply_flower_bytes=9 * 60_000,
                  reply_objects=27, clients=2, connected_s=40.0, waiting_s=5.0, unfetched_tasks=1.0,
                  unfetched_flower_bytes=4_400_000, unfetched_objects=3)
    old_formula = sum(run_wire_bytes(FLOWER_1_41, c)["total"]) - c.task_flower_bytes - c.reply_flower_bytes
    old_formula -= sum(run_wire_bytes(FLOWER_1_41, c)["bundle"])
    assert old_formula < 0  # what the summary used to print
    assert wirecost.protocol_wire_bytes(c, run_wire_bytes(FLOWER_1_41, c)) > 0


def test_a_task_queued_behind_another_is_held_time_once():
    """Prefetch: task 2 was sent while task 1 ran; the node held a task from 0 to 9 s, not 4 + 8 = 12 s."""
    clock = TaskClock(start=0.0)
    clock.sent(client=1, task_id=1, now=0.0)
    clock.sent(client=1, task_id=2, now=1.0)
    clock.replied(task_id=1, now=4.0)
    clock.replied(task_id=2, now=9.0)
    assert clock.busy[1] == 9.0 and clock.waiting_s(now=10.0) == 1.0


def test_a_queued_task_is_fetched_after_the_push_and_one_behind_an_open_task_is_not():
    """A node fetches one task at a time: task 2 (queued while task 1 ran) came with the poll right after task 1's
    push, however young; task 3, queued behind task 2 that still runs, is not fetched, however old."""
    clock = TaskClock(start=0.0)
    clock.sent(1, 1, now=0.0, flower_bytes=40_000, objects=3)
    clock.sent(1, 2, now=9.5, flower_bytes=40_000, objects=3)
    clock.replied(1, now=9.8, flower_bytes=5_000, objects=3)
    clock.sent(1, 3, now=1.0 + 9.8, flower_bytes=40_000, objects=3)  # queued behind task 2
    clock.sent(2, 4, now=0.0, flower_bytes=40_000, objects=3)  # 15 s old, nothing ahead of it: fetched
    assert clock.unfetched(15.0, poll_interval_s=3.0) == (1.0, 40_000.0, 3.0)
    assert clock.repolls == 0  # task 2 was waiting when task 1's reply was pushed: no empty poll after it


def test_the_clock_counts_every_reply_read_and_the_empty_polls_after_them():
    """Replies read but never handled by the loop (the batch that reached the last version, the drain after
    it) crossed the wire: the clock's own count wins over the loop's totals; a reply with no task queued behind
    it is followed by one empty poll, one with a queued task by none."""
    clock = TaskClock(start=0.0)
    clock.sent(1, 1, now=0.0, flower_bytes=40_000, objects=3)
    clock.replied(1, now=2.0, flower_bytes=6_000, objects=3)  # nothing queued: an empty re-poll
    clock.sent(1, 2, now=2.1, flower_bytes=40_000, objects=3)
    clock.sent(1, 3, now=3.0, flower_bytes=40_000, objects=3)
    clock.replied(2, now=4.0, flower_bytes=6_000, objects=3)  # task 3 queued: its poll fetched it
    clock.replied(3, now=6.0, flower_bytes=6_000, objects=3)
    totals = {"messages_down": 3, "flower_bytes_down": 120_000, "flower_objects_down": 9,
              "messages_up": 2, "flower_bytes_up": 12_000, "flower_objects_up": 6}  # the loop handled two
    c = clock.counts(totals, now=6.0)
    assert (c.replies, c.reply_flower_bytes, c.reply_objects, c.repolls) == (3, 18_000, 9, 2)
    parts = run_wire_bytes(FLOWER_1_41, c)
    assert parts["replies"] == FLOWER_1_41.reply(18_000, 9, 3)
    assert parts["polls"] == FLOWER_1_41.polls(c.waiting_s, 2)
    # written out from the constants: the idle node-seconds' polls, plus one whole poll per empty re-poll
    w = FLOWER_1_41
    idle = c.waiting_s / w.poll_interval_s
    assert parts["polls"] == (round((idle + 2 * w.polls_per_reply) * w.poll_up),
                              round((idle + 2 * w.polls_per_reply) * w.poll_down))
    assert w.polls(0.0, 2) == (round(2 * w.polls_per_reply * w.poll_up), round(2 * w.polls_per_reply * w.poll_down))
    assert w.polls(0.0, 2)[0] > 0 and w.polls_per_reply > 0  # a re-poll costs bytes

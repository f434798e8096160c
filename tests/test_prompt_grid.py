"""``PromptGrid``: Flower's push-then-pull ``send_and_receive`` without the fixed 3 s between pulls.

No wall-clock asserts: the loop runs on a fake clock whose ``sleep`` only advances it, against a scripted grid
whose replies appear at given pulls; ``Compressed.start`` runs a real small round on ``benchmarks/flowerkit.py``'s
grid given Flower's own HTTP loop, with ``time.sleep`` recorded (Flower's loop sleeps 3 s, ``PromptGrid`` 0.1 s).
"""

from __future__ import annotations

import math
import threading
import time
from types import SimpleNamespace

import pytest
import torch
from flwr.app import ConfigRecord, RecordDict
from flwr.serverapp import Grid
from flwr.serverapp.strategy import FedAvg
from flwr.superlink.grid.http_grid import HttpGrid

from benchmarks.compatkit import FAMILIES, client_app
from benchmarks.flowerkit import LocalGrid, server_identity
from fedcomp.flower import Compressed, PromptGrid, compression_mod
from fedcomp.flower.grid import DEFAULT_PULL_INTERVAL, prompt

NEVER = math.inf


class FakeTime:
    """A clock that moves only when slept on (or when a pull takes time); a loop that never ends fails."""

    def __init__(self) -> None:
        self.now = 0.0
        self.sleeps: list[float] = []

    def clock(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.now += seconds
        assert len(self.sleeps) < 1000, "still pulling after 1000 sleeps"


class ScriptedGrid(Grid):
    """Message i's reply can be pulled from read ``ready[i]`` on (1 = the first read of the loop: reads are
    counted by the loop's sleeps, since ``PromptGrid`` pulls each id with a call of its own, on threads);
    ``calls`` logs every method reached. Its own ``send_and_receive`` must never run under ``PromptGrid``."""

    def __init__(self, ready: list[float], ids: list[str | None] | None = None, pull_cost: float = 0.0,
                 clock: FakeTime | None = None) -> None:
        self.ready, self.ids, self.pull_cost, self.time = ready, ids, pull_cost, clock
        self.calls: list[tuple] = []
        self.reads: list[list[str]] = []  # the ids asked for, read by read
        self.given: set[str] = set()
        self.extra = "only on the inner grid"
        self.lock = threading.Lock()

    @property
    def pulled(self) -> list[list[str]]:
        return [sorted(ids) for ids in self.reads]

    def set_run(self, run) -> None:
        self.calls.append(("set_run", run))

    @property
    def run(self):
        self.calls.append(("run",))
        return "the run"

    def create_message(self, content, message_type, dst_node_id, group_id, ttl=None):
        self.calls.append(("create_message", content, message_type, dst_node_id, group_id, ttl))
        return "a message"

    def get_node_ids(self):
        self.calls.append(("get_node_ids",))
        return [100, 101]

    def get_nodes(self):
        self.calls.append(("get_nodes",))
        return ["node info"]

    def push_messages(self, messages):
        messages = list(messages)
        self.calls.append(("push_messages", messages))
        return list(self.ids) if self.ids is not None else [f"m{i}" for i in range(len(messages))]

    def pull_messages(self, message_ids):
        ids = list(message_ids)
        with self.lock:
            self.calls.append(("pull_messages", ids))
            read = len(self.time.sleeps) + 1 if self.time is not None else len(self.reads) + 1
            self.reads.extend([] for _ in range(read - len(self.reads)))
            self.reads[read - 1].extend(ids)
            if self.time is not None:
                self.time.now += self.pull_cost
            out = [i for i in ids if i not in self.given and self.ready[int(i[1:])] <= read]
            self.given.update(out)
        return (SimpleNamespace(metadata=SimpleNamespace(reply_to_message_id=i)) for i in out)  # a generator

    def send_and_receive(self, messages, *, timeout=None):
        raise AssertionError("the wrapped grid's send_and_receive ran")


def scripted(ready, interval=DEFAULT_PULL_INTERVAL, **kw):
    t = FakeTime()
    inner = ScriptedGrid(ready, clock=t, **kw)
    return inner, PromptGrid(inner, interval, clock=t.clock, sleep=t.sleep), t


def reply_ids(replies) -> list[str]:
    return [r.metadata.reply_to_message_id for r in replies]


# ---- the loop --------------------------------------------------------------------------------------------------
def test_all_replies_returned_when_they_arrive_at_different_pulls():
    inner, grid, t = scripted([1, 4, 2])
    replies = grid.send_and_receive(["a", "b", "c"])
    assert reply_ids(replies) == ["m0", "m2", "m1"]  # in the order pulled
    assert len(inner.pulled) == 4 and t.sleeps == [DEFAULT_PULL_INTERVAL] * 3  # one pull per 0.1 s, not per 3 s
    assert inner.calls[0] == ("push_messages", ["a", "b", "c"])


def test_only_the_ids_still_missing_are_pulled_again():
    inner, grid, _ = scripted([1, 4, 2, 2])
    grid.send_and_receive(list("abcd"))
    assert inner.pulled == [["m0", "m1", "m2", "m3"], ["m1", "m2", "m3"], ["m1"], ["m1"]]


def test_no_timeout_waits_for_every_reply_however_long():
    inner, grid, t = scripted([1, 60], interval=0.5)
    assert reply_ids(grid.send_and_receive(["a", "b"], timeout=None)) == ["m0", "m1"]
    assert len(inner.pulled) == 60 and t.sleeps == [0.5] * 59


def test_timeout_is_respected_and_the_last_pull_is_at_the_deadline():
    inner, grid, t = scripted([2, NEVER], interval=0.3)
    replies = grid.send_and_receive(["a", "b"], timeout=1.0)
    assert reply_ids(replies) == ["m0"]
    assert t.sleeps == pytest.approx([0.3, 0.3, 0.3, 0.1])  # never past the deadline
    assert t.now == pytest.approx(1.0) and len(inner.pulled) == 5


def test_timeout_counts_the_time_pulls_take():
    inner, grid, t = scripted([NEVER], interval=0.1, pull_cost=0.4)
    grid.send_and_receive(["a"], timeout=1.0)
    assert t.now <= 1.0 + 0.4 + 1e-9 and len(inner.pulled) == 3  # pulls at 0, 0.5, 1.0 (each 0.4 s long)


def test_a_zero_timeout_still_pulls_once():
    inner, grid, t = scripted([1, NEVER])
    assert reply_ids(grid.send_and_receive(["a", "b"], timeout=0)) == ["m0"]
    assert len(inner.pulled) == 1 and t.sleeps == []


def test_messages_that_could_not_be_pushed_are_not_waited_for():
    inner, grid, t = scripted([1, 1], ids=["m0", None])  # HttpGrid returns None for a message it could not push
    assert reply_ids(grid.send_and_receive(["a", "b"])) == ["m0"]
    assert inner.pulled == [["m0"]] and t.sleeps == []


def test_many_missing_replies_are_read_less_often_so_the_superlink_sees_a_bounded_rate():
    """40 replies missing and at most 20 pull requests a second: 2 s between reads, not 0.1 s; once one is
    missing, every 0.1 s again. A deadline cuts the long wait short."""
    t = FakeTime()
    inner = ScriptedGrid([3] * 39 + [5], clock=t)
    grid = PromptGrid(inner, 0.1, max_reads_per_s=20.0, clock=t.clock, sleep=t.sleep)
    assert len(grid.send_and_receive([f"x{i}" for i in range(40)])) == 40
    assert t.sleeps == [2.0, 2.0, 0.1, 0.1]
    assert [len(ids) for ids in inner.reads] == [40, 40, 40, 1, 1]
    t = FakeTime()
    inner = ScriptedGrid([NEVER] * 40, clock=t)
    grid = PromptGrid(inner, 0.1, max_reads_per_s=20.0, clock=t.clock, sleep=t.sleep)
    assert grid.send_and_receive([f"x{i}" for i in range(40)], timeout=3.0) == []
    assert t.sleeps == [2.0, 1.0] and t.now == 3.0


def test_a_few_missing_replies_keep_the_pull_interval():
    t = FakeTime()
    grid = PromptGrid(ScriptedGrid([3] * 4, clock=t), 0.1, max_reads_per_s=50.0, clock=t.clock, sleep=t.sleep)
    grid.send_and_receive(list("abcd"))
    assert t.sleeps == [0.1, 0.1]  # 4 missing / 50 a second = 0.08 s: the pull interval stands


def test_nothing_pushed_returns_at_once():
    inner, grid, t = scripted([], ids=[])
    assert grid.send_and_receive([]) == [] and inner.pulled == [] and t.sleeps == []


# ---- construction ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("bad", [0, 0.0, -0.1, math.nan, math.inf])
def test_pull_interval_must_be_positive_and_finite(bad):
    with pytest.raises(ValueError, match="pull_interval"):
        PromptGrid(ScriptedGrid([]), bad)


@pytest.mark.parametrize("bad", ["0.1", None, True])
def test_pull_interval_must_be_a_number(bad):
    with pytest.raises(TypeError, match="pull_interval"):
        PromptGrid(ScriptedGrid([]), bad)


@pytest.mark.parametrize("bad", [0, -1.0, math.nan, math.inf, "5", None, True])
def test_max_reads_per_s_must_be_a_positive_finite_number(bad):
    with pytest.raises(ValueError, match="max_reads_per_s"):
        PromptGrid(ScriptedGrid([]), max_reads_per_s=bad)


def test_it_wraps_only_grids():
    with pytest.raises(TypeError, match="Grid"):
        PromptGrid(object())


def test_wrapping_a_prompt_grid_does_not_nest():
    inner = ScriptedGrid([])
    outer = PromptGrid(PromptGrid(inner, 0.5), 0.2)
    assert outer.grid is inner and outer.pull_interval == 0.2
    assert PromptGrid(PromptGrid(PromptGrid(inner))).grid is inner
    already = PromptGrid(inner, 0.5)
    assert prompt(already) is already  # Compressed.start keeps the user's own PromptGrid and its interval


def test_prompt_wraps_flowers_grids_and_leaves_others_alone():
    http = HttpGrid(token="t")  # never connects: nothing is called on it
    wrapped = prompt(http)
    assert isinstance(wrapped, PromptGrid) and wrapped.grid is http
    local = LocalGrid({})
    assert prompt(local) is local  # its own send_and_receive returns at once what is there: keep it


def test_every_grid_method_reaches_the_wrapped_grid():
    inner = ScriptedGrid([NEVER])
    grid = PromptGrid(inner)
    content = RecordDict()
    grid.set_run("run 7")
    assert grid.run == "the run"
    assert grid.create_message(content, "train", 100, "1", 30.0) == "a message"
    assert list(grid.get_node_ids()) == [100, 101]
    assert list(grid.get_nodes()) == ["node info"]
    assert list(grid.push_messages(["x"])) == ["m0"]
    assert list(grid.pull_messages(["m0"])) == []
    assert [c[0] for c in inner.calls] == [
        "set_run", "run", "create_message", "get_node_ids", "get_nodes", "push_messages", "pull_messages"
    ]
    assert inner.calls[0] == ("set_run", "run 7") and inner.calls[2] == ("create_message", content, "train", 100,
                                                                          "1", 30.0)
    assert grid.extra == "only on the inner grid"  # what the grid has beyond Flower's API
    assert isinstance(grid, Grid) and "ScriptedGrid" in repr(grid)


# ---- Compressed.start ------------------------------------------------------------------------------------------
class FlowerLoopGrid(LocalGrid):
    """``benchmarks/flowerkit.py``'s federation with Flower's own HTTP ``send_and_receive`` (push, then pull with
    ``time.sleep(3)`` between pulls); each reply becomes pullable one pull after its push."""

    send_and_receive = HttpGrid.send_and_receive

    def __init__(self, *args, **kw) -> None:
        super().__init__(*args, **kw)
        self.pulls = self.pushes = 0
        self.seen: set[str] = set()

    def push_messages(self, messages):
        self.pushes += 1
        return super().push_messages(messages)

    def pull_messages(self, message_ids):
        self.pulls += 1
        ids = list(message_ids)
        ready = [m for m in ids if m in self.seen]
        self.seen.update(ids)
        return super().pull_messages(ready)


class GridSeen(FedAvg):
    """FedAvg recording the grid its configure_* get."""

    grids: list[type] = []

    def configure_train(self, server_round, arrays, config, grid):
        self.grids.append(type(grid))
        return super().configure_train(server_round, arrays, config, grid)


@pytest.fixture
def sleeps(monkeypatch):
    """Every ``time.sleep`` called through the ``time`` module (Flower's loop); none sleeps."""
    calls: list[float] = []
    monkeypatch.setattr(time, "sleep", calls.append)
    return calls


def run_start(strategy, grid, rounds=2):
    fam = FAMILIES["mlp"]
    torch.manual_seed(0)
    with server_identity():
        return strategy.start(grid, fam.record(fam.build()), num_rounds=rounds, train_config=ConfigRecord({"lr": 0.05}))


def federation(mods, cls=FlowerLoopGrid, n=2):
    app = client_app(FAMILIES["mlp"], mods)
    return cls({100 + i: (app, {"partition-id": i, "num-partitions": n}) for i in range(n)}, {})


def fedavg(**kw):
    return GridSeen(**{"min_train_nodes": 2, "min_available_nodes": 2, "min_evaluate_nodes": 2, **kw})


def test_flowers_loop_sleeps_3_s_per_pull_on_this_grid(sleeps):
    """The control: a plain strategy on the grid runs Flower's loop, and the fixture sees its 3 s sleeps."""
    grid = federation([])
    run_start(fedavg(), grid)
    assert sleeps == [3] * 4 and grid.pulls == 8  # 2 rounds x (train, evaluate) x (pull, sleep 3 s, pull)


def test_compressed_start_runs_the_strategy_on_a_prompt_grid(sleeps):
    grid = federation([compression_mod])
    strategy = Compressed(fedavg(), "topk", density=0.1)
    GridSeen.grids = []
    result = run_start(strategy, grid)
    assert sleeps == []  # Flower's 3 s loop never ran: PromptGrid pulled (sleeping 0.1 s, not through time.sleep)
    assert grid.pushes == 4 and grid.pulls == 16  # both rounds' train and evaluate: push, then per message 2 pulls
    assert GridSeen.grids == [PromptGrid, PromptGrid]  # what Strategy.start handed configure_train
    assert sorted(result.train_metrics_clientapp) == [1, 2] and sorted(result.evaluate_metrics_clientapp) == [1, 2]
    assert len([r for r in grid.replies if r.metadata.message_type == "train" and not r.has_error()]) == 4


def test_compressed_start_keeps_a_grid_with_its_own_send_and_receive(sleeps):
    """A grid whose ``send_and_receive`` is not Flower's loop keeps it (the in-process test grid returns at once
    what is there: a lost reply would otherwise be waited for until the timeout)."""
    grid = federation([compression_mod], cls=LocalGrid)
    GridSeen.grids = []
    run_start(Compressed(fedavg(), "topk", density=0.1), grid, rounds=1)
    assert GridSeen.grids == [LocalGrid] and sleeps == []

"""Reading replies: one reply still uploading never holds back the replies that are complete.

Flower's deployment ``pull_messages`` downloads the replies it gets one after another and, for a reply pulled
before its objects are all uploaded, backs off (1, 2, 4 ... 10 s) until they are. Here a stub grid stands in:
the pull of a "slow" message id blocks on an event until the test opens it (the upload finishing), and every
call is logged in order. No wall-clock asserts: the tests check what was returned while the slow call was
still blocked, the order of the log, and counts; time only bounds a hang.
"""

from __future__ import annotations

import json
import random
import threading
from collections import Counter
from types import SimpleNamespace

import pytest
import torch
from flwr.app import Message, MetricRecord, RecordDict

from benchmarks.flowerkit import LocalGrid, server_identity
from fedcomp.flower import PromptGrid, records
from fedcomp.flower.grid import ReplyReader
from fedcomp.flower.transport import GridTransport
from fedcomp.protocol import Task
from fedcomp.server.loops import FailureEvent, ReplyEvent, encode_model
from fedcomp.spec import ModelSpec

HANG_S = 60.0  # bounds a hang only
STALL = 0.05  # seconds after which a running pull counts as slow (small: the tests never wait on it)


class Gates:
    """Per message id: the pull of a gated id blocks until ``open(mid)``; ``log`` records ("pull", id) when a
    call starts and ("return", id) when it returns a reply, in order; ``calls`` counts calls per id."""

    def __init__(self, gated=()) -> None:
        self.events = {mid: threading.Event() for mid in gated}
        self.log: list[tuple[str, str]] = []
        self.calls: Counter[str] = Counter()
        self.lock = threading.Lock()

    def open(self, mid: str) -> None:
        self.events[mid].set()

    def enter(self, ids: list[str]) -> None:
        with self.lock:
            for mid in ids:
                self.log.append(("pull", mid))
                self.calls[mid] += 1
        for mid in ids:
            if mid in self.events:
                assert self.events[mid].wait(HANG_S), f"{mid} was never released"

    def returned(self, mids) -> None:
        with self.lock:
            self.log.extend(("return", m) for m in mids)

    def order(self, kind: str) -> list[str]:
        with self.lock:
            return [m for k, m in self.log if k == kind]


class StubGrid:
    """``ready[id]``: the call (1 = first) from which that id's reply is returned; ids absent never answer."""

    def __init__(self, ready: dict[str, int], gated=(), fail: dict[str, int] | None = None) -> None:
        self.ready, self.gates, self.fail = ready, Gates(gated), dict(fail or {})
        self.given: Counter[str] = Counter()

    def pull_messages(self, message_ids):
        ids = list(message_ids)
        self.gates.enter(ids)
        with self.gates.lock:
            for mid in ids:
                if self.fail.get(mid, 0) >= self.gates.calls[mid]:
                    raise ConnectionError(f"pull of {mid} failed")
            out = [m for m in ids if self.ready.get(m, 10**9) <= self.gates.calls[m] and not self.given[m]]
            self.given.update(out)
        self.gates.returned(out)
        return (SimpleNamespace(metadata=SimpleNamespace(reply_to_message_id=m)) for m in out)


def ids_of(replies) -> list[str]:
    return [r.metadata.reply_to_message_id for r in replies]


def take_when(reader: ReplyReader, predicate) -> list:
    """Replies taken until ``predicate(all taken so far)`` holds (a hang fails)."""
    got: list = []
    while not predicate(got):
        assert reader.wait(HANG_S), "no reply came"
        got += reader.take()
    return got


# ---- ReplyReader ---------------------------------------------------------------------------------------------
def read_until(reader: ReplyReader, ids: list[str], want: set[str], got: list | None = None) -> list:
    """Read the ids not yet in ``got`` again and again until every id in ``want`` is in (a hang fails)."""
    got = [] if got is None else got
    for _ in range(10_000):
        if want <= set(ids_of(got)):
            return got
        got += reader.read([m for m in ids if m not in ids_of(got)])
        reader.wait(0.01)
    raise AssertionError(f"still missing {want - set(ids_of(got))}")


def test_complete_replies_are_read_while_one_is_still_uploading():
    grid = StubGrid({"slow": 1, "a": 1, "b": 1}, gated={"slow"})
    reader = ReplyReader(grid, stall_after=STALL)
    got = read_until(reader, ["slow", "a", "b"], {"a", "b"})
    assert sorted(ids_of(got)) == ["a", "b"] and grid.gates.order("return") == sorted(ids_of(got))
    assert reader.pending == {"slow"}  # its call is still blocked: a and b did not wait for it
    grid.gates.open("slow")
    assert ids_of(take_when(reader, bool)) == ["slow"]  # once complete, it comes to the next take
    assert reader.pending == set() and reader.take() == []
    assert grid.gates.calls == {"slow": 1, "a": 1, "b": 1}  # each id pulled once: nothing lost, nothing twice
    assert reader.stats.pulls == 3 and reader.stats.replies == 3


def test_one_worker_still_reads_past_a_stalled_call():
    """With ``workers=1`` the slow call holds the only worker: a thread of its own is started for the rest."""
    grid = StubGrid({"slow": 1, "a": 1, "b": 1}, gated={"slow"})
    reader = ReplyReader(grid, workers=1, stall_after=STALL)
    assert sorted(ids_of(read_until(reader, ["slow", "a", "b"], {"a", "b"}))) == ["a", "b"]
    assert grid.gates.order("pull")[0] == "slow"  # it was pulled first, and still did not hold them back
    grid.gates.open("slow")
    assert ids_of(take_when(reader, bool)) == ["slow"]


def test_an_id_is_never_pulled_twice_at_once():
    grid = StubGrid({"slow": 1, "a": 3}, gated={"slow"})
    reader = ReplyReader(grid, stall_after=STALL)
    got = read_until(reader, ["slow", "a"], {"a"})  # the loop reads every id still missing, again and again
    assert ids_of(got) == ["a"] and grid.gates.calls == {"slow": 1, "a": 3}
    grid.gates.open("slow")
    assert ids_of(take_when(reader, bool)) == ["slow"] and grid.gates.calls["slow"] == 1


def test_no_reply_yet_means_the_id_is_pulled_again_by_the_next_read():
    grid = StubGrid({"a": 2, "b": 1})
    reader = ReplyReader(grid, stall_after=HANG_S)  # nothing is slow here: read waits for every call
    assert ids_of(reader.read(["a", "b"])) == ["b"]
    assert reader.pending == set()  # a's call returned nothing: free to be read again
    assert ids_of(reader.read(["a"])) == ["a"] and grid.gates.calls == {"a": 2, "b": 1}


def test_replies_come_in_the_order_their_ids_were_requested():
    grid = StubGrid({m: 1 for m in "edcba"})
    assert ids_of(ReplyReader(grid, workers=3, stall_after=HANG_S).read(list("edcba"))) == list("edcba")


def test_a_failing_pull_raises_in_take_and_the_id_can_be_read_again():
    grid = StubGrid({"a": 1, "b": 1}, fail={"a": 1})
    reader = ReplyReader(grid, stall_after=HANG_S)
    with pytest.raises(ConnectionError, match="pull of a"):
        reader.read(["a", "b"])
    assert ids_of(reader.take()) == ["b"]  # kept for the take after the error
    assert ids_of(reader.read(["a"])) == ["a"]


def test_many_replies_slow_and_fast_each_come_exactly_once():
    rng = random.Random(3)
    ids = [f"m{i}" for i in range(40)]
    gated = sorted(rng.sample(ids, 6))
    grid = StubGrid({m: rng.randint(1, 4) for m in ids}, gated=gated)
    reader = ReplyReader(grid, workers=3, stall_after=STALL)
    got = read_until(reader, ids, set(ids) - set(gated))  # every fast reply, while no upload has finished
    assert set(ids_of(got)).isdisjoint(gated)
    for m in gated:  # the uploads finish one by one; the loop goes on reading what is missing
        grid.gates.open(m)
        got = read_until(reader, ids, {m}, got)
    assert sorted(ids_of(got)) == sorted(ids)  # none lost, none twice
    assert sum(grid.gates.calls[m] for m in ids) == reader.stats.pulls


@pytest.mark.parametrize("bad", [dict(workers=0), dict(stall_after=0)])
def test_reader_arguments_are_checked(bad):
    with pytest.raises(ValueError):
        ReplyReader(StubGrid({}), **bad)


# ---- GridTransport and PromptGrid on the in-process federation -----------------------------------------------
def echo(msg: Message, context) -> Message:
    return Message(RecordDict({"metrics": MetricRecord({"num-examples": 1})}), reply_to=msg)


def crash(msg: Message, context) -> Message:
    raise RuntimeError("the ClientApp failed")


class GatedFederation(LocalGrid):
    """``benchmarks/flowerkit.py``'s federation whose pulls go through ``Gates`` (gated by destination node)."""

    def __init__(self, apps, slow_nodes=()) -> None:
        super().__init__(apps)
        self.slow_nodes = set(slow_nodes)
        self.gates = Gates()
        self.node_of: dict[str, int] = {}

    def push_messages(self, messages):
        messages = list(messages)
        ids = list(super().push_messages(messages))
        for mid, msg in zip(ids, messages, strict=True):
            self.node_of[mid] = msg.metadata.dst_node_id
            if msg.metadata.dst_node_id in self.slow_nodes:
                self.gates.events[mid] = threading.Event()
        return ids

    def pull_messages(self, message_ids):
        ids = list(message_ids)
        self.gates.enter(ids)
        out = list(super().pull_messages(ids))
        self.gates.returned(m.metadata.reply_to_message_id for m in out)
        return out

    def open_node(self, node: int) -> None:
        for mid, n in self.node_of.items():
            if n == node:
                self.gates.open(mid)


SPEC = ModelSpec((("w", (4,)),))
TASKS = records.TaskFormat({"compressor": "dgc"}, records.ArrayLayout.of_spec(SPEC))
MODEL = encode_model({"w": torch.zeros(4)}, SPEC, 0)


def task(task_id: int, client: int) -> Task:
    return Task(task_id=task_id, client=client, base_version=0, sent_at=0.0, deadline=600.0)


def test_transport_hands_over_complete_replies_and_errors_while_one_uploads():
    apps = {100: (echo, {}), 101: (echo, {}), 102: (crash, {})}  # 103 has no app: NODE_UNAVAILABLE
    grid = GatedFederation(apps, slow_nodes={101})
    transport = GridTransport(grid, tasks=TASKS)
    transport.reader.stall_after = STALL
    with server_identity():
        for tid, node in enumerate((100, 101, 102, 103), start=1):
            transport.send(task(tid, node), MODEL)
        first: list = []
        while len(first) < 3:
            first += transport.poll(HANG_S)
        assert sorted(e.task_id for e in first) == [1, 3, 4]  # 101's reply is still uploading
        assert [type(e) for e in sorted(first, key=lambda e: e.task_id)] == [ReplyEvent, FailureEvent, FailureEvent]
        failures = {e.task_id: e.reason for e in first if isinstance(e, FailureEvent)}
        assert failures[3].startswith("CLIENT_APP_RAISED_EXCEPTION") and failures[4].startswith("NODE_UNAVAILABLE")
        grid.open_node(101)
        second = transport.poll(HANG_S)  # woken by the reply, not by the next pull
    assert [(type(e), e.task_id, e.client) for e in second] == [(ReplyEvent, 2, 101)]
    assert transport.watch == {} and transport.poll(0) == []
    assert set(grid.gates.calls.values()) == {1}  # every id pulled once, the slow one too


def test_prompt_grid_reads_the_others_while_one_uploads():
    """The slow upload finishes only once the other replies' pulls have returned: a loop that waited for it
    before reading them (Flower's one call for every id) would never end."""
    grid = GatedFederation({100: (echo, {}), 101: (echo, {}), 102: (echo, {})}, slow_nodes={101})
    prompt = PromptGrid(grid, 0.01)
    prompt.reader.stall_after = STALL

    def release_when_others_are_in():
        while len(grid.gates.order("return")) < 2:
            threading.Event().wait(0.01)
        grid.open_node(101)

    threading.Thread(target=release_when_others_are_in, daemon=True).start()
    with server_identity():
        replies = prompt.send_and_receive([Message(RecordDict(), dst_node_id=n, message_type="train")
                                           for n in (100, 101, 102)], timeout=HANG_S)
    returned = grid.gates.order("return")
    slow_id = next(iter(grid.gates.events))
    assert len(replies) == 3 and sorted(ids_of(replies)) == sorted(returned)
    assert returned[-1] == slow_id and grid.gates.calls[slow_id] == 1


def test_prompt_grid_timeout_does_not_wait_for_a_reply_still_uploading():
    grid = GatedFederation({100: (echo, {}), 101: (echo, {})}, slow_nodes={101})
    now = [0.0]
    prompt = PromptGrid(grid, 0.01, clock=lambda: now[0], sleep=lambda s: now.__setitem__(0, now[0] + s))
    prompt.reader.stall_after = 1.0  # the first read waits this long (real time) for the slow call, no longer
    with server_identity():
        replies = prompt.send_and_receive([Message(RecordDict(), dst_node_id=n, message_type="train")
                                           for n in (100, 101)], timeout=0.05)
    assert now[0] == pytest.approx(0.05)  # the deadline, on the loop's own clock
    assert [grid.node_of[m] for m in ids_of(replies)] == [100]
    grid.open_node(101)  # its read ends later, in the background; the next exchange drops it


def test_a_reply_that_comes_after_its_watch_expired_is_dropped_and_poll_still_waits():
    grid = GatedFederation({100: (echo, {})}, slow_nodes={100})
    transport = GridTransport(grid, tasks=TASKS)
    with server_identity():
        transport.send(task(1, 100), MODEL)
        assert transport.poll(0) == []  # its pull is blocked: the upload goes on
    transport.watch.clear()  # the task's TTL passed
    grid.open_node(100)
    assert transport.reader.wait(HANG_S)  # the reply came, for nobody
    assert transport.poll(0) == [] and transport.reader.take() == []  # dropped, not kept to wake every wait


def test_many_missing_replies_are_read_less_often_so_the_superlink_sees_a_bounded_rate():
    """With 40 replies missing and at most 20 reads a second, reads come every 2 s (not every 0.25 s): polls in
    between issue no request. Time is the transport's clock, moved by hand."""
    clock = {"t": 0.0}
    grid = StubGrid({})  # never answers
    transport = GridTransport(grid, max_reads_per_s=20.0, tasks=TASKS)
    transport.reader.stall_after = STALL
    transport.clock = lambda: clock["t"]
    for tid in range(1, 41):
        transport.watch[f"m{tid}"] = SimpleNamespace(task=task(tid, 100 + tid), expires=1e9)
    assert transport.read_interval() == pytest.approx(2.0)
    for step in range(9):  # 0, 0.5, ..., 4.0 s: reads at 0, 2 and 4 s
        clock["t"] = 0.5 * step
        transport._pull()
        transport.reader.settle()
    assert set(grid.gates.calls.values()) == {3} and len(grid.gates.calls) == 40
    few = GridTransport(StubGrid({}), max_reads_per_s=20.0)
    assert few.read_interval() == few.pull_interval  # a handful missing: every pull interval, as before
    with pytest.raises(ValueError, match="max_reads_per_s"):
        GridTransport(grid, max_reads_per_s=0.0)


class PushingStub(StubGrid):
    """``StubGrid`` that also takes pushes: message ids ``e0``, ``e1``, ... (none ever answers)."""

    def push_messages(self, messages):
        start = len(self.ready)
        ids = [f"e{start + i}" for i, _ in enumerate(messages)]
        self.ready.update(dict.fromkeys(ids, 10**9))
        return ids


def test_evaluate_reads_many_missing_replies_at_the_bounded_rate(monkeypatch):
    """40 evaluate replies missing and at most 20 requests a second: the loop sleeps 2 s between reads (its clock
    moved by hand) and stops at its timeout with what came (nothing)."""
    import fedcomp.flower.transport as transport_mod

    clock = {"t": 0.0}
    sleeps: list[float] = []

    def sleep(seconds: float) -> None:
        sleeps.append(seconds)
        clock["t"] += seconds

    monkeypatch.setattr(transport_mod, "time", SimpleNamespace(monotonic=lambda: clock["t"], sleep=sleep))
    grid = PushingStub({})
    transport = GridTransport(grid, max_reads_per_s=20.0, tasks=TASKS)
    transport.reader.stall_after = STALL
    with server_identity():
        assert transport.evaluate(list(range(100, 140)), MODEL, 3, timeout=5.0) == []
    assert sleeps == [2.0, 2.0, 1.0] and set(grid.gates.calls.values()) == {3}


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_flower_servers_transport_reads_at_the_run_configs_rate(monkeypatch, tmp_path, mode):
    """``max-reads-per-s`` of the run config reaches the product ServerApp's transport (a one-version run): the
    sync loop's and the one ``Compressed(..., mode="async")`` reads its replies with."""
    from flwr.app import Context

    import server_app.app as app_mod
    from clients.app import app as client_app

    rates: list[float] = []
    init = GridTransport.__init__

    def recording(self, grid, **options):
        init(self, grid, **options)
        rates.append(self.max_reads_per_s)

    monkeypatch.setattr(GridTransport, "__init__", recording)
    run_config = {"num-versions": 1, "mode": mode, "buffer-size": 1, "concurrency": 1, "node-wait": 60.0,
                  "poll-interval": 0.05, "max-reads-per-s": 7.0, "out-dir": str(tmp_path / "out")}
    apps = {11: (client_app, {"partition-id": 0, "num-partitions": 1, "state-dir": str(tmp_path / "c0")})}
    with server_identity():
        app_mod.main(LocalGrid(apps, run_config), Context(1, 0, {}, RecordDict(), dict(run_config)))
    assert rates == [7.0]
    assert json.loads((tmp_path / "out" / "summary.json").read_text())["completed"] is True

"""``PromptGrid``: a round ends when its last reply is in, not at Flower's next 3 s pull.

Flower's deployment grid (``HttpGrid``) answers ``send_and_receive`` by pushing the messages, then pulling the
replies with a fixed ``time.sleep(3)`` between pulls: a round whose replies were all in 0.2 s after the push
still waits until the pull at 3 s. Every round of a strategy's ``start`` pays it twice (train and evaluate).
``PromptGrid`` wraps any ``Grid`` and runs the same push-then-pull loop through the wrapped grid's own
``push_messages`` / ``pull_messages``, every ``pull_interval`` seconds (default 0.1).

Reading a reply (``ReplyReader``, also what ``server_app``'s ``GridTransport`` reads with): Flower's deployment
``pull_messages(ids)`` takes every reply the SuperLink has for ``ids`` (the SuperLink then forgets them) and
downloads their objects one message after another; a reply is visible before its objects are all uploaded,
and its download then backs off 1, 2, 4 ... 10 s until they are, holding back every reply after it. Flower's
public ``Grid`` API cannot tell a complete reply from one still uploading, so ``ReplyReader`` pulls each id with
a call of its own on background threads: a reply still uploading costs its own wait (Flower's backoff, counted
in ``ReplyReader.stats``), never the others'.

Contract: the replies are those the wrapped grid's ``send_and_receive`` returns, only sooner. With
``timeout=None`` both wait for a reply to every message; with a timeout both return what arrived by then
(``PromptGrid`` pulls once more at the deadline; a reply whose download is still backing off then is not waited
for, where Flower's loop would wait for it past the deadline). Everything else (``run``,
``get_node_ids``, ``push_messages``, ...) is the wrapped grid's, unchanged. ``Compressed.start`` uses it by
itself; with a plain strategy::

    from fedcomp.flower import PromptGrid

    result = FedAvg().start(grid=PromptGrid(grid), initial_arrays=arrays, num_rounds=10)
"""

from __future__ import annotations

import math
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable

from flwr.app import Message, RecordDict
from flwr.serverapp import Grid

#: Seconds between pulls: a pull is one small request to the SuperLink per reply still missing (the replies'
#: bytes travel once, whenever they are pulled), so 10 a second per missing reply while a round waits.
DEFAULT_PULL_INTERVAL = 0.1

#: The reads' bound on the SuperLink, in pull requests a second: a read is one request per reply still missing,
#: so with many replies missing reads come less often (``read_interval``). 200 keeps a 1,000-node round at one
#: read every 5 s instead of 10,000 requests a second.
DEFAULT_MAX_READS_PER_S = 200.0

#: A pull that took this long backed off at least once in Flower's reader (its first sleep is 1 s +- 20 %), or
#: downloaded a reply that slowly: ``ReadStats.slow`` counts them.
SLOW_PULL_S = 0.8


def read_interval(missing: int, pull_interval: float, max_reads_per_s: float = DEFAULT_MAX_READS_PER_S) -> float:
    """Seconds between reads of ``missing`` replies: ``pull_interval``, or longer when one request per missing
    reply would make more than ``max_reads_per_s`` requests a second. A large deployment then learns of a reply
    later instead of loading its SuperLink.

    >>> read_interval(10, 0.1), read_interval(1000, 0.1)
    (0.1, 5.0)
    """
    return max(pull_interval, missing / max_reads_per_s)


def check_rate(max_reads_per_s: float) -> float:
    """``max_reads_per_s`` as a float, or ``ValueError`` unless it is a finite number > 0."""
    if isinstance(max_reads_per_s, bool) or not isinstance(max_reads_per_s, (int, float)):
        raise ValueError(f"max_reads_per_s must be a number, got {max_reads_per_s!r}")
    if not (math.isfinite(max_reads_per_s) and max_reads_per_s > 0):
        raise ValueError(f"max_reads_per_s must be finite and > 0, got {max_reads_per_s!r}")
    return float(max_reads_per_s)


class ReadStats:
    """What a ``ReplyReader`` did: ``pulls`` (``pull_messages`` calls, one message id each), ``replies`` (messages
    they returned), ``slow`` and ``slow_s`` (calls that took ``SLOW_PULL_S`` seconds or more, and their seconds:
    against a SuperLink, a reply pulled before its objects were all uploaded, which makes Flower's reader back
    off 1, 2, 4 ... 10 s, or a download that slow)."""

    __slots__ = ("pulls", "replies", "slow", "slow_s")

    def __init__(self) -> None:
        self.pulls = self.replies = self.slow = 0
        self.slow_s = 0.0

    def as_dict(self) -> dict[str, float]:
        return {k: getattr(self, k) for k in self.__slots__}


class ReplyReader:
    """Reads replies so that one slow upload never holds back the replies that are complete.

    Flower's ``pull_messages(ids)`` reads the replies it gets one after another, and a reply pulled before its
    objects are all uploaded makes it wait (backing off 1, 2, 4 ... 10 s) with every reply behind it; once
    pulled, a reply is gone from the SuperLink, so it cannot be put back and read later. ``ReplyReader`` pulls
    each message id with its own ``grid.pull_messages([mid])`` call, on background threads: at most ``workers``
    calls at once, plus one thread per call that has run ``stall_after`` seconds or more. A quick pull takes
    milliseconds; one still running after ``stall_after`` is backing off or downloading a big reply: ``read``
    no longer waits for it, it keeps its thread without taking a worker, and its reply comes to a later
    ``read`` (or wakes ``wait``). An id is never pulled twice at once, nor again while its reply waits to be
    taken (a second pull of a delivered id gets an error reply from the SuperLink); a call that returns nothing
    (no reply yet) frees the id for the next ``read``. Replies come back once each; an exception a call raised
    is raised by the next ``take`` (the id can then be read again). Threads end when nothing is left to pull.
    Example::

        reader = ReplyReader(grid)
        replies = reader.read(["id-1", "id-2"])  # the replies complete by now; a slow one comes in a later read
    """

    def __init__(self, grid: Grid, workers: int = 4, stall_after: float = 0.05) -> None:
        if workers < 1 or not stall_after > 0:
            raise ValueError(f"need workers >= 1 and stall_after > 0, got {workers}, {stall_after}")
        self.grid, self.workers, self.stall_after = grid, workers, stall_after
        self.stats = ReadStats()
        self._cond = threading.Condition()
        self._queue: deque[str] = deque()
        self._busy: dict[str, float] = {}  # id -> when its call started
        self._order: dict[str, int] = {}  # id -> request number (replies are taken in request order)
        self._done: list[tuple[int, Message]] = []
        self._held: set[str] = set()  # ids with a reply in _done: pulling one again would get an error reply
        self._errors: list[BaseException] = []
        self._starting = 0
        self._seq = 0

    @property
    def pending(self) -> set[str]:
        """Ids whose pull is queued or running."""
        with self._cond:
            return set(self._order)

    def request(self, ids: Iterable[str]) -> None:
        """Queue one pull for each id in ``ids`` that has none queued or running."""
        with self._cond:
            for mid in ids:
                if mid not in self._order and mid not in self._held:
                    self._order[mid], self._seq = self._seq, self._seq + 1
                    self._queue.append(mid)
            self._staff()

    def read(self, ids: Iterable[str]) -> list[Message]:
        """``request(ids)``, ``settle()``, then ``take()``: every reply complete by now, in one call."""
        self.request(ids)
        self.settle()
        return self.take()

    def settle(self) -> None:
        """Wait until nothing is queued and every running call is at least ``stall_after`` seconds old: the
        quick calls have returned, the slow ones go on in the background."""
        with self._cond:
            while True:
                now = time.monotonic()
                young = [self.stall_after - (now - t) for t in self._busy.values() if now - t < self.stall_after]
                if not (self._queue or self._starting or young):
                    return
                self._staff()
                self._cond.wait(min(young, default=self.stall_after))

    def wait(self, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds for a reply (or error) to take; whether there is one."""
        with self._cond:
            return bool(self._cond.wait_for(lambda: self._done or self._errors, timeout))

    def take(self) -> list[Message]:
        """The replies pulled since the last ``take``, in the order their ids were requested."""
        with self._cond:
            if self._errors:
                raise self._errors.pop(0)
            done, self._done = self._done, []
            self._held.clear()
        return [m for _, m in sorted(done, key=lambda d: d[0])]

    def _staff(self) -> None:
        """Start threads so that ``workers`` calls can run that are not stalled (lock held)."""
        now = time.monotonic()
        fresh = sum(now - t < self.stall_after for t in self._busy.values())
        for _ in range(min(self.workers - fresh, len(self._queue)) - self._starting):
            self._starting += 1
            threading.Thread(target=self._work, name="fedcomp-reply-reader", daemon=True).start()

    def _work(self) -> None:
        started = True
        while True:
            with self._cond:
                self._starting -= started
                started = False
                if not self._queue:
                    self._cond.notify_all()  # settle() may be waiting for this thread to start
                    return
                mid = self._queue.popleft()
                start = self._busy[mid] = time.monotonic()
            got: list[Message] = []
            error: BaseException | None = None
            try:
                got = list(self.grid.pull_messages([mid]))
            except BaseException as exc:  # noqa: BLE001 - raised to the caller by take()
                error = exc
            with self._cond:
                seconds = time.monotonic() - start
                del self._busy[mid]
                seq = self._order.pop(mid)
                self._done.extend((seq, m) for m in got)
                if got:
                    self._held.add(mid)
                if error is not None:
                    self._errors.append(error)
                self.stats.pulls += 1
                self.stats.replies += len(got)
                if seconds >= SLOW_PULL_S:
                    self.stats.slow += 1
                    self.stats.slow_s += seconds
                self._cond.notify_all()


class PromptGrid(Grid):
    """``grid`` with ``send_and_receive`` pulling every ``pull_interval`` seconds through a ``ReplyReader``
    (``reader``: its ``stats`` count the pulls and the slow ones), less often when more replies are missing than
    ``max_reads_per_s`` allows (``read_interval``). Wrapping a ``PromptGrid`` wraps its grid (no nesting).
    ``clock`` and ``sleep`` are for tests."""

    def __init__(
        self,
        grid: Grid,
        pull_interval: float = DEFAULT_PULL_INTERVAL,
        *,
        max_reads_per_s: float = DEFAULT_MAX_READS_PER_S,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        if not isinstance(grid, Grid):
            raise TypeError(f"PromptGrid wraps a flwr Grid, got {type(grid).__name__}")
        if isinstance(pull_interval, bool) or not isinstance(pull_interval, (int, float)):
            raise TypeError(f"pull_interval must be a number of seconds, got {pull_interval!r}")
        if not (math.isfinite(pull_interval) and pull_interval > 0):
            raise ValueError(f"pull_interval must be > 0 seconds, got {pull_interval!r}")
        self.grid: Grid = grid.grid if isinstance(grid, PromptGrid) else grid
        self.pull_interval = float(pull_interval)
        self.max_reads_per_s = check_rate(max_reads_per_s)
        self.reader = ReplyReader(self.grid)
        self._clock, self._sleep = clock, sleep

    def __repr__(self) -> str:
        return f"PromptGrid({self.grid!r}, pull_interval={self.pull_interval}, max_reads_per_s={self.max_reads_per_s})"

    def __getattr__(self, name: str):  # what a grid has beyond Flower's API (HttpGrid.close, a test grid's log)
        if name == "grid":  # not set yet: never recurse
            raise AttributeError(name)
        return getattr(self.grid, name)

    # Flower's Grid API, delegated -------------------------------------------------------------------------
    def set_run(self, run) -> None:
        self.grid.set_run(run)

    @property
    def run(self):
        return self.grid.run

    def create_message(
        self, content: RecordDict, message_type: str, dst_node_id: int, group_id: str, ttl: float | None = None
    ) -> Message:
        return self.grid.create_message(content, message_type, dst_node_id, group_id, ttl)

    def get_node_ids(self) -> Iterable[int]:
        return self.grid.get_node_ids()

    def get_nodes(self):
        return self.grid.get_nodes()

    def push_messages(self, messages: Iterable[Message]) -> Iterable[str]:
        return self.grid.push_messages(messages)

    def pull_messages(self, message_ids: Iterable[str]) -> Iterable[Message]:
        return self.grid.pull_messages(message_ids)

    # The one change ---------------------------------------------------------------------------------------
    def send_and_receive(self, messages: Iterable[Message], *, timeout: float | None = None) -> Iterable[Message]:
        """Push ``messages``, then read the ids still without a reply (``ReplyReader``: one pull per id, so a
        reply still uploading never holds back the others) every ``pull_interval`` seconds (with many missing,
        every ``read_interval``) until every message has one or ``timeout`` seconds have passed (``None``: no
        limit); the replies in the order read. A message the grid could not push (id ``None`` or empty) has no
        reply to wait for; a reply read after its exchange ended is dropped, as Flower's loop would never have
        pulled it."""
        missing = dict.fromkeys(mid for mid in self.grid.push_messages(messages) if mid)
        del messages
        deadline = None if timeout is None else self._clock() + timeout
        replies: list[Message] = []
        while missing:
            for reply in self.reader.read(list(missing)):
                if reply.metadata.reply_to_message_id in missing:
                    del missing[reply.metadata.reply_to_message_id]
                    replies.append(reply)
            wait = read_interval(len(missing), self.pull_interval, self.max_reads_per_s)
            wait = wait if deadline is None else min(wait, deadline - self._clock())
            if not missing or wait <= 0:
                break
            self._sleep(wait)
        return replies


def prompt(grid: Grid) -> Grid:
    """``grid`` as ``Compressed.start`` runs a strategy on it: wrapped in a ``PromptGrid`` when its
    ``send_and_receive`` is Flower's own push-then-pull loop (``HttpGrid``, ``InMemoryGrid``); a ``PromptGrid`` as
    it is; any other grid unchanged, since its own ``send_and_receive`` may do more or other than wait for every
    reply (a test grid that returns at once what is there would otherwise wait out the timeout for a lost reply)."""
    if isinstance(grid, PromptGrid):
        return grid
    own = getattr(type(grid), "send_and_receive", None)
    return PromptGrid(grid) if getattr(own, "__module__", "").startswith("flwr.") else grid

"""``PromptGrid``: a round ends when its last reply is in, not at Flower's next 3 s pull.

Flower's deployment grid (``HttpGrid``) answers ``send_and_receive`` by pushing the messages, then pulling the
replies with a fixed ``time.sleep(3)`` between pulls: a round whose replies were all in 0.2 s after the push
still waits until the pull at 3 s. Every round of a strategy's ``start`` pays it twice (train and evaluate).
``PromptGrid`` wraps any ``Grid`` and runs the same push-then-pull loop through the wrapped grid's own
``push_messages`` / ``pull_messages``, every ``pull_interval`` seconds (default 0.1).

Contract: the replies are those the wrapped grid's ``send_and_receive`` returns, only sooner. With
``timeout=None`` both wait for a reply to every message; with a timeout both return what arrived by then
(``PromptGrid`` pulls once more at the deadline, so it never returns fewer). Everything else (``run``,
``get_node_ids``, ``push_messages``, ...) is the wrapped grid's, unchanged. ``Compressed.start`` uses it by
itself; with a plain strategy::

    from fedcomp.flower import PromptGrid

    result = FedAvg().start(grid=PromptGrid(grid), initial_arrays=arrays, num_rounds=10)
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable

from flwr.app import Message, RecordDict
from flwr.serverapp import Grid

#: Seconds between pulls: a pull is one small request to the SuperLink (the replies' bytes travel once,
#: whenever they are pulled), so 10 a second while a round waits costs the SuperLink next to nothing.
DEFAULT_PULL_INTERVAL = 0.1


class PromptGrid(Grid):
    """``grid`` with ``send_and_receive`` pulling every ``pull_interval`` seconds. Wrapping a ``PromptGrid``
    wraps its grid (no nesting). ``clock`` and ``sleep`` are for tests."""

    def __init__(
        self,
        grid: Grid,
        pull_interval: float = DEFAULT_PULL_INTERVAL,
        *,
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
        self._clock, self._sleep = clock, sleep

    def __repr__(self) -> str:
        return f"PromptGrid({self.grid!r}, pull_interval={self.pull_interval})"

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
        """Push ``messages``, then pull the ids still without a reply every ``pull_interval`` seconds until
        every message has one or ``timeout`` seconds have passed (``None``: no limit); the replies in the order
        pulled. A message the grid could not push (id ``None`` or empty) has no reply to wait for."""
        missing = dict.fromkeys(mid for mid in self.grid.push_messages(messages) if mid)
        del messages
        deadline = None if timeout is None else self._clock() + timeout
        replies: list[Message] = []
        while missing:
            got = list(self.grid.pull_messages(list(missing)))
            replies.extend(got)
            for reply in got:
                missing.pop(reply.metadata.reply_to_message_id, None)
            wait = self.pull_interval if deadline is None else min(self.pull_interval, deadline - self._clock())
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

"""When to queue a node's next task (``prefetch``): just before the node is expected to need it.

A task queued behind a running one carries the model of its dispatch, so every second it waits in the queue ages
that model (staleness) without making the node any faster; what it buys is only that the pull right after the
node's reply push finds work. So the server queues it ``lead`` seconds before the running task is expected to
end, not at once: ``due = start + k x cycle - lead`` for the node's ``k``-th open task, where ``start`` is when
its oldest open task started (its dispatch, or the node's previous reply when it was queued behind that) and
``cycle`` the node's task time as the server sees it (dispatch or previous reply -> reply): the shortest of its
last ``window`` tasks, since a task the node found late (it had polled empty and slept 3 s) looks longer than
the node needs, and an average of those would make the next queued task late again. A node with no finished
task yet gets no queued task (nothing is known of its cycle). A wrong guess costs little: too early, the model
is a little older; too late, the node polls once empty and sleeps (what happens without prefetch).

A queued task is worth sending only if it can still be applied when its reply lands. Flower cannot recall a
message once it is on the SuperLink, and the node pulls it exactly when it starts it, so "before it starts" is
the moment of its dispatch: ``staleness_at_reply`` predicts the versions the server makes between then and the
queued task's reply (the recent version rate times the time until the node's open tasks and this one end, each a
``cycle``), and the loop does not queue a task predicted to come back more than ``max_staleness``
versions stale: the node's next task then leaves when its reply lands, with the newest model (refreshed).

>>> timer = PrefetchTimer(lead=2.0)
>>> timer.dispatched(1, client=7, now=0.0)
>>> timer.replied(1, now=10.0)           # a 10 s cycle
>>> timer.dispatched(2, client=7, now=10.0)
>>> timer.due(7, [2], now=10.0)          # queue the next one 2 s before task 2 should end
18.0
>>> for t in (10.0, 12.0, 14.0):         # the server makes a version every 2 s
...     timer.stepped(t)
>>> timer.staleness_at_reply(7, [2], at=18.0, now=14.0)  # sent at 18, it ends at 30: 12 s at 0.5 versions/s
6.0
"""

from __future__ import annotations

import math
from collections import deque

#: How many recent server steps the version rate is measured over.
RATE_WINDOW = 16


class PrefetchTimer:
    """Per node: its recent task cycles and when its open tasks started (see the module docstring). ``lead``:
    seconds before the expected end of the running task; ``window``: cycles kept per node."""

    def __init__(self, lead: float, window: int = 5) -> None:
        self.lead, self.window = float(lead), int(window)
        self.cycles: dict[int, list[float]] = {}
        self.last_reply: dict[int, float] = {}
        self.sent: dict[int, tuple[int, float]] = {}  # open task id -> (client, dispatch time)
        self.steps: deque[float] = deque(maxlen=RATE_WINDOW)  # when the server made its recent versions

    def dispatched(self, task_id: int, client: int, now: float) -> None:
        self.sent[int(task_id)] = (int(client), float(now))

    def start(self, task_id: int) -> float | None:
        """When ``task_id`` started on its node: its dispatch, or its node's last reply if that came later."""
        sent = self.sent.get(int(task_id))
        if sent is None:
            return None
        client, t = sent
        return max(t, self.last_reply.get(client, t))

    def replied(self, task_id: int, now: float, timed: bool = True) -> None:
        """A reply to ``task_id`` arrived at ``now``: one more cycle measured. ``timed=False``: the reply was read
        before that of a task sent to its node earlier (out of order, ``Ledger.overtakes``), so when it started is
        not known; a cycle from the wrong start (near 0) would hold as the shortest for ``window`` replies and queue
        tasks too early."""
        start = self.start(task_id)
        if start is None:
            return
        client, _ = self.sent.pop(int(task_id))
        if not timed:
            return
        recent = self.cycles.setdefault(client, [])
        recent.append(max(now - start, 0.0))
        del recent[: -self.window]
        self.last_reply[client] = max(now, self.last_reply.get(client, now))

    def cycle(self, client: int) -> float | None:
        """The node's expected task time: the shortest of its recent ones (None before its first reply)."""
        recent = self.cycles.get(int(client))
        return min(recent) if recent else None

    def failed(self, task_id: int) -> None:
        self.sent.pop(int(task_id), None)

    def due(self, client: int, open_tasks: list[int], now: float) -> float:
        """When to queue one more task behind ``open_tasks`` (the node's, oldest first); ``inf``: not yet known."""
        cycle = self.cycle(client)
        start = self.start(open_tasks[0]) if open_tasks else now
        if cycle is None or start is None:
            return math.inf
        return start + len(open_tasks) * cycle - self.lead

    def stepped(self, now: float) -> None:
        """The server made a new version at ``now``."""
        self.steps.append(float(now))

    def rate(self, now: float) -> float | None:
        """Versions per second over the recent steps, up to ``now`` (a pause lowers it); None before two steps."""
        if len(self.steps) < 2 or now <= self.steps[0]:
            return None
        return (len(self.steps) - 1) / (now - self.steps[0])

    def staleness_at_reply(self, client: int, open_tasks: list[int], at: float, now: float) -> float:
        """Versions the server is expected to make between ``at`` (a queued task's dispatch behind ``open_tasks``)
        and that task's reply: the version rate times the time until the node's open tasks, then this one, end
        (each a ``cycle``, the shortest recent one, as ``due`` assumes: a task sent at once, not queued, looks
        longer by the node's empty poll, which is no part of a queued task's time; the running one ends at the
        earliest at ``at``). 0 while the rate or the node's cycle is not known."""
        rate, cycle = self.rate(now), self.cycle(client)
        start = self.start(open_tasks[0]) if open_tasks else at
        if rate is None or cycle is None or start is None:
            return 0.0
        ahead_ends = max(start + len(open_tasks) * cycle, at)
        return rate * (ahead_ends + cycle - at)

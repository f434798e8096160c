"""The deployment's wire meter (fedcomp.sim.wirecost.MeteredTransport): every reply read crosses the wire, also those
the loop never handles; after the loop it reads the replies that landed since (``drain``)."""

from fedcomp.protocol import ReplyMeta
from fedcomp.server.loops import ReplyEvent, SendReceipt, Transport
from fedcomp.sim.wirecost import MeteredTransport, TaskClock
from fedcomp.tools.summary import metered


class Replies(Transport):
    """Answers each ``poll`` with the next batch of replies (none once they run out)."""

    def __init__(self, batches):
        self.batches = list(batches)

    def clients(self):
        return [1]

    def send(self, task, model):
        return SendReceipt(40_000, 3)

    def poll(self, wait):
        return self.batches.pop(0) if self.batches else []

    def evaluate(self, clients, model, version, timeout):
        return []


def reply(task_id, size=6_000):
    return ReplyEvent(task_id, 1, b"x", ReplyMeta(task_id, 0), {}, size, 3)


def test_drain_reads_the_replies_left_after_the_loop_and_the_clock_counts_them():
    clock = TaskClock(start=0.0)
    for task_id in (1, 2, 3):
        clock.sent(1, task_id, now=0.0, flower_bytes=40_000, objects=3)
    meter = MeteredTransport(Replies([[reply(1)], [reply(2), reply(3, 7_000)]]), clock)
    assert [e.task_id for e in meter.poll(0.0)] == [1]  # the loop's last read
    assert meter.drain(wait=5.0) == 2  # the two pushed after it; returns once a read finds nothing
    assert (clock.replies, clock.reply_flower_bytes, clock.reply_objects) == (3, 19_000, 9)
    assert not clock.open


def test_the_summary_carries_the_replies_after_the_run_and_the_clients_median_compute():
    clock = TaskClock(start=0.0)
    for task_id in (1, 2, 3):
        clock.sent(1, task_id, now=0.0, flower_bytes=40_000, objects=3)
    events = [[ReplyEvent(t, 1, b"x", ReplyMeta(t, 0), {"train-seconds": s}, 6_000, 3)] for t, s in
              ((1, 9.0), (2, 0.2), (3, 0.3))]  # the first task also built the worker
    meter = MeteredTransport(Replies(events), clock)
    meter.poll(0.0)
    unread = meter.drain(wait=5.0)
    summary = metered({"wire": {}}, meter, unread)
    assert summary["wire"]["replies_after_the_run"] == 2
    assert summary["train_seconds_median"] == 0.3


class LateReply(Replies):
    """A reply that lands ``after`` seconds after the first poll (a node still working when the loop ended)."""

    def __init__(self, event, after):
        super().__init__([])
        self.event, self.after, self.t0 = event, after, None

    def poll(self, wait):
        import time

        self.t0 = self.t0 if self.t0 is not None else time.monotonic()
        if self.event is not None and time.monotonic() - self.t0 >= self.after:
            event, self.event = self.event, None
            return [event]
        time.sleep(min(wait, 0.05))
        return []


def test_the_drain_waits_as_long_as_the_task_cycles_it_saw_not_only_the_compute():
    """The compute says 0.1 s per task, the tasks took 2 s from dispatch to reply (transport latency, load): a
    reply 1.5 s late is read (the wait is 2 x 2 s + 1 s), where a wait from the compute (1.2 s) missed it."""
    clock = TaskClock(start=0.0)
    for task_id in (1, 2, 3):
        clock.sent(1, task_id, now=0.0)
    clock.replied(1, now=2.0, flower_bytes=6_000, objects=3)
    clock.replied(2, now=4.0, flower_bytes=6_000, objects=3)
    assert clock.cycles == [2.0, 2.0]
    meter = MeteredTransport(LateReply(reply(3), after=1.5), clock)
    meter.train_seconds = [0.1, 0.1]
    assert meter.drain() == 1
    assert clock.replies == 3 and not clock.open

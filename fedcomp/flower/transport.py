"""``fedcomp.server.loops.Transport`` over Flower's ``Grid`` (push/pull; never waits for all replies).

Every task is in ``compression_mod``'s layout (``fedcomp.flower.records``): the product's loops (``server_app``,
the simulator) send ``TaskFormat.content`` (the model as the downlink blob, their ``ConfigRecord "config"`` folded
into fedcomp's record), so their tasks take the same client path as ``Compressed``'s; ``Compressed(..., mode="async")``
sends the wrapped strategy's message with fedcomp's record through a subclass
(``fedcomp.flower.loopmode.ModTransport``, which overrides ``message`` and ``to_event``). A reply's example
count is its ``num-examples`` metric (what the server weights by when the run says so).

Error replies (NODE_UNAVAILABLE, CLIENT_APP_RAISED_EXCEPTION, TTL expiry, ...) become ``FailureEvent``s. Replies
are matched to tasks by ``reply_to_message_id`` (SuperLink-made error replies carry ``src_node_id`` 1, so the
source node id is never trusted for that). A message id stays watched until its Flower TTL has passed, so a
reply that arrives after the server's own deadline is still seen (and ignored as "late" by the protocol).
Replies are read through ``fedcomp.flower.grid.ReplyReader`` (one pull per message id, on background threads):
a reply still uploading when it is pulled waits out Flower's backoff on its own thread, and the replies that
are complete reach the loop without waiting for it (``reader.stats`` counts such slow reads).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, RecordDict
from flwr.common.constant import ErrorCode
from flwr.serverapp import Grid

from fedcomp.flower import records
from fedcomp.flower.grid import DEFAULT_MAX_READS_PER_S, ReplyReader, check_rate, read_interval
from fedcomp.flower.replies import example_weight
from fedcomp.protocol import Outcome, ReplyMeta, Task
from fedcomp.server.loops import COMPUTE_METRIC, Event, FailureEvent, ReplyEvent, SendReceipt, Transport
from fedcomp.wire import decode

ERROR_NAMES = {v: k for k, v in vars(ErrorCode).items() if k.isupper() and isinstance(v, int)}


@dataclass
class _Watch:
    task: Task
    expires: float


class TaskMessages:
    """How a server writes its train messages and reads their replies: ``content(task, model)``, the records of
    ``task``'s message with the downlink blob ``model``, and ``to_event(task, reply)``. Here the product loops'
    (``tasks``: ``records.TaskFormat``; ``reply_event``); ``fedcomp.flower.loopmode.ModTransport`` writes and
    reads ``Compressed``'s. The simulator's engines take either, to run the same messages without a Grid."""

    def __init__(self, tasks: records.TaskFormat | None = None) -> None:
        self.tasks = tasks

    def require_tasks(self) -> records.TaskFormat:
        if self.tasks is None:
            raise ValueError(f"this {type(self).__name__} was made without a TaskFormat: it cannot write tasks")
        return self.tasks

    def content(self, task: Task, model: bytes) -> RecordDict:
        return self.require_tasks().content(task, model)

    def to_event(self, task: Task, reply: Message) -> Event:
        return reply_event(task, reply)


class GridTransport(TaskMessages, Transport):
    """``ttl_slack``: seconds of Flower TTL beyond the task deadline. ``node_refresh``: seconds between
    ``get_node_ids`` calls (each is one request to the SuperLink). ``pull_interval``: seconds between reads of
    the replies still missing (one request per reply); a reply read on a background thread ends a ``poll`` wait
    at once. ``read_workers``: pulls at once, besides those waiting on a slow upload. ``max_reads_per_s``: the
    reads' bound on the SuperLink: with many replies missing the reads come less often (``read_interval``).
    ``tasks``: how the tasks are written (the compression, the model's layout); needed to send tasks."""

    def __init__(self, grid: Grid, ttl_slack: float = 30.0, node_refresh: float = 2.0, pull_interval: float = 0.25,
                 read_workers: int = 4, max_reads_per_s: float = DEFAULT_MAX_READS_PER_S,
                 tasks: records.TaskFormat | None = None):
        super().__init__(tasks)
        self.grid = grid
        self.ttl_slack, self.node_refresh, self.pull_interval = ttl_slack, node_refresh, pull_interval
        self.max_reads_per_s = check_rate(max_reads_per_s)
        self.reader = ReplyReader(grid, read_workers)
        self._read_at = -1e18
        self.clock = time.monotonic  # when the reads were made (a test may move it by hand)
        self.watch: dict[str, _Watch] = {}
        self._nodes: list[int] = []
        self._nodes_at = -1e18

    def clients(self) -> list[int]:
        now = time.monotonic()
        if now - self._nodes_at >= self.node_refresh:
            self._nodes = sorted(int(n) for n in self.grid.get_node_ids())
            self._nodes_at = now
        return list(self._nodes)

    def _push(self, message: Message) -> str:
        ids = list(self.grid.push_messages([message]))
        if not ids or not ids[0]:
            raise RuntimeError(f"SuperLink did not accept the message to node {message.metadata.dst_node_id}")
        return ids[0]

    def send(self, task: Task, model: bytes) -> SendReceipt:
        ttl = max(1.0, task.deadline - task.sent_at) + self.ttl_slack
        msg = self.message(task, model, ttl)
        size, objects = records.flower_size(msg)
        msg_id = self._push(msg)
        self.watch[msg_id] = _Watch(task, time.monotonic() + ttl)
        return SendReceipt(size, objects)

    def message(self, task: Task, model: bytes, ttl: float) -> Message:
        """The train message of ``task`` with the downlink blob ``model`` (``content``)."""
        return Message(self.content(task, model), task.client, records.TRAIN, ttl=ttl, group_id=str(task.round))

    def poll(self, wait: float) -> list[Event]:
        end = time.monotonic() + wait
        while True:
            events = self._pull()
            now = time.monotonic()
            if events or now >= end:
                return events
            self.reader.wait(min(self.read_interval(), end - now))  # a slow reply read meanwhile wakes it

    def read_interval(self) -> float:
        """Seconds between reads of the replies watched (``fedcomp.flower.grid.read_interval``)."""
        return read_interval(len(self.watch), self.pull_interval, self.max_reads_per_s)

    def _pull(self) -> list[Event]:
        now = self.clock()
        for mid in [m for m, w in self.watch.items() if w.expires < now]:
            del self.watch[mid]
        if now - self._read_at >= self.read_interval():  # new requests at most once per read interval
            self._read_at = now
            self.reader.request(list(self.watch))
            self.reader.settle()
        events: list[Event] = []
        for reply in self.reader.take():  # what landed, also from slow reads; with nothing watched: dropped
            w = self.watch.pop(reply.metadata.reply_to_message_id, None)
            if w is None:
                continue
            events.append(self.to_event(w.task, reply))
        return events

    def evaluate(self, clients: list[int], model: bytes, version: int, timeout: float) -> list[dict[str, float]]:
        """Federated evaluation of the model blob ``model`` (version ``version``): an evaluate message with the
        model as a dense ArrayRecord (what the train function's ``evaluate`` reads) to each of ``clients``; the
        metrics of the replies that come within ``timeout`` seconds."""
        spec = self.require_tasks().layout.spec()  # type: ignore[union-attr]
        dense = decode(model, spec).to_dense()
        arrays = ArrayRecord({n: Array(t.numpy().astype(np.float32)) for n, t in dense.items()})
        content = RecordDict({self.require_tasks().arrays_key: arrays,
                              records.CONFIG: ConfigRecord({records.SERVER_ROUND: int(version)})})
        pending: dict[str, int] = {}
        for c in clients:
            msg = Message(RecordDict(dict(content)), c, records.EVALUATE, ttl=timeout + 5)
            try:
                pending[self._push(msg)] = c
            except RuntimeError:
                continue
        out: list[dict[str, float]] = []
        end = time.monotonic() + timeout
        reader = ReplyReader(self.grid)  # its own: never takes a training reply from the loop's reader
        while pending and time.monotonic() < end:
            for reply in reader.read(list(pending)):
                if pending.pop(reply.metadata.reply_to_message_id, None) is None:
                    continue
                if not reply.has_error() and "metrics" in reply.content.metric_records:
                    out.append({k: float(v) for k, v in reply.content.metric_records["metrics"].items()})
            if pending:
                time.sleep(min(read_interval(len(pending), self.pull_interval, self.max_reads_per_s),
                               max(end - time.monotonic(), 0.0)))
        return out


def reply_event(task: Task, reply: Message) -> Event:
    """The loop's event for ``reply`` to ``task``: a ``FailureEvent`` for an error reply, a ``ReplyEvent`` (blob,
    meta with the reply's ``num-examples``, its train seconds as ``COMPUTE_METRIC``) otherwise, with an ``error``
    when the records are not a ``compression_mod`` reply to this task (the protocol rejects and counts it)."""
    if reply.has_error():
        code = ERROR_NAMES.get(reply.error.code, str(reply.error.code))
        text = reply.error.reason.strip()
        text = text if len(text) <= 300 else "..." + text[-300:]  # a traceback's last lines name the exception
        return FailureEvent(task.task_id, task.client, Outcome.LOST, f"{code}: {text}")
    size, objects = records.flower_size(reply)
    try:
        blob, meta = records.read_mod_reply(reply.content)
        examples = example_weight(reply.content, records.NUM_EXAMPLES)
    except records.RecordError as exc:
        meta = ReplyMeta(task.task_id, 0)
        return ReplyEvent(task.task_id, task.client, b"", meta, {}, size, objects, error=f"records: {exc}")
    meta = replace(meta, num_examples=int(examples))
    metrics = {COMPUTE_METRIC: records.mod_reply_seconds(reply.content)}
    if meta.task_id != task.task_id:
        error = f"records: reply claims task {meta.task_id}, answers {task.task_id}"
        return ReplyEvent(task.task_id, task.client, b"", meta, metrics, size, objects, error=error)
    return ReplyEvent(task.task_id, task.client, blob, meta, metrics, size, objects)

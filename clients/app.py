"""The fedcomp Flower ``ClientApp``: a thin forwarder that imports no torch.

A message of the public layout (what ``Compressed(strategy)`` sends: fedcomp's ConfigRecord beside the
strategy's records) takes the one client path: ``clients.task.app``, the product's train function under
``compression_mod``, served by the node's worker as any Flower app is (``clients.forward.WarmApp``), or in this
process when there is none. A message of the product's own layout (a ``task`` record with a ``model`` blob) is
handled as follows.

Flower 1.41's SuperNode starts a fresh ``flwr-clientapp`` process for every message; this module is what that
process imports, so it holds only Flower, the standard library and ``clients.channel``. Per ``train`` or
``evaluate`` message:

* the node config names a warm worker (``worker-socket``, ``worker-key``: ``flower-client --worker warm``, the
  default): the message's content, the run and node config, the node and run id and ``context.state`` go to the
  worker over its private channel (``clients.channel``), which answers with the reply's records and the new
  state; a task that fails there raises here, as it would in-process;
* no worker, or the worker cannot be reached within ``worker-wait`` seconds (or dies during the task): the task
  runs in this process (``clients.work``, imported only then), with a warning, so no task is lost.

What a task does (acks/nacks, training, compression, where the client session lives, ``state-dir``, ``gpu``,
``kernels``) is ``clients.work``'s contract. The node settings are ``context.node_config``: ``partition-id``,
``num-partitions``, ``gpu``, ``device-class``, ``state-dir``, ``kernels`` and the worker's keys.

>>> reply = app(train_message, Context(1, 17, {"partition-id": 0, "num-partitions": 2}, RecordDict(), run))
... # doctest: +SKIP
"""

from __future__ import annotations

from logging import WARNING
from pathlib import Path
from typing import Any

from flwr.app import Context, Message, RecordDict
from flwr.clientapp import ClientApp
from flwr.common.logger import log

from clients import channel
from clients.forward import WarmApp, time_left

app = ClientApp()
#: The root of the code this ClientApp runs (the run's FAB in a deployment): the worker must run the same.
CODE_ROOT = str(Path(__file__).resolve().parents[1])
#: The product's train function under ``compression_mod``: what a message of the public layout runs.
TASK_APP = "clients.task:app"
_PUBLIC: list[WarmApp] = []


def is_public(msg: Message) -> bool:
    """Whether ``msg`` has the public layout (``Compressed``'s: fedcomp's ConfigRecord and/or the strategy's
    ArrayRecord) rather than the product's own (a ``task`` record, a ``model`` blob)."""
    content = msg.content
    return "fedcomp" in content.config_records or any(k != "model" for k in content.array_records)


def public_app() -> WarmApp:
    """``clients.task.app`` behind the node's worker (``clients.forward.WarmApp``), made once per process."""
    if not _PUBLIC:
        _PUBLIC.append(WarmApp(CODE_ROOT, TASK_APP))
    return _PUBLIC[0]


@app.train()
def train(msg: Message, context: Context) -> Message:
    """One train task: forwarded to the node's worker, else run in-process."""
    if is_public(msg):  # strategy -> compression_mod -> clients.task.train -> compression_mod -> reply
        return public_app()(msg, context)
    return Message(handle("train", msg.content, context, timeout=time_left(msg)), reply_to=msg)


@app.evaluate()
def evaluate_model(msg: Message, context: Context) -> Message:
    """Federated evaluation of the task's model on this node's share of the test split."""
    if is_public(msg):
        return public_app()(msg, context)
    return Message(handle("evaluate", msg.content, context, timeout=time_left(msg)), reply_to=msg)


def handle(
    kind: str, content: RecordDict, context: Context, bench: Any = None, timeout: float = channel.TASK_WAIT
) -> RecordDict:
    """The reply content of a ``kind`` task (``"train"`` or ``"evaluate"``), from the worker when the node config
    names one and it answers, else computed here, with ``bench`` (a ``clients.work.Bench`` the caller keeps
    between tasks: a warm node in one process, as the simulator runs one) or a fresh one; ``context.state`` is
    updated either way. A worker that takes the task and sends nothing for ``timeout`` seconds is killed and the
    task fails (``channel.WorkerHung``)."""
    endpoint = channel.Endpoint.from_node_config(context.node_config)
    if endpoint is not None:
        try:
            try:
                return forward(endpoint, kind, content, context, timeout)
            except channel.Restarting:  # the worker restarts on this run's code: once more, to the new one
                return forward(endpoint, kind, content, context, timeout)
        except channel.Unreachable as exc:
            log(WARNING, "fedcomp: %s; running this %s task in the ClientApp process", exc, kind)
    from clients import work  # torch and the model code: only on this path

    return work.HANDLERS[kind](content, context, bench)


class KeptNode:
    """The product's ClientApp for one node that keeps its task state (data partition, model, client session) in
    this process between messages, as the node's warm worker keeps it; the public entry point of a simulator's
    warm node (``simulations.engines``). A cold node is ``app`` itself.

    >>> node = KeptNode()
    >>> reply = node(train_message, context)  # doctest: +SKIP
    """

    def __init__(self) -> None:
        self.bench: Any = None  # a clients.work.Bench, made at the first message (torch is imported then)

    def __call__(self, msg: Message, context: Context) -> Message:
        from clients import work

        if is_public(msg):  # the public layout: clients.task.app keeps a bench per node itself
            from clients import task

            return task.app(msg, context)
        if self.bench is None:
            self.bench = work.Bench()
        kind = msg.metadata.message_type
        return Message(work.HANDLERS[kind](msg.content, context, self.bench), reply_to=msg)


def forward(
    endpoint: channel.Endpoint, kind: str, content: RecordDict, context: Context, timeout: float = channel.TASK_WAIT
) -> RecordDict:
    """Run the task in the worker; raises what the task raised there, ``channel.Unreachable`` if no worker ran
    it (a worker running other code than this app's refuses, and restarts on this app's code)."""
    reply: dict[str, Any] = channel.request(
        endpoint,
        {
            "code": CODE_ROOT,
            "kind": kind,
            "content": content,
            "run_id": context.run_id,
            "node_id": context.node_id,
            "node_config": dict(context.node_config),
            "run_config": dict(context.run_config),
            "state": context.state,
        },
        timeout,
    )
    return channel.adopt_reply(reply, context.state)["content"]

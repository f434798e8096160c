"""The fedcomp Flower ``ClientApp``: a thin forwarder that imports no torch.

Every message takes the one client path: ``clients.task.app``, the product's train function under
``compression_mod`` (strategy or the product's loops -> ``compression_mod`` -> ``clients.task.train`` ->
``compression_mod`` -> reply), served by the node's long-lived worker as any Flower app is
(``clients.forward.WarmApp``: ``flower-client --worker warm``, the default), or in this process when there is
none or it cannot be reached (with a warning, so no task is lost).

Flower 1.41's SuperNode starts a fresh ``flwr-clientapp`` process for every message; this module is what that
process imports, so it holds only Flower, the standard library and ``clients.forward``. What a task does
(acks/nacks, training, compression, where the client session lives, ``state-dir``, ``gpu``, ``kernels``) is
``compression_mod``'s and ``clients.task``'s contract. The node settings are ``context.node_config``:
``partition-id``, ``num-partitions``, ``gpu``, ``device-class``, ``state-dir``, ``kernels`` and the worker's keys.

>>> reply = app(train_message, Context(1, 17, {"partition-id": 0, "num-partitions": 2}, RecordDict(), run))
... # doctest: +SKIP
"""

from __future__ import annotations

from pathlib import Path

from flwr.app import Context, Message
from flwr.clientapp import ClientApp

from clients.forward import WarmApp

app = ClientApp()
#: The root of the code this ClientApp runs (the run's FAB in a deployment): the worker must run the same.
CODE_ROOT = str(Path(__file__).resolve().parents[1])
#: The product's train function under ``compression_mod``: what every message runs.
TASK_APP = "clients.task:app"
_TASK: list[WarmApp] = []


def task_app() -> WarmApp:
    """``clients.task.app`` behind the node's worker (``clients.forward.WarmApp``), made once per process."""
    if not _TASK:
        _TASK.append(WarmApp(CODE_ROOT, TASK_APP))
    return _TASK[0]


@app.train()
def train(msg: Message, context: Context) -> Message:
    """One train task: forwarded to the node's worker, else run in-process."""
    return task_app()(msg, context)


@app.evaluate()
def evaluate_model(msg: Message, context: Context) -> Message:
    """Federated evaluation of the task's model on this node's share of the test split."""
    return task_app()(msg, context)

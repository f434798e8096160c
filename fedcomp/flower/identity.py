"""The running task's identity that Flower sets before a ServerApp's ``main`` (``TaskIdentity``): a strategy needs
it to build its messages. Code that drives a strategy outside a ServerApp (the simulator's public-strategy runs,
the in-process test federation) sets it for the run with ``server_identity``.

    >>> with server_identity(run_id=7):
    ...     pass
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from flwr.supercore.task_identity import TaskIdentity


@contextmanager
def server_identity(run_id: int) -> Iterator[None]:
    """Run ``run_id``'s server (node 0, task 1) as the running task; the identity before is put back afterwards."""
    saved = (TaskIdentity._run_id, TaskIdentity._node_id, TaskIdentity._task_id)
    TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = run_id, 0, 1
    try:
        yield
    finally:
        TaskIdentity._run_id, TaskIdentity._node_id, TaskIdentity._task_id = saved

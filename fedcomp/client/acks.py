"""The client half of the ack protocol: which task each pending update answered, and what acks and nacks do.

>>> side = ClientSide(fedcomp.build("topk", spec, density=0.1))  # doctest: +SKIP
>>> blob, seq = side.send(7, grads)  # the update answering task 7, pending  # doctest: +SKIP
>>> side.apply([Resolution(7, 0, Outcome.TIMEOUT)])  # the update comes back into the residual  # doctest: +SKIP
{'timeout': 1}
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from fedcomp.kernels.encode import encode_update
from fedcomp.protocol import Outcome, Resolution


class ClientSide:
    """The client half of the ack protocol over a ``Pipeline``: remembers which task each pending ``seq`` answered
    and applies the server's resolutions (ack -> forget, nack -> restore into the error-feedback memory).

    Resolutions may arrive twice (the server re-sends those of a task that failed); applying one again is a
    no-op because the pipeline no longer holds that ``seq``. A resolution whose ``seq`` is not the one its task
    sent (0 stands for "the one it sent") changes nothing: the update stays pending and listed for resync.
    """

    def __init__(self, pipeline: Any, task_seqs: Mapping[int, int] | None = None) -> None:
        self.pipeline = pipeline
        self.task_seqs: dict[int, int] = {int(k): int(v) for k, v in (task_seqs or {}).items()}

    def apply(self, resolutions: list[Resolution]) -> dict[str, int]:
        """Apply acks/nacks; returns counts per outcome actually applied (repeats are not counted)."""
        counts: dict[str, int] = {}
        for r in resolutions:
            # Only tasks this state answered count: a resolution for another incarnation's task (a resumed
            # server, a restarted node) is ignored even if its seq number happens to be pending here. One that
            # names this task but another seq is ignored too, and the task keeps its update pending: the resync
            # request lists it again until a resolution with its seq (or seq 0: the server never saw it) comes.
            seq = self.task_seqs.get(r.task_id, 0)
            if not seq or (r.seq and r.seq != seq):
                continue
            del self.task_seqs[r.task_id]
            done = self.pipeline.ack(seq) if r.outcome is Outcome.APPLIED else self.pipeline.nack(seq)
            if done:
                counts[r.outcome.value] = counts.get(r.outcome.value, 0) + 1
        return counts

    def pending_tasks(self) -> tuple[int, ...]:
        """Task ids whose update is still pending here (``ReplyMeta.pending``: the resync request).

        >>> side.sent(7, 3); side.pending_tasks()  # doctest: +SKIP
        (7,)
        """
        return tuple(sorted(t for t, seq in self.task_seqs.items() if seq in self.pipeline.pending))

    def send(
        self,
        task_id: int,
        tensors: Mapping[str, Any],
        base_version: int = 0,
        client_id: int = 0,
        max_norm: float = 0.0,
    ) -> tuple[bytes, int]:
        """The pipeline's send step (``Pipeline.send``: compensate, compress, update the memory, encode) for the
        update answering ``task_id``; returns ``(blob, seq)``. It stays pending until the ack or nack of its task
        (``apply``); ``max_norm`` > 0 bounds the norm of what is sent (client-side DP clipping)."""
        blob = self.pipeline.send(tensors, base_version=base_version, client_id=client_id, max_norm=max_norm)
        self.sent(task_id, self.pipeline.last_seq)
        return blob, self.pipeline.last_seq

    def sent(self, task_id: int, seq: int) -> None:
        """Record that ``seq`` answers ``task_id``."""
        self.task_seqs[int(task_id)] = int(seq)

    def answered(self, task_id: int) -> tuple[bytes, int] | None:
        """``(blob, seq)`` of the update still pending that answered ``task_id`` (the same bytes again), or ``None``.
        A task that comes twice is answered with its first update, whether the first reply left or not: the server
        applies that ``seq`` once, and a duplicate is judged as one. (Restoring it and sending a new one applied
        its mass twice when the first reply had reached the server.)

        >>> side.answered(7)  # doctest: +SKIP
        (b'FCMP...', 3)
        """
        seq = self.task_seqs.get(int(task_id), 0)
        update = self.pipeline.pending.get(seq)
        if update is None:
            return None
        return encode_update(update, self.pipeline.spec, backend=self.pipeline.backend), seq


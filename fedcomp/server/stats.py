"""The server's counters: outcomes, rejection reasons, staleness and bytes per version (one JSONL row each)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from fedcomp.counters import Counters
from fedcomp.protocol import Outcome


@dataclass
class VersionStats(Counters):
    """Counters since the last version (one JSONL row per version), plus byte and message totals.

    ``payload_*`` are the fedcomp blob sizes; ``flower_*`` the serialized Flower objects of the messages
    (see docs/protocol.md for how they are measured). ``merge`` and ``roll``: ``fedcomp.counters.Counters``.

    >>> s = VersionStats()
    >>> s.count(Outcome.REJECTED, "wire/crc: CRC mismatch")
    >>> s.reject_reasons
    {'wire/crc': 1}
    """

    accepted: int = 0
    stale: int = 0
    duplicate: int = 0
    late: int = 0
    rejected: int = 0
    timeout: int = 0
    lost: int = 0
    reject_reasons: dict[str, int] = field(default_factory=dict)
    staleness_hist: dict[int, int] = field(default_factory=dict)
    payload_bytes_up: int = 0
    payload_bytes_down: int = 0
    flower_bytes_up: int = 0
    flower_bytes_down: int = 0
    flower_objects_up: int = 0
    flower_objects_down: int = 0
    messages_up: int = 0
    messages_down: int = 0
    prefetched: int = 0  # tasks sent queued behind another open task of their node (prefetch)
    prefetched_applied: int = 0  # ... whose update was applied
    prefetched_staleness: int = 0  # the staleness of those, summed (the cost of queuing; mean = this / applied)
    prefetched_stale: int = 0  # queued tasks nacked stale: they ran although the model had moved on too far
    #: Tasks these counters never saw sent (a dead server's, sent after its last checkpoint, or another run's) that a
    #: client reported pending: nacked ``lost`` (counted there too), so ``messages_down + unknown_tasks`` are the
    #: tasks the outcomes answer.
    unknown_tasks: int = 0
    #: Versions (``Compressed``: rounds) whose train metrics the wrapped strategy's aggregation could not make (the
    #: replies' metrics disagreed in keys or types): the model was aggregated, without metrics.
    metrics_failed: int = 0

    def count(self, outcome: Outcome, reason: str = "", staleness: int | None = None) -> None:
        key = {Outcome.APPLIED: "accepted"}.get(outcome, outcome.value)
        setattr(self, key, getattr(self, key) + 1)
        if outcome is Outcome.REJECTED:
            short = reason.split(":")[0][:60]
            self.reject_reasons[short] = self.reject_reasons.get(short, 0) + 1
        if outcome is Outcome.APPLIED and staleness is not None:
            self.staleness_hist[staleness] = self.staleness_hist.get(staleness, 0) + 1

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["staleness_hist"] = {str(k): v for k, v in sorted(self.staleness_hist.items())}
        return d

    @staticmethod
    def from_dict(d: Mapping[str, Any]) -> VersionStats:
        s = VersionStats(**{k: v for k, v in d.items() if k != "staleness_hist"})
        s.staleness_hist = {int(k): int(v) for k, v in d.get("staleness_hist", {}).items()}
        s.reject_reasons = dict(d.get("reject_reasons", {}))
        return s

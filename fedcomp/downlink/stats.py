"""Downlink counters: messages sent by kind, their payload bytes, and resyncs."""

from __future__ import annotations

from dataclasses import asdict, dataclass

from fedcomp.counters import Counters


@dataclass
class DownlinkStats(Counters):
    """Downlink messages by kind and their payload bytes (``full_*``: full copies; ``delta_*``: delta chains);
    ``resyncs``: clients forgotten after a failed task (their next message is a full copy). ``merge`` and ``roll``:
    ``fedcomp.counters.Counters``.

    >>> s = DownlinkStats(full=1, full_bytes=100)
    >>> s.merge(DownlinkStats(delta=2, delta_bytes=30))
    >>> s.to_dict()["downlink_delta_bytes"]
    30
    """

    full: int = 0
    delta: int = 0
    full_bytes: int = 0
    delta_bytes: int = 0
    resyncs: int = 0

    def to_dict(self, prefix: str = "downlink_") -> dict[str, int]:
        return {prefix + k: v for k, v in asdict(self).items()}

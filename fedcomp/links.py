"""Link and device profiles and the virtual-clock arithmetic of one task.

A task dispatched at time ``t`` finishes at::

    t + rtt/2 + down_bytes/down_bps + compute(device, steps) + up_bytes/up_bps + rtt/2

where the byte counts are the real encoded message sizes. Loss and disconnects are drawn from a seeded
``random.Random`` owned by the caller, so the same seed gives the same timeline.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, replace
from typing import Any

MBPS = 1e6 / 8  # bytes per second in one megabit per second


@dataclass(frozen=True)
class LinkProfile:
    """A client's access link. Bandwidths in bytes/s, RTT in seconds, probabilities per message."""

    name: str
    up_Bps: float
    down_Bps: float
    rtt_s: float
    loss: float = 0.0  # probability that one message (either direction) is lost
    disconnect: float = 0.0  # probability that the node drops out during a task

    def __post_init__(self) -> None:
        if not (self.up_Bps > 0 and self.down_Bps > 0):
            raise ValueError(f"link {self.name!r}: bandwidths must be > 0")
        if self.rtt_s < 0 or not (0 <= self.loss < 1) or not (0 <= self.disconnect < 1):
            raise ValueError(f"link {self.name!r}: rtt must be >= 0 and loss/disconnect in [0, 1)")

    def transfer_s(self, up_bytes: int, down_bytes: int) -> float:
        """Seconds on the wire for one download plus one upload, RTT included."""
        return self.rtt_s + down_bytes / self.down_Bps + up_bytes / self.up_Bps

    def with_options(self, **options: Any) -> "LinkProfile":
        return replace(self, **options)


def _mbps(name: str, up: float, down: float, rtt_ms: float, loss: float = 0.0, disconnect: float = 0.0) -> LinkProfile:
    return LinkProfile(name, up * MBPS, down * MBPS, rtt_ms / 1e3, loss, disconnect)


#: Presets from public throttling presets and measurements (figures in DESIGN notes).
LINKS: dict[str, LinkProfile] = {
    p.name: p
    for p in (
        _mbps("datacenter", 10_000, 10_000, 1),
        _mbps("wifi", 30, 50, 20),
        _mbps("lte", 7.5, 25, 45),
        _mbps("slow4g", 0.75, 1.6, 150),
        _mbps("3g", 1.2, 1.2, 250, loss=0.005),
        _mbps("gprs", 0.02, 0.08, 650, loss=0.01),
    )
}


@dataclass(frozen=True)
class DeviceProfile:
    """Deterministic compute cost: seconds per training sample processed (forward + backward)."""

    name: str
    s_per_sample: float
    startup_s: float = 0.0  # fixed cost per task (process start, model load)

    def compute_s(self, samples: int) -> float:
        return self.startup_s + samples * self.s_per_sample


DEVICES: dict[str, DeviceProfile] = {
    d.name: d
    for d in (
        DeviceProfile("datacenter_gpu", 2e-5, 0.05),
        DeviceProfile("laptop", 5e-4, 0.2),
        DeviceProfile("phone", 2e-3, 0.5),
    )
}


@dataclass(frozen=True)
class TaskTiming:
    """When one task's result reaches the server, or that it never does."""

    finish_s: float
    lost: bool  # the reply (or the task) was lost on the link
    disconnected: bool  # the node vanished during the task

    @property
    def delivered(self) -> bool:
        return not (self.lost or self.disconnected)


def task_timing(
    dispatch_s: float,
    link: LinkProfile,
    device: DeviceProfile,
    *,
    down_bytes: int,
    up_bytes: int,
    samples: int,
    rng: random.Random,
) -> TaskTiming:
    """Finish time of a task and its fate, drawn from ``rng`` (two draws per task, always, for stable streams)."""
    if down_bytes < 0 or up_bytes < 0 or samples < 0:
        raise ValueError("byte counts and samples must be >= 0")
    lost_draw, disc_draw = rng.random(), rng.random()
    finish = dispatch_s + link.transfer_s(up_bytes, down_bytes) + device.compute_s(samples)
    # a message is lost if either direction loses it
    lost = lost_draw < 1 - (1 - link.loss) ** 2
    return TaskTiming(finish if math.isfinite(finish) else math.inf, lost, disc_draw < link.disconnect)

"""Link and device profiles and the virtual-clock arithmetic of one task.

A task dispatched at time ``t`` finishes at::

    t + rtt/2 + down_bytes/down_bps + compute(device, steps) + up_bytes/up_bps + rtt/2

where the byte counts are the real encoded message sizes (``finish_time``: the virtual clock without a transport
model; with Flower's transport on the clock, ``fedcomp.sim.virtual`` adds the poll wait, one round trip per request,
the SuperExec's poll, the ClientApp process start, the reply check and the server's reply pull). Loss and
disconnects are drawn from a seeded ``random.Random`` owned by the caller, so the same seed gives the same timeline.

``Availability`` windows say when a node is online (a periodic on/off schedule); ``link_from_config`` and
``device_from_config`` build custom profiles from plain mappings (a scenario file's ``[links.NAME]`` and
``[devices.NAME]`` tables), with bandwidths in Mbit/s and RTT in ms as people write them.
"""

from __future__ import annotations

import math
import random
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

from fedcomp.registry import check_ranges

MBPS = 1e6 / 8  # bytes per second in one megabit per second
#: The slowest link and the longest round trip a scenario's link table may give (``link_from_config``): beyond them
#: a transfer runs to years of virtual time, and the server's read back-off (seconds a step) takes that long in
#: wall time to get there.
MIN_BPS, MAX_RTT_S = 0.001 * MBPS, 600.0
#: A device's largest charges: a minute per sample, a day to start a task (beyond them a clock overflows).
MAX_S_PER_SAMPLE, MAX_STARTUP_S = 60.0, 86_400.0


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
        if not 0 <= self.rtt_s < math.inf or not (0 <= self.loss < 1) or not (0 <= self.disconnect < 1):
            raise ValueError(f"link {self.name!r}: rtt must be finite and >= 0, and loss/disconnect in [0, 1)")

    def transfer_s(self, up_bytes: int, down_bytes: int) -> float:
        """Seconds on the wire for one download plus one upload, RTT included."""
        return self.rtt_s + down_bytes / self.down_Bps + up_bytes / self.up_Bps

    def with_options(self, **options: Any) -> LinkProfile:
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

    def __post_init__(self) -> None:
        check_ranges(("s_per_sample", self.s_per_sample, f"in [0, {MAX_S_PER_SAMPLE:g}]",
                      0 <= self.s_per_sample <= MAX_S_PER_SAMPLE),
                     ("startup_s", self.startup_s, f"in [0, {MAX_STARTUP_S:g}]", 0 <= self.startup_s <= MAX_STARTUP_S),
                     error=ValueError, prefix=f"device {self.name!r}: ")

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
    """When one task's result reaches the server, or that it never does.

    ``lost_down``: the task itself was lost on the downlink (the client never ran it); otherwise a loss is of
    the reply (the client ran the task, the server never sees the result).
    """

    finish_s: float
    lost: bool  # the reply (or the task) was lost on the link
    disconnected: bool  # the node vanished during the task
    lost_down: bool = False

    @property
    def delivered(self) -> bool:
        return not (self.lost or self.disconnected)


@dataclass(frozen=True)
class Fate:
    """What the link does to one task, drawn before anything is sent.

    ``lost_down``: the task is lost on the downlink (the client never runs it). ``lost_up``: the reply is lost
    (the client ran the task). ``disconnect_at``: None, or the fraction (0..1) of the task's duration after
    which the node vanishes.
    """

    lost_down: bool
    lost_up: bool
    disconnect_at: float | None

    @property
    def delivered(self) -> bool:
        return not (self.lost_down or self.lost_up or self.disconnect_at is not None)


def draw_fate(link: LinkProfile, rng: random.Random) -> Fate:
    """Two draws per task, always (stable streams): the task is lost with ``p = link.loss``, else its reply with
    ``p`` (so either direction: ``1 - (1-p)^2``); the node vanishes with ``link.disconnect``, at a uniform point."""
    lost_draw, disc_draw = rng.random(), rng.random()
    p = link.loss
    lost_down = lost_draw < p
    lost_up = not lost_down and lost_draw < 1 - (1 - p) ** 2
    at = disc_draw / link.disconnect if disc_draw < link.disconnect else None
    return Fate(lost_down, lost_up, at)


def finish_time(
    dispatch_s: float, link: LinkProfile, device: DeviceProfile, *, down_bytes: int, up_bytes: int, samples: int
) -> float:
    """``dispatch + rtt + down_bytes/down_bw + compute(samples) + up_bytes/up_bw`` (bytes must be >= 0)."""
    if down_bytes < 0 or up_bytes < 0 or samples < 0:
        raise ValueError("byte counts and samples must be >= 0")
    finish = dispatch_s + link.transfer_s(up_bytes, down_bytes) + device.compute_s(samples)
    return finish if math.isfinite(finish) else math.inf


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
    finish = finish_time(dispatch_s, link, device, down_bytes=down_bytes, up_bytes=up_bytes, samples=samples)
    fate = draw_fate(link, rng)
    return TaskTiming(finish, fate.lost_down or fate.lost_up, fate.disconnect_at is not None, fate.lost_down)


@dataclass(frozen=True)
class Availability:
    """A periodic on/off schedule: online iff ``(t + phase_s) mod period_s < online_s``.

    ``period_s = 0`` means always online. Phones that charge at night, laptops closed half the day.
    """

    period_s: float = 0.0
    online_s: float = 0.0
    phase_s: float = 0.0

    def __post_init__(self) -> None:
        if self.period_s < 0 or not math.isfinite(self.period_s):
            raise ValueError(f"availability period_s must be finite and >= 0, got {self.period_s}")
        if self.period_s and not (0 < self.online_s <= self.period_s):
            raise ValueError(f"availability online_s must be in (0, period_s={self.period_s}], got {self.online_s}")
        if not math.isfinite(self.phase_s):
            raise ValueError(f"availability phase_s must be finite, got {self.phase_s}")

    @property
    def always(self) -> bool:
        return self.period_s == 0 or self.online_s >= self.period_s

    def online(self, t: float) -> bool:
        return self.always or (t + self.phase_s) % self.period_s < self.online_s

    def next_change(self, t: float) -> float:
        """The first time after ``t`` at which ``online`` flips (``inf`` if it never does)."""
        if self.always:
            return math.inf
        pos = (t + self.phase_s) % self.period_s
        edge = self.online_s if pos < self.online_s else self.period_s
        return t + (edge - pos)

    def online_time(self, start: float, end: float) -> float:
        """Seconds online in ``[start, end)``.

        Example:
            >>> Availability(period_s=10.0, online_s=4.0).online_time(0.0, 25.0)
            12.0
        """
        if end <= start:
            return 0.0
        if self.always:
            return end - start

        def upto(t: float) -> float:  # online seconds in [-phase, t)
            full, pos = divmod(t + self.phase_s, self.period_s)
            return full * self.online_s + min(pos, self.online_s)

        return upto(end) - upto(start)

    def offline_at(self, start: float, end: float) -> float | None:
        """The first time in ``[start, end)`` at which the node is offline, or None if online throughout."""
        if self.always:
            return None
        if not self.online(start):
            return start
        change = self.next_change(start)
        return change if change < end else None


def _known(kind: str, name: str, given: Mapping[str, Any], known: set[str]) -> None:
    unknown = set(given) - known
    if unknown:
        raise ValueError(f"{kind} {name!r}: unknown key(s) {sorted(unknown)}; known: {sorted(known)}")


def link_from_config(name: str, cfg: Mapping[str, Any]) -> LinkProfile:
    """A link from ``{up_mbps, down_mbps, rtt_ms, loss, disconnect}``; ``base = "preset"`` starts from a preset."""
    _known("link", name, cfg, {"base", "up_mbps", "down_mbps", "rtt_ms", "loss", "disconnect"})
    base = cfg.get("base")
    if base is not None and base not in LINKS:
        raise ValueError(f"link {name!r}: unknown base {base!r}; known: {sorted(LINKS)}")
    b = LINKS[base] if base else None
    try:
        up = float(cfg["up_mbps"]) * MBPS if "up_mbps" in cfg else (b.up_Bps if b else None)
        down = float(cfg["down_mbps"]) * MBPS if "down_mbps" in cfg else (b.down_Bps if b else None)
        rtt = float(cfg["rtt_ms"]) / 1e3 if "rtt_ms" in cfg else (b.rtt_s if b else None)
        loss = float(cfg.get("loss", b.loss if b else 0.0))
        disconnect = float(cfg.get("disconnect", b.disconnect if b else 0.0))
    except (TypeError, ValueError, OverflowError) as exc:
        raise ValueError(f"link {name!r}: {exc}") from None
    if up is None or down is None or rtt is None:
        raise ValueError(f"link {name!r}: needs up_mbps, down_mbps and rtt_ms (or a base preset)")
    if not (up >= MIN_BPS and down >= MIN_BPS):
        raise ValueError(f"link {name!r}: up_mbps and down_mbps must be >= {MIN_BPS / MBPS:g} (1 kbit/s)")
    if not 0 <= rtt <= MAX_RTT_S:
        raise ValueError(f"link {name!r}: rtt_ms must be in [0, {MAX_RTT_S * 1e3:g}], got {rtt * 1e3:g}")
    return LinkProfile(name, up, down, rtt, loss, disconnect)


def device_from_config(name: str, cfg: Mapping[str, Any]) -> DeviceProfile:
    """A device class from ``{s_per_sample, startup_s}``; ``base = "preset"`` starts from a preset."""
    _known("device", name, cfg, {"base", "s_per_sample", "startup_s"})
    base = cfg.get("base")
    if base is not None and base not in DEVICES:
        raise ValueError(f"device {name!r}: unknown base {base!r}; known: {sorted(DEVICES)}")
    b = DEVICES[base] if base else None
    if "s_per_sample" not in cfg and b is None:
        raise ValueError(f"device {name!r}: needs s_per_sample (or a base preset)")
    try:
        per = float(cfg.get("s_per_sample", b.s_per_sample if b else 0.0))
        startup = float(cfg.get("startup_s", b.startup_s if b else 0.0))
    except (TypeError, ValueError, OverflowError) as exc:
        raise ValueError(f"device {name!r}: {exc}") from None
    return DeviceProfile(name, per, startup)

"""Link-aware density (``density="auto"``): the server picks, per node and per task, how much of the update to send.

The right density depends on the client's link: a laptop on WiFi uploads a 1.2 MB int8 update in a fraction of
its task, a phone on 3G needs seconds. ``AutoDensity`` learns each node's link from what the server observes of
its own tasks, never from a profile: per delivered reply the communication time ``comm = (arrival - start) -
compute`` (``start``: the dispatch, or the node's previous reply when the task was queued behind it: prefetch;
``compute``: the client-reported training seconds) and the payload bytes of the task's model and of the reply,
fitted by least squares to ``comm = latency + bytes x seconds_per_byte``. It then gives the node the largest
density of the ladder whose upload stays within ``upload_budget`` x (latency + compute): the upload may lengthen
the task by that share at most (the fitted latency holds the poll wait, round trips and the typical model
download).

Steps, for one node:

1. Probe: its first tasks take the ``probe`` densities (far apart, so the fit sees two sizes); they also send
   more of the early, fast-moving updates (DGC's observation behind sparsity warm-up).
2. Fit: ``(latency, seconds_per_byte)`` over the probes and the last ``window`` replies (no fit when the probes'
   sizes are within 1.5x of each other, or when the slope is within two standard errors of 0: the density then
   costs no upload time worth saving and the densest is chosen).
3. Choose: the largest ladder density ``d`` with ``seconds_per_byte x bytes(d) <= upload_budget x (latency +
   compute)``, where ``bytes(d)`` comes from the replies seen at each density (any node), scaled linearly to
   densities not seen yet; the ladder's smallest density when none fits.

Error feedback and the ack/nack contract are unchanged: what a sparser task leaves out stays in the client's
residual. The estimates are soft state: a restarted server learns them again (the probes run again).

>>> auto = AutoDensity(AutoDensityConfig(probe=(0.3, 0.1)))
>>> auto.choose(7)
0.3
>>> auto.dispatched(1, 7, now=0.0, density=0.3, down_bytes=50_000)
>>> auto.replied(1, now=4.0, up_bytes=300_000, compute_s=1.0)
>>> auto.choose(7)
0.1
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from fedcomp.registry import ConfigError

#: The densities ``AutoDensity`` chooses from, densest first. Nothing denser than 30%: with error feedback a 30%
#: update trains as well as a dense one (the example app's frontier) and costs a third of the upload; on the main
#: scenario a ladder topped by 100% reached 95% at 42.2 virtual s, this one at 36.7 s (docs/results.md).
LADDER = (0.3, 0.1, 0.03, 0.01)


@dataclass(frozen=True)
class AutoDensityConfig:
    """``upload_budget``: the upload may take at most this share of the rest of the task (latency + compute).
    ``ladder``: the densities to choose from. ``probe``: the densities of a node's first tasks. ``window``: the
    replies (besides the probes) the fit uses."""

    upload_budget: float = 0.5
    ladder: tuple[float, ...] = LADDER
    probe: tuple[float, ...] = (0.3, 0.1)
    window: int = 16

    def __post_init__(self) -> None:
        if isinstance(self.upload_budget, bool) or not isinstance(self.upload_budget, (int, float)):
            raise ConfigError(f"upload_budget must be a number, got {self.upload_budget!r}")
        if not (self.upload_budget > 0 and math.isfinite(self.upload_budget)):
            raise ConfigError(f"upload_budget must be finite and > 0, got {self.upload_budget}")
        for d in (*self.ladder, *self.probe):
            if not 0.0 < d <= 1.0:
                raise ConfigError(f"auto density: every density must be in (0, 1], got {d}")
        if not self.ladder or len(set(self.probe)) < 2 or self.window < 1:
            raise ConfigError("auto density: needs a ladder, two different probe densities and window >= 1")
        object.__setattr__(self, "ladder", tuple(sorted(set(self.ladder), reverse=True)))


@dataclass
class LinkEstimate:
    """One node's observations: ``(payload bytes down + up, communication seconds)`` of its probes and recent
    replies (the task's model and the reply share the link's time; one slope for both keeps the fit identified
    when a full model copy and a denser reply come together, and errs towards a slower uplink)."""

    probes: list[tuple[float, float, float]] = field(default_factory=list)  # (bytes up, bytes down, seconds)
    recent: deque[tuple[float, float, float]] = field(default_factory=deque)
    compute_s: float = 0.0  # mean client-reported compute seconds
    replies: int = 0
    density: float = 0.0  # the last density chosen
    probing: bool = False  # whether that choice was a probe

    def add(self, up: float, down: float, comm_s: float, compute_s: float, probing: bool, window: int) -> None:
        self.replies += 1
        self.compute_s += (compute_s - self.compute_s) / self.replies
        if probing:
            self.probes.append((up, down, comm_s))
        else:
            self.recent.append((up, down, comm_s))
            while len(self.recent) > window:
                self.recent.popleft()

    def fit(self) -> tuple[float, float] | None:
        """``(latency_s, seconds_per_byte)`` by least squares over bytes down + up (latency >= 0, seconds per byte
        >= 1e-12). ``None`` until two replies of clearly different sizes (1.5x apart) were seen, and, from three
        replies on, when the bytes explain nothing: a slope under two standard errors (the poll wait's noise
        swamps the upload, as on a fast link or with a small model)."""
        obs = self.probes + list(self.recent)
        ups = [u for u, _, _ in obs]
        if len(obs) < 2 or max(ups) < 1.5 * max(min(ups), 1.0):
            return None
        pts = [(u + d, t) for u, d, t in obs]
        sizes = [b for b, _ in pts]
        n = len(pts)
        mb, mt = sum(sizes) / n, sum(t for _, t in pts) / n
        var = sum((b - mb) ** 2 for b in sizes)
        if var <= 0:
            return None
        slope = sum((b - mb) * (t - mt) for b, t in pts) / var
        if n > 2:
            rss = sum((t - mt - slope * (b - mb)) ** 2 for b, t in pts)
            if slope < 2 * math.sqrt(rss / (n - 2) / var):
                return None
        slope = max(slope, 1e-12)
        return max(mt - slope * mb, 0.0), slope


class AutoDensity:
    """The server side of ``density="auto"``: ``choose`` a node's density for a task, then tell it what happened
    (``dispatched``, ``replied``; ``failed`` drops a task that never answered). Flower-free; one per run."""

    def __init__(self, config: AutoDensityConfig | None = None) -> None:
        self.config = config or AutoDensityConfig()
        self.links: dict[int, LinkEstimate] = {}
        #: task id -> (client, dispatch time, density, probing, payload bytes down)
        self.open: dict[int, tuple[int, float, float, bool, int]] = {}
        self.last_reply: dict[int, float] = {}  # node -> arrival of its last reply
        self.sizes: dict[float, tuple[float, int]] = {}  # density -> (mean payload bytes up, replies)

    def choose(self, client: int) -> float:
        """The density of ``client``'s next task."""
        link = self.links.setdefault(client, LinkEstimate())
        cfg = self.config
        fit = link.fit()
        link.probing = len(link.probes) < len(cfg.probe)
        if link.probing:
            link.density = cfg.probe[len(link.probes)]
            return link.density
        if fit is None:  # sizes hardly differ, or the bytes explain no time: the density costs no upload time
            link.density = cfg.ladder[0]
            return link.density
        latency, s_per_byte = fit
        allowed = cfg.upload_budget * (latency + link.compute_s)
        link.density = next((d for d in cfg.ladder if s_per_byte * self.bytes_at(d) <= allowed), cfg.ladder[-1])
        return link.density

    def bytes_at(self, density: float) -> float:
        """Expected payload bytes of a reply at ``density``: the mean seen there, else the nearest density seen
        scaled linearly (0 before any reply)."""
        if density in self.sizes:
            return self.sizes[density][0]
        if not self.sizes:
            return 0.0
        near = min(self.sizes, key=lambda d: abs(math.log(d / density)))
        return self.sizes[near][0] * density / near

    def dispatched(self, task_id: int, client: int, now: float, density: float, down_bytes: int) -> None:
        """Task ``task_id`` left for ``client`` at ``now`` with ``density`` (the one ``choose`` gave) and a model
        blob of ``down_bytes``."""
        link = self.links.setdefault(client, LinkEstimate())
        self.open[task_id] = (client, now, density, link.probing, int(down_bytes))

    def replied(self, task_id: int, now: float, up_bytes: int, compute_s: float) -> None:
        """A reply of ``up_bytes`` payload bytes to ``task_id`` arrived at ``now``."""
        opened = self.open.pop(task_id, None)
        if opened is None:
            return
        client, sent, density, probing, down = opened
        mean, n = self.sizes.get(density, (0.0, 0))
        self.sizes[density] = (mean + (up_bytes - mean) / (n + 1), n + 1)
        compute = max(float(compute_s), 0.0) if math.isfinite(compute_s) else 0.0
        start = max(sent, self.last_reply.get(client, sent))  # a queued task starts once the one before it replied
        self.last_reply[client] = now
        comm = max(now - start - compute, 0.0)
        link = self.links.setdefault(client, LinkEstimate())
        link.add(float(up_bytes), float(down), comm, compute, probing, self.config.window)

    def failed(self, task_id: int) -> None:
        self.open.pop(task_id, None)

    def report(self) -> dict[str, Any]:
        """``summary()`` by node id (as strings, for JSON) and the mean payload bytes of a reply per density."""
        return {
            "nodes": {str(k): v for k, v in self.summary().items()},
            "reply_payload_bytes": {f"{d:g}": round(b, 1) for d, (b, _) in sorted(self.sizes.items())},
        }

    def summary(self) -> dict[int, dict[str, Any]]:
        """Per node: the last density chosen, replies seen and the fitted link (latency s, uplink Mbit/s)."""
        out = {}
        for client, link in self.links.items():
            fit = link.fit()
            out[client] = {
                "density": link.density,
                "replies": link.replies,
                "latency_s": None if fit is None else round(fit[0], 3),
                "up_mbps": None if fit is None else round(8 / fit[1] / 1e6, 3),
            }
        return out

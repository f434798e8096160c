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

1. Plan: a node's first tasks, in the order they are dispatched (queued tasks included: with prefetch several
   leave before any reply), are the warm-up, at the first ``probe`` density, then one task at each ``probe``
   density (far apart, so the fit sees two sizes; they also send more of the early, fast-moving updates, DGC's
   observation behind sparsity warm-up). A planned task that fails is planned again: its density goes to the
   node's next task. The node's first reply (``warmup``), whichever planned task it answers, is counted but never
   fitted: its time holds a cold start that no later task pays (a ClientApp or worker process started, a model
   built: 6-7 s against 0.1 s of link time in Flower's in-process simulation); fitted, it made a fast link look
   thousands of times slower. (When the warm-up task was lost and a probe's reply came first, the window may hold
   one density: the re-probe below gives it a second.)
2. Re-probe: a node that has sat at one density for a whole window (the window holds neither two sizes nor two
   densities) gets one task at the ladder step next to it (denser, or the next sparser at the top): the fit sees
   two sizes again, at little cost on a slow link, and a denser step is tried. Tasks queued behind a planned task
   or a re-probe that has not answered keep the last choice (the densest before any fit).
3. Fit: ``(latency, seconds_per_byte)`` over the last ``window`` replies, probes included (no fit when their sizes
   are within 1.5x of each other, or when the slope is within two standard errors of 0: the density then costs no
   upload time worth saving and the densest is chosen). Nothing stays for good: a one-off delay and a link that
   has changed age out of the window, and the re-probes keep the fit identified, so the density recovers.
4. Choose: the largest ladder density ``d`` with ``seconds_per_byte x bytes(d) <= upload_budget x (latency +
   compute)``, where ``bytes(d)`` comes from the replies seen at each density (any node), scaled linearly to
   densities not seen yet; the ladder's smallest density when none fits.

Error feedback and the ack/nack contract are unchanged: what a sparser task leaves out stays in the client's
residual. The estimates are soft state: a restarted server learns them again (the warm-up and probes run again).

>>> auto = AutoDensity(AutoDensityConfig(probe=(0.3, 0.1)))
>>> auto.choose(7)
0.3
>>> auto.dispatched(1, 7, now=0.0, density=0.3, down_bytes=50_000)
>>> auto.replied(1, now=9.0, up_bytes=300_000, compute_s=1.0)  # the warm-up, with a cold start: not fitted
>>> auto.choose(7)
0.3
>>> auto.dispatched(2, 7, now=9.0, density=0.3, down_bytes=50_000)
>>> auto.replied(2, now=13.0, up_bytes=300_000, compute_s=1.0)  # 3 s for 350 kB
>>> auto.choose(7)
0.1
>>> auto.dispatched(3, 7, now=13.0, density=0.1, down_bytes=50_000)
>>> auto.replied(3, now=16.0, up_bytes=100_000, compute_s=1.0)  # 2 s for 150 kB: 0.3 would add 1.5 s, 0.1 0.5 s
>>> auto.choose(7)
0.1

The plan follows dispatches, not replies: three tasks queued to a new node before it answers are the warm-up and
the two probes.

>>> queued = AutoDensity(AutoDensityConfig(probe=(0.3, 0.1)))
>>> for task_id in (1, 2, 3):
...     queued.dispatched(task_id, 8, now=0.0, density=queued.choose(8), down_bytes=50_000)
>>> [queued.open[t][2] for t in (1, 2, 3)]
[0.3, 0.3, 0.1]
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from fedcomp.registry import ConfigError

#: The densities ``AutoDensity`` chooses from, densest first. Nothing denser than 30%: with error feedback a 30%
#: update trains as well as a dense one (the example app's frontier) and costs a third of the upload; on the main
#: scenario a ladder topped by 100% reached 95% at 42.2 virtual s, this one at 36.7 s (docs/results.md).
LADDER = (0.3, 0.1, 0.03, 0.01)
#: Replies per density whose sizes ``AutoDensity`` keeps (their median is the size it expects there).
SIZES = 32


@dataclass(frozen=True)
class AutoDensityConfig:
    """``upload_budget``: the upload may take at most this share of the rest of the task (latency + compute).
    ``ladder``: the densities to choose from. ``probe``: the densities of a node's first tasks after the warm-up.
    ``warmup``: a node's first replies the fit never sees (their time holds its cold start); as many tasks at the
    first probe density lead the plan. ``window``: the latest replies, probes included, the fit uses."""

    upload_budget: float = 0.5
    ladder: tuple[float, ...] = LADDER
    probe: tuple[float, ...] = (0.3, 0.1)
    warmup: int = 1
    window: int = 16

    def __post_init__(self) -> None:
        if isinstance(self.upload_budget, bool) or not isinstance(self.upload_budget, (int, float)):
            raise ConfigError(f"upload_budget must be a number, got {self.upload_budget!r}")
        if not (self.upload_budget > 0 and math.isfinite(self.upload_budget)):
            raise ConfigError(f"upload_budget must be finite and > 0, got {self.upload_budget}")
        for d in (*self.ladder, *self.probe):
            if not 0.0 < d <= 1.0:
                raise ConfigError(f"auto density: every density must be in (0, 1], got {d}")
        if not self.ladder or len(set(self.probe)) < 2 or self.window < 2:
            raise ConfigError("auto density: needs a ladder, two different probe densities and window >= 2")
        if isinstance(self.warmup, bool) or not isinstance(self.warmup, int) or self.warmup < 0:
            raise ConfigError(f"auto density: warmup must be a whole number >= 0, got {self.warmup!r}")
        object.__setattr__(self, "ladder", tuple(sorted(set(self.ladder), reverse=True)))

    @property
    def plan(self) -> tuple[float, ...]:
        """The densities of a node's first tasks, in dispatch order: the warm-up, then the probes."""
        return (self.probe[0],) * self.warmup + self.probe


@dataclass
class LinkEstimate:
    """One node's observations: ``(density, payload bytes up, bytes down, communication seconds, compute seconds)``
    of its last ``window`` replies, probes included (the task's model and the reply share the link's time; one slope
    for both keeps the fit identified when a full model copy and a denser reply come together, and errs towards a
    slower uplink). Nothing stays for good: a reply ages out after ``window`` newer ones, so a one-off delay (a
    worker restart, a stall) and a link that has since changed leave the fit on their own."""

    obs: deque[tuple[float, float, float, float, float]] = field(default_factory=deque)
    replies: int = 0  # replies seen, the warm-up included
    density: float = 0.0  # the last density chosen
    probing: bool = False  # whether that choice was a probe (planned or a re-probe)
    planned: list[float] = field(default_factory=list)  # densities of planned tasks answered or on their way
    settled: float = 0.0  # the last density chosen by the fit (0 before any)
    probes_out: int = 0  # probe tasks dispatched and not yet answered or failed
    sent: dict[float, int] = field(default_factory=dict)  # density -> tasks dispatched at it

    def add(self, obs: tuple[float, float, float, float, float], warmup: int, window: int) -> None:
        """One reply's observation; the node's first ``warmup`` replies are counted but never fitted."""
        self.replies += 1
        if self.replies <= warmup:  # its time holds the node's cold start, which no later task pays
            return
        self.obs.append(obs)
        while len(self.obs) > window:
            self.obs.popleft()

    def densities(self) -> set[float]:
        """The densities of the replies in the window."""
        return {d for d, *_ in self.obs}

    def spread(self) -> bool:
        """Whether the window holds two replies of clearly different sizes (1.5x apart), as a fit needs."""
        ups = [u for _, u, _, _, _ in self.obs]
        return len(ups) > 1 and max(ups) >= 1.5 * max(min(ups), 1.0)

    def unidentified(self) -> bool:
        """Whether the window holds neither two sizes nor two densities: only a probe tells more (two densities
        of one size mean the density costs nothing)."""
        return not self.spread() and len(self.densities()) < 2

    @property
    def compute_s(self) -> float:
        """Mean client-reported compute seconds over the window (0 before any)."""
        return sum(c for *_, c in self.obs) / len(self.obs) if self.obs else 0.0

    def fit(self) -> tuple[float, float] | None:
        """``(latency_s, seconds_per_byte)`` by least squares over bytes down + up (latency >= 0, seconds per byte
        >= 1e-12). ``None`` until two replies of clearly different sizes (1.5x apart) were seen, and, from three
        replies on, when the bytes explain nothing: a slope under two standard errors (the poll wait's noise
        swamps the upload, as on a fast link or with a small model)."""
        if not self.spread():
            return None
        pts = [(u + d, t) for _, u, d, t, _ in self.obs]
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
        #: task id -> (client, dispatch time, density, probing, planned, payload bytes down)
        self.open: dict[int, tuple[int, float, float, bool, bool, int]] = {}
        self.last_reply: dict[int, float] = {}  # node -> arrival of its last reply
        #: density -> payload bytes up of its recent replies (the median: one node that sends more cannot move it)
        self.sizes: dict[float, deque[int]] = {}

    def choose(self, client: int) -> float:
        """The density of ``client``'s next task (``dispatched`` commits it: a task that was never sent takes
        nothing from the plan)."""
        link = self.links.setdefault(client, LinkEstimate())
        cfg = self.config
        planned = self.next_planned(link)
        link.probing = planned is not None or (link.unidentified() and link.probes_out == 0)
        if link.probing:
            link.density = self.reprobe_density(link) if planned is None else planned
            return link.density
        fit = link.fit()
        if link.unidentified():  # a probe is on its way: keep the last choice until it answers
            link.density = link.settled or cfg.ladder[0]
        elif fit is None:  # sizes hardly differ, or the bytes explain no time: the density costs no upload time
            link.density = cfg.ladder[0]
        else:
            latency, s_per_byte = fit
            allowed = cfg.upload_budget * (latency + link.compute_s)
            link.density = next((d for d in cfg.ladder if s_per_byte * self.bytes_at(d) <= allowed), cfg.ladder[-1])
        link.settled = link.density
        return link.density

    def next_planned(self, link: LinkEstimate) -> float | None:
        """The plan's next density for ``link``: the first of ``config.plan`` (warm-up, then probes) not yet taken
        by a task answered or on its way (a failed one gave its density back); ``None`` once all are taken."""
        taken = list(link.planned)
        for d in self.config.plan:
            if d in taken:
                taken.remove(d)
            else:
                return d
        return None

    def reprobe_density(self, link: LinkEstimate) -> float:
        """A re-probe's density, once the window has lost its second size: the step next to its one density
        (denser, or the next sparser at the top): enough for two sizes, and cheap on a slow link."""
        cfg = self.config
        held = max(link.densities(), default=cfg.probe[0])
        steps = sorted({*cfg.ladder, *cfg.probe} - {held})
        return min((d for d in steps if d > held), default=steps[-1])

    def bytes_at(self, density: float) -> float:
        """Expected payload bytes of a reply at ``density``: the median of the recent replies there (``SIZES``),
        else the nearest density seen scaled linearly (0 before any reply)."""
        if density in self.sizes:
            return float(statistics.median(self.sizes[density]))
        if not self.sizes:
            return 0.0
        near = min(self.sizes, key=lambda d: abs(math.log(d / density)))
        return float(statistics.median(self.sizes[near])) * density / near

    def dispatched(self, task_id: int, client: int, now: float, density: float, down_bytes: int) -> None:
        """Task ``task_id`` left for ``client`` at ``now`` with ``density`` (the one ``choose`` gave) and a model
        blob of ``down_bytes``. A task the plan chose takes its density from the plan."""
        link = self.links.setdefault(client, LinkEstimate())
        planned = link.probing and self.next_planned(link) == density
        self.open[task_id] = (client, now, density, link.probing, planned, int(down_bytes))
        link.probes_out += link.probing
        link.sent[density] = link.sent.get(density, 0) + 1
        if planned:
            link.planned.append(density)

    def replied(self, task_id: int, now: float, up_bytes: int, compute_s: float, timed: bool = True) -> None:
        """A reply of ``up_bytes`` payload bytes to ``task_id`` arrived at ``now`` (one the server did not reject:
        a rejected one is ``failed``). ``timed=False`` (read before the reply of a task sent to its node earlier,
        ``Ledger.overtakes``): its size counts, its timing does not (when it started is not known)."""
        opened = self.open.pop(task_id, None)
        if opened is None:
            return
        client, sent, density, probing, _, down = opened
        link = self.links.setdefault(client, LinkEstimate())
        link.probes_out -= probing
        self.sizes.setdefault(density, deque(maxlen=SIZES)).append(int(up_bytes))
        if not timed:
            return
        compute = max(float(compute_s), 0.0) if math.isfinite(compute_s) else 0.0
        start = max(sent, self.last_reply.get(client, sent))  # a queued task starts once the one before it replied
        self.last_reply[client] = max(now, self.last_reply.get(client, now))
        comm = max(now - start - compute, 0.0)
        link.add((density, float(up_bytes), float(down), comm, compute), self.config.warmup, self.config.window)

    def failed(self, task_id: int) -> None:
        """``task_id`` will never answer (lost, timed out, an error reply): a planned task gives its density back
        to the plan, so the node's next task takes it again."""
        opened = self.open.pop(task_id, None)
        if opened is None:
            return
        client, _, density, probing, planned, _ = opened
        link = self.links[client]
        link.probes_out -= probing
        if planned:
            link.planned.remove(density)

    def report(self) -> dict[str, Any]:
        """``summary()`` by node id (as strings, for JSON) and the median payload bytes of a reply per density."""
        return {
            "nodes": {str(k): v for k, v in self.summary().items()},
            "reply_payload_bytes": {f"{d:g}": round(self.bytes_at(d), 1) for d in sorted(self.sizes)},
        }

    def summary(self) -> dict[int, dict[str, Any]]:
        """Per node: the last density chosen, replies seen, the fitted link (latency s, uplink Mbit/s) and the
        tasks dispatched at each density (densest first)."""
        out = {}
        for client, link in self.links.items():
            fit = link.fit()
            out[client] = {
                "density": link.density,
                "replies": link.replies,
                "latency_s": None if fit is None else round(fit[0], 3),
                "up_mbps": None if fit is None else round(8 / fit[1] / 1e6, 3),
                "tasks_by_density": {f"{d:g}": n for d, n in sorted(link.sent.items(), reverse=True)},
            }
        return out

"""Wire bytes: what Flower's transport puts on the TCP connection around the Flower object bytes.

Three byte figures, never mixed: *payload bytes* (the compressed update), *Flower object bytes* (the serialized
Flower objects of a message: payload + records + metadata) and *wire bytes* (TCP payload bytes between a SuperNode
and the SuperLink: Flower object bytes + the HTTP requests and responses the transport makes for them, the idle
polls and heartbeats, and the app bundle). :class:`WireCost` turns Flower object bytes and counts into wire bytes;
it is a pure function of counts, so the simulation can charge links with it and a deployment can report it.

Directions are the client's: *up* is SuperNode -> SuperLink, *down* is SuperLink -> SuperNode.

Example:
    >>> from fedcomp.wirecost import FLOWER_1_41
    >>> up, down = FLOWER_1_41.reply(10_000, objects=4)
    >>> up > 10_000 and down > 0
    True
    >>> FLOWER_1_41.idle(0.0)
    (0, 0)
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["FLOWER_1_41", "WireCost"]


@dataclass(frozen=True)
class WireCost:
    """Wire (TCP payload) bytes Flower's transport adds around Flower object bytes, per direction.

    A task fetch is ``task_round_trips`` fixed requests (pull the message list, confirm receipt) plus one pull
    request per Flower object; a reply push is ``reply_round_trips`` fixed requests plus one push request per
    Flower object. Every request costs ``request_up`` bytes up (HTTP request line + headers + protobuf envelope)
    and ``response_down`` bytes down (status line + headers + envelope); every Flower object adds
    ``object_up`` / ``object_down`` bytes of identifiers and framing on top of its own bytes. While connected a
    node polls every ``poll_interval_s`` (``poll_up`` / ``poll_down`` bytes) and sends a heartbeat every
    ``heartbeat_interval_s`` (``heartbeat_up`` / ``heartbeat_down``). The app bundle (``bundle_up`` /
    ``bundle_down`` wire bytes) is fetched once per client per run.

    Contract: every method returns non-negative ``(up, down)`` integers, monotone in its arguments.

    Example:
        >>> cost = WireCost(request_up=500, response_down=100, object_up=80, object_down=80)
        >>> cost.task(1000, objects=2)  # 2 fixed + 2 object requests
        (2160, 1560)
    """

    request_up: int = 0
    response_down: int = 0
    object_up: int = 0
    object_down: int = 0
    task_round_trips: int = 2
    reply_round_trips: int = 2
    poll_up: int = 0
    poll_down: int = 0
    poll_interval_s: float = 3.0
    heartbeat_up: int = 0
    heartbeat_down: int = 0
    heartbeat_interval_s: float = 30.0
    bundle_up: int = 0
    bundle_down: int = 0

    def __post_init__(self) -> None:
        for name in ("poll_interval_s", "heartbeat_interval_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"WireCost.{name} must be > 0")
        for name, value in vars(self).items():
            if value < 0:
                raise ValueError(f"WireCost.{name} must be >= 0, got {value}")

    def task_requests(self, objects: int) -> int:
        """HTTP round trips to fetch one task message of ``objects`` Flower objects."""
        return self.task_round_trips + max(0, int(objects))

    def reply_requests(self, objects: int) -> int:
        """HTTP round trips to push one reply message of ``objects`` Flower objects (and its confirmation)."""
        return self.reply_round_trips + max(0, int(objects))

    def task(self, flower_bytes: int, objects: int) -> tuple[int, int]:
        """``(up, down)`` wire bytes to fetch one task message (``flower_bytes`` travel down)."""
        n = self.task_requests(objects)
        objs = max(0, int(objects))
        return n * self.request_up + objs * self.object_up, (
            int(flower_bytes) + n * self.response_down + objs * self.object_down
        )

    def reply(self, flower_bytes: int, objects: int) -> tuple[int, int]:
        """``(up, down)`` wire bytes to push one reply message (``flower_bytes`` travel up) and confirm it."""
        n = self.reply_requests(objects)
        objs = max(0, int(objects))
        return int(flower_bytes) + n * self.request_up + objs * self.object_up, (
            n * self.response_down + objs * self.object_down
        )

    def idle(self, seconds: float) -> tuple[int, int]:
        """``(up, down)`` wire bytes of polls and heartbeats while a node is connected for ``seconds``."""
        s = max(0.0, float(seconds))
        polls = s / self.poll_interval_s
        beats = s / self.heartbeat_interval_s
        return (
            round(polls * self.poll_up + beats * self.heartbeat_up),
            round(polls * self.poll_down + beats * self.heartbeat_down),
        )

    def bundle(self) -> tuple[int, int]:
        """``(up, down)`` wire bytes of fetching the app bundle, once per client per run."""
        return self.bundle_up, self.bundle_down


# Flower 1.41 over HTTP (the product's default transport), measured on loopback with a counting TCP proxy
# (benchmarks/wire_calibration.py; figures in docs/results.md, "Wire calibration").
FLOWER_1_41 = WireCost(
    request_up=850,
    response_down=130,
    object_up=100,
    object_down=100,
    task_round_trips=2,
    reply_round_trips=2,
    poll_up=853,
    poll_down=128,
    poll_interval_s=3.0,
    heartbeat_up=850,
    heartbeat_down=130,
    heartbeat_interval_s=30.0,
    bundle_up=900,
    bundle_down=648_000,
)

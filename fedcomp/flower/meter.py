"""What ``Compressed`` counts per round, in the three byte figures' first two: payload bytes (the fedcomp blobs,
or the dense model's array data) and Flower object bytes (every serialized Flower object of a message), into the
ledger's ``VersionStats``; and the ``fedcomp-*`` metrics that join the wrapped strategy's train metrics.

    >>> from fedcomp.server import VersionStats
    >>> metrics = round_metrics(None, VersionStats().to_dict(), dense_bytes=400)
    >>> metrics["fedcomp-applied"], metrics["fedcomp-dense-bytes"]
    (0, 400)
"""

from __future__ import annotations

from logging import INFO
from typing import Any

from flwr.app import Message, MetricRecord, RecordDict
from flwr.common.logger import log

from fedcomp.flower import records
from fedcomp.server import VersionStats


def task_sent(stats: VersionStats, msg: Message, blob: bytes | None, arrays_key: str) -> None:
    """A train message left: its payload (the downlink blob, else the model's array data) and Flower objects."""
    size, objects = records.flower_size(msg)
    stats.payload_bytes_down += len(blob) if blob is not None else _arrays_bytes(msg.content, arrays_key)
    stats.flower_bytes_down += size
    stats.flower_objects_down += objects
    stats.messages_down += 1


def reply_received(stats: VersionStats, reply: Message) -> None:
    """A reply arrived (its payload bytes are counted where it is decoded, ``ServerProtocol.admit``)."""
    size, objects = records.flower_size(reply)
    stats.flower_bytes_up += size
    stats.flower_objects_up += objects
    stats.messages_up += 1


def round_metrics(
    metrics: MetricRecord | None, row: dict[str, Any], dense_bytes: int, server_round: int | None = None
) -> MetricRecord:
    """``metrics`` (the wrapped strategy's) plus the round's ``fedcomp-*`` counts and bytes; with ``server_round``
    the round's line is logged too."""
    if server_round is not None:
        up = row["payload_bytes_up"]
        ratio = f" ({dense_bytes * row['messages_up'] / up:.0f}x smaller than dense fp32)" if up else ""
        log(INFO, "[fedcomp] round %d: %d applied, %d rejected, %d lost; %d payload bytes up%s", server_round,
            row["accepted"], row["rejected"], row["lost"] + row["timeout"], up, ratio)
    out = MetricRecord(dict(metrics) if metrics is not None else {})
    out["fedcomp-applied"] = int(row["accepted"])
    out["fedcomp-rejected"] = int(row["rejected"] + row["duplicate"] + row["late"])
    out["fedcomp-lost"] = int(row["lost"] + row["timeout"] + row["stale"])
    for key in ("payload_bytes_up", "flower_bytes_up", "payload_bytes_down", "flower_bytes_down"):
        out["fedcomp-" + key.replace("_", "-")] = int(row[key])
    out["fedcomp-dense-bytes"] = int(dense_bytes)
    return out


def _arrays_bytes(content: RecordDict, key: str) -> int:
    return sum(len(a.data) for a in content.array_records[key].values()) if key in content.array_records else 0

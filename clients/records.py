"""Flower record layout of fedcomp messages, shared by the ServerApp and the ClientApp.

Fewest Flower objects per message (each is one HTTP request in deployment):

* task (server -> client): ``ArrayRecord "model"`` with one ``Array`` (stype ``fedcomp/wire``: the model as
  dense fp32 records of the fedcomp wire format) and one ``ConfigRecord "task"`` (task id, base version,
  round, and the ack/nack resolutions as one JSON string);
* reply (client -> server): ``ArrayRecord "update"`` with one ``Array`` (the compressed update blob),
  one ``ConfigRecord "meta"`` (task id, seq, examples, incarnation) and one ``MetricRecord "metrics"``.

``flower_size(message)`` is the serialized size of every Flower object of a message (the bytes the object
store moves, headers of HTTP excluded) and the number of objects.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict

from fedcomp.protocol import ReplyMeta, Resolution

STYPE = "fedcomp/wire"
TRAIN = "train"
EVALUATE = "evaluate"


class RecordError(ValueError):
    """A message lacks a record or field fedcomp needs."""


def blob_record(blob: bytes) -> ArrayRecord:
    return ArrayRecord({"blob": Array(dtype="uint8", shape=(len(blob),), stype=STYPE, data=bytes(blob))})


def read_blob(content: RecordDict, key: str) -> bytes:
    try:
        arr = content.array_records[key]["blob"]
    except KeyError:
        raise RecordError(f"no ArrayRecord {key!r} with an Array 'blob'") from None
    if arr.stype != STYPE:
        raise RecordError(f"array {key!r} has stype {arr.stype!r}, expected {STYPE!r}")
    return bytes(arr.data)


@dataclass(frozen=True)
class TaskContent:
    task_id: int
    base_version: int
    round: int
    resolutions: list[Resolution]
    model: bytes
    resync: bool = False


def task_content(
    task_id: int, base_version: int, round_: int, resolutions: list[Resolution], model: bytes, resync: bool = False
) -> RecordDict:
    cfg = ConfigRecord(
        {
            "task-id": int(task_id),
            "base-version": int(base_version),
            "round": int(round_),
            "resolutions": json.dumps([r.to_dict() for r in resolutions], separators=(",", ":")),
            "resync": bool(resync),
        }
    )
    return RecordDict({"model": blob_record(model), "task": cfg})


def read_task(content: RecordDict) -> TaskContent:
    try:
        cfg = content.config_records["task"]
        res = [Resolution.from_dict(d) for d in json.loads(str(cfg.get("resolutions", "[]")))]
        return TaskContent(
            int(cfg["task-id"]),
            int(cfg["base-version"]),
            int(cfg.get("round", 0)),
            res,
            read_blob(content, "model"),
            bool(cfg.get("resync", False)),
        )
    except (KeyError, ValueError, TypeError) as exc:
        raise RecordError(f"malformed task: {exc}") from exc


def reply_content(blob: bytes, meta: ReplyMeta, metrics: dict[str, float]) -> RecordDict:
    return RecordDict(
        {
            "update": blob_record(blob),
            "meta": ConfigRecord(
                {
                    "task-id": meta.task_id,
                    "seq": meta.seq,
                    "num-examples": meta.num_examples,
                    "incarnation": meta.incarnation,
                }
            ),
            "metrics": MetricRecord({k: float(v) for k, v in metrics.items()}),
        }
    )


def read_reply(content: RecordDict) -> tuple[bytes, ReplyMeta, dict[str, float]]:
    """Blob, meta and metrics of a reply; ``RecordError`` if the layout is wrong."""
    try:
        cfg = content.config_records["meta"]
        meta = ReplyMeta(
            int(cfg["task-id"]), int(cfg["seq"]), int(cfg.get("num-examples", 1)), int(cfg.get("incarnation", 0))
        )
    except (KeyError, ValueError, TypeError) as exc:
        raise RecordError(f"malformed reply meta: {exc}") from exc
    metrics = dict(content.metric_records["metrics"]) if "metrics" in content.metric_records else {}
    return read_blob(content, "update"), meta, {k: float(v) for k, v in metrics.items() if isinstance(v, (int, float))}


def flower_size(message: Message) -> tuple[int, int]:
    """(bytes, objects): serialized size of all Flower objects of ``message`` (what the object store moves)."""
    from flwr.supercore.inflatable.inflatable_object import get_all_nested_objects

    objects = get_all_nested_objects(message)
    return sum(len(o.deflate()) for o in objects.values()), len(objects)

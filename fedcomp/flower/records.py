"""Flower record layout of fedcomp messages, shared by every server (``Compressed``, the product's loops) and
``compression_mod``: one layout, the mod's.

* task: the records of the server's train message (a wrapped strategy's, or the product's ``ConfigRecord
  "config"`` with ``server-round``), plus ``ConfigRecord "fedcomp"``: task id, base version, the ack/nack
  resolutions as one JSON string, resync, which ArrayRecord is the model, the ``Compression`` fields, and with a
  compressed downlink the model's blob and array layout (the model's ArrayRecord then leaves the message);
* reply: the train function's records minus the model's ArrayRecord, plus ``ConfigRecord "fedcomp"``: task id,
  seq, incarnation, the update blob and the arrays outside the update, packed.

Over HTTP every Flower object is one request of its own (about 0.9 KB of headers up, 0.13 KB down;
docs/protocol.md, "Wire bytes"), so blobs ride inline as bytes fields. A blob larger than Flower's array chunk
(``INLINE_MAX``, 5 MiB by default) travels as one ``Array`` (stype ``fedcomp/wire``) in an ``ArrayRecord`` of the
same name, which Flower splits into chunks; readers accept both forms.

``flower_size(message)`` is the serialized size of every Flower object of a message (the bytes the object
store moves, headers of HTTP excluded) and the number of objects.

Example (``Message`` construction needs a Flower run context, so the content alone):
    >>> from fedcomp.protocol import Task
    >>> fmt = TaskFormat({"compressor": "dgc"}, ArrayLayout.of_spec(ModelSpec((("w", (2,)),))))
    >>> content = fmt.content(Task(3, 17, 0, 0.0, 60.0), b"blob")
    >>> sorted(content.config_records), model_blob(content), read_mod_task(content).task_id
    (['fedcomp'], b'blob', 3)
"""

from __future__ import annotations

import dataclasses
import io
import json
import math
import struct
import zlib
from dataclasses import dataclass
from typing import Any

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
from flwr.common.constant import FLWR_PRIVATE_MAX_ARRAY_CHUNK_SIZE

from fedcomp.protocol import ReplyMeta, Resolution, Task
from fedcomp.registry import ConfigError
from fedcomp.spec import ModelSpec, entries_problem

STYPE = "fedcomp/wire"
#: Blobs up to this size ride inline in the message's ConfigRecord (one Flower object); larger ones go as an
#: ``Array`` that Flower chunks.
INLINE_MAX = int(FLWR_PRIVATE_MAX_ARRAY_CHUNK_SIZE)
TRAIN = "train"
EVALUATE = "evaluate"


#: The keys of fedcomp's ConfigRecord fields, one name each for both sides (the mod and the wrapper, the
#: product's apps).
TASK_ID = "task-id"
BASE_VERSION = "base-version"
SEQ = "seq"
INCARNATION = "incarnation"
RESOLUTIONS = "resolutions"
RESYNC = "resync"
DENSITY = "density"
RUN_KEY = "run-key"
MAX_NORM = "max-norm"
ARRAYS_KEY = "arrays-key"
NUM_EXAMPLES = "num-examples"
LAYOUT = "layout"
DENSE_ARRAYS = "dense-arrays"
#: The ConfigRecord of the product's own train config (``TaskFormat``), and its round key (Flower's name).
CONFIG, SERVER_ROUND = "config", "server-round"


class RecordError(ValueError):
    """A message lacks a record or field fedcomp needs."""


#: Key of a reply's resync request (the task ids of the node's other pending updates).
PENDING_KEY = "pending"
#: More pending task ids than a node can have outstanding is a malformed reply, not work for the ledger.
MAX_PENDING = 1024


def pending_tasks(value: object) -> tuple[int, ...]:
    """A resync request as task ids: a list of at most ``MAX_PENDING`` ints >= 0 (absent: ``None`` -> empty),
    else ``RecordError`` (the reply is rejected and counted)."""
    if value is None:
        return ()
    ok = isinstance(value, list) and len(value) <= MAX_PENDING
    if not ok or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in value):
        shown = repr(value) if len(repr(value)) <= 80 else repr(value)[:77] + "..."
        raise RecordError(f"{PENDING_KEY!r} must be a list of at most {MAX_PENDING} task ids, got {shown}")
    return tuple(value)


def whole(cfg: Any, key: str, default: int | None = None, signed: bool = False) -> int:
    """Control field ``key`` of ``cfg``: an int (not a bool, not a float) in ``[0, 2**64)`` (``signed``:
    ``[-2**63, 2**63)``), else ``RecordError``; ``default`` when absent and one is given.

    >>> whole({"seq": 3}, "seq"), whole({}, "run-key", 0, signed=True)
    (3, 0)
    >>> whole({"seq": float("inf")}, "seq")  # doctest: +IGNORE_EXCEPTION_DETAIL
    Traceback (most recent call last):
    RecordError: 'seq' must be a whole number in [0, 2**64), got inf
    """
    value = cfg.get(key, default) if default is not None else cfg[key]
    low, high = (-(1 << 63), 1 << 63) if signed else (0, 1 << 64)
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value < high:
        shown = "[-2**63, 2**63)" if signed else "[0, 2**64)"
        raise RecordError(f"{key!r} must be a whole number in {shown}, got {str(value)[:40]}")
    return value


def blob_record(blob: bytes) -> ArrayRecord:
    return ArrayRecord({"blob": Array(dtype="uint8", shape=(len(blob),), stype=STYPE, data=bytes(blob))})


def read_blob(content: RecordDict, key: str) -> bytes:
    """The blob ``key``: an ``Array 'blob'`` in ``ArrayRecord key``, or a bytes field ``key`` of a ConfigRecord
    (the inline form); ``RecordError`` if neither is there."""
    if key in content.array_records:
        arr = content.array_records[key].get("blob")
        if arr is None:
            raise RecordError(f"no ArrayRecord {key!r} with an Array 'blob'")
        if arr.stype != STYPE:
            raise RecordError(f"array {key!r} has stype {arr.stype!r}, expected {STYPE!r}")
        return bytes(arr.data)
    for cfg in content.config_records.values():
        value = cfg.get(key)
        if isinstance(value, bytes):
            return value
    raise RecordError(f"no ArrayRecord {key!r} with an Array 'blob' and no inline {key!r} bytes")


def task_max_norm(value: object) -> float:
    """A task's ``max-norm`` field: 0 (absent: no bound) or a finite positive number (``RecordError`` otherwise).

    >>> task_max_norm(2), task_max_norm(0.0)
    (2.0, 0.0)
    """
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (0.0 <= value < math.inf):
        raise RecordError(f"{MAX_NORM!r} must be a finite number >= 0, got {value!r}")
    return float(value)


def task_density(value: object) -> float:
    """A task's ``density`` field: 0 (absent: the run's setting) or a finite number in (0, 1] (a bool or text is
    not a number here: ``RecordError``)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise RecordError(f"{DENSITY!r} must be a number in (0, 1], got {value!r}")
    d = float(value)
    if not (d == 0.0 or 0.0 < d <= 1.0):
        raise RecordError(f"{DENSITY!r} must be in (0, 1], got {value!r}")
    return d


def flower_size(message: Message) -> tuple[int, int]:
    """(bytes, objects): serialized size of all Flower objects of ``message`` (what the object store moves).
    Each object id is computed once (Flower's ``no_object_id_recompute``, as its own push does): a parent's id
    would otherwise deflate and hash its children again, several times over for a dense model's records."""
    from flwr.supercore.inflatable.inflatable_object import get_all_nested_objects, no_object_id_recompute

    with no_object_id_recompute():
        objects = get_all_nested_objects(message)
        return sum(len(o.deflate()) for o in objects.values()), len(objects)


# ---------------------------------------------------------------------------------------------------------------
# The layout of ``compression_mod`` / ``Compressed``: the user's records pass through; fedcomp adds its own.
#
# * task: the wrapped strategy's records, plus ``ConfigRecord "fedcomp"`` (task id, base version, resolutions,
#   resync, which ArrayRecord is the model, the ``Compression`` fields). With a compressed downlink the model's
#   ArrayRecord leaves the message: the update's arrays travel as one blob (``"fedcomp-model"``), the others
#   packed (``"dense"``), both inside that ConfigRecord with the model's array layout. The product's loops fold
#   their train config into it too (``"records"``).
# * reply: the user's records minus the model's ArrayRecord, plus ``ConfigRecord "fedcomp"``: task id, seq,
#   incarnation, the update blob (``"fedcomp-update"``), the arrays outside the update, packed (``"dense"``), and
#   the user's MetricRecords, folded (``"records"``).
# Blobs over ``INLINE_MAX`` go as an ``ArrayRecord`` of the same name instead, which Flower chunks.
#
# Fewest Flower objects: a compressed reply is the Message, its RecordDict and one ConfigRecord, whatever the
# model and its metrics (a plain reply has one more object per array and per record).

CONTROL = "fedcomp"
MODEL = "fedcomp-model"
UPDATE = "fedcomp-update"


#: Float arrays that travel dense, as values, by name suffix: running statistics are set-points the model needs
#: whole and current, not steps to accumulate (inside a sparse update most stay at their initial values for rounds
#: and the rest lag: a BatchNorm CNN fell to chance). torch's BatchNorm/InstanceNorm names, and Keras's.
DENSE_SUFFIXES: tuple[str, ...] = ("running_mean", "running_var", "moving_mean", "moving_variance")


@dataclass(frozen=True)
class ArrayLayout:
    """Names, shapes and numpy dtype names of an ArrayRecord's arrays, in record order, and which travel dense.

    The one rule of what travels how (docs/flower.md, "What travels how"): the float arrays (float16/32/64:
    weights, biases, adapters) whose names do not end in one of ``dense`` form the ``ModelSpec`` the compressed
    update covers; every other array travels dense, in the user's record, as it is: running statistics
    (``DENSE_SUFFIXES``), int64 ``num_batches_tracked``, bool masks. ``Compressed`` pins the layout at the first
    round: later rounds must have the same names and shapes (``conform`` raises ``ConfigError`` naming what
    changed) and are cast back to the first round's dtypes, so a strategy that turns float32 into float64
    (FedOpt) or int64 into float64 (a weighted mean) never changes what is compressed.

    >>> import numpy as np
    >>> first = ArrayLayout.of(ArrayRecord({"w": Array(np.zeros(2, "float32")), "n": Array(np.array(3))}))
    >>> first.spec().names, first.conform(ArrayRecord({"w": Array(np.ones(2)), "n": Array(np.array(3.4))}))["n"].dtype
    (['w'], 'int64')
    """

    entries: tuple[tuple[str, tuple[int, ...], str], ...]
    dense: tuple[str, ...] = DENSE_SUFFIXES

    def __post_init__(self) -> None:
        """``RecordError`` unless the names are distinct strings, the shapes tuples of ints >= 0 and the dtypes
        names of numpy number or bool dtypes (what an ArrayRecord's arrays hold): a layout comes from the server."""
        if (problem := entries_problem((name, shape) for name, shape, _ in self.entries)) is not None:
            raise RecordError(f"array {problem}")
        for name, _, dtype in self.entries:
            if not _number_dtype(dtype):
                raise RecordError(f"array {name!r}: {dtype!r} is not the name of a numpy number or bool dtype")

    @staticmethod
    def of(record: ArrayRecord, dense: tuple[str, ...] = DENSE_SUFFIXES) -> ArrayLayout:
        return ArrayLayout(tuple((k, tuple(int(d) for d in a.shape), str(a.dtype)) for k, a in record.items()), dense)

    @staticmethod
    def of_spec(spec: ModelSpec) -> ArrayLayout:
        """The layout of a model that is all update: ``spec``'s arrays, float32, in spec order."""
        return ArrayLayout(tuple((n, tuple(int(d) for d in s), "float32") for n, s in spec.entries))

    @staticmethod
    def is_float(dtype: str) -> bool:
        return str(dtype).startswith("float")

    def compresses(self, name: str, dtype: str) -> bool:
        """Whether array ``name`` of ``dtype`` is in the compressed update (else it travels dense)."""
        return self.is_float(dtype) and not name.endswith(self.dense)

    def spec(self) -> ModelSpec:
        """The update's model spec: the compressed arrays, in record order."""
        return ModelSpec(tuple((n, s) for n, s, d in self.entries if self.compresses(n, d)))

    def conform(self, record: ArrayRecord) -> ArrayRecord:
        """``record`` with every array in this layout's dtype (integers and bools rounded); ``ConfigError`` naming
        the arrays if the names, their order or the shapes differ. Returns ``record`` itself when nothing changes."""
        got = ArrayLayout.of(record, self.dense)
        if got == self:
            return record
        mine = [(n, s) for n, s, _ in self.entries]
        theirs = [(n, s) for n, s, _ in got.entries]
        if mine != theirs:
            raise ConfigError(f"the model's arrays changed between rounds: {_difference(dict(mine), dict(theirs))}")
        out = {}
        for (name, _, dtype), (_, _, now) in zip(self.entries, got.entries, strict=True):
            arr = record[name]
            if now != dtype:
                x = arr.numpy()
                x = np.rint(x) if not self.is_float(dtype) and np.issubdtype(x.dtype, np.floating) else x
                arr = Array(np.asarray(x).astype(dtype))
            out[name] = arr
        return ArrayRecord(out)

    def rest(self, record: ArrayRecord) -> ArrayRecord | None:
        """The arrays of ``record`` outside the update (they travel dense), or ``None`` if there are none."""
        names = set(self.spec().names)
        kept = {k: a for k, a in record.items() if k not in names}
        return ArrayRecord(kept) if kept else None

    def check_rest(self, record: ArrayRecord) -> None:
        """``RecordError`` unless ``record`` (a reply's arrays outside the update) holds exactly this layout's
        dense arrays, each in its shape, with no NaN or Inf: the server averages them into the model.

        >>> import numpy as np
        >>> layout = ArrayLayout.of(ArrayRecord({"w": Array(np.zeros(2, "float32")), "bn.running_var": Array(
        ...     np.ones(3, "float32"))}))
        >>> layout.check_rest(ArrayRecord({"bn.running_var": Array(np.ones(1, "float32"))}))
        Traceback (most recent call last):
        fedcomp.flower.records.RecordError: dense array 'bn.running_var' has shape (1,), the model's is (3,)
        """
        expected = {n: s for n, s, d in self.entries if not self.compresses(n, d)}
        if set(record.keys()) != set(expected):
            raise RecordError(f"dense arrays {_difference(expected, {k: a.shape for k, a in record.items()})}")
        for name, arr in record.items():
            if tuple(arr.shape) != tuple(expected[name]):
                raise RecordError(f"dense array {name!r} has shape {tuple(arr.shape)}, the model's is "
                                  f"{tuple(expected[name])}")
            x = arr.numpy()
            if x.dtype.kind in "fc" and not np.isfinite(x).all():
                raise RecordError(f"dense array {name!r} holds NaN or Inf")

    def to_json(self) -> str:
        return json.dumps([[n, list(s), d] for n, s, d in self.entries], separators=(",", ":"))

    @staticmethod
    def from_json(text: str, dense: tuple[str, ...] = DENSE_SUFFIXES) -> ArrayLayout:
        """The layout ``to_json`` wrote: a JSON list of ``[name, shape, dtype]``; ``RecordError`` naming what is wrong
        for anything else (not JSON, other types, negative dimensions, an unknown dtype, a name twice)."""
        try:
            items = json.loads(text)
            if not isinstance(items, list) or not all(isinstance(e, list) and len(e) == 3 for e in items):
                raise ValueError("not a list of [name, shape, dtype] entries")
            if not all(isinstance(s, list) for _, s, _ in items):
                raise ValueError("a shape is not a list")
            return ArrayLayout(tuple((n, tuple(s), d) for n, s, d in items), dense)
        except RecordError as exc:
            raise RecordError(f"malformed array layout: {exc}") from None
        except (ValueError, TypeError, RecursionError) as exc:
            raise RecordError(f"malformed array layout: {exc}") from exc


#: Key, in fedcomp's ConfigRecord, of small records folded into it (a reply's MetricRecords, the product loops'
#: train config): one JSON string ``{"metric": {name: {key: value}}, "config": {...}}``. Over HTTP every record
#: is one Flower object and one request of its own (about 1 KB of headers); folded, a reply is 3 objects.
FOLDED = "records"
_FOLDABLE = {"metric": MetricRecord, "config": ConfigRecord}


def _json_exact(value: Any) -> bool:
    """Whether JSON carries ``value`` back as it was: numbers, strings, bools and non-empty lists of one of them."""
    if isinstance(value, list):
        return bool(value) and all(type(v) is type(value[0]) and _json_exact(v) for v in value)
    return isinstance(value, (int, float, str, bool))


def fold(out: RecordDict, cfg: dict[str, Any]) -> None:
    """Move ``out``'s ConfigRecords and MetricRecords (each whose values JSON carries exactly: no bytes) into
    ``cfg[FOLDED]``: ``{"metric" | "config": {record name: {key: value}}}`` (a float keeps its exact value)."""
    folded: dict[str, dict[str, dict[str, Any]]] = {}
    for kind, records in (("config", out.config_records), ("metric", out.metric_records)):
        for name, record in list(records.items()):
            if name != CONTROL and all(_json_exact(v) for v in record.values()):
                folded.setdefault(kind, {})[name] = dict(record)
                del out[name]
    if folded:
        cfg[FOLDED] = json.dumps(folded, separators=(",", ":"))


def unfold(content: RecordDict, reserved: tuple[str, ...] = ()) -> None:
    """Put the records folded into fedcomp's ConfigRecord back as records of their own (nothing to do when there
    are none); ``RecordError`` naming what is wrong when the field is malformed or a name is taken, by a record of
    ``content`` or by one still to come (``reserved``: the model's ArrayRecord, rebuilt from its blob)."""
    cfg = content.config_records.get(CONTROL)
    text = cfg.get(FOLDED) if cfg is not None else None
    if text is None:
        return
    try:
        folded = json.loads(str(text))
        if not isinstance(folded, dict) or set(folded) - set(_FOLDABLE):
            raise ValueError(f"kinds {sorted(folded)[:4] if isinstance(folded, dict) else type(folded).__name__}")
        made = {}
        for kind, named in folded.items():
            for name, fields in dict(named).items():
                if name in content or name in made or name in reserved:
                    raise ValueError(f"record {name!r} is there already")
                made[str(name)] = _FOLDABLE[kind](dict(fields))
    except (ValueError, TypeError, AttributeError, RecursionError) as exc:
        raise RecordError(f"malformed {FOLDED!r}: {exc}") from exc
    for name, record in made.items():
        content[name] = record
    del cfg[FOLDED]


#: Key, in fedcomp's ConfigRecord, of the arrays that travel dense (``ArrayLayout.rest``), packed into one bytes
#: field: over HTTP every Flower ``Array`` is an object and a request of its own (a ResNet-50 has 160 such arrays).
DENSE = "dense"
_PACK_HEAD = struct.Struct("<II")  # CRC32 of everything after it, header length


def pack_arrays(record: ArrayRecord) -> bytes:
    """``record`` as one byte string: CRC32 and header length (little-endian uint32 each), a JSON header
    ``[[name, dtype, shape, stype, nbytes], ...]``, then each array's Flower ``data`` bytes in order. No pickle."""
    head = json.dumps([[k, a.dtype, list(a.shape), a.stype, len(a.data)] for k, a in record.items()],
                      separators=(",", ":")).encode()
    body = head + b"".join(bytes(a.data) for a in record.values())
    return _PACK_HEAD.pack(zlib.crc32(body), len(head)) + body


def unpack_arrays(data: bytes) -> ArrayRecord:
    """The ``ArrayRecord`` that ``pack_arrays`` packed; ``RecordError`` naming what is wrong for anything else
    (CRC, lengths, header, or an array whose bytes do not load as the dtype and shape the header states)."""
    try:
        crc, size = _PACK_HEAD.unpack_from(data)
        if zlib.crc32(data[_PACK_HEAD.size :]) != crc:
            raise ValueError("CRC32 mismatch")
        if size > len(data) - _PACK_HEAD.size:
            raise ValueError(f"header of {size} bytes in {len(data)}")
        header = json.loads(data[_PACK_HEAD.size : _PACK_HEAD.size + size])
        if not isinstance(header, list) or sum(int(h[4]) for h in header) != len(data) - _PACK_HEAD.size - size:
            raise ValueError("array lengths do not add up to the packed bytes")
        out, at = {}, _PACK_HEAD.size + size
        for name, dtype, shape, stype, nbytes in header:
            if int(nbytes) < 0:
                raise ValueError(f"array {name!r}: negative length")
            arr = Array(dtype=str(dtype), shape=tuple(int(d) for d in shape), stype=str(stype),
                        data=data[at : at + int(nbytes)])
            x = npy(arr.data)
            if str(x.dtype) != arr.dtype or tuple(x.shape) != tuple(arr.shape):
                raise ValueError(f"array {name!r}: bytes hold {x.dtype}{x.shape}, header says {dtype}{shape}")
            out[str(name)] = arr
            at += int(nbytes)
        return ArrayRecord(out)
    except (ValueError, TypeError, KeyError, IndexError, struct.error, OSError, RecursionError) as exc:
        raise RecordError(f"malformed packed arrays: {exc}") from exc


def npy(data: bytes) -> np.ndarray:
    """The array of ``.npy`` bytes (a Flower ``Array``'s ``data``), read without trusting the header: its shape
    must account for exactly the bytes that follow it (``np.load`` allocates what the header claims first), and
    the dtype must be a plain number or bool; ``ValueError`` otherwise.

    >>> import io
    >>> out = io.BytesIO(); np.save(out, np.arange(3, dtype="int16")); npy(out.getvalue()).tolist()
    [0, 1, 2]
    """
    stream = io.BytesIO(data)
    readers = {(1, 0): np.lib.format.read_array_header_1_0, (2, 0): np.lib.format.read_array_header_2_0}
    version = np.lib.format.read_magic(stream)
    if version not in readers:
        raise ValueError(f".npy version {version}")
    shape, fortran, dtype = readers[version](stream)  # a header over 10,000 bytes is refused
    if dtype.kind not in "biufc" or dtype.hasobject:
        raise ValueError(f"dtype {dtype} is not a number")
    count = math.prod(shape)
    if count * dtype.itemsize != len(data) - stream.tell():
        raise ValueError(f"header claims {shape} {dtype}, {len(data) - stream.tell()} bytes follow")
    x = np.frombuffer(data, dtype, count, stream.tell())
    return x.reshape(shape[::-1]).T if fortran else x.reshape(shape)


def _move_rest(out: RecordDict, cfg: dict[str, Any], arrays_key: str, layout: ArrayLayout) -> None:
    """Take the arrays outside the update out of ``out[arrays_key]`` and pack them into ``cfg[DENSE]``."""
    if arrays_key not in out.array_records:
        return
    rest = layout.rest(out.array_records[arrays_key])
    del out[arrays_key]
    if rest is not None:
        cfg[DENSE] = pack_arrays(rest)


def restore_dense(content: RecordDict, arrays_key: str, layout: ArrayLayout | None = None) -> None:
    """Put the packed arrays of a fedcomp task or reply back where the user had them, ``content[arrays_key]``
    (``RecordError`` if they are malformed); nothing to do when there are none. A server reading a reply passes
    its pinned ``layout``: the packed arrays must be exactly its dense ones (``ArrayLayout.check_rest``), and a
    reply without them has no ``content[arrays_key]`` at all (the update is the reply's only say on the model)."""
    cfg = content.config_records.get(CONTROL)
    packed = cfg.get(DENSE) if cfg is not None else None
    if packed is None:
        if layout is not None and arrays_key in content:
            del content[arrays_key]
        return
    if not isinstance(packed, bytes):
        raise RecordError(f"{DENSE!r} must be bytes, got {type(packed).__name__}")
    record = unpack_arrays(packed)
    if layout is not None:
        layout.check_rest(record)
    content[arrays_key] = record
    del cfg[DENSE]


@dataclass(frozen=True)
class ModTask:
    """What ``Compressed`` adds to a train message (read by ``compression_mod``)."""

    task_id: int
    base_version: int
    resolutions: list[Resolution]
    resync: bool
    arrays_key: str
    compression: dict[str, str]
    layout: ArrayLayout | None = None  # only with a compressed downlink (the model's arrays are not in the message)
    dense: tuple[str, ...] = DENSE_SUFFIXES  # name suffixes of the float arrays that travel dense
    density: float = 0.0  # the server's density for this task (density="auto", async mode); 0 = the compression's
    run_key: int = 0  # the server run's id (0: not sent); a client state of another run is set aside
    max_norm: float = 0.0  # the server's max_update_norm (0: none): the mod bounds the update it sends to it

    def layout_of(self, arrays: ArrayRecord) -> ArrayLayout:
        """The model's layout: the one the task carries (compressed downlink), else that of ``arrays``."""
        return self.layout if self.layout is not None else ArrayLayout.of(arrays, self.dense)


def _number_dtype(dtype: object) -> bool:
    """Whether ``dtype`` is the name of a numpy bool, integer, float or complex dtype."""
    try:
        return isinstance(dtype, str) and np.dtype(dtype).kind in "biufc"
    except (TypeError, ValueError):
        return False


def _difference(before: dict[str, tuple[int, ...]], now: dict[str, tuple[int, ...]]) -> str:
    """What changed between two {name: shape} layouts, in words."""
    parts = []
    if added := [n for n in now if n not in before]:
        parts.append(f"added {added[:5]}")
    if removed := [n for n in before if n not in now]:
        parts.append(f"removed {removed[:5]}")
    if reshaped := [f"{n} {before[n]} -> {now[n]}" for n in now if n in before and before[n] != now[n]]:
        parts.append(f"reshaped {reshaped[:5]}")
    return "; ".join(parts) or "the order of the arrays changed"


def add_mod_task(content: RecordDict, task: ModTask, model_blob: bytes | None, task_folds: bool = False) -> RecordDict:
    """A new RecordDict: ``content``'s records plus fedcomp's (``model_blob`` replaces the model's float arrays).
    ``task_folds``: fold ``content``'s Config- and MetricRecords in too (``fold``: one Flower object each less), for
    a server whose nodes all run ``compression_mod`` (the product's loops, ``Compressed`` in async mode); a sync
    strategy's message keeps its records, so a node without the mod still reads its config and says what is
    missing."""
    out = RecordDict(dict(content))
    cfg: dict[str, Any] = {
        TASK_ID: int(task.task_id),
        BASE_VERSION: int(task.base_version),
        RESOLUTIONS: json.dumps([r.to_dict() for r in task.resolutions], separators=(",", ":")),
        RESYNC: bool(task.resync),
        ARRAYS_KEY: task.arrays_key,
        **task.compression,
    }
    if task.dense != DENSE_SUFFIXES:
        cfg[DENSE_ARRAYS] = ",".join(task.dense)
    if task.density:
        cfg[DENSITY] = float(task.density)
    if task.run_key:
        cfg[RUN_KEY] = int(task.run_key)
    if task.max_norm:
        cfg[MAX_NORM] = float(task.max_norm)
    if model_blob is not None:
        layout = task.layout or task.layout_of(content.array_records[task.arrays_key])
        cfg[LAYOUT] = layout.to_json()
        _move_rest(out, cfg, task.arrays_key, layout)
        if len(model_blob) <= INLINE_MAX:
            cfg[MODEL] = bytes(model_blob)
        else:
            out[MODEL] = blob_record(model_blob)
    if task_folds:
        fold(out, cfg)  # compression_mod unfolds them before the train function sees the message
    out[CONTROL] = ConfigRecord(cfg)
    return out


def model_blob(content: RecordDict) -> bytes | None:
    """The compressed downlink's model blob of a fedcomp task (either form), or ``None`` with a dense downlink."""
    cfg = content.config_records.get(CONTROL)
    if MODEL in content.array_records or (cfg is not None and isinstance(cfg.get(MODEL), bytes)):
        return read_blob(content, MODEL)
    return None


def read_mod_task(content: RecordDict) -> ModTask | None:
    """fedcomp's part of a train message; ``None`` when the server did not ask for compression."""
    if CONTROL not in content.config_records:
        return None
    cfg = dict(content.config_records[CONTROL])
    try:
        compression = {k: str(v) for k, v in cfg.items() if k in COMPRESSION_KEYS}
        text = cfg.get(DENSE_ARRAYS)
        dense = DENSE_SUFFIXES if text is None else tuple(x for x in str(text).split(",") if x)
        return ModTask(
            whole(cfg, TASK_ID),
            whole(cfg, BASE_VERSION),
            [Resolution.from_dict(d) for d in json.loads(str(cfg.get(RESOLUTIONS, "[]")))],
            bool(cfg.get(RESYNC, False)),
            str(cfg[ARRAYS_KEY]),
            compression,
            ArrayLayout.from_json(str(cfg[LAYOUT]), dense) if LAYOUT in cfg else None,
            dense,
            task_density(cfg.get(DENSITY, 0.0)),
            whole(cfg, RUN_KEY, 0, signed=True),
            task_max_norm(cfg.get(MAX_NORM, 0.0)),
        )
    except (KeyError, ValueError, TypeError, RecursionError) as exc:
        raise RecordError(f"malformed fedcomp task: {exc}") from exc


@dataclass(frozen=True)
class TaskFormat:
    """How a server writes fedcomp's part of its train messages: the compression it asks for, which ArrayRecord
    is the model (``arrays_key``), and, when the model travels as a blob (a compressed downlink, or a server that
    owns the model as the product's loops do), its array ``layout``.

    ``content(task, blob)`` is the whole train message of a server without a wrapped strategy (the product's
    loops): ``ConfigRecord "config"`` (``server-round``, and the task id, which the product's train function seeds
    its batches with) and fedcomp's record with the model as ``blob``; ``mod_task`` is fedcomp's part alone, for a
    server that adds it to a strategy's message (``Compressed``).
    """

    compression: dict[str, str]
    layout: ArrayLayout | None = None
    arrays_key: str = "arrays"
    dense: tuple[str, ...] = DENSE_SUFFIXES
    max_norm: float = 0.0  # the server's max_update_norm, sent with each task (0: none)

    def mod_task(self, task: Task) -> ModTask:
        return ModTask(task.task_id, task.base_version, task.resolutions, task.resync, self.arrays_key,
                       self.compression, self.layout, self.dense, task.density, task.run_key, self.max_norm)

    def content(self, task: Task, model: bytes) -> RecordDict:
        if self.layout is None:
            raise ValueError("a task whose model travels as a blob needs the model's layout")
        config = ConfigRecord({SERVER_ROUND: int(task.round)})
        return add_mod_task(RecordDict({CONFIG: config}), self.mod_task(task), model, task_folds=True)


#: Key, in a ``compression_mod`` reply's ConfigRecord, of the seconds the train function took (what
#: ``density="auto"`` subtracts from the task's time to learn the node's link).
SECONDS = "train-seconds"

#: The ``fedcomp.task.config.Compression`` fields as ConfigRecord keys.
COMPRESSION_KEYS = ("compressor", "memory", "options", "downlink", "downlink-options")


def add_mod_reply(
    content: RecordDict, layout: ArrayLayout, arrays_key: str, blob: bytes, meta: ReplyMeta
) -> RecordDict:
    """The user's reply with the model's ArrayRecord replaced by fedcomp's ConfigRecord: task id, seq,
    incarnation, the update blob (inline; over ``INLINE_MAX`` as ``ArrayRecord UPDATE``) and the arrays that
    travel dense, packed (``DENSE``); the user's Config- and MetricRecords are folded in (``fold``), their other
    records pass as they are."""
    out = RecordDict(dict(content))
    cfg: dict[str, Any] = {TASK_ID: meta.task_id, SEQ: meta.seq, INCARNATION: meta.incarnation}
    _move_rest(out, cfg, arrays_key, layout)
    fold(out, cfg)
    if len(blob) <= INLINE_MAX:
        cfg[UPDATE] = bytes(blob)
    else:
        out[UPDATE] = blob_record(blob)
    out[CONTROL] = ConfigRecord(cfg)
    return out


def mod_reply_seconds(content: RecordDict) -> float:
    """The train seconds a ``compression_mod`` reply reports (0 when absent or not a finite number >= 0)."""
    cfg = content.config_records.get(CONTROL)
    value = cfg.get(SECONDS) if cfg is not None else None
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and 0 <= value < float("inf")
    return float(value) if ok else 0.0


def read_mod_reply(content: RecordDict) -> tuple[bytes, ReplyMeta]:
    """Blob and meta of a ``compression_mod`` reply (``num_examples`` is the wrapper's business); the records
    the mod folded in are put back in ``content`` (``unfold``). ``RecordError`` if the reply lacks them (a client
    without the mod) or they are malformed."""
    cfg = content.config_records.get(CONTROL)
    if cfg is None or (UPDATE not in content.array_records and not isinstance(cfg.get(UPDATE), bytes)):
        raise RecordError("no fedcomp update in the reply (is compression_mod in the ClientApp's mods?)")
    cfg = content.config_records[CONTROL]
    try:
        meta = ReplyMeta(whole(cfg, TASK_ID), whole(cfg, SEQ), 1, whole(cfg, INCARNATION, 0))
    except KeyError as exc:
        raise RecordError(f"malformed fedcomp reply: {exc}") from exc
    blob, pending = read_blob(content, UPDATE), pending_tasks(cfg.get(PENDING_KEY))
    unfold(content)
    return blob, dataclasses.replace(meta, pending=pending)

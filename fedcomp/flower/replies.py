"""What the wrapped strategy receives from ``Compressed``: replies in the layout it expects, rebuilt from the
decoded updates (docs/flower.md, "What each strategy receives").

* ``dense_reply``: one client's reply with the model's ArrayRecord = ``current - update`` (the update's arrays in
  their first-round dtype) and the reply's own dense arrays (integers and bools as float64);
* ``mean_update`` + ``dense_means``: the weighted mean of every accepted update, summed in O(nnz), and of the
  arrays that travel dense, for the FedAvg family, which then gets one reply;
* ``mean_reply``: that one reply's content (the wrapped strategy's metrics aggregation of the replies, their
  example count, the dense means, ``current - mean``), in sync rounds and for each async version alike;
* ``example_weight``: the reply's weight (FedAvg's ``num-examples``), checked, once ``check_metrics`` found every
  metric a finite number within float range (what a metrics aggregation can sum; else a counted rejection);
* ``aggregate_metrics``: the wrapped strategy's metrics aggregation, which never stops a run (replies whose
  metrics disagree in keys or types get no aggregated metrics, counted in ``metrics_failed``).

Example (no Flower run needed for the content)::

    >>> import numpy as np, torch
    >>> from flwr.app import Array, ArrayRecord, MetricRecord, RecordDict
    >>> from fedcomp.flower.records import ArrayLayout
    >>> current = ArrayRecord({"w": Array(np.ones(2, "float32")), "n": Array(np.array(3))})
    >>> layout = ArrayLayout.of(current)
    >>> out = dense_reply(RecordDict(), layout, current, {"w": torch.ones(2)}, {"w": torch.full((2,), 0.5)}, "arrays")
    >>> out["arrays"]["w"].numpy().tolist(), out["arrays"]["n"].dtype
    ([0.5, 0.5], 'float64')
    >>> check_metrics(RecordDict({"m": MetricRecord({"loss": [0.5, 1.5], "num-examples": 10 ** 400})}))
    Traceback (most recent call last):
    ...
    fedcomp.flower.records.RecordError: metric 'num-examples' of 'm' must be ... got an integer of 1329 bits
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from logging import WARNING
from typing import Any

import numpy as np
import torch
from flwr.app import Array, ArrayRecord, MetricRecord, RecordDict
from flwr.common.logger import log

from fedcomp.flower import records
from fedcomp.payload import Update
from fedcomp.protocol import MAX_WEIGHT
from fedcomp.server.aggregate import SparseAccumulator
from fedcomp.spec import ModelSpec


def example_weight(content: RecordDict, key: str) -> float:
    """The reply's ``key`` metric (FedAvg's ``num-examples``): an int or float in ``[0, MAX_WEIGHT]`` (2**53:
    weights, their sum and their products with float32 values stay finite), else ``RecordError``; first every
    metric of the reply is checked (``check_metrics``)."""
    if not content.metric_records:
        raise records.RecordError("reply has no MetricRecord")
    check_metrics(content)
    value = next(iter(content.metric_records.values())).get(key, None)
    if not _finite(value) or not 0 <= value <= MAX_WEIGHT:
        raise records.RecordError(f"metric {key!r} must be a finite number in [0, 2**53], got {_shown(value)}")
    return float(value)


def admitted_weight(content: RecordDict, options: Any) -> float:
    """A reply's example weight (``example_weight`` under ``options.weighted_by_key``), and where the wrapped
    strategy gets one dense reply per client (``options.sparse`` false) its one model ArrayRecord checked
    (``check_one_model``); ``RecordError`` otherwise."""
    weight = example_weight(content, options.weighted_by_key)
    if not options.sparse:
        check_one_model(content, options.arrays_key)
    return weight


def check_one_model(content: RecordDict, arrays_key: str) -> None:
    """``RecordError`` if the reply holds an ArrayRecord besides the model's (``arrays_key``) and fedcomp's update:
    a strategy given one dense reply per client takes exactly one (Flower's raise ``InconsistentMessageReplies``
    on the whole round otherwise)."""
    extra = [k for k in content.array_records if k not in (arrays_key, records.UPDATE)]
    if extra:
        raise records.RecordError(f"ArrayRecord {extra[0][:60]!r} next to the model's {arrays_key!r}: one is taken")


def shared_metrics(wrapper: Any, contents: list[RecordDict]) -> None:
    """Each reply's MetricRecord cut to the keys every reply has (in place): a strategy given one dense reply per
    client refuses replies whose metric keys differ (Flower's raise ``InconsistentMessageReplies``), so one node's
    extra key would cost the round its model. Metrics it drops are logged and counted as ``metrics_failed``."""
    named = [next(iter(c.metric_records.items())) for c in contents if c.metric_records]
    if not named:
        return
    keys = set.intersection(*(set(r.keys()) for _, r in named))
    if all(len(r) == len(keys) for _, r in named):
        return
    for content, (name, record) in zip(contents, named, strict=True):
        content[name] = MetricRecord({k: v for k, v in record.items() if k in keys})
    log(WARNING, "[fedcomp] the replies' metric keys differ: only the %d they share are aggregated", len(keys))
    count_metrics_failed(wrapper)


def check_metrics(content: RecordDict) -> None:
    """``RecordError`` unless every value of the reply's MetricRecords is an int or float (or a list of them, as a
    MetricRecord holds) that converts to a finite float: what a metrics aggregation (sums of products) can take.
    A JSON integer of 400 digits or a NaN is refused here, at admission, not in the aggregation of the round."""
    for name, record in content.metric_records.items():
        for key, value in record.items():
            items = value if isinstance(value, list) else [value]
            for i, item in enumerate(items):
                if not _finite(item):
                    where = f"{key!r}[{i}]" if isinstance(value, list) else repr(key)
                    raise records.RecordError(
                        f"metric {where} of {name!r} must be a finite number within float range, got {_shown(item)}"
                    )


def _finite(value: object) -> bool:
    """True for an int or float (not a bool) that converts to a finite float."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    try:
        return math.isfinite(float(value))
    except OverflowError:  # an int beyond float range
        return False


def _shown(value: object) -> str:
    """``value`` for a message, short whatever its size (an int of 10^5 digits is not printed)."""
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 64:
        return f"an integer of {value.bit_length()} bits"
    if isinstance(value, list):
        return f"a list of {len(value)}"
    return repr(value)[:60]


def dense_reply(
    content: RecordDict,
    layout: records.ArrayLayout,
    current: ArrayRecord,
    current_floats: dict[str, torch.Tensor],
    delta: dict[str, torch.Tensor],
    arrays_key: str,
) -> RecordDict:
    """``content`` as the wrapped strategy expects it: fedcomp's records removed; the model's ArrayRecord =
    ``current_floats - delta`` for the update's arrays (in their dtype) and, for the others, the reply's own
    (else ``current``'s), integers and bools as float64 so a strategy's float arithmetic on them (QFedAvg scales
    in place) cannot fail; they go back to the clients in their first-round dtype (``ArrayLayout.conform``)."""
    out = RecordDict({k: v for k, v in content.items() if k not in (records.UPDATE, records.CONTROL)})
    own = content.array_records.get(arrays_key, {})
    arrays = {}
    for name, shape, dtype in layout.entries:
        if layout.compresses(name, dtype):
            arrays[name] = Array((current_floats[name] - delta[name].reshape(shape)).numpy().astype(dtype))
        else:
            arr = own[name] if name in own else current[name]
            arrays[name] = arr if layout.is_float(arr.dtype) else Array(arr.numpy().astype(np.float64))
    out[arrays_key] = ArrayRecord(arrays)
    return out


def mean_update(spec: ModelSpec, updates: list[Update], weights: list[float]) -> dict[str, torch.Tensor]:
    """``Σ wᵢ·updateᵢ / Σ wᵢ`` in O(nnz) (the updates were decoded and weight-bounded once, in ``admit``)."""
    acc = SparseAccumulator(spec)
    for update, weight in zip(updates, weights, strict=True):
        acc.add(update, weight=weight, trusted=True)
    return acc.result(normalize="weights")


def dense_means(contents: list[RecordDict], key: str, weights: list[float]) -> dict[str, ArrayRecord]:
    """The replies' arrays outside the update (running statistics, counters, masks), example-weighted means in
    their dtype (integers rounded, a bool mask the weighted majority) over the replies that sent them (each the
    layout's whole set: ``records.ArrayLayout.check_rest``); ``{}`` when none did or they weigh 0 in all (nothing
    to weigh by: the model's own arrays stay)."""
    sent = [(c.array_records[key], w) for c, w in zip(contents, weights, strict=True) if key in c.array_records]
    total = sum(w for _, w in sent)
    if not sent or not total > 0:
        return {}
    out = {}
    for name, first in sent[0][0].items():
        acc = sum(w * r[name].numpy().astype(np.float64) for r, w in sent)
        out[name] = Array(_as_dtype(acc / total, first.numpy().dtype))
    return {key: ArrayRecord(out)}


def _as_dtype(mean: np.ndarray, dtype: np.dtype) -> np.ndarray:
    """A float64 mean in ``dtype``: integers rounded and kept within the dtype's range (a mean of counters near
    ``2**63`` rounds to ``2**63`` in float64, which a cast would wrap to ``-2**63``), floats as they are."""
    if dtype.kind not in "iub":
        return np.asarray(mean).astype(dtype)
    rounded = np.rint(mean)
    if dtype.kind in "iu":
        info = np.iinfo(dtype)
        top = np.float64(info.max)
        top = top if int(top) <= info.max else np.nextafter(top, 0.0)  # the largest float64 the dtype holds
        rounded = np.clip(rounded, np.float64(info.min), top)
    return np.asarray(rounded).astype(dtype)


def mean_reply(
    wrapper: Any, contents: list[RecordDict], weights: list[float], current: ArrayRecord,
    floats: dict[str, torch.Tensor], mean: dict[str, torch.Tensor],
) -> RecordDict:
    """The one reply the FedAvg family gets for the accepted replies ``contents`` (example weights ``weights``)
    whose updates' weighted mean is ``mean``: the wrapped strategy's ``train_metrics_aggr_fn`` of the replies,
    their example count under its ``weighted_by_key``, the dense arrays' weighted means and the model
    ``current - mean`` (``wrapper``: the ``Compressed`` with the layout pinned)."""
    opts = wrapper.options
    metrics = aggregate_metrics(wrapper, contents, weights)
    metrics[opts.weighted_by_key] = float(sum(weights)) or 1.0
    content = RecordDict({"metrics": metrics, **dense_means(contents, opts.arrays_key, weights)})
    return dense_reply(content, wrapper.layout, current, floats, mean, opts.arrays_key)


def aggregate_metrics(wrapper: Any, contents: list[RecordDict], weights: list[float]) -> MetricRecord:
    """The wrapped strategy's ``train_metrics_aggr_fn`` of the accepted replies ``contents`` (``guarded``). Empty
    when it has none, when there are no replies or their example weights total 0 (nothing to weigh by)."""
    metrics_fn = getattr(wrapper.strategy, "train_metrics_aggr_fn", None)
    if not metrics_fn or not contents or not sum(weights) > 0:
        return MetricRecord()
    return guarded(wrapper, metrics_fn)(contents, wrapper.options.weighted_by_key)


def guarded(wrapper: Any, metrics_fn: Callable[..., MetricRecord]) -> Callable[..., MetricRecord]:
    """``metrics_fn`` (a strategy's metrics aggregation, run on client data) that never ends the run: when it
    raises (replies whose metrics disagree in keys or types, a list where another sends a number) one line is
    logged and counted (``metrics_failed`` in the stats of ``wrapper.proto``) and the metrics are empty; the
    model is aggregated all the same."""

    def call(contents: list[RecordDict], key: str) -> MetricRecord:
        try:
            return metrics_fn(contents, key)
        except Exception as exc:  # noqa: BLE001 - the user's function on client data: never the end of the run
            log(WARNING, "[fedcomp] the metrics of %d replies were not aggregated: %s: %s", len(contents),
                type(exc).__name__, str(exc)[:200])
            count_metrics_failed(wrapper)
            return MetricRecord()

    return call


def count_metrics_failed(wrapper: Any) -> None:
    """One more round or version whose metrics were not (all) aggregated, in the stats of ``wrapper.proto``."""
    stats = getattr(wrapper.proto, "stats", None)
    if stats is not None:
        stats.metrics_failed += 1


@contextmanager
def metrics_guarded(wrapper: Any) -> Iterator[None]:
    """While inside, the wrapped strategy's own ``train_metrics_aggr_fn`` (what its ``aggregate_train`` of one
    dense reply per client calls) is ``guarded``."""
    strategy = wrapper.strategy
    metrics_fn = getattr(strategy, "train_metrics_aggr_fn", None)
    if metrics_fn is None:
        yield
        return
    strategy.train_metrics_aggr_fn = guarded(wrapper, metrics_fn)
    try:
        yield
    finally:
        strategy.train_metrics_aggr_fn = metrics_fn

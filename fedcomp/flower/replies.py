"""What the wrapped strategy receives from ``Compressed``: replies in the layout it expects, rebuilt from the
decoded updates (docs/flower.md, "What each strategy receives").

* ``dense_reply``: one client's reply with the model's ArrayRecord = ``current - update`` (the update's arrays in
  their first-round dtype) and the reply's own dense arrays (integers and bools as float64);
* ``mean_update`` + ``dense_means``: the weighted mean of every accepted update, summed in O(nnz), and of the
  arrays that travel dense, for the FedAvg family, which then gets one reply;
* ``mean_reply``: that one reply's content (the wrapped strategy's metrics aggregation of the replies, their
  example count, the dense means, ``current - mean``), in sync rounds and for each async version alike;
* ``example_weight``: the reply's weight (FedAvg's ``num-examples``), checked.

Example (no Flower run needed for the content)::

    >>> import numpy as np, torch
    >>> from flwr.app import Array, ArrayRecord, MetricRecord, RecordDict
    >>> from fedcomp.flower.records import ArrayLayout
    >>> current = ArrayRecord({"w": Array(np.ones(2, "float32")), "n": Array(np.array(3))})
    >>> layout = ArrayLayout.of(current)
    >>> out = dense_reply(RecordDict(), layout, current, {"w": torch.ones(2)}, {"w": torch.full((2,), 0.5)}, "arrays")
    >>> out["arrays"]["w"].numpy().tolist(), out["arrays"]["n"].dtype
    ([0.5, 0.5], 'float64')
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from flwr.app import Array, ArrayRecord, MetricRecord, RecordDict

from fedcomp.flower import records
from fedcomp.payload import Update
from fedcomp.server.aggregate import SparseAccumulator
from fedcomp.spec import ModelSpec


def example_weight(content: RecordDict, key: str) -> float:
    """The reply's ``key`` metric (FedAvg's ``num-examples``): a finite number >= 0, else ``RecordError``."""
    if not content.metric_records:
        raise records.RecordError("reply has no MetricRecord")
    value = next(iter(content.metric_records.values())).get(key, None)
    if not isinstance(value, (int, float)) or not np.isfinite(value) or value < 0:
        raise records.RecordError(f"metric {key!r} must be a finite number >= 0, got {value!r}")
    return float(value)


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
    layout's whole set: ``records.ArrayLayout.check_rest``; a plain mean when their weights are all 0); ``{}`` when
    none did."""
    sent = [(c.array_records[key], w) for c, w in zip(contents, weights, strict=True) if key in c.array_records]
    if not sent:
        return {}
    total = sum(w for _, w in sent)
    if total <= 0:
        sent, total = [(r, 1.0) for r, _ in sent], float(len(sent))
    out = {}
    for name, first in sent[0][0].items():
        acc = sum(w * r[name].numpy().astype(np.float64) for r, w in sent)
        dtype = first.numpy().dtype
        out[name] = Array(np.asarray(np.rint(acc / total) if dtype.kind in "iub" else acc / total).astype(dtype))
    return {key: ArrayRecord(out)}


def mean_reply(
    wrapper: Any, contents: list[RecordDict], weights: list[float], current: ArrayRecord,
    floats: dict[str, torch.Tensor], mean: dict[str, torch.Tensor],
) -> RecordDict:
    """The one reply the FedAvg family gets for the accepted replies ``contents`` (example weights ``weights``)
    whose updates' weighted mean is ``mean``: the wrapped strategy's ``train_metrics_aggr_fn`` of the replies,
    their example count under its ``weighted_by_key``, the dense arrays' weighted means and the model
    ``current - mean`` (``wrapper``: the ``Compressed`` with the layout pinned)."""
    opts = wrapper.options
    metrics_fn = getattr(wrapper.strategy, "train_metrics_aggr_fn", None)
    metrics = metrics_fn(contents, opts.weighted_by_key) if metrics_fn and contents else MetricRecord()
    metrics[opts.weighted_by_key] = float(sum(weights)) or 1.0
    content = RecordDict({"metrics": metrics, **dense_means(contents, opts.arrays_key, weights)})
    return dense_reply(content, wrapper.layout, current, floats, mean, opts.arrays_key)

"""Weighted sum of compressed updates into dense buffers, at O(nnz) per sparse payload.

Cost contract: ``SparseAccumulator.add`` touches only the kept positions of a sparse payload
(``TensorPayload.add_to``, one ``index_add_``), so adding a 0.1%-density update costs ~0.1% of a dense add; it
never densifies a payload. The dense buffers (one float32 tensor per spec entry) are allocated once, in
``__init__``; ``reset`` zeroes them in place. ``result`` is the only O(model size) call.

Device: the buffers live on ``device`` (default the CPU). ``add`` goes through ``fedcomp.kernels.scatter_add``:
CUDA buffers take the Triton decode + weighted scatter-add kernel (payloads decoded on the CPU are moved to the
GPU once per tensor), CPU buffers ``TensorPayload.add_to``; ``backend`` forces one (see ``fedcomp.kernels``).
LOWRANK payloads always take ``add_to`` (their factors are multiplied out, O(r m n)).
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch

from fedcomp.kernels.scatter import scatter_add
from fedcomp.payload import TensorPayload, Update, ValueCoding
from fedcomp.protocol import NORMALIZATIONS
from fedcomp.spec import ModelSpec


class SparseAccumulator:
    """``Σ_i w_i · u_i`` over added updates, per spec tensor.

    ``add`` validates the whole update before changing any buffer (a rejected update leaves the sum as it was):
    the tensor names must be exactly the spec's, each payload's shape must match, its value count must match its
    index count (or ``numel`` when dense), and sparse indices must lie in ``[0, numel)``. Index order and
    uniqueness are the wire decoder's job (``fedcomp.decode`` validates them); duplicate indices would simply add
    twice. Every value must be finite after dequantization and after scaling by ``weight`` in float32
    (``Values.finite_after``: a per-block bound for quantized payloads, one read pass for float ones), so no
    single add writes NaN or Inf. ``weight`` must be finite and ``>= 0``. The buffers are float32: a sum of many
    contributions close to float32's largest value can still overflow (checking it would cost O(model) per add),
    so keep weights and updates well inside its range (example counts, staleness factors and 1/K all are).
    """

    def __init__(self, spec: ModelSpec, *, device: torch.device | str = "cpu", backend: str | None = None) -> None:
        self.spec, self.device, self.backend = spec, torch.device(device), backend
        self._shapes = dict(spec.entries)
        self.buffers: dict[str, torch.Tensor] = {
            name: torch.zeros(shape, dtype=torch.float32, device=self.device) for name, shape in spec.entries
        }
        self.count = 0
        self.total_weight = 0.0

    def add(
        self, update: Update | Mapping[str, TensorPayload], weight: float = 1.0, *, trusted: bool = False
    ) -> None:
        """``buffers += weight * update`` in O(nnz); ``ValueError`` naming the offending tensor on a mismatch.

        ``trusted=True`` skips the validation of the payloads (not of the weight): for an ``Update`` that
        ``fedcomp.decode`` returned for this spec (it checked names, shapes, indices and finiteness after
        dequantization) added with a weight whose product with the update's norm the caller bounded
        (``fedcomp.server`` does: ``WEIGHTED_NORM_LIMIT``). Validate once, on the way in."""
        payloads = update.tensors if isinstance(update, Update) else update
        weight = float(weight)
        if not (math.isfinite(weight) and weight >= 0.0):
            raise ValueError(f"weight must be finite and >= 0, got {weight}")
        if not trusted:
            self._validate(payloads, weight)
        if weight > 0.0:
            for name, payload in payloads.items():
                if payload.values.coding is ValueCoding.LOWRANK:  # no kernel: add_to multiplies the factors out
                    payload.add_to(self.buffers[name], weight)
                else:
                    scatter_add(self.buffers[name], payload, weight, backend=self.backend)
        self.count += 1
        self.total_weight += weight

    def _validate(self, payloads: Mapping[str, TensorPayload], weight: float) -> None:
        unknown = [n for n in payloads if n not in self._shapes]
        if unknown:
            raise ValueError(f"update has tensor(s) not in the model spec: {', '.join(map(repr, unknown))}")
        missing = [n for n in self._shapes if n not in payloads]
        if missing:
            raise ValueError(f"update lacks tensor(s) of the model spec: {', '.join(map(repr, missing))}")
        for name, p in payloads.items():
            shape = self._shapes[name]
            if tuple(p.shape) != shape:
                raise ValueError(f"tensor {name!r}: payload shape {tuple(p.shape)} != spec shape {shape}")
            try:
                _check_payload(p, math.prod(shape), weight)
            except ValueError as e:
                raise ValueError(f"tensor {name!r}: {e}") from None

    def result(self, normalize: str = "weights") -> dict[str, torch.Tensor]:
        """The aggregate as new tensors (later ``add``/``reset`` calls do not change them).

        * ``"weights"``: ``Σ w_i u_i / Σ w_i``, the weighted mean (FedAvg with example-count weights);
          ``ValueError`` if the total weight is 0.
        * ``"sum"``: ``Σ w_i u_i`` unnormalised (the caller divides, or the weights already sum to 1).
        * ``"count"``: ``Σ w_i u_i / K`` with K the number of added updates (FedBuff: staleness weights shrink
          the step instead of being renormalised away); ``ValueError`` if nothing was added.
        """
        if normalize == "sum":
            scale = 1.0
        elif normalize == "weights":
            if self.total_weight <= 0.0:
                raise ValueError("cannot normalise by weights: total weight is 0")
            scale = 1.0 / self.total_weight
            if scale > torch.finfo(torch.float32).max:
                raise ValueError(f"cannot normalise by weights: total weight {self.total_weight:g} underflows float32")
        elif normalize == "count":
            if self.count == 0:
                raise ValueError("cannot normalise by count: no update was added")
            scale = 1.0 / self.count
        else:
            raise ValueError(f"normalize must be one of {NORMALIZATIONS}, got {normalize!r}")
        return {name: buf * scale for name, buf in self.buffers.items()}

    def reset(self) -> None:
        """Zero the buffers in place and forget count and total weight."""
        for buf in self.buffers.values():
            buf.zero_()
        self.count = 0
        self.total_weight = 0.0

    def __len__(self) -> int:
        return self.count


def _check_payload(p: TensorPayload, numel: int, weight: float) -> None:
    """``ValueError`` unless ``p`` has ``numel`` values (dense; LOWRANK: factors fitting the shape) or in-range
    int64 indices matching its values, and every ``weight * value`` is finite in float32."""
    if p.indices is None:
        if p.nnz != numel:
            raise ValueError(f"dense payload has {p.nnz} values for {numel} elements")
    elif p.indices.ndim != 1 or p.indices.numel() != p.nnz:
        raise ValueError(f"{p.indices.numel()} indices for {p.nnz} values")
    elif p.indices.dtype != torch.int64:
        raise ValueError(f"indices must be int64, got {p.indices.dtype}")
    elif p.nnz and (int(p.indices.min()) < 0 or int(p.indices.max()) >= numel):
        raise ValueError(f"index out of range [0, {numel})")
    if p.values.coding is ValueCoding.LOWRANK:  # P (m x r), Q (n x r) with m = shape[0], m n = numel
        rows = p.shape[0] if len(p.shape) >= 2 else 0
        if p.values.block != rows or p.values.factors()[2].shape[0] * rows != numel:
            raise ValueError(f"LOWRANK factors of {len(p.values)} entries do not fit shape {p.shape}")
    if not p.values.finite_after(weight):
        raise ValueError(f"NaN or Inf in the values or in weight x values (weight {weight:g}, float32)")

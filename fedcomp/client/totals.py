"""The running sums of a send pipeline that make conservation checkable from a saved state alone
(``fedcomp check``): what went in and was not applied yet; ``Pipeline.send`` calls ``before_step`` and
``after_step`` around its compression and knows nothing else of them.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from fedcomp.client.flat_sums import FlatSums
from fedcomp.payload import TensorPayload


@dataclass
class Totals:
    """The running sum, in float64 per tensor name, that makes conservation checkable from a saved state alone::

        outstanding == residual + Σ pending        (within float32 rounding of the steps)

    ``outstanding``: Σ of what the error-feedback memory took in at each ``send`` (its inflow: the pseudo-gradient
    itself for the ``residual`` memory, the momentum-corrected ``u_t`` for ``dgc``, measured as
    ``residual_after - residual_before + sent``), minus Σ of the updates the server acked (their pending payloads,
    taken off at ``ack``): the mass computed and not applied yet. ``acked`` / ``nacked``: how many ``seq`` were
    resolved each way, so ``sent == acked + nacked + len(pending)``. One dense float64 set per model (states saved
    with two, ``computed`` and ``applied``, load as their difference). Example::

        pipe = build("topk", spec, density=0.1)
        pipe.send(grads)                 # outstanding["w"] == residual + the pending update 1
        pipe.ack(1)                      # outstanding["w"] == residual
    """

    outstanding: dict[str, torch.Tensor] = field(default_factory=dict)
    acked: int = 0
    nacked: int = 0
    #: ``outstanding`` as views of one buffer, made by ``after_step`` (a cache: rebuilt when the sums are replaced)
    _flat: FlatSums | None = field(default=None, repr=False, compare=False)

    def add(self, sums: dict[str, torch.Tensor], name: str, payload: TensorPayload, weight: float) -> None:
        """``sums[name] += weight * decompress(payload)`` in float64, on the sum's device (created if missing)."""
        vals = payload.values.dequantize()
        target = self.zeros(sums, name, payload.shape, vals.device)
        vals = vals.to(target.device, torch.float64)
        if payload.indices is None:
            target.view(-1).add_(vals.view(-1), alpha=weight)
        else:
            target.view(-1).index_add_(0, payload.indices.to(target.device), vals, alpha=weight)

    def on_ack(self, payloads: Mapping[str, TensorPayload]) -> None:
        """The server applied an update: its mass leaves ``outstanding`` (by the flat sums' few ops where the last
        step made them and nothing replaced them since, else one tensor at a time: the same arithmetic)."""
        self.acked += 1
        flat = self._flat
        rest = flat.add(payloads, -1.0) if flat is not None and flat.holds(self.outstanding) else payloads
        for name, payload in rest.items():
            self.add(self.outstanding, name, payload, -1.0)

    @staticmethod
    def zeros(sums: dict[str, torch.Tensor], name: str, shape: tuple[int, ...], device: Any) -> torch.Tensor:
        t = sums.get(name)
        if t is None:
            t = sums[name] = torch.zeros(shape, dtype=torch.float64, device=device)
        return t

    def to(self, device: torch.device | str) -> None:
        self.outstanding = {k: t.to(device) for k, t in self.outstanding.items()}

    def state_dict(self) -> dict[str, Any]:
        return {
            "outstanding": {k: t.clone() for k, t in self.outstanding.items()},
            "acked": self.acked,
            "nacked": self.nacked,
        }

    @staticmethod
    def from_state(state: Mapping[str, Any]) -> Totals:
        """The totals ``state_dict`` saved, or the ``computed`` and ``applied`` sums earlier releases saved (as
        their difference); ``KeyError`` / ``TypeError`` / ``AttributeError`` on anything else."""
        return Totals(outstanding_of(state), int(state["acked"]), int(state["nacked"]))

    # ---- observing a send step (``Pipeline.send``) ---------------------------------------------------------
    def before_step(self, pipe: Any) -> None:
        """Before the step: ``outstanding -= residual`` (two dense passes in all, with ``after_step``; each one
        ``torch._foreach`` call over the model's tensors: the same arithmetic as one ``sub_``/``add_`` per tensor)."""
        rs = {name: r for name in pipe.spec.names if (r := pipe.residual_of(name)) is not None}
        if rs:
            torch._foreach_sub_(self._sums_like(rs), list(rs.values()))

    def after_step(self, pipe: Any, payloads: Mapping[str, TensorPayload]) -> bool:
        """After the step: ``outstanding += residual + sent`` (so the inflow is ``residual_after - residual_before +
        sent``, O(nnz) for the sent part). False when the memory keeps no residual (nothing can be recorded)."""
        rs = {name: pipe.residual_of(name) for name in payloads}
        if any(r is None for r in rs.values()):
            return False
        self._flat = FlatSums.of(self.outstanding, rs, self._flat) if rs else None
        if rs:
            torch._foreach_add_(self._sums_like(rs), list(rs.values()))
        rest = payloads if self._flat is None else self._flat.add(payloads)  # a few ops for them all
        for name, p in rest.items():
            self.add(self.outstanding, name, p, 1.0)
        return True

    def _sums_like(self, residuals: Mapping[str, torch.Tensor]) -> list[torch.Tensor]:
        """The ``outstanding`` sums of ``residuals``' names, created as zeros where missing."""
        return [Totals.zeros(self.outstanding, n, tuple(r.shape), r.device) for n, r in residuals.items()]


def outstanding_of(state: Mapping[str, Any]) -> dict[str, torch.Tensor]:
    """Float64 copies of a saved totals state's ``outstanding`` sums, or ``computed - applied`` for a state saved
    with both (earlier releases)."""
    if "outstanding" in state:
        return {k: t.to(torch.float64, copy=True) for k, t in state["outstanding"].items()}
    applied = state["applied"]
    return {
        k: t.to(torch.float64, copy=True) - (applied[k].to(torch.float64) if k in applied else 0.0)
        for k, t in state["computed"].items()
    }

"""The running sums of a send pipeline that make conservation checkable from a saved state alone
(``fedcomp check``): what went in, what the server applied; ``Pipeline.send`` calls ``before_step`` and
``after_step`` around its compression and knows nothing else of them.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from fedcomp.payload import TensorPayload


@dataclass
class Totals:
    """Running sums over a pipeline's life, in float64, per tensor name, that make conservation checkable from a
    saved state alone::

        computed == applied + residual + Σ pending        (within float32 rounding of the steps)

    ``computed``: Σ of what the error-feedback memory took in at each ``send`` (its inflow: the pseudo-gradient
    itself for the ``residual`` memory, the momentum-corrected ``u_t`` for ``dgc``), measured as
    ``residual_after - residual_before + sent``. ``applied``: Σ of the updates the server acked (their pending
    payloads, added at ``ack``). ``acked`` / ``nacked``: how many ``seq`` were resolved each way, so
    ``sent == acked + nacked + len(pending)``. Example::

        pipe = build("topk", spec, density=0.1)
        pipe.send(grads); pipe.ack(1)
        pipe.totals.applied["w"]        # the decoded update 1, float64
    """

    computed: dict[str, torch.Tensor] = field(default_factory=dict)
    applied: dict[str, torch.Tensor] = field(default_factory=dict)
    acked: int = 0
    nacked: int = 0

    def add(self, sums: dict[str, torch.Tensor], name: str, payload: TensorPayload, weight: float) -> None:
        """``sums[name] += weight * decompress(payload)`` in float64, on the sum's device (created if missing)."""
        target = self.zeros(sums, name, payload.shape, payload.values.dequantize().device)
        vals = payload.values.dequantize().to(target.device, torch.float64)
        if payload.indices is None:
            target.view(-1).add_(vals.view(-1), alpha=weight)
        else:
            target.view(-1).index_add_(0, payload.indices.to(target.device), vals, alpha=weight)

    @staticmethod
    def zeros(sums: dict[str, torch.Tensor], name: str, shape: tuple[int, ...], device: Any) -> torch.Tensor:
        t = sums.get(name)
        if t is None:
            t = sums[name] = torch.zeros(shape, dtype=torch.float64, device=device)
        return t

    def to(self, device: torch.device | str) -> None:
        self.computed = {k: t.to(device) for k, t in self.computed.items()}
        self.applied = {k: t.to(device) for k, t in self.applied.items()}

    def state_dict(self) -> dict[str, Any]:
        return {
            "computed": {k: t.clone() for k, t in self.computed.items()},
            "applied": {k: t.clone() for k, t in self.applied.items()},
            "acked": self.acked,
            "nacked": self.nacked,
        }

    @staticmethod
    def from_state(state: Mapping[str, Any]) -> Totals:
        return Totals(
            {k: t.to(torch.float64, copy=True) for k, t in state["computed"].items()},
            {k: t.to(torch.float64, copy=True) for k, t in state["applied"].items()},
            int(state["acked"]),
            int(state["nacked"]),
        )

    # ---- observing a send step (``Pipeline.send``) ---------------------------------------------------------
    def before_step(self, pipe: Any) -> None:
        """Before the step: ``computed -= residual`` (two dense passes in all, with ``after_step``)."""
        for name in pipe.spec.names:
            r = pipe.residual_of(name)
            if r is not None:
                Totals.zeros(self.computed, name, tuple(r.shape), r.device).sub_(r)

    def after_step(self, pipe: Any, payloads: Mapping[str, TensorPayload]) -> bool:
        """After the step: ``computed += residual + sent`` (so the inflow is ``residual_after - residual_before +
        sent``, O(nnz) for the sent part). False when the memory keeps no residual (nothing can be recorded)."""
        for name, p in payloads.items():
            r = pipe.residual_of(name)
            if r is None:
                return False
            Totals.zeros(self.computed, name, tuple(r.shape), r.device).add_(r)
            self.add(self.computed, name, p, 1.0)
        return True

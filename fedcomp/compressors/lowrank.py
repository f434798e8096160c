"""Low-rank compression (PowerSGD, Vogels et al., NeurIPS 2019): ``lowrank``.

Each tensor with ``ndim >= 2`` is viewed as the matrix ``M`` of shape ``(shape[0], prod(shape[1:]))`` and sent as
rank-``r`` factors found by one power iteration from the previous step's ``Q`` (warm start, as torch's DDP
PowerSGD hook does)::

    P = orthonormal(M Q)      # QR
    Q = M^T P
    sent = P Q^T = P diag(s) Q̂^T,  s = column norms of Q,  Q̂ = Q / s   # Q̂ kept for the next step

so a wire record holds ``4 r (m + n + 1)`` bytes instead of ``4 m n`` (``ValueCoding.LOWRANK``). What the power
iteration misses is not dropped: the error-feedback memory (``residual`` by default) keeps ``M - sent`` and adds it
to the next step, and the warm start lets the iterations converge on the dominant subspace over steps.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from fedcomp.compressors._blocks import check_int, positive_or_one
from fedcomp.compressors.base import COMPRESSORS, Compressor, Seeded
from fedcomp.payload import TensorPayload, Values


@dataclass(frozen=True)
class LowRankConfig:
    """``rank``: columns of ``P`` and ``Q`` (at most ``min(m, n)`` per tensor). ``dense_below``: tensors with fewer
    elements (and every tensor with ``ndim <= 1``: biases, norm scales) are sent whole as fp32, as are those whose
    factors would not be smaller than the tensor. ``seed``: of the initial ``Q`` draws (give each client its own)."""

    rank: int = 4
    dense_below: int = 1024
    seed: int = 0

    def __post_init__(self) -> None:
        check_int("rank", self.rank, 1)
        check_int("dense_below", self.dense_below, 0)
        check_int("seed", self.seed, 0)


@COMPRESSORS.register("lowrank")
class LowRank(Seeded, Compressor):
    """Rank-``r`` power-iteration compression with a warm-started ``Q`` per tensor name (``state_dict`` keeps the
    ``Q``s and the generator, so a restored client sends exactly what it would have sent).

    >>> comp = LowRank(LowRankConfig(rank=2))
    >>> p = comp.compress(torch.randn(64, 32), "w")
    >>> p.values.coding.name, len(p.values), p.to_dense().shape
    ('LOWRANK', 192, torch.Size([64, 32]))

    ``p.to_dense()`` is exactly what error feedback subtracts and what the server adds (``Values.dequantize``).
    """

    Config: ClassVar[type] = LowRankConfig

    def __init__(self, config: Any = None) -> None:
        super().__init__(config)
        self._init_rng(self.config.seed)
        #: The warm-start ``Q`` (``n x r``, float32, on the last tensor's device) of every tensor compressed so far.
        self.qs: dict[str, torch.Tensor] = {}

    def rank_for(self, shape: tuple[int, ...]) -> int:
        """The rank a tensor of ``shape`` is sent at, or 0 when it goes dense: ``ndim <= 1``, fewer than
        ``dense_below`` elements, or factors ``r (m + n + 1)`` (with the scales) not smaller than ``m n``."""
        numel = math.prod(shape)
        if len(shape) <= 1 or numel == 0 or numel < self.config.dense_below:
            return 0
        m, n = shape[0], numel // shape[0]
        r = min(self.config.rank, m, n)
        return r if r * (m + n + 1) < m * n else 0

    def compress(self, tensor: torch.Tensor, name: str) -> TensorPayload:
        shape = tuple(tensor.shape)
        r = self.rank_for(shape)
        if r == 0:
            return TensorPayload(shape, Values.f32(tensor.detach().reshape(-1).to(torch.float32, copy=True)))
        m = tensor.detach().reshape(shape[0], -1).to(torch.float32)
        p = torch.linalg.qr(m @ self._warm_q(name, m.shape[1], r, m.device)).Q
        q = m.T @ p
        s = torch.linalg.vector_norm(q, dim=0, dtype=torch.float64).to(torch.float32)  # no overflow in the squares
        q = q / positive_or_one(s)
        self.qs[name] = q  # unit columns (P is the same for any column scale): M Q stays in range next step
        return TensorPayload(shape, Values.lowrank(p, s, q))

    def _warm_q(self, name: str, n: int, r: int, device: torch.device) -> torch.Tensor:
        """Last step's ``Q`` for ``name``, or a fresh standard normal ``(n, r)`` draw from the seeded generator when
        there is none of that shape (first step, another rank) or it is not finite."""
        q = self.qs.get(name)
        if q is None or tuple(q.shape) != (n, r) or not bool(torch.isfinite(q).all()):
            q = torch.randn(n, r, generator=self.generator)
        return q.to(device)

    def state_dict(self) -> dict[str, Any]:
        return {"rng": self.generator.get_state(), "q": {k: q.detach().cpu().clone() for k, q in self.qs.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.generator.set_state(state["rng"])
        self.qs = {k: q.to(torch.float32, copy=True) for k, q in state["q"].items()}

"""Ternary coding of kept values, as in Sparse Ternary Compression (Sattler et al., 2019): ``topk+ternary``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from fedcomp.compressors._blocks import blocked, check_block, effective_block, positive_or_one
from fedcomp.compressors.base import COMPRESSORS, Quantizer
from fedcomp.payload import ValueCoding, Values


@dataclass(frozen=True)
class TernaryConfig:
    """``block``: values per scale; ``None`` (default) = one scale for the whole tensor (STC's mu)."""

    block: int | None = None

    def __post_init__(self) -> None:
        check_block(self.block)


@COMPRESSORS.register("ternary")
class TernaryQuantizer(Quantizer):
    """Code = sign(x) in {-1, 0, +1} (zeros stay 0); scale = mean |x| over the block's nonzero values.

    After top-k (STC) every kept value becomes ``+-mu`` with mu the mean kept magnitude. Deterministic and
    biased: the memory keeps ``x - scale * sign(x)`` under error feedback. A zero block gets scale 0.
    """

    Config: ClassVar[type] = TernaryConfig

    def quantize(self, values: torch.Tensor, name: str) -> Values:
        del name
        x = values.detach().float()
        block = effective_block(self.config.block, x.numel())
        mags = blocked(x, block).abs()
        nonzero = (mags > 0).sum(dim=1).to(mags.dtype)
        # Divide before summing: a mean of finite values stays finite even when their sum would overflow.
        scales = (mags / positive_or_one(nonzero)[:, None]).sum(dim=1)
        return Values(ValueCoding.TERNARY, torch.sign(x).to(torch.int8), scales, block)

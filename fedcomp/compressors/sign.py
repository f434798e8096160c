"""Scaled sign (EF-SignSGD, Karimireddy et al., ICML 2019)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from fedcomp.compressors._blocks import block_counts, blocked, check_block, effective_block
from fedcomp.compressors.base import COMPRESSORS, Quantizer
from fedcomp.payload import ValueCoding, Values


@dataclass(frozen=True)
class SignConfig:
    """``block``: values per scale; ``None`` (default) = one scale for the whole tensor, as in the paper."""

    block: int | None = None

    def __post_init__(self) -> None:
        check_block(self.block)


@COMPRESSORS.register("sign")
class SignQuantizer(Quantizer):
    """Code = sign(x) in {-1, +1} (x == 0 -> +1); scale = mean |x| of the block (``||x||_1 / d`` per tensor).

    Deterministic and biased: it is meant to run with error feedback, where the memory keeps
    ``x - scale * sign(x)``; that is what makes EF-SignSGD converge like SGD. A zero block gets scale 0.
    """

    Config: ClassVar[type] = SignConfig

    def quantize(self, values: torch.Tensor, name: str) -> Values:
        del name
        x = values.detach().float()
        n = x.numel()
        block = effective_block(self.config.block, n)
        # Divide before summing: a mean of finite values stays finite even when their sum would overflow.
        scales = (blocked(x, block).abs() / block_counts(n, block, x.device)[:, None]).sum(dim=1)
        codes = (x >= 0).to(torch.int8).mul_(2).sub_(1)  # +1 for x >= 0 (zeros included), else -1
        return Values(ValueCoding.SIGN, codes, scales, block)

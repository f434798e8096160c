"""Blockwise absmax integer quantizers: ``int8`` and ``int4``.

Values are cut into blocks of ``block``; each block gets one fp32 scale ``absmax / qmax`` (qmax = 127 or 7) and
each value the integer code ``round(x / scale)`` in ``[-qmax, qmax]``. ``ScaledRoundingQuantizer`` is the shared
machinery (QSGD in fedcomp/compressors/qsgd.py is the same with an L2-norm scale).
"""

from __future__ import annotations

from abc import abstractmethod
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from fedcomp.compressors._blocks import blocked, check_int, divide, positive_or_one, stochastic_round_
from fedcomp.compressors.base import COMPRESSORS, Quantizer, Seeded
from fedcomp.payload import ValueCoding, Values


class ScaledRoundingQuantizer(Seeded, Quantizer):
    """Per-block scale, code = rounding of ``x / scale`` clamped to ``[-qmax, qmax]``.

    With stochastic rounding the code is ``floor(x / scale)`` or one more, rounded up with probability equal to
    the fraction, so ``E[code * scale] == x`` (unbiased, up to fp32 rounding) and ``|x - code * scale| < scale``.
    Deterministic rounding is round-to-nearest (ties to even): biased, ``|x - code * scale| <= scale / 2``.
    A block of zeros gets scale 0 and codes 0. Under error feedback the memory keeps ``x - code * scale``.

    Subclasses set ``qmax`` and ``coding`` and define ``block_scales``; ``block_size`` and ``stochastic`` read the
    config's ``block`` and ``stochastic`` unless overridden (QSGD: ``bucket``, always stochastic).
    """

    qmax: int
    coding: ValueCoding

    def __init__(self, config: Any = None) -> None:
        super().__init__(config)
        self._init_rng(self.config.seed)

    @property
    def block_size(self) -> int:
        return self.config.block

    @property
    def stochastic(self) -> bool:
        return self.config.stochastic

    @abstractmethod
    def block_scales(self, blocks: torch.Tensor) -> torch.Tensor:
        """One fp32 scale >= 0 per row of ``blocks`` (zero-padded ``(num_blocks, block)``)."""

    def quantize(self, values: torch.Tensor, name: str) -> Values:
        del name
        n, block = values.numel(), self.block_size
        blocks = blocked(values.detach().float(), block)
        scales = self.block_scales(blocks)
        r = (blocks / positive_or_one(scales)[:, None]).view(-1)[:n].clamp_(-self.qmax, self.qmax)
        # r is within [-qmax, qmax], so both roundings stay in range (stochastic rounding never passes ceil(r)).
        codes = stochastic_round_(r, self.generator) if self.stochastic else r.round_()
        return Values(self.coding, codes.to(torch.int8), scales, block)


@dataclass(frozen=True)
class BlockwiseConfig:
    """``block``: values per scale; ``stochastic``: unbiased stochastic rounding (else round-to-nearest);
    ``seed``: of the rounding RNG (give each client its own)."""

    block: int = 256
    stochastic: bool = True
    seed: int = 0

    def __post_init__(self) -> None:
        check_int("block", self.block, 1)
        if not isinstance(self.stochastic, bool):
            raise ValueError(f"stochastic must be a bool, got {self.stochastic!r}")
        check_int("seed", self.seed, 0)


class AbsmaxQuantizer(ScaledRoundingQuantizer):
    """Scale = ``absmax(block) / qmax``: the largest value of each block is coded exactly (code ``±qmax``)."""

    Config: ClassVar[type] = BlockwiseConfig

    def block_scales(self, blocks: torch.Tensor) -> torch.Tensor:
        return divide(blocks.abs().amax(dim=1), self.qmax)


@COMPRESSORS.register("int8")
class Int8Quantizer(AbsmaxQuantizer):
    """8-bit blockwise absmax: codes in [-127, 127], one fp32 scale per ``block`` (default 256) values.

    Unbiased by default (stochastic rounding); ``stochastic=False`` rounds to nearest (biased, lower variance).
    """

    qmax = 127
    coding = ValueCoding.INT8


@COMPRESSORS.register("int4")
class Int4Quantizer(AbsmaxQuantizer):
    """4-bit blockwise absmax: codes in [-7, 7], one fp32 scale per ``block`` (default 256) values.

    Unbiased by default (stochastic rounding); ``stochastic=False`` rounds to nearest (biased, lower variance).
    """

    qmax = 7
    coding = ValueCoding.INT4

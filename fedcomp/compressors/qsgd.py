"""QSGD (Alistarh et al., NeurIPS 2017): unbiased stochastic quantization to ``levels`` per bucket norm."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from fedcomp.compressors._blocks import check_int, l2_norms
from fedcomp.compressors.base import COMPRESSORS
from fedcomp.compressors.blockwise import ScaledRoundingQuantizer
from fedcomp.payload import ValueCoding


@dataclass(frozen=True)
class QSGDConfig:
    """``levels`` s in [1, 127]; ``bucket``: values per norm; ``seed``: of the rounding RNG (one per client).

    Default s = 127, bucket = 512 (the paper's "8-bit QSGD, bucket 512"): any 7 < s <= 127 is sent as one byte
    per value, so s = 127 uses the whole byte and has the lowest variance for that size; s <= 7 is sent as
    4-bit codes (e.g. ``levels=7``).
    """

    levels: int = 127
    bucket: int = 512
    seed: int = 0

    def __post_init__(self) -> None:
        check_int("levels", self.levels, 1, 127)
        check_int("bucket", self.bucket, 1)
        check_int("seed", self.seed, 0)


@COMPRESSORS.register("qsgd")
class QSGDQuantizer(ScaledRoundingQuantizer):
    """Per bucket of ``bucket`` values with norm ``||b||_2``: code = sign(x) * level, level in ``[0, s]`` the
    stochastic rounding of ``s * |x| / ||b||_2``; scale = ``||b||_2 / s``; value = code * scale.

    Unbiased: ``E[code * scale] == x``, and ``|x - code * scale| < scale``. Variance per bucket of d values is at
    most ``min(d / s**2, sqrt(d) / s) * ||b||_2**2`` (Lemma 3.1). Codes are INT4 when s <= 7, else INT8. A zero
    bucket gets scale 0 and codes 0. Under error feedback the memory keeps ``x - code * scale`` (zero mean).
    """

    Config: ClassVar[type] = QSGDConfig

    def __init__(self, config: Any = None) -> None:
        super().__init__(config)
        self.qmax = self.config.levels
        self.coding = ValueCoding.INT4 if self.qmax <= 7 else ValueCoding.INT8

    @property
    def block_size(self) -> int:
        return self.config.bucket

    @property
    def stochastic(self) -> bool:
        return True

    def block_scales(self, blocks: torch.Tensor) -> torch.Tensor:
        # Sign times stochastic rounding of |x| / scale equals stochastic rounding of x / scale (same two
        # neighbours, same probabilities), so the shared signed rounding is exactly QSGD.
        return l2_norms(blocks, self.qmax)

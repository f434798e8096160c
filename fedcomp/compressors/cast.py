"""Half-precision casts: ``fp16`` and ``bf16``."""

from __future__ import annotations

from typing import ClassVar

import torch

from fedcomp.compressors.base import COMPRESSORS, Quantizer
from fedcomp.payload import FLOAT_DTYPES, ValueCoding, Values


class CastQuantizer(Quantizer):
    """Cast every value to a 16-bit float, rounding to nearest (ties to even): deterministic and biased.

    Saturating: values beyond the format's largest finite value are sent as that value (never inf). Under error
    feedback the memory keeps the cast error ``x - cast(x)`` (and any saturated excess), which it sends later.
    """

    coding: ClassVar[ValueCoding]

    def quantize(self, values: torch.Tensor, name: str) -> Values:
        del name
        dtype = FLOAT_DTYPES[self.coding]
        top = torch.finfo(dtype).max
        return Values(self.coding, values.detach().float().clamp(-top, top).to(dtype))


@COMPRESSORS.register("fp16")
class FP16Quantizer(CastQuantizer):
    """IEEE half precision: relative error <= 2**-11 for |x| >= 2**-14, finite range +-65504; smaller values lose
    precision (subnormals) and those with |x| <= 2**-25 are sent as 0."""

    coding = ValueCoding.F16


@COMPRESSORS.register("bf16")
class BF16Quantizer(CastQuantizer):
    """bfloat16: fp32's range with an 8-bit significand (relative error <= 2**-8 for normal values)."""

    coding = ValueCoding.BF16

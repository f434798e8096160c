"""The lossless baseline."""

from __future__ import annotations

import torch

from fedcomp.compressors.base import COMPRESSORS, Quantizer
from fedcomp.payload import Values


@COMPRESSORS.register("identity")
class IdentityQuantizer(Quantizer):
    """Every value as fp32: lossless, so the error-feedback residual stays zero.

    The payload owns a copy: it never aliases the input (the residual memory writes into its input tensor).
    """

    def quantize(self, values: torch.Tensor, name: str) -> Values:
        del name
        return Values.f32(values.detach().to(torch.float32, copy=True))

"""Quantize-and-pack with error feedback in one pass: the ``ResidualMemory`` + quantizer step on one tensor.

``ef_quantize(quantizer, x, residual)`` codes ``c = x + residual`` with one of the project's quantizers
(``int8``, ``int4``, ``qsgd``, ``sign``) and overwrites ``residual`` with ``c - dequantize(codes)``: exactly
``ResidualMemory.compensate`` -> ``quantizer.quantize`` -> ``ResidualMemory.update``. With ``pack=True`` it also
returns the codes bit-packed as on the wire (int4: 4-bit two's complement fields, sign: 1 bit, 1 = +1, least
significant first; int8: the codes' bytes).

CUDA tensors take the Triton path, CPU tensors the torch reference (the quantizer itself). Triton path, blocks
of at most ``MAX_TILE`` (4096) values: one pass, read x and residual, write codes (1 B), residual and the
per-block scales (12 + 1 B/element at int8; packed bytes on top). Larger blocks (sign's default one scale per
tensor): c and the scales by torch reductions, then a code pass (about 25 B/element).

Agreement with the reference: deterministic modes (round to nearest, sign) give identical codes, residuals and
absmax scales (sign and L2 scales: same to fp32 rounding of the sum order). Stochastic rounding draws from
``tl.rand`` with a seed taken from the quantizer's generator: the same distribution (codes are ``floor`` or
``ceil`` of ``c / scale`` with ``P(ceil) = frac``), not the same stream as the torch path.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import IntEnum
from typing import Any

import numpy as np
import torch

from fedcomp.compressors._blocks import block_counts, blocked
from fedcomp.compressors.base import Quantizer
from fedcomp.compressors.blockwise import AbsmaxQuantizer
from fedcomp.compressors.qsgd import QSGDQuantizer
from fedcomp.compressors.sign import SignQuantizer
from fedcomp.kernels._backend import resolve, to_device
from fedcomp.kernels._chunks import table
from fedcomp.payload import ValueCoding, Values


class ScaleRule(IntEnum):
    """How a block's scale is computed (the kernels' ``MODE``)."""

    ABSMAX = 0  # absmax / qmax (int8, int4)
    L2 = 1  # ||block||_2 / qmax (QSGD)
    MEAN_ABS = 2  # mean |x|, codes are signs (sign)


@dataclass(frozen=True)
class QuantSpec:
    """What the kernels need to know about a quantizer. ``block=None``: one block for the whole tensor."""

    rule: ScaleRule
    qmax: int
    coding: ValueCoding
    block: int | None
    stochastic: bool


#: Quantizer class -> its ``QuantSpec``: the quantizers the kernels implement (int8 and int4 are absmax quantizers).
#: A subclass takes the entry of its nearest registered class.
QUANT_SPECS: dict[type[Quantizer], Callable[[Any], QuantSpec]] = {
    SignQuantizer: lambda q: QuantSpec(ScaleRule.MEAN_ABS, 1, ValueCoding.SIGN, q.config.block, False),
    QSGDQuantizer: lambda q: QuantSpec(ScaleRule.L2, q.qmax, q.coding, q.block_size, True),
    AbsmaxQuantizer: lambda q: QuantSpec(ScaleRule.ABSMAX, q.qmax, q.coding, q.block_size, q.stochastic),
}


def has_kernel(quantizer: object) -> bool:
    """Whether ``quantizer`` is one the kernels implement (a ``QUANT_SPECS`` class or a subclass of one)."""
    return any(cls in QUANT_SPECS for cls in type(quantizer).__mro__)


def quant_spec(quantizer: Quantizer) -> QuantSpec:
    """The ``QuantSpec`` of one of the project's quantizers (int8, int4, qsgd, sign); ``TypeError`` otherwise."""
    for cls in type(quantizer).__mro__:
        spec = QUANT_SPECS.get(cls)
        if spec is not None:
            return spec(quantizer)
    raise TypeError(f"no kernel for quantizer {type(quantizer).__name__}")


@dataclass(frozen=True)
class Quantized:
    """``values``: the payload values of ``c`` (codes unpacked, as ``Values`` holds them); ``packed``: uint8 wire
    bytes of the codes when asked for (``None`` otherwise)."""

    values: Values
    packed: torch.Tensor | None = None


def pack_codes(codes: torch.Tensor, coding: ValueCoding) -> torch.Tensor:
    """Torch reference of the wire packing of int8 ``codes`` (1-D): uint8 bytes, as docs/wire-format.md says."""
    if coding is ValueCoding.INT8:
        return codes.view(torch.uint8).clone()
    bits = {ValueCoding.INT4: 4, ValueCoding.SIGN: 1}[coding]
    per = 8 // bits
    n = codes.numel()
    pad = (-n) % per
    if bits == 1:
        fld = (codes > 0).to(torch.int32)
    else:
        fld = codes.to(torch.int32) & ((1 << bits) - 1)
    fld = torch.nn.functional.pad(fld, (0, pad)).view(-1, per)
    shifts = torch.arange(per, device=codes.device, dtype=torch.int32) * bits
    return (fld << shifts).sum(dim=1).to(torch.uint8)


def ef_quantize(
    quantizer: Quantizer,
    x: torch.Tensor,
    residual: torch.Tensor | None = None,
    *,
    name: str = "",
    pack: bool = False,
    backend: str | None = None,
) -> Quantized:
    """Quantize ``c = x + residual`` (or ``x``) with ``quantizer``'s rule; ``residual`` (same shape as ``x``,
    contiguous fp32) is overwritten with ``c - dequantized``. ``x`` is not modified. 1-D output, flat order."""
    if x.dtype != torch.float32 or not x.is_contiguous():
        raise ValueError("x must be a contiguous float32 tensor")
    if residual is not None and (
        residual.shape != x.shape or residual.dtype != torch.float32 or not residual.is_contiguous()
    ):
        raise ValueError("residual must be a contiguous float32 tensor shaped like x")
    if resolve(x, backend) == "triton":
        return _triton_quantize(quantizer, quant_spec(quantizer), x, residual, pack)
    flat = x.reshape(-1)
    if residual is not None:
        c = residual.view(-1)
        c.add_(flat)  # == x + residual, the reference compensate
    else:
        c = flat
    values = quantizer.quantize(c, name)
    if residual is not None:
        c.add_(values.dequantize().to(c.device), alpha=-1.0)  # the reference update: e = c - decompressed
    packed = pack_codes(values.data, values.coding) if pack else None
    return Quantized(values, packed)


def quantize_all(quantizer: Quantizer, xs: Sequence[torch.Tensor], residuals: Sequence[torch.Tensor] | None = None,
                 *, backend: str | None = None) -> tuple[list[Values], list[torch.Tensor]]:
    """``ef_quantize(quantizer, x, e, backend=backend)`` for every ``x`` of ``xs`` (contiguous fp32, one device)
    with ``e`` its residual (``residuals``, overwritten in place) or, without ``residuals``, new zeros: the values
    (1-D, flat order) and the ``e`` (now the coding errors ``c - dequantized``).

    On the Triton path one launch for all (``quant_many_kernel``, a table of the tensors' addresses copied to the
    device once): each tensor's codes and scales are slices of flat outputs (its codes start 16-byte aligned), its
    own blocks, so they are those of one call per ``x``; stochastic rounding draws one seed for the launch (the same
    distribution, other draws). Quantizers with one block per tensor or blocks larger than a tile
    (``_triton_quant.MAX_TILE``: sign's default) and fewer than two tensors are quantized one by one.

    >>> from fedcomp.compressors.blockwise import BlockwiseConfig, Int8Quantizer
    >>> q = Int8Quantizer(BlockwiseConfig(block=2, stochastic=False))
    >>> values, errors = quantize_all(q, [torch.tensor([1.0, -2.0, 0.5]), torch.tensor([4.0])])
    >>> [v.data.tolist() for v in values], [v.scales.numel() for v in values]
    ([[64, -127, 127], [127]], [2, 1])
    """
    spec = quant_spec(quantizer)
    if not _many_takes(spec, xs, residuals, backend):
        errors = list(residuals) if residuals is not None else [torch.zeros_like(x) for x in xs]
        return [ef_quantize(quantizer, x, e, backend=backend).values for x, e in zip(xs, errors, strict=True)], errors
    from fedcomp.kernels import _triton_quant as K

    block, counts = spec.block, [x.numel() for x in xs]
    nblocks = [Values.num_blocks(c, block) for c in counts]
    code_at = np.cumsum([0, *(-(-c // 16) * 16 for c in counts)]).tolist()  # each tensor's codes 16-byte aligned
    scale_at = np.cumsum([0, *nblocks]).tolist()
    dev = xs[0].device
    codes = torch.empty(code_at[-1], dtype=torch.int8, device=dev)
    scales = torch.empty(scale_at[-1], dtype=torch.float32, device=dev)
    values = [Values(spec.coding, codes[a: a + c], scales[s: s + b], block)
              for a, c, s, b in zip(code_at, counts, scale_at, nblocks, strict=False)]
    if residuals is None:  # the errors: slices of one new buffer, written (not read) by the kernel
        err = torch.empty(code_at[-1], dtype=torch.float32, device=dev)
        errors = [err[a: a + c] for a, c in zip(code_at, counts, strict=False)]
    else:
        errors = list(residuals)
    bp = triton_next_pow2(block)
    rows = max(1, K.MAX_TILE // bp)
    pointers = np.array([t.data_ptr() for t in (*xs, *errors)], dtype=np.int64)
    tab, programs = table([pointers[: len(xs)], pointers[len(xs):], counts, code_at[:-1], scale_at[:-1]], nblocks, rows)
    if programs:
        K.quant_many_kernel[(programs,)](
            to_device(torch.from_numpy(tab), dev), len(xs), programs, codes, scales, block, float(spec.qmax),
            _seed(quantizer) if spec.stochastic else 0, READ_E=residuals is not None, MODE=int(spec.rule),
            STOCHASTIC=spec.stochastic, ALIGNED=not (pointers % 16).any() and codes.data_ptr() % 16 == 0, ROWS=rows,
            BP=bp, num_warps=K.NUM_WARPS, enable_fp_fusion=False,
        )
    return values, errors


def _many_takes(spec: QuantSpec, xs: Sequence[torch.Tensor], residuals: Sequence[torch.Tensor] | None,
                backend: str | None) -> bool:
    """Whether ``quant_many_kernel`` takes these tensors (see ``quantize_all``); the per-tensor way
    (``ef_quantize``) refuses the ones that are not contiguous fp32 or whose residual is not shaped like them."""
    if len(xs) < 2 or spec.block is None or resolve(xs[0], backend) != "triton":
        return False
    from fedcomp.kernels import _triton_quant as K

    if triton_next_pow2(spec.block) > K.MAX_TILE:
        return False
    dev = xs[0].device
    pairs = zip(xs, residuals if residuals is not None else xs, strict=True)
    return all(x.dtype == e.dtype == torch.float32 and x.is_contiguous() and e.is_contiguous() and x.shape == e.shape
               and x.device == e.device == dev for x, e in pairs)


def _seed(quantizer: Quantizer) -> int:
    gen = getattr(quantizer, "generator", None)
    return int(torch.randint(0, 2**31 - 1, (1,), generator=gen))


def _torch_scales(quantizer, spec: QuantSpec, c: torch.Tensor, block: int) -> torch.Tensor:
    """Per-block scales by the reference's own code (the large-block path)."""
    blocks = blocked(c, block)
    if spec.rule is ScaleRule.MEAN_ABS:  # SignQuantizer.quantize: divide before summing
        return (blocks.abs() / block_counts(c.numel(), block, c.device)[:, None]).sum(dim=1)
    return quantizer.block_scales(blocks)


def _triton_quantize(quantizer, spec: QuantSpec, x, residual, pack: bool) -> Quantized:
    from fedcomp.kernels import _triton_quant as K

    n = x.numel()
    dev = x.device
    block = spec.block if spec.block is not None else max(n, 1)
    nblocks = Values.num_blocks(n, block)
    seed = _seed(quantizer) if spec.stochastic else 0
    codes = torch.empty(n, dtype=torch.int8, device=dev)
    scales = torch.empty(nblocks, dtype=torch.float32, device=dev)
    bits = {ValueCoding.INT4: 4, ValueCoding.SIGN: 1}.get(spec.coding, 0)
    nbytes = math.ceil(n * bits / 8)
    packed = torch.empty(nbytes, dtype=torch.uint8, device=dev) if pack and bits else None
    pack_bits = bits if packed is not None else 0
    qmax = float(spec.qmax)
    xf = x.view(-1)
    ef = residual.view(-1) if residual is not None else xf
    bp = triton_next_pow2(block)
    common = dict(MODE=int(spec.rule), STOCHASTIC=spec.stochastic, PACK_BITS=pack_bits, num_warps=K.NUM_WARPS,
                  enable_fp_fusion=False)
    if n == 0:
        pass
    elif bp <= K.MAX_TILE and (pack_bits == 0 or block % (8 // pack_bits) == 0):
        rows = max(1, K.MAX_TILE // bp)
        K.quant_tile_kernel[(math.ceil(nblocks / rows),)](
            xf, ef, codes, scales, codes if packed is None else packed, n, nblocks, block, nbytes, qmax, seed,
            HAS_E=residual is not None, ROWS=rows, BP=bp, **common,
        )
    else:
        if residual is not None:
            c = ef.add_(xf)  # c = x + residual, in the residual's storage
        else:
            c = xf
        scales.copy_(_torch_scales(quantizer, spec, c, block))
        K.quant_1d_kernel[(math.ceil(n / K.BLOCK_1D),)](
            c, ef, codes, scales, codes if packed is None else packed, n, block, nbytes, qmax, seed,
            WRITE_E=residual is not None, BLOCK=K.BLOCK_1D, **common,
        )
    if pack and spec.coding is ValueCoding.INT8:
        packed = codes.view(torch.uint8).clone()
    elif pack and n == 0:
        packed = torch.empty(0, dtype=torch.uint8, device=dev)
    return Quantized(Values(spec.coding, codes, scales, block), packed)


def triton_next_pow2(n: int) -> int:
    """Smallest power of two >= ``n`` (>= 1)."""
    return 1 << max(0, (n - 1).bit_length())

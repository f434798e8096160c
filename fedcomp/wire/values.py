"""Value codings: how a record's kept values are laid out, checked and read back.

Float codings (F32, F16, BF16) are raw little-endian IEEE words. Quantized codings carry ``block`` and the
scale count as varints, then ``ceil(count / block)`` float32 scales, then the codes: INT8 one byte each
(two's complement), INT4 4-bit two's complement fields, SIGN one bit each (1 = +1, 0 = -1), TERNARY 2-bit
two's complement fields (0, 1, 3 = -1; 2 is invalid). Every value and scale must be finite, scales must be
>= 0, and every ``code x scale`` must be finite in float32 (checked per block: ``|scale| x`` the coding's largest
code, the block's actual codes only when that bound overflows).

LOWRANK (dense records of a tensor with ndim >= 2, wire version 2) carries the factors of its ``(m, n)`` matrix
view, ``m = shape[0]``: the rank ``r`` as a varint (``1 <= r <= min(m, n)``), ``r`` float32 scales (finite,
>= 0), then ``r (m + n)`` float32 factor entries (``P`` then ``Q``, row-major, finite), with
``max|P| x max|Q| x sum(scales) <= 2**127`` so that ``P diag(scales) Q^T`` is finite in float32.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from fedcomp.payload import FLOAT_DTYPES, LOWRANK_LIMIT, ValueCoding, Values
from fedcomp.wire.bits import Reader, pack_uint, take_packed, varint
from fedcomp.wire.errors import WireCategory, WireError

MAX_BLOCK = (1 << 32) - 1

# Float codings: numpy dtype on the wire, and the mask of exponent bits that marks Inf/NaN when all set.
_FLOAT_WIRE = {ValueCoding.F32: "<f4", ValueCoding.F16: "<f2", ValueCoding.BF16: "<i2"}
_BF16_EXP = 0x7F80
# Bits per code of the sub-byte quantized codings.
_CODE_WIDTH = {ValueCoding.INT4: 4, ValueCoding.SIGN: 1, ValueCoding.TERNARY: 2}


def coding_of(raw: int, what: str) -> ValueCoding:
    try:
        return ValueCoding(raw)
    except ValueError:
        raise WireError(f"{what}: unknown value coding id {raw}") from None


def _bf16_finite(words: np.ndarray) -> bool:
    return not np.any((words & _BF16_EXP) == _BF16_EXP)


def _float_words(data: torch.Tensor, coding: ValueCoding) -> np.ndarray:
    t = data.detach().cpu().contiguous()
    if coding is ValueCoding.BF16:
        words = t.view(torch.int16).numpy()
        finite = _bf16_finite(words)
    else:
        words = t.numpy()
        finite = bool(np.isfinite(words).all())
    if not finite:
        raise WireError("values contain NaN or Inf", WireCategory.NON_FINITE)
    return words


def _wire_view(a: np.ndarray) -> memoryview:
    """Zero-copy byte view of a contiguous little-endian array (the encoder joins the parts once)."""
    return memoryview(np.ascontiguousarray(a)).cast("B")


def _pack_codes(codes: np.ndarray, coding: ValueCoding) -> bytes | memoryview:
    if coding is ValueCoding.INT8:
        return _wire_view(codes)
    width = _CODE_WIDTH[coding]
    if coding is ValueCoding.SIGN:
        return pack_uint(codes > 0, 1)
    return pack_uint(codes.view(np.uint8) & np.uint8((1 << width) - 1), width)


def _check_codes(codes: np.ndarray, coding: ValueCoding) -> None:
    lo, hi = coding.code_range
    if codes.size and (int(codes.min()) < lo or int(codes.max()) > hi):
        raise WireError(f"{coding.name} codes outside [{lo}, {hi}]")
    if coding is ValueCoding.SIGN and np.any(codes == 0):
        raise WireError("SIGN codes must be -1 or +1, found 0")


def _check_scales(v: Values, count: int) -> np.ndarray:
    if not isinstance(v.block, int) or not 0 < v.block <= MAX_BLOCK:
        raise WireError(f"{v.coding.name}: block must be an int in [1, {MAX_BLOCK}], got {v.block!r}")
    if v.scales is None or v.scales.dtype != torch.float32 or v.scales.dim() != 1:
        raise WireError(f"{v.coding.name}: scales must be a 1-D float32 tensor")
    want = Values.num_blocks(count, v.block)
    if v.scales.numel() != want:
        raise WireError(f"{v.coding.name}: {v.scales.numel()} scales for {count} codes in blocks of {v.block}")
    scales = v.scales.detach().cpu().contiguous().numpy()
    _check_scale_values(scales, "")
    return scales


def _check_scale_values(scales: np.ndarray, prefix: str) -> None:
    """Scales are finite and not negative (absmax scales are >= 0 by construction; -0.0 equals 0 and passes)."""
    if not np.isfinite(scales).all():
        raise WireError(f"{prefix}scales contain NaN or Inf", WireCategory.NON_FINITE)
    if (scales < 0).any():
        raise WireError(f"{prefix}negative scale {float(scales.min())} (scales must be >= 0)")


def _check_products(v: Values, prefix: str) -> None:
    """Every ``code x scale`` is finite in float32 (a per-block bound; see ``Values.finite_after``)."""
    if not v.finite_after():
        raise WireError(
            f"{prefix}code x scale overflows float32: dequantized values would be NaN or Inf", WireCategory.NON_FINITE
        )


def encode_values(v: Values, count: int) -> tuple[bytes, bytes | memoryview, bytes | memoryview]:
    """``(parameter bytes, scale bytes, code/value bytes)``; validates ``v`` (dtype, length, range, finiteness)."""
    coding = coding_of(v.coding, "values")
    if coding is ValueCoding.LOWRANK:
        raise WireError("LOWRANK values need a dense record (indices None)")
    if not isinstance(v.data, torch.Tensor) or v.data.dim() != 1 or v.data.numel() != count:
        raise WireError(f"values must be a 1-D tensor of {count} entries")
    if coding.is_float:
        if v.data.dtype != FLOAT_DTYPES[coding]:
            raise WireError(f"{coding.name} values must be {FLOAT_DTYPES[coding]}, got {v.data.dtype}")
        if v.scales is not None or v.block:
            raise WireError(f"{coding.name} values take no scales or block")
        return b"", b"", _wire_view(_float_words(v.data, coding).astype(_FLOAT_WIRE[coding], copy=False))
    if v.data.dtype != torch.int8:
        raise WireError(f"{coding.name} codes must be int8, got {v.data.dtype}")
    scales = _check_scales(v, count)
    codes = v.data.detach().cpu().contiguous().numpy()
    _check_codes(codes, coding)
    _check_products(Values(coding, torch.from_numpy(codes), torch.from_numpy(scales), v.block), "")
    params = varint(v.block) + varint(scales.size)
    return params, _wire_view(scales.astype("<f4", copy=False)), _pack_codes(codes, coding)


def read_values(r: Reader, coding: ValueCoding, count: int, what: str) -> Values:
    """Read and validate ``count`` values of ``coding`` (lengths are checked before allocating)."""
    if coding.is_float:
        words = r.array(_FLOAT_WIRE[coding], count, f"{what} values", "values")
        finite = _bf16_finite(words) if coding is ValueCoding.BF16 else bool(np.isfinite(words).all())
        if not finite:
            raise WireError(f"{what}: values contain NaN or Inf", WireCategory.NON_FINITE)
        data = torch.from_numpy(words)
        return Values(coding, data.view(torch.bfloat16) if coding is ValueCoding.BF16 else data)
    block = r.varint(f"{what} block", MAX_BLOCK)
    if block == 0:
        raise WireError(f"{what}: block must be > 0 for {coding.name}")
    n_scales = r.varint(f"{what} scale count")
    if n_scales != Values.num_blocks(count, block):
        raise WireError(f"{what}: {n_scales} scales for {count} codes in blocks of {block}")
    scales = r.array("<f4", n_scales, f"{what} scales", "scales")
    _check_scale_values(scales, f"{what}: ")
    codes = _read_codes(r, coding, count, what)
    values = Values(coding, torch.from_numpy(codes), torch.from_numpy(scales), block)
    _check_products(values, f"{what}: ")
    return values


def _code_table(coding: ValueCoding) -> np.ndarray:
    """``table[byte].view(int8)`` = the codes packed in ``byte`` (invalid fields map outside ``code_range``)."""
    width = _CODE_WIDTH[coding]
    shifts = np.arange(0, 8, width)
    fields = (np.arange(256)[:, None] >> shifts) & ((1 << width) - 1)
    if coding is ValueCoding.SIGN:
        codes = (2 * fields - 1).astype(np.int8)
    else:
        codes = (fields - ((fields >> (width - 1)) << width)).astype(np.int8)  # two's complement
    # One machine word per byte holding its codes in memory order: one gather, then an int8 view.
    return np.ascontiguousarray(codes).view(_WORD[codes.shape[1]]).reshape(-1)


_WORD = {2: np.int16, 4: np.int32, 8: np.int64}
_CODE_TABLES = {c: _code_table(c) for c in _CODE_WIDTH}


def _read_codes(r: Reader, coding: ValueCoding, count: int, what: str) -> np.ndarray:
    if coding is ValueCoding.INT8:
        codes = r.array("i1", count, f"{what} codes", "values")
    else:
        raw = take_packed(r, count, _CODE_WIDTH[coding], f"{what} codes", "values")
        codes = _CODE_TABLES[coding][raw].view(np.int8)[:count]
    lo, hi = coding.code_range
    if codes.size and (int(codes.min()) < lo or int(codes.max()) > hi):
        raise WireError(f"{what}: {coding.name} codes outside [{lo}, {hi}]")
    return codes


# ----------------------------------------------------------------------------------------------- LOWRANK


def matrix_dims(shape: tuple[int, ...], prefix: str = "") -> tuple[int, int]:
    """``(m, n)`` of the matrix view ``(shape[0], prod(shape[1:]))`` that LOWRANK factors; ``WireError`` (shape)
    for ``ndim < 2`` or an empty tensor.

    >>> matrix_dims((16, 3, 3, 3))
    (16, 27)
    """
    if len(shape) < 2 or 0 in shape:
        raise WireError(f"{prefix}LOWRANK needs a non-empty tensor with ndim >= 2, not {shape}", WireCategory.SHAPE)
    return shape[0], math.prod(shape[1:])


def _check_rank(rank: int, m: int, n: int, prefix: str) -> None:
    if not 1 <= rank <= min(m, n):
        raise WireError(f"{prefix}LOWRANK rank {rank} outside [1, {min(m, n)}] for {m} x {n}", WireCategory.SHAPE)


def _check_lowrank_bound(v: Values, prefix: str) -> None:
    """Every value of ``P diag(scales) Q^T`` is finite in float32 (bound: ``Values.finite_after``)."""
    if not v.finite_after():
        raise WireError(
            f"{prefix}LOWRANK max|P| x max|Q| x sum(scales) = {v.lowrank_bound():g} exceeds {LOWRANK_LIMIT:g}: the "
            "product could overflow float32 (NaN or Inf)",
            WireCategory.NON_FINITE,
        )


def encode_lowrank(v: Values, shape: tuple[int, ...]) -> tuple[bytes, memoryview, memoryview]:
    """``(rank varint, scale bytes, factor bytes)`` of a LOWRANK ``v`` for a tensor of ``shape``; validates the
    layout (``block = m``, ``r (m + n)`` float32 entries, ``1 <= r <= min(m, n)``), finiteness, scales >= 0 and
    the product bound, raising ``WireError`` like ``decode`` would."""
    m, n = matrix_dims(tuple(shape))
    data, scales = v.data, v.scales
    if not isinstance(data, torch.Tensor) or data.dim() != 1 or data.dtype != torch.float32:
        raise WireError("LOWRANK factors must be a 1-D float32 tensor")
    if not isinstance(scales, torch.Tensor) or scales.dim() != 1 or scales.dtype != torch.float32:
        raise WireError("LOWRANK scales must be a 1-D float32 tensor (one per rank)")
    rank = scales.numel()
    _check_rank(rank, m, n, "")
    if v.block != m or data.numel() != rank * (m + n):
        raise WireError(
            f"LOWRANK layout: block {v.block} and {data.numel()} factor entries, want block {m} (rows) and "
            f"{rank} x ({m} + {n}) entries",
            WireCategory.SHAPE,
        )
    s = scales.detach().cpu().contiguous().numpy()
    _check_scale_values(s, "")
    words = _float_words(data, ValueCoding.F32)
    _check_lowrank_bound(v, "")
    return varint(rank), _wire_view(s.astype("<f4", copy=False)), _wire_view(words.astype("<f4", copy=False))


def read_lowrank(r: Reader, shape: tuple[int, ...], what: str) -> Values:
    """Read and validate the LOWRANK value section of a dense record for ``shape`` (rank range and byte counts
    are checked before allocating)."""
    m, n = matrix_dims(tuple(shape), f"{what}: ")
    rank = r.varint(f"{what} rank")
    _check_rank(rank, m, n, f"{what}: ")
    r.need(4 * rank * (m + n + 1), f"{what} LOWRANK scales and factors")
    scales = r.array("<f4", rank, f"{what} scales", "scales")
    _check_scale_values(scales, f"{what}: ")
    factors = r.array("<f4", rank * (m + n), f"{what} factors", "values")
    if not np.isfinite(factors).all():
        raise WireError(f"{what}: LOWRANK factors contain NaN or Inf", WireCategory.NON_FINITE)
    values = Values(ValueCoding.LOWRANK, torch.from_numpy(factors), torch.from_numpy(scales), m)
    _check_lowrank_bound(values, f"{what}: ")
    return values

"""In-memory form of a compressed update: what compressors produce and what the wire codec carries.

A ``TensorPayload`` holds one tensor's compressed form: optional sorted flat ``indices`` (``None`` = every
position, dense) and ``Values`` for those positions. Quantized codings keep their integer codes unpacked
(one int8 per value) in memory; bit packing (int4 nibbles, sign bits, ternary 2-bit codes) is the wire
codec's job. A ``LOWRANK`` payload is dense and carries the factors of a matrix instead of its values
(``Values.lowrank``); ``Values.dequantize`` multiplies them out, so every consumer sees the tensor. ``Update`` is
one client's whole message: identity, base model version and one payload per model tensor.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from enum import IntEnum

import torch


class ValueCoding(IntEnum):
    """How the kept values are represented. The integer is the on-wire code (docs/wire-format.md)."""

    F32 = 0
    F16 = 1
    BF16 = 2
    INT8 = 3  # codes in [-127, 127], value = code * scale[block]
    INT4 = 4  # codes in [-7, 7]
    SIGN = 5  # codes in {-1, +1}
    TERNARY = 6  # codes in {-1, 0, +1}
    LOWRANK = 7  # factors: value = (P diag(scales) Q^T)[i, j] (Values.lowrank; wire version 2)

    @property
    def is_float(self) -> bool:
        return self in (ValueCoding.F32, ValueCoding.F16, ValueCoding.BF16)

    @property
    def code_range(self) -> tuple[int, int]:
        """Inclusive bounds of the integer codes of a quantized coding."""
        return _CODE_RANGE[self]


_CODE_RANGE = {
    ValueCoding.INT8: (-127, 127),
    ValueCoding.INT4: (-7, 7),
    ValueCoding.SIGN: (-1, 1),
    ValueCoding.TERNARY: (-1, 1),
}

FLOAT_DTYPES = {
    ValueCoding.F32: torch.float32,
    ValueCoding.F16: torch.float16,
    ValueCoding.BF16: torch.bfloat16,
}


@dataclass(frozen=True)
class Values:
    """Values for the kept positions of one tensor.

    Float codings: ``data`` is a 1-D tensor of that float dtype and ``scales`` is ``None``.
    Quantized codings: ``data`` is 1-D int8 codes within ``coding.code_range`` (SIGN codes are never 0),
    ``scales`` is 1-D float32 with ``ceil(len(data) / block)`` entries, value ``i`` =
    ``data[i] * scales[i // block]``.
    LOWRANK (dense payloads of an ``(m, n)`` matrix view, ``m = shape[0]``): ``data`` is float32 ``P`` (``m x r``)
    then ``Q`` (``n x r``), both row-major; ``scales`` the ``r`` component scales (float32, >= 0); ``block = m``.
    The values are ``P diag(scales) Q^T`` flattened (``dequantize``); ``len`` counts the ``r (m + n)`` factor
    entries (``TensorPayload.nnz`` is ``m n``). Build them with ``Values.lowrank``.
    """

    coding: ValueCoding
    data: torch.Tensor
    scales: torch.Tensor | None = None
    block: int = 0

    def __len__(self) -> int:
        return int(self.data.numel())

    def dequantize(self) -> torch.Tensor:
        """The values as float32 (1-D); LOWRANK: the ``m n`` values of ``P diag(scales) Q^T``, row-major."""
        if self.coding.is_float:
            return self.data.to(torch.float32)
        if self.coding is ValueCoding.LOWRANK:  # in float64: P diag(s) may overflow float32 where the product fits
            p, s, q = (t.double() for t in self.factors())
            return ((p * s) @ q.T).reshape(-1).to(torch.float32)
        assert self.scales is not None and self.block > 0
        n = self.data.numel()
        if n == 0:
            return torch.zeros(0, dtype=torch.float32)
        per = self.scales.repeat_interleave(self.block)[:n] if self.scales.numel() > 1 else self.scales
        return self.data.to(torch.float32) * per

    def finite_after(self, weight: float = 1.0) -> bool:
        """True iff every value of ``weight * dequantize()`` is finite in float32 (the arithmetic of
        ``dequantize`` and of the scatter-add), decided without dequantizing.

        Float codings: one read pass (``aminmax``). Quantized codings: a per-block bound first, ``|scale| x`` the
        coding's largest code, O(number of blocks); only when that bound is not finite, the exact per-block largest
        ``|code|`` (one pass over the codes). NaN/Inf values or scales give False; an empty ``Values`` gives True.
        Requires ``ceil(len / block)`` scales for a quantized coding (``ValueError`` otherwise).

        LOWRANK is decided by a bound instead, O(r (m + n)): ``max|P| x max|Q| x sum(scales) x |weight|`` (float64)
        must be finite and at most ``LOWRANK_LIMIT`` (2**127, half of float32's range, which also covers the
        rounding of the float64 product to float32). It bounds every ``|value|``, so True implies finite; a payload
        past it is refused even if its product would fit (no honest gradient comes near).
        """
        if self.coding is ValueCoding.LOWRANK:
            return self.lowrank_bound() * abs(weight) <= LOWRANK_LIMIT
        if len(self) == 0:
            return True
        w = torch.tensor(weight, dtype=torch.float32)
        if self.coding.is_float:
            lo, hi = torch.aminmax(self.data)
            return _finite(torch.maximum(-lo.float(), hi.float()) * w)
        scales = self._checked_scales().abs()
        if _finite(scales.amax() * max(map(abs, self.coding.code_range)) * w):
            return True
        return _finite((self._block_code_max().float() * scales).amax() * w)

    def _checked_scales(self) -> torch.Tensor:
        want = Values.num_blocks(len(self), self.block) if self.block > 0 else -1
        if self.scales is None or self.scales.dim() != 1 or self.scales.numel() != want:
            got = None if self.scales is None else tuple(self.scales.shape)
            raise ValueError(f"{self.coding.name}: scales {got} for {len(self)} codes in blocks of {self.block}")
        return self.scales.float()

    def _block_code_max(self) -> torch.Tensor:
        """Largest ``|code|`` of each block (int16, one per scale)."""
        mags = self.data.to(torch.int16).abs_()
        n, b = mags.numel(), self.block
        full = mags[: n - n % b].view(-1, b).amax(1)
        return torch.cat([full, mags[n - n % b :].amax(0, keepdim=True)]) if n % b else full

    def factors(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """LOWRANK: ``(P, scales, Q)`` as float32 views, ``P`` ``(m, r)`` and ``Q`` ``(n, r)``; ``ValueError`` unless
        ``r >= 1`` scales, ``m = block >= 1`` and ``len = r (m + n)`` with ``n >= 1``."""
        m, r = self.block, 0 if self.scales is None else self.scales.numel()
        if self.scales is None or self.scales.dim() != 1 or r < 1 or m < 1 or self.data.dim() != 1:
            raise ValueError(f"LOWRANK: needs 1-D data, rank >= 1 scales and block = rows >= 1 (block {m}, rank {r})")
        if len(self) % r or len(self) // r <= m:
            raise ValueError(f"LOWRANK: {len(self)} factor entries do not make P ({m} x {r}) and Q (n x {r}), n >= 1")
        f = self.data.to(torch.float32)
        return f[: m * r].view(m, r), self.scales.to(torch.float32), f[m * r :].view(-1, r)

    def lowrank_bound(self) -> float:
        """LOWRANK: ``max|P| x max|Q| x sum(scales)`` in float64, a bound on every ``|value|`` (``nan`` or ``inf``
        when a factor or scale is not finite)."""
        p, s, q = (t.double() for t in self.factors())
        return float(p.abs().max() * q.abs().max() * s.abs().sum())

    @staticmethod
    def lowrank(p: torch.Tensor, scales: torch.Tensor, q: torch.Tensor) -> Values:
        """The LOWRANK values ``P diag(scales) Q^T`` of an ``(m, n)`` matrix from ``P`` ``(m, r)``, ``scales``
        ``(r,)`` and ``Q`` ``(n, r)`` (copied to float32)::

            v = Values.lowrank(torch.ones(3, 1), torch.tensor([2.0]), torch.ones(4, 1))
            v.dequantize().reshape(3, 4)  # all 2.0; len(v) == 7 factor entries
        """
        data = torch.cat([p.detach().reshape(-1), q.detach().reshape(-1)]).to(torch.float32)
        scales = scales.detach().reshape(-1).to(torch.float32, copy=True)
        return Values(ValueCoding.LOWRANK, data, scales, int(p.shape[0]))

    @staticmethod
    def f32(x: torch.Tensor) -> Values:
        return Values(ValueCoding.F32, flat(x).to(torch.float32))

    @staticmethod
    def num_blocks(count: int, block: int) -> int:
        return math.ceil(count / block) if count else 0


#: LOWRANK values are accepted while ``Values.lowrank_bound() x |weight|`` stays at most this (docs/wire-format.md).
LOWRANK_LIMIT = 2.0**127


def flat(t: torch.Tensor) -> torch.Tensor:
    """``t.detach().reshape(-1)``, without a view op where ``t`` already is one (1-D, outside autograd): the same
    data. A send makes hundreds of these, and on a GPU each view op costs the host about a microsecond.

    >>> x = torch.ones(3)
    >>> flat(x) is x, flat(torch.ones(2, 2)).shape, flat(torch.ones(2, requires_grad=True)).requires_grad
    (True, torch.Size([4]), False)
    """
    if t.requires_grad:
        t = t.detach()
    return t if t.dim() == 1 else t.reshape(-1)


def _finite(x: torch.Tensor) -> bool:
    return bool(torch.isfinite(x))


@dataclass(frozen=True)
class TensorPayload:
    """One tensor's compressed form. ``indices``: int64, sorted, unique, in ``[0, numel)``; ``None`` = dense."""

    shape: tuple[int, ...]
    values: Values
    indices: torch.Tensor | None = None

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nnz(self) -> int:
        """Positions given a value: ``len(values)``, or ``numel`` for LOWRANK (dense; ``len`` counts its factors)."""
        return self.numel if self.values.coding is ValueCoding.LOWRANK else len(self.values)

    @property
    def is_dense(self) -> bool:
        return self.indices is None

    def to_dense(self) -> torch.Tensor:
        """Decompressed tensor (float32, ``shape``)."""
        vals = self.values.dequantize()
        if self.indices is None:
            return vals.reshape(self.shape).clone()
        out = torch.zeros(self.numel, dtype=torch.float32)
        out[self.indices] = vals
        return out.reshape(self.shape)

    def scaled(self, factor: float) -> TensorPayload:
        """This payload times ``factor``, in its own coding: float values are scaled, quantized ones keep their
        codes and scale their ``scales``. Indices are shared."""
        v = self.values
        if v.coding.is_float:
            values = dataclasses.replace(v, data=v.data * factor)
        else:
            assert v.scales is not None
            values = dataclasses.replace(v, scales=v.scales * factor)
        return dataclasses.replace(self, values=values)

    def add_to(self, target: torch.Tensor, weight: float = 1.0) -> None:
        """``target += weight * decompressed`` in O(nnz) for sparse payloads (``target`` float32, contiguous, on
        any device: a payload decoded on the CPU is moved to ``target``'s device)."""
        vals = self.values.dequantize().to(target.device)
        flat = target.view(-1)
        if self.indices is None:
            flat.add_(vals, alpha=weight)
        else:
            flat.index_add_(0, self.indices.to(target.device), vals, alpha=weight)


@dataclass
class Update:
    """One client's compressed update, as encoded on the wire."""

    tensors: dict[str, TensorPayload]
    base_version: int = 0
    seq: int = 0
    client_id: int = 0
    meta: dict[str, float] = field(default_factory=dict)

    def to_dense(self) -> dict[str, torch.Tensor]:
        return {name: p.to_dense() for name, p in self.tensors.items()}

    @property
    def nnz(self) -> int:
        return sum(p.nnz for p in self.tensors.values())

"""CRC-32 (``zlib.crc32``) of a byte buffer where it lives: one Triton pass over the bytes, then a few small GF(2)
matrix products on the same device.

``crc32(buf)`` returns the 4 little-endian bytes of ``zlib.crc32(bytes(buf))`` as a uint8 tensor on ``buf``'s
device, without a host synchronisation::

    crc32(torch.frombuffer(bytearray(b"abc"), dtype=torch.uint8))  # the bytes of zlib.crc32(b"abc") = 0x352441C2

How: the CRC register update ``r <- T[(r ^ byte) & 0xFF] ^ (r >> 8)`` is linear over GF(2) in ``(r, byte)``, so
``reg(A || B) = Z^|B| (reg(A)) ^ reg(B)`` with ``Z^L`` the operator of ``L`` zero bytes (a 32 x 32 bit matrix).
The Triton pass takes the register of every 64-byte chunk (one chunk per lane; the buffer front-padded with
zeros to whole chunks, which leaves a zero register unchanged). Each fold level then combines 64 neighbouring
registers ``x_i``, each covering ``D`` bytes, into ``XOR_i Z^((63 - i) D) x_i``: the bits of the 64 registers
times one stacked 0/1 matrix (a float32 matmul whose sums, at most 2048, are exact), parity, repacked; the
matrices are built once per ``D`` on the host and cached per device. The start value 0xFFFFFFFF and the final
xor are one host constant, ``Z^n (0xFFFFFFFF) ^ 0xFFFFFFFF``, xor'ed on the device. Each byte is read once;
``1 + ceil(log_64(n / 64))`` levels.
"""

from __future__ import annotations

import functools
import math

import numpy as np
import torch

_POLY = 0xEDB88320
_INIT = 0xFFFFFFFF
#: Registers combined per fold level.
FOLD = 64


def _byte_table() -> np.ndarray:
    table = np.zeros(256, dtype=np.int64)
    for i in range(256):
        r = i
        for _ in range(8):
            r = (r >> 1) ^ (_POLY if r & 1 else 0)
        table[i] = r
    return table


_TABLE = _byte_table()


def _bits(x: int) -> np.ndarray:
    return (x >> np.arange(32)) & 1


def _mul(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return (a @ b) & 1


@functools.cache
def _zero_byte() -> np.ndarray:
    """``Z``: the register after one zero byte, as a 0/1 matrix (``out_bits = Z @ in_bits mod 2``)."""
    return np.stack([_bits(int(_TABLE[(1 << j) & 0xFF] ^ ((1 << j) >> 8))) for j in range(32)], axis=1)


@functools.lru_cache(maxsize=64)
def _zeros_op(length: int) -> np.ndarray:
    """``Z^length`` (square and multiply)."""
    result, power = np.eye(32, dtype=np.int64), _zero_byte()
    while length:
        if length & 1:
            result = _mul(power, result)
        length >>= 1
        if length:
            power = _mul(power, power)
    return result


def _apply(op: np.ndarray, x: int) -> int:
    return int((_mul(op, _bits(x)) << np.arange(32)).sum())


@functools.cache
def _zero_powers() -> tuple[np.ndarray, ...]:
    """``Z^(2^i)`` for i < 64: any run of zero bytes is a product of these."""
    powers = [_zero_byte()]
    for _ in range(63):
        powers.append(_mul(powers[-1], powers[-1]))
    return tuple(powers)


def _through_zeros(x: int, length: int) -> int:
    """``Z^length (x)``: register ``x`` fed ``length`` zero bytes, one matrix-vector product per set bit of
    ``length`` (the buffer's length changes from send to send: no matrix power per call)."""
    v = _bits(x)
    for power in (p for i, p in enumerate(_zero_powers()) if length >> i & 1):
        v = _mul(power, v)
    return int((v << np.arange(32)).sum())


@functools.lru_cache(maxsize=32)
def _fold_matrix(distance: int, device: torch.device) -> torch.Tensor:
    """``(FOLD * 32, 32)`` float32: row ``32 i + j`` holds bit ``j``'s image under ``Z^((FOLD - 1 - i) distance)``."""
    step, op, mats = _zeros_op(distance), np.eye(32, dtype=np.int64), []
    for _ in range(FOLD):
        mats.append(op.T)  # [j, k]: input bit j -> output bit k
        op = _mul(step, op)
    return torch.from_numpy(np.concatenate(mats[::-1]).astype(np.float32)).to(device)


@functools.lru_cache(maxsize=8)
def _device_table(device: torch.device) -> torch.Tensor:
    return torch.from_numpy(_TABLE).to(device)


def _fold(reg: torch.Tensor, distance: int) -> torch.Tensor:
    """One level: ``FOLD`` registers of ``distance`` bytes each into one (front-padded with zero registers)."""
    front = (-reg.numel()) % FOLD
    if front:
        reg = torch.cat([reg.new_zeros(front), reg])
    shifts = torch.arange(32, device=reg.device)
    bits = ((reg[:, None] >> shifts) & 1).to(torch.float32).view(-1, FOLD * 32)
    ones = (bits @ _fold_matrix(distance, reg.device)).to(torch.int64)  # exact: sums <= FOLD * 32
    return ((ones & 1) << shifts).sum(dim=1)


def crc32(buf: torch.Tensor) -> torch.Tensor:
    """``zlib.crc32`` of the 1-D uint8 tensor ``buf`` as its 4 little-endian bytes (uint8, on ``buf``'s device);
    a Triton kernel (a CPU ``buf`` needs ``TRITON_INTERPRET=1``) and torch ops. No host synchronisation."""
    from fedcomp.kernels import _triton_encode as K

    n, dev = buf.numel(), buf.device
    chunk, lanes = K.CRC_CHUNK, K.CRC_LANES
    nchunks = math.ceil(n / chunk)
    reg = torch.zeros(max(nchunks, 1), dtype=torch.int64, device=dev)
    if nchunks:
        K.crc32_chunks_kernel[(math.ceil(nchunks / lanes),)](
            buf, _device_table(dev), reg, n, nchunks * chunk - n, nchunks, C=chunk, LANES=lanes
        )
    distance = chunk
    while reg.numel() > 1:
        reg, distance = _fold(reg, distance), distance * FOLD
    crc = reg ^ (_through_zeros(_INIT, n) ^ _INIT)  # the start value fed through n bytes, and the final xor
    return ((crc >> torch.arange(0, 32, 8, device=dev)) & 0xFF).to(torch.uint8)

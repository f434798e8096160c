"""Byte-level primitives of the wire format: varints, a bounds-checked reader and fixed-width bit packing.

Bit order everywhere is little-endian: bit ``j`` of a stream is bit ``j % 8`` of byte ``j // 8``, and a
``w``-bit field ``i`` occupies stream bits ``[i*w, (i+1)*w)``, least significant bit first. Padding bits in
the last byte are zero; readers reject anything else, so every payload has exactly one encoding.
"""

from __future__ import annotations

import numpy as np

from fedcomp.wire.errors import WireCategory, WireError

U64_MAX = (1 << 64) - 1
MAX_WIDTH = 32
_MAX_VARINT_BYTES = 10


def varint(value: int) -> bytes:
    """LEB128 encoding of an unsigned integer ``< 2**64``."""
    if value < 0 or value > U64_MAX:
        raise WireError(f"varint out of range: {value}")
    out = bytearray()
    while True:
        byte = value & 0x7F
        value >>= 7
        if value:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def varint_len(value: int) -> int:
    return max(1, (value.bit_length() + 6) // 7)


class Reader:
    """Cursor over ``blob[pos:end]``; every read is bounds-checked and counted into a named section.

    ``sections`` maps section name → bytes consumed, for ``encoded_size_breakdown``.
    """

    def __init__(self, blob: bytes, pos: int, end: int) -> None:
        self.blob, self.pos, self.end = blob, pos, end
        self.sections: dict[str, int] = {}

    @property
    def remaining(self) -> int:
        return self.end - self.pos

    def _count(self, section: str, n: int) -> None:
        self.sections[section] = self.sections.get(section, 0) + n

    def need(self, n: int, what: str) -> None:
        """Fail unless ``n >= 0`` and ``n`` more bytes are available (call before allocating for them): a negative
        count (from a negative shape) would move the cursor backwards and re-read bytes already taken."""
        if n < 0:
            raise WireError(f"{what}: negative byte count {n} (bad shape or count)", WireCategory.SHAPE)
        if n > self.remaining:
            raise WireError(
                f"{what}: needs {n} bytes, only {self.remaining} left (truncated or bad count)", WireCategory.TRUNCATED
            )

    def take(self, n: int, what: str, section: str) -> int:
        """Claim ``n >= 0`` bytes (``need``); returns their offset in ``blob``."""
        self.need(n, what)
        off = self.pos
        self.pos += n
        self._count(section, n)
        return off

    def u8(self, what: str, section: str = "header") -> int:
        off = self.take(1, what, section)
        return self.blob[off]

    def varint(self, what: str, max_value: int = U64_MAX, section: str = "header") -> int:
        """A minimal-length LEB128 varint ``<= max_value``."""
        value, shift = 0, 0
        for i in range(_MAX_VARINT_BYTES):
            byte = self.u8(what, section)
            value |= (byte & 0x7F) << shift
            if not byte & 0x80:
                if byte == 0 and i > 0:
                    raise WireError(f"{what}: non-minimal varint")
                if value > max_value:
                    raise WireError(f"{what}: {value} exceeds the limit {max_value}")
                return value
            shift += 7
        raise WireError(f"{what}: varint longer than {_MAX_VARINT_BYTES} bytes")

    def array(self, dtype: str, count: int, what: str, section: str) -> np.ndarray:
        """``count >= 0`` items of a little-endian numpy ``dtype``, copied (writable); ``WireError`` otherwise."""
        size = np.dtype(dtype).itemsize
        off = self.take(count * size, what, section)
        return np.frombuffer(self.blob, dtype=dtype, count=count, offset=off).copy()


def packed_len(count: int, width: int) -> int:
    """Bytes of ``count`` fields of ``width`` bits."""
    return (count * width + 7) // 8


def pack_uint(values: np.ndarray, width: int) -> bytes:
    """Pack non-negative integers ``< 2**width`` as ``width``-bit fields (``0 <= width <= MAX_WIDTH``)."""
    n = values.size
    if width == 0 or n == 0:
        return b""
    if width == 8:
        return values.astype(np.uint8).tobytes()
    if width == 1:
        return np.packbits(values.astype(np.uint8), bitorder="little").tobytes()
    if width in (2, 4):
        per = 8 // width
        v = values.astype(np.uint8)
        pad = (-n) % per
        if pad:
            v = np.concatenate([v, np.zeros(pad, np.uint8)])
        v = v.reshape(-1, per)
        out = v[:, 0].copy()
        for j in range(1, per):  # at most 8 whole-array passes, not a per-element loop
            out |= v[:, j] << np.uint8(j * width)
        return out.tobytes()
    shifts = np.arange(width, dtype=np.uint64)
    bits = ((values.astype(np.uint64)[:, None] >> shifts) & np.uint64(1)).astype(np.uint8)
    return np.packbits(bits.reshape(-1), bitorder="little").tobytes()


def take_packed(reader: Reader, count: int, width: int, what: str, section: str) -> np.ndarray:
    """The raw bytes (uint8 view) of ``count`` ``width``-bit fields; rejects non-zero padding bits."""
    nbytes = packed_len(count, width)
    off = reader.take(nbytes, what, section)
    raw = np.frombuffer(reader.blob, dtype=np.uint8, count=nbytes, offset=off)
    used = (count * width) % 8
    if used and raw[-1] >> used:
        raise WireError(f"{what}: non-zero padding bits")
    return raw


#: Fields unpacked at a time (a multiple of 8: every chunk starts on a byte). The bit matrix of a chunk takes
#: 9 bytes per bit, so a decode's scratch stays under 5 MB whatever the count (the result: 8 bytes per field).
UNPACK_CHUNK = 1 << 14


def unpack_uint(reader: Reader, count: int, width: int, what: str, section: str) -> np.ndarray:
    """Read ``count`` unsigned ``width``-bit fields (``width <= MAX_WIDTH``); rejects non-zero padding bits.

    Returns uint8 for ``width <= 1`` and int64 otherwise.
    """
    if width > MAX_WIDTH:
        raise WireError(f"{what}: field width {width} exceeds {MAX_WIDTH}")
    raw = take_packed(reader, count, width, what, section)
    if width == 0 or count == 0:
        return np.zeros(count, dtype=np.uint8 if width <= 1 else np.int64)
    if width == 1:
        return np.unpackbits(raw, count=count, bitorder="little")
    weights = np.left_shift(np.int64(1), np.arange(width, dtype=np.int64))
    out = np.empty(count, dtype=np.int64)
    for lo in range(0, count, UNPACK_CHUNK):
        n = min(UNPACK_CHUNK, count - lo)
        start = lo * width // 8
        bits = np.unpackbits(raw[start:start + packed_len(n, width)], count=n * width, bitorder="little")
        out[lo:lo + n] = bits.reshape(n, width).astype(np.int64) @ weights
    return out

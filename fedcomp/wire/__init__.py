"""Wire codec: one self-describing, versioned, CRC-checked byte string per update (docs/wire-format.md)."""

from fedcomp.wire.codec import check, decode, encode, encoded_size_breakdown
from fedcomp.wire.errors import WireCategory, WireError

__all__ = ["WireCategory", "WireError", "check", "decode", "encode", "encoded_size_breakdown"]

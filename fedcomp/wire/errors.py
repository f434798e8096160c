"""The one error type decode raises, and what kind of failure it is."""

from __future__ import annotations

from enum import Enum


class WireCategory(str, Enum):
    """What part of a payload failed validation (the server's rejection reason reads ``wire/<value>: ...``)."""

    OVERSIZED = "oversized"  # longer than the size cap
    CRC = "crc"  # checksum mismatch: corrupted (or cut) in transit
    TRUNCATED = "truncated"  # shorter than a field or record says
    MAGIC = "magic"  # not a fedcomp payload
    CODEC_VERSION = "codec version"  # a codec version this decoder does not read
    FINGERPRINT = "fingerprint"  # built for another model spec
    SHAPE = "shape"  # tensor count, shapes, element counts or index ranges disagree with the spec
    NON_FINITE = "non-finite"  # NaN or Inf in values or scales, or code x scale overflows float32
    MALFORMED = "malformed"  # anything else: bad varints, codings, padding, meta, ordering, ...


class WireError(ValueError):
    """A payload failed validation. The message names the field or record that is wrong; ``category`` says which
    kind of failure it is (no need to read the message).

    >>> WireError("CRC mismatch", WireCategory.CRC).category.value
    'crc'
    """

    def __init__(self, message: str, category: WireCategory = WireCategory.MALFORMED) -> None:
        super().__init__(message)
        self.category = WireCategory(category)

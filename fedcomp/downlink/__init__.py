"""Downlink compression: what the server sends clients as "the model", and the replica a client keeps.

By job: ``model`` (the public model's arithmetic both ends share: digest, dense encoding, full copy, delta
application), ``envelope`` (the ``FCD`` message codec), ``replica`` (the client: ``Replica``, ``receive``),
``broadcaster`` (the server: ``Broadcaster`` and the ``DOWNLINKS`` modes ``dense``, ``fp16``, ``int8``,
``delta``), ``stats`` (counters).

>>> spec = ModelSpec((("w", (8,)),))
>>> server = build_broadcaster("int8", spec)
>>> blob = server.message(client=1, task_id=1, params={"w": torch.linspace(-1, 1, 8)}, version=0)
>>> replica = receive(blob, spec, None)                 # bitwise the server's public model, or DownlinkError
>>> replica.digest(spec) == server.digest
True
"""

from fedcomp.downlink.broadcaster import DOWNLINKS, Broadcaster, DeltaBroadcaster, build_broadcaster
from fedcomp.downlink.envelope import (
    RESYNC,
    DownlinkError,
    Envelope,
    Kind,
    decode_envelope,
    encode_envelope,
    encode_full,
)
from fedcomp.downlink.model import apply_part, dense_fp32_bytes, encode_dense, materialize, model_digest
from fedcomp.downlink.replica import Replica, receive
from fedcomp.downlink.stats import DownlinkStats

__all__ = [
    "DOWNLINKS",
    "RESYNC",
    "Broadcaster",
    "DeltaBroadcaster",
    "DownlinkError",
    "DownlinkStats",
    "Envelope",
    "Kind",
    "Replica",
    "apply_part",
    "build_broadcaster",
    "decode_envelope",
    "dense_fp32_bytes",
    "encode_dense",
    "encode_envelope",
    "encode_full",
    "materialize",
    "model_digest",
    "receive",
]

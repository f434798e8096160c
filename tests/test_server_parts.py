"""The server's parts on their own: wire error categories, the named checks, the norm read from codes, the atomic
write, the counters' merge/roll."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fedcomp.client.pipeline import build
from fedcomp.counters import Counters
from fedcomp.protocol import Outcome
from fedcomp.server import CHECKS, GATES, VersionStats, atomic_write, update_norm, wire_reason
from fedcomp.spec import ModelSpec
from fedcomp.wire import WireCategory, WireError, decode

SPEC = ModelSpec((("w", (24, 16)), ("b", (16,))))
OTHER = ModelSpec((("w", (24, 16)), ("c", (16,))))


def blob(compressor: str = "topk+int8", seed: int = 0, **opts) -> bytes:
    gen = torch.Generator().manual_seed(seed)
    grads = {n: torch.randn(s, generator=gen) for n, s in SPEC.entries}
    return build(compressor, SPEC, memory="residual", **opts).send(grads, base_version=0, client_id=1)


@pytest.mark.parametrize(
    "mutate, spec, max_bytes, category",
    [
        (lambda b: b[:-1] + bytes([b[-1] ^ 1]), SPEC, None, WireCategory.CRC),
        (lambda b: b[:10], SPEC, None, WireCategory.TRUNCATED),
        (lambda b: b"XYZ" + b[3:], SPEC, None, WireCategory.MAGIC),
        (lambda b: b, OTHER, None, WireCategory.FINGERPRINT),
        (lambda b: b, SPEC, 64, WireCategory.OVERSIZED),
    ],
    ids=["crc", "truncated", "magic", "fingerprint", "oversized"],
)
def test_decode_errors_carry_their_category(mutate, spec, max_bytes, category):
    with pytest.raises(WireError) as err:
        decode(mutate(blob(density=0.1)), spec, max_bytes=max_bytes)
    assert err.value.category is category
    assert wire_reason(err.value).startswith(f"wire/{category.value}: ")


def test_the_checks_are_small_named_functions_in_order():
    assert [c.__name__ for c in GATES] == ["known_client", "open_task", "new_seq"]
    assert [c.__name__ for c in CHECKS] == [
        "header_seq", "header_client", "header_base", "finite", "norm_bound", "fresh", "weighted"
    ]  # the decode is admit's own step before them (decode_reply)


@settings(max_examples=30, deadline=None)
@given(
    compressor=st.sampled_from(["topk+int8", "topk+int4", "qsgd", "sign", "ternary", "identity", "dgc+int8"]),
    seed=st.integers(0, 10_000),
)
def test_the_norm_read_from_codes_and_scales_is_the_dequantized_norm(compressor, seed):
    opts = {"density": 0.2} if compressor.startswith(("topk", "dgc")) else {}
    update = decode(blob(compressor, seed, **opts), SPEC)
    want = math.sqrt(sum(float(p.values.dequantize().double().square().sum()) for p in update.tensors.values()))
    assert update_norm(update) == pytest.approx(want, rel=1e-6)


def test_atomic_write_replaces_the_file_and_leaves_no_temporary(tmp_path):
    path = tmp_path / "state.pt"
    atomic_write(path, b"old")
    atomic_write(path, lambda f: f.write(b"new"))
    assert path.read_bytes() == b"new" and [p.name for p in tmp_path.iterdir()] == ["state.pt"]


def test_counters_merge_and_roll():
    a = VersionStats()
    a.count(Outcome.REJECTED, "wire/crc: CRC mismatch")
    a.count(Outcome.APPLIED, staleness=2)
    total = VersionStats()
    row = a.roll()
    total.merge(row)
    total.merge(row)
    assert isinstance(a, Counters) and a == VersionStats()
    assert total.accepted == 2 and total.reject_reasons == {"wire/crc": 2} and total.staleness_hist == {2: 2}


def test_an_unreadable_tensor_count_is_a_shape_error():
    import zlib

    from fedcomp.wire.codec import _FIXED, CRC_BYTES

    good = blob(density=0.1)
    body = bytearray(good[:-CRC_BYTES])
    at = _FIXED + 3  # client_id, seq, base_version are one-byte varints here; the tensor count follows
    body[at : at + 1] = b"\x82\x00"  # the same count as a non-minimal varint
    bad = bytes(body) + zlib.crc32(bytes(body)).to_bytes(CRC_BYTES, "little")
    with pytest.raises(WireError, match="tensor count: non-minimal varint") as err:
        decode(bad, SPEC)
    assert err.value.category is WireCategory.SHAPE


def test_a_checkpoint_written_before_moved_to_existed_still_loads():
    from benchmarks.faultkit import make_proto

    p = make_proto(buffer_size=1)
    p.dispatch(3, 0.0)
    state = p.state_dict()
    for led in state["clients"].values():
        del led["moved_to"]  # the ledger fields of a checkpoint made before client restarts were tracked
    q = make_proto(buffer_size=1)
    q.load_state_dict(state)
    assert q.ledger(3).moved_to is None and [r.outcome for r in q.dispatch(3, 1.0).resolutions] == [Outcome.LOST]


@pytest.mark.parametrize("weight, outcome", [(1e38, Outcome.REJECTED), (float("inf"), Outcome.REJECTED),
                                             (-1.0, Outcome.REJECTED), (0.0, Outcome.APPLIED), (32.0, Outcome.APPLIED)])
def test_a_callers_own_weight_is_bounded_once_in_admit(weight, outcome):
    """``Compressed`` aggregates with the user's example weight and adds the update as trusted: ``admit`` must
    bound that weight (finite, >= 0, weight × norm below ``WEIGHTED_NORM_LIMIT``), not the staleness weight."""
    from benchmarks.faultkit import Client, make_proto

    proto, client = make_proto(), Client(1, seed=0)
    blob, meta = client.run(proto.dispatch(1, 0.0))
    decision, update = proto.admit(1, blob, meta, 1.0, weight=weight)
    assert decision.outcome is outcome, decision
    assert (update is not None) == (outcome is Outcome.APPLIED)
    if outcome is Outcome.APPLIED:
        assert decision.weight == weight
    else:
        assert decision.reason.startswith(("weight", "norm")), decision.reason

"""Hostile replies at the server: each is rejected with a reason, counted, nacked; the model is never touched.

Cases go through the real server path (``Loop.handle`` -> ``ServerProtocol.on_reply`` -> ``decode``). The model
(and the FedBuff buffer) are compared byte for byte before and after a burst of bad updates, and a good update
is applied afterwards (the server keeps serving). The fuzz tests (hypothesis, derandomized, >= 10^4 cases in
all) mutate valid blobs and their control fields and check the same invariants on every case.
"""

from __future__ import annotations

import hashlib
import struct
import zlib

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from benchmarks.faultkit import pipeline_blobs
from fedcomp.payload import TensorPayload, Update, ValueCoding, Values
from fedcomp.protocol import Outcome, ProtocolConfig, ReplyMeta
from fedcomp.server import ServerProtocol
from fedcomp.server.loops import LOOPS, LoopConfig, ReplyEvent, Reporter
from fedcomp.server.optimizers import SERVER_OPTIMIZERS
from fedcomp.server.staleness import STALENESS
from fedcomp.spec import ModelSpec
from fedcomp.wire import encode
from fedcomp.wire.codec import MAGIC

SPEC = ModelSpec((("w", (40, 25)), ("b", (25,))))
OTHER_SHAPES = ModelSpec((("w", (25, 40)), ("b", (25,))))  # same names, other shapes: another fingerprint
NORM_BOUND = 50.0
CLIENT = 9


def fuzz(n: int):
    return settings(max_examples=n, derandomize=True, deadline=None, suppress_health_check=list(HealthCheck))


def make_proto(**cfg) -> ServerProtocol:
    gen = torch.Generator().manual_seed(3)
    params = {n: torch.randn(s, generator=gen) for n, s in SPEC.entries}
    config = ProtocolConfig(**{"buffer_size": 2, "max_staleness": 2, "max_update_norm": NORM_BOUND, **cfg})
    return ServerProtocol(SPEC, params, SERVER_OPTIMIZERS.build("sgd", lr=1.0), STALENESS.build("constant"), config)


def model_hash(p: ServerProtocol) -> str:
    """Digest of the model bytes and of the FedBuff buffer (what a bad update must never change)."""
    h = hashlib.sha256()
    for n in SPEC.names:
        h.update(p.params[n].contiguous().numpy().tobytes())
        h.update(p.accumulator.result(normalize="sum")[n].contiguous().numpy().tobytes() if p.buffered else b"")
    h.update(f"{p.version}/{p.buffered}".encode())
    return h.hexdigest()


def seal(body: bytes) -> bytes:
    return body + zlib.crc32(body).to_bytes(4, "little")


def reseal(blob: bytes) -> bytes:
    """Recompute the CRC of a (modified) blob, so the defect behind it reaches the structural checks."""
    return seal(blob[:-4])


def valid_update(seq: int, base: int, value: float = 0.1, client: int = CLIENT) -> Update:
    idx = torch.tensor([1, 7, 300, 999], dtype=torch.int64)
    return Update(
        {
            "w": TensorPayload((40, 25), Values.f32(torch.full((4,), value)), idx),
            "b": TensorPayload((25,), Values.f32(torch.full((25,), value))),
        },
        base_version=base,
        seq=seq,
        client_id=client,
    )


def blob_for(seq: int, base: int, **kw) -> bytes:
    return encode(valid_update(seq, base, **kw), SPEC)


def huge_int8(seq: int, base: int) -> bytes:
    """Finite codes and scales whose product overflows float32 (encode refuses it, so the scale is patched into a
    valid blob behind a fresh CRC, as a hostile client would)."""
    codes = Values(ValueCoding.INT8, torch.full((25,), 127, dtype=torch.int8), torch.full((1,), 1.5), 32)
    u = valid_update(seq, base)
    blob = encode(Update({"w": u.tensors["w"], "b": TensorPayload((25,), codes)}, base, seq, CLIENT), SPEC)
    body = blob[:-4]
    assert body.count(struct.pack("<f", 1.5)) == 1
    body = body.replace(struct.pack("<f", 1.5), struct.pack("<f", 3e38))
    return body + zlib.crc32(body).to_bytes(4, "little")


def nan_in_dense(seq: int, base: int) -> bytes:
    """A dense fp32 record with a NaN behind a valid CRC."""
    blob = blob_for(seq, base, value=0.5)
    pattern = torch.tensor([0.5], dtype=torch.float32).numpy().tobytes()
    at = blob.rindex(pattern)
    return reseal(blob[:at] + torch.tensor([float("nan")]).numpy().tobytes() + blob[at + 4 :])


# (name, blob(seq, base) -> bytes, expected outcome, reason prefix)
CASES = [
    ("truncated", lambda s, b: blob_for(s, b)[:-7], Outcome.REJECTED, "wire/"),
    ("truncated-short", lambda s, b: blob_for(s, b)[:9], Outcome.REJECTED, "wire/truncated"),
    (
        "bit-flipped",
        lambda s, b: bytes([x ^ (0x10 if i == 30 else 0) for i, x in enumerate(blob_for(s, b))]),
        Outcome.REJECTED,
        "wire/crc",
    ),
    (
        "oversized",
        lambda s, b: blob_for(s, b) + bytes(2 * SPEC.dense_bytes + 70_000),
        Outcome.REJECTED,
        "wire/oversized",
    ),
    (
        "wrong-fingerprint",
        lambda s, b: encode(
            Update(
                {"w": TensorPayload((25, 40), Values.f32(torch.ones(1000))), "b": valid_update(s, b).tensors["b"]},
                b,
                s,
                CLIENT,
            ),
            OTHER_SHAPES,
        ),
        Outcome.REJECTED,
        "wire/fingerprint",
    ),
    (
        "wrong-tensor-count",
        lambda s, b: reseal(
            blob_for(s, b)[: len(MAGIC) + 1 + 8 + 3] + bytes([5]) + blob_for(s, b)[len(MAGIC) + 1 + 8 + 4 :]
        ),
        Outcome.REJECTED,
        "wire/shape",
    ),
    ("nan", nan_in_dense, Outcome.REJECTED, "wire/non-finite"),
    ("inf-after-dequantize", huge_int8, Outcome.REJECTED, "wire/non-finite"),  # decode checks code x scale
    ("norm", lambda s, b: blob_for(s, b, value=100.0), Outcome.REJECTED, "norm"),
    (
        "codec-version",
        lambda s, b: reseal(MAGIC + bytes([7]) + blob_for(s, b)[len(MAGIC) + 1 :]),
        Outcome.REJECTED,
        "wire/codec version",
    ),
    ("bad-magic", lambda s, b: b"XXXX" + blob_for(s, b)[4:], Outcome.REJECTED, "wire/magic"),
    ("seq-mismatch", lambda s, b: blob_for(s + 1, b), Outcome.REJECTED, "seq"),
    ("other-client", lambda s, b: blob_for(s, b, client=CLIENT + 1), Outcome.REJECTED, "client id"),
    ("wrong-base-version", lambda s, b: blob_for(s, b + 1), Outcome.REJECTED, "base version"),
]


def test_case_blobs_are_valid_blobs_but_for_their_defect():
    """The good blob of every case family decodes and is applied (so a rejection is the defect's doing)."""
    p = make_proto(buffer_size=1)
    t = p.dispatch(CLIENT, 0.0)
    assert p.on_reply(CLIENT, blob_for(1, t.base_version), ReplyMeta(t.task_id, 1, 1, 5), 0.0).outcome is (
        Outcome.APPLIED
    )


@pytest.mark.parametrize("name, make, outcome, reason", CASES, ids=[c[0] for c in CASES])
def test_each_hostile_reply_is_rejected_counted_nacked_and_the_model_untouched(name, make, outcome, reason):
    p = make_proto()
    good = p.dispatch(1, 0.0)  # one good update sits in the FedBuff buffer (K=2) during the attack
    assert p.on_reply(1, blob_for(1, 0, client=1), ReplyMeta(good.task_id, 1, 1, 5), 0.0).outcome is Outcome.APPLIED
    before = model_hash(p)
    t = p.dispatch(CLIENT, 0.0)
    d = p.on_reply(CLIENT, make(1, t.base_version), ReplyMeta(t.task_id, 1, 1, 5), 1.0)
    assert d.outcome is outcome and d.reason.startswith(reason), d.reason
    assert model_hash(p) == before
    assert p.stats.rejected == 1 and sum(p.stats.reject_reasons.values()) == 1
    assert next(iter(p.stats.reject_reasons)).startswith(reason.rstrip("/"))
    t2 = p.dispatch(CLIENT, 2.0)
    assert [(x.task_id, x.seq, x.outcome) for x in t2.resolutions] == [(t.task_id, 1, Outcome.REJECTED)]
    # the server keeps serving: the client's next (good) update completes the buffer and the model moves
    d = p.on_reply(CLIENT, blob_for(2, p.version), ReplyMeta(t2.task_id, 2, 1, 5), 3.0)
    assert d.outcome is Outcome.APPLIED and d.stepped and model_hash(p) != before


def test_replays_duplicates_and_stale_updates():
    p = make_proto(buffer_size=1)
    t = p.dispatch(CLIENT, 0.0)
    blob = blob_for(1, 0)
    assert p.on_reply(CLIENT, blob, ReplyMeta(t.task_id, 1, 1, 5), 0.0).outcome is Outcome.APPLIED
    after_first = model_hash(p)
    # the same reply again (network duplicate), then replayed as the answer to a new task
    assert p.on_reply(CLIENT, blob, ReplyMeta(t.task_id, 1, 1, 5), 0.0).outcome is Outcome.DUPLICATE
    t2 = p.dispatch(CLIENT, 1.0)
    assert p.on_reply(CLIENT, blob, ReplyMeta(t2.task_id, 1, 1, 5), 1.0).outcome is Outcome.DUPLICATE
    # replayed blob under a fresh seq: the header's seq gives it away
    d = p.on_reply(CLIENT, blob, ReplyMeta(t2.task_id, 2, 1, 5), 1.0)
    assert d.outcome is Outcome.REJECTED and d.reason.startswith("seq")
    assert model_hash(p) == after_first and p.stats.duplicate == 2
    # stale beyond the bound (max_staleness 2): nacked "stale"
    old = p.dispatch(CLIENT, 2.0)
    for c in (20, 21, 22):
        tc = p.dispatch(c, 2.0)
        p.on_reply(c, blob_for(1, tc.base_version, client=c), ReplyMeta(tc.task_id, 1, 1, 1), 2.0)
    assert p.version == 4
    before = model_hash(p)
    d = p.on_reply(CLIENT, blob_for(3, old.base_version), ReplyMeta(old.task_id, 3, 1, 5), 3.0)
    assert d.outcome is Outcome.STALE and model_hash(p) == before
    assert p.dispatch(CLIENT, 4.0).resolutions[-1].outcome is Outcome.STALE


class ScriptedTransport:
    """Replays a fixed list of reply events, one per poll; used to push a burst through ``Loop.handle``."""

    def __init__(self) -> None:
        self.t = 0.0

    def now(self) -> float:
        return self.t


def test_burst_through_the_loop_leaves_model_bytes_identical(tmp_path):
    p = make_proto()
    clock = ScriptedTransport()
    loop = LOOPS.get("async")(p, None, LoopConfig(num_versions=1), Reporter(None, clock=clock), clock=clock)  # type: ignore[arg-type]
    t1 = p.dispatch(1, 0.0)
    loop.handle(ReplyEvent(t1.task_id, 1, blob_for(1, 0, client=1), ReplyMeta(t1.task_id, 1, 1, 5)), 0.0)
    before = model_hash(p)
    decisions, nacks = [], []
    for k in range(3):
        for i, (_name, make, _outcome, _reason) in enumerate(CASES):
            seq = 1 + k * len(CASES) + i
            t = p.dispatch(CLIENT, float(seq))
            nacks += t.resolutions
            decisions.append(
                loop.handle(ReplyEvent(t.task_id, CLIENT, make(seq, 0), ReplyMeta(t.task_id, seq, 1, 5)), 0)
            )
        t = p.dispatch(CLIENT, 99.0)  # unreadable records (the transport could not parse the reply)
        nacks += t.resolutions
        loop.handle(ReplyEvent(t.task_id, CLIENT, b"", ReplyMeta(t.task_id, 0), error="records: no 'meta'"), 0.0)
    assert all(d.outcome is Outcome.REJECTED for d in decisions)
    assert model_hash(p) == before and p.version == 0
    counts = p.stats.reject_reasons
    assert p.stats.rejected == 3 * (len(CASES) + 1) and counts["records"] == 3 and counts["norm"] == 3
    assert {"wire/crc", "wire/oversized", "wire/fingerprint", "wire/codec version", "wire/non-finite"} <= set(counts)
    t = p.dispatch(CLIENT, 100.0)
    nacks += t.resolutions
    assert [r.outcome for r in nacks] == [Outcome.REJECTED] * (3 * (len(CASES) + 1))
    d = loop.handle(ReplyEvent(t.task_id, CLIENT, blob_for(500, 0), ReplyMeta(t.task_id, 500, 1, 5)), 1.0)
    assert d.outcome is Outcome.APPLIED and d.stepped and p.version == 1


# ------------------------------------------------------------------------------------------------------- fuzz

BASES = [blob_for(1, 0)]


BASES += pipeline_blobs(SPEC, CLIENT)

mutation = st.one_of(
    st.tuples(st.just("flip"), st.integers(0, 1 << 20), st.integers(0, 7)),
    st.tuples(st.just("truncate"), st.integers(0, 1 << 20), st.just(0)),
    st.tuples(st.just("set"), st.integers(0, 1 << 20), st.integers(0, 255)),
    st.tuples(st.just("insert"), st.integers(0, 1 << 20), st.integers(0, 255)),
    st.tuples(st.just("delete"), st.integers(0, 1 << 20), st.integers(1, 16)),
)


def mutate(blob: bytes, ops, resealed: bool) -> bytes:
    b = bytearray(blob)
    for op, pos, arg in ops:
        i = pos % max(len(b), 1)
        if op == "flip" and b:
            b[i] ^= 1 << arg
        elif op == "truncate":
            del b[i:]
        elif op == "set" and b:
            b[i] = arg
        elif op == "insert":
            b.insert(i, arg)
        elif op == "delete":
            del b[i : i + arg]
    out = bytes(b)
    return reseal(out) if resealed and len(out) > 4 else out


def judge(blob: bytes, meta_seq: int, incarnation: int, examples: int, stale: bool) -> None:
    p = make_proto(buffer_size=1, weight_by_examples=True)
    t = p.dispatch(CLIENT, 0.0)
    if stale:
        for c in (30, 31, 32):
            tc = p.dispatch(c, 0.0)
            p.on_reply(c, blob_for(1, tc.base_version, client=c), ReplyMeta(tc.task_id, 1, 1, 1), 0.0)
    before = model_hash(p)
    d = p.on_reply(CLIENT, blob, ReplyMeta(t.task_id, meta_seq, examples, incarnation), 1.0)
    if d.outcome is Outcome.APPLIED:
        assert not stale and meta_seq == 1 and examples > 0
        assert all(torch.isfinite(x).all() for x in p.params.values())
    else:
        assert model_hash(p) == before, d
        assert d.outcome in (Outcome.REJECTED, Outcome.STALE, Outcome.DUPLICATE), d
        assert d.reason
        if d.outcome is not Outcome.DUPLICATE:
            assert p.dispatch(CLIENT, 2.0).resolutions[-1].outcome is d.outcome
    p.roll_stats()


@fuzz(5000)
@given(st.sampled_from(range(len(BASES))), st.lists(mutation, min_size=1, max_size=4), st.booleans())
def test_fuzz_mutated_blobs(base, ops, resealed):
    judge(mutate(BASES[base], ops, resealed), 1, 5, 1, stale=False)


@fuzz(3000)
@given(
    st.sampled_from(range(len(BASES))),
    st.lists(mutation, max_size=2),
    st.integers(-(1 << 40), 1 << 40),
    st.integers(-(1 << 62), 1 << 62),
    st.integers(-(1 << 62), 1 << 62),
    st.booleans(),
)
def test_fuzz_control_fields(base, ops, seq, incarnation, examples, stale):
    judge(mutate(BASES[base], ops, True) if ops else BASES[base], seq, incarnation, examples, stale)


@fuzz(2500)
@given(st.binary(max_size=600))
def test_fuzz_random_bytes(raw):
    judge(raw, 1, 5, 1, stale=False)


# ------------------------------------------------------------------------------- what a rejected reply may claim


def test_a_reply_that_is_no_update_adopts_no_node_and_answers_no_task():
    """A reply's pending list moves another node's resolutions here (a restarted client under a new node id). A
    reply whose blob is no update claims nothing: it neither adopts the node that ran the listed task (whose
    timeout nack must still reach that node), nor nacks ids the ledger does not know."""
    from benchmarks.faultkit import Client, make_proto

    proto, honest = make_proto(buffer_size=1, task_timeout=10.0), Client(2, 0)
    t1, t2 = proto.dispatch(2, 0.0), proto.dispatch(9, 0.0)
    honest.run(t1)  # its reply will never arrive
    bogus = ReplyMeta(t2.task_id, 1, 1, 555, pending=(t1.task_id, *range(10**9, 10**9 + 1024)))
    decision = proto.on_reply(9, b"junk", bogus, 1.0)
    assert decision.outcome is Outcome.REJECTED and decision.reason.startswith("wire")
    assert proto.ledger(2).moved_to is None and proto.stats.unknown_tasks == 0
    proto.expire(20.0)  # t1 times out: its nack waits for node 2's next task
    nacks = [r for r in proto.dispatch(2, 21.0).resolutions if r.task_id == t1.task_id]
    assert [r.outcome for r in nacks] == [Outcome.TIMEOUT]


@pytest.mark.parametrize("hostile_answers", [False, True], ids=["hostile-silent", "hostile-answers"])
def test_a_node_that_lists_another_nodes_task_ids_takes_neither_its_ledger_nor_its_resolutions(hostile_answers):
    """Task ids are sequential, so a node can list another node's (one that never replied: the server knows no
    incarnation for it). Adopting that node's ledger by its ids sent the victim's nacks to the hostile node (and,
    before the copies, left the victim's update pending for good). Now only a node that replied as the lister's
    incarnation is adopted: the victim keeps its ledger, its next task carries its own nack at once, the hostile
    node gets a copy it cannot act on, and gradient mass is conserved."""
    from benchmarks.faultkit import Client, Tally, conservation_error, drain, make_proto

    proto, tally = make_proto(buffer_size=1, max_staleness=4, task_timeout=10.0), Tally()
    tally.watch(proto)
    victim, hostile = Client(1, seed=1), Client(2, seed=2)
    tv, th = proto.dispatch(1, 0.0), proto.dispatch(2, 0.0)
    blob, meta = hostile.run(th)
    forged = ReplyMeta(meta.task_id, meta.seq, 10, meta.incarnation, pending=(tv.task_id,))
    assert proto.on_reply(2, blob, forged, 1.0).outcome is Outcome.APPLIED
    assert proto.ledger(1).moved_to is None and proto.ledger(1).incarnation == 0  # no capture
    victim.run(tv)  # its reply is lost
    proto.fail_task(1, tv.task_id, Outcome.LOST, "NODE_UNAVAILABLE", 2.0)
    if hostile_answers:
        copies = proto.dispatch(2, 3.0).resolutions
        assert [(r.task_id, r.outcome) for r in copies if r.task_id == tv.task_id] == [(tv.task_id, Outcome.LOST)]
        hostile.side.apply(copies)  # a copy of the victim's nack: the hostile node holds no such update
    task = proto.dispatch(1, 10.0)
    assert [(r.task_id, r.outcome) for r in task.resolutions] == [(tv.task_id, Outcome.LOST)]  # the victim's own
    for k in range(3):
        blob, meta = victim.run(task)
        assert proto.on_reply(1, blob, meta, 11.0 + 10 * k).outcome is Outcome.APPLIED
        task = proto.dispatch(1, 20.0 + 10 * k)
    victim.side.apply(task.resolutions)
    assert tv.task_id not in victim.side.pending_tasks()  # before the end of the run
    clients = {1: victim, 2: hostile}
    drain(proto, clients, 100.0)
    assert not victim.side.pending_tasks() and not hostile.side.pending_tasks()
    assert conservation_error(proto, clients, tally) < 1e-5


def test_a_long_pending_list_costs_one_pass_over_the_ledger_and_nacks_land_with_its_sender(monkeypatch):
    """1,024 ids no node holds: one index of the ledger's resolutions for them all (not a scan per id), and the
    ``lost`` nacks they get go to the sender's own outbox: its own share."""
    import dataclasses

    from benchmarks.faultkit import Client, make_proto
    from fedcomp.server.ledger import Ledger

    proto = make_proto(buffer_size=1, task_timeout=10.0)
    for node in range(20, 60):  # other nodes with open tasks
        proto.dispatch(node, 0.0)
    task = proto.dispatch(9, 0.0)
    blob, meta = Client(9, 1).run(task)
    passes = []
    holders = Ledger._holders
    monkeypatch.setattr(Ledger, "_holders", lambda self: passes.append(1) or holders(self))
    unknown = tuple(range(10**9, 10**9 + 1024))
    assert proto.on_reply(9, blob, dataclasses.replace(meta, pending=unknown), 1.0).outcome is Outcome.APPLIED
    assert passes == [1] and proto.stats.unknown_tasks == 1024
    assert {r.task_id for r in proto.ledger(9).outbox} >= set(unknown)
    assert all(not proto.ledger(n).outbox for n in range(20, 60))

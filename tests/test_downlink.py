"""Downlink compression: replica consistency under losses, nacks and restarts; fallbacks; hostile blobs."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fedcomp.downlink import (
    DOWNLINKS,
    RESYNC,
    DownlinkError,
    Kind,
    Replica,
    build_broadcaster,
    decode_envelope,
    dense_fp32_bytes,
    encode_envelope,
    model_digest,
    receive,
)
from fedcomp.registry import ConfigError
from fedcomp.server.loops import encode_model
from fedcomp.spec import ModelSpec
from fedcomp.wire import WireError, decode, encode

SPEC = ModelSpec((("conv", (40, 32)), ("bias", (32,)), ("fc", (10, 8))))
MODES = ["dense", "fp16", "int8", "delta"]


def model(seed: int, scale: float = 1.0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {n: scale * torch.randn(s, generator=g) for n, s in SPEC.entries}


def step(w: dict[str, torch.Tensor], seed: int, scale: float) -> dict[str, torch.Tensor]:
    d = model(seed, scale)
    return {n: w[n] + d[n] for n in w}


def same(replica: Replica, public: dict[str, torch.Tensor]) -> bool:
    return all(torch.equal(replica.tensors[n], public[n]) for n in SPEC.names)


def options(mode: str) -> dict:
    return {"density": 0.05, "history": 4} if mode == "delta" else {}


# ---- the property: every replica equals the public model of its version -----------------------------------

EVENT = st.tuples(
    st.sampled_from(["version", "big", "task", "task", "task", "restart", "corrupt"]),
    st.integers(0, 2),  # client
    st.sampled_from(["ok", "ok", "ok", "lost_down", "lost_up", "raised"]),
)


@pytest.mark.parametrize("mode", MODES)
@settings(max_examples=25)
@given(events=st.lists(EVENT, min_size=1, max_size=40))
def test_replicas_bitwise_equal_public_model(mode, events):
    b = build_broadcaster(mode, SPEC, **options(mode))
    w, version, task_id = model(0), 0, 0
    replicas: dict[int, Replica | None] = {0: None, 1: None, 2: None}
    for i, (kind, client, fate) in enumerate(events):
        if kind in ("version", "big"):
            w, version = step(w, i + 1, 0.5 if kind == "big" else 0.01), version + 1
            continue
        if kind == "restart":  # the node lost its state
            replicas[client] = None
            continue
        if kind == "corrupt" and replicas[client] is not None:
            replicas[client].tensors["fc"].view(-1)[0] += 1e-3
            continue
        task_id += 1
        blob = b.message(client, task_id, w, version)
        assert b.version == version
        if fate == "lost_down":
            continue  # never reached the client; the server hears nothing (the task times out)
        try:
            replicas[client] = receive(blob, SPEC, replicas[client])
        except DownlinkError as exc:  # the client refuses to train: error reply -> the server forgets it
            assert RESYNC in str(exc)
            b.on_failure(client, task_id)
            task_id += 1
            replicas[client] = receive(b.message(client, task_id, w, version), SPEC, replicas[client])
            assert b.synced.get(client) is None
        assert replicas[client].version == version
        assert same(replicas[client], b.public)  # trains on exactly P_v
        if fate == "ok":
            b.on_reply(client, task_id)
        elif fate == "raised":
            b.on_failure(client, task_id)


def test_dense_mode_is_todays_blob():
    b = build_broadcaster("dense", SPEC)
    w = model(1)
    assert b.message(5, 1, w, 3) == encode_model(w, SPEC, 3)
    assert dense_fp32_bytes(SPEC) == len(encode_model(w, SPEC, 3))
    r = receive(b.message(5, 2, w, 3), SPEC, None)
    assert r.version == 3 and all(torch.equal(r.tensors[n], w[n]) for n in SPEC.names)


@pytest.mark.parametrize("mode,ratio", [("fp16", 1.9), ("int8", 3.5)])
def test_quantized_copies_are_smaller_and_close(mode, ratio):
    b = build_broadcaster(mode, SPEC)
    w = model(2)
    blob = b.message(1, 1, w, 0)
    assert dense_fp32_bytes(SPEC) / len(blob) > ratio
    for n in SPEC.names:
        assert torch.allclose(b.public[n], w[n], atol=0.05, rtol=0.01)
    b.on_reply(1, 1)
    again = b.message(1, 2, w, 0)  # already holds P_0: a 0-part delta message
    assert decode_envelope(again, SPEC).kind == Kind.DELTAS and len(again) < 60


def test_a_reply_naming_another_nodes_task_leaves_that_task_in_flight():
    """Node 2 names node 1's task: node 1's task stays in flight, so node 1's own reply still tells the server
    it holds that model (its next task is a delta, not a full copy), and node 2 is not taken to hold it."""
    b = build_broadcaster("int8", SPEC)
    w = model(2)
    b.message(1, 1, w, 0)
    b.on_reply(2, 1)
    assert 1 in b.in_flight and 2 not in b.synced
    b.on_reply(1, 1)
    assert decode_envelope(b.message(1, 2, w, 0), SPEC).kind == Kind.DELTAS


# ---- the delta mode -----------------------------------------------------------------------------------------


def test_delta_messages_are_small_and_chain():
    b = build_broadcaster("delta", SPEC, density=0.02, history=8)
    w = model(3)
    r = receive(b.message(1, 1, w, 0), SPEC, None)
    b.on_reply(1, 1)
    for v in range(1, 4):  # the client misses versions 1 and 2
        w = step(w, 10 + v, 0.01)
        b.publish(w, v)
    blob = b.message(1, 2, w, 3)
    msg = decode_envelope(blob, SPEC)
    assert msg.kind == Kind.DELTAS and (msg.base, msg.version, len(msg.parts)) == (0, 3, 3)
    assert len(blob) * 3 < dense_fp32_bytes(SPEC)  # small tensors travel dense in every delta
    r = receive(blob, SPEC, r)
    assert same(r, b.public)


def test_client_ahead_of_the_server_view_skips_what_it_has():
    """A reply lost on the uplink: the client holds v2 while the server believes v1."""
    b = build_broadcaster("delta", SPEC, density=0.05)
    w = model(4)
    r = receive(b.message(1, 1, w, 0), SPEC, None)
    b.on_reply(1, 1)
    w = step(w, 5, 0.01)
    r = receive(b.message(1, 2, w, 1), SPEC, r)  # reply lost: no on_reply
    w = step(w, 6, 0.01)
    blob = b.message(1, 3, w, 2)
    assert decode_envelope(blob, SPEC).base == 0
    r = receive(blob, SPEC, r)
    assert r.version == 2 and same(r, b.public)


def test_too_far_behind_gets_a_full_copy():
    b = build_broadcaster("delta", SPEC, density=0.01, history=3)
    w = model(5)
    receive(b.message(1, 1, w, 0), SPEC, None)
    b.on_reply(1, 1)
    for v in range(1, 5):
        w = step(w, 20 + v, 0.01)
        b.publish(w, v)
    msg = decode_envelope(b.message(1, 2, w, 4), SPEC)
    assert msg.kind == Kind.FULL and msg.version == 4
    assert b.stats.full == 2 and b.stats.delta == 0


def test_deltas_larger_than_dense_fall_back_to_full():
    b = build_broadcaster("delta", SPEC, compressor="topk", density=1.0, dense_below=0)
    w = model(6)
    receive(b.message(1, 1, w, 0), SPEC, None)
    b.on_reply(1, 1)
    w = step(w, 7, 0.1)
    assert decode_envelope(b.message(1, 2, w, 1), SPEC).kind == Kind.FULL


def test_fingerprint_mismatch_asks_for_a_full_copy():
    b = build_broadcaster("delta", SPEC, density=0.05)
    w = model(8)
    r = receive(b.message(1, 1, w, 0), SPEC, None)
    b.on_reply(1, 1)
    r.tensors["conv"].view(-1)[7] = torch.nextafter(r.tensors["conv"].view(-1)[7], torch.tensor(9.0))  # one ulp
    w = step(w, 9, 0.01)
    with pytest.raises(DownlinkError, match="fingerprint mismatch"):
        receive(b.message(1, 2, w, 1), SPEC, r)
    b.on_failure(1, 2)
    blob = b.message(1, 3, w, 1)
    assert decode_envelope(blob, SPEC).kind == Kind.FULL
    assert same(receive(blob, SPEC, r), b.public)
    assert b.stats.resyncs == 1


def test_restarted_client_without_replica_refuses_deltas():
    b = build_broadcaster("delta", SPEC)
    w = model(9)
    receive(b.message(1, 1, w, 0), SPEC, None)
    b.on_reply(1, 1)
    w = step(w, 10, 0.01)
    with pytest.raises(DownlinkError, match="no replica"):
        receive(b.message(1, 2, w, 1), SPEC, None)


def test_server_error_feedback_tracks_the_true_model():
    """``W_v - P_v`` is all that was not broadcast: with the true model frozen it drains to zero."""
    b = build_broadcaster("delta", SPEC, density=0.1)
    w0 = model(11)
    b.publish(w0, 0)
    w = step(w0, 12, 0.1)
    start = max(float((w[n] - b.public[n]).abs().max()) for n in SPEC.names)
    sent = {n: torch.zeros(s) for n, s in SPEC.entries}
    for v in range(1, 60):
        b.publish(w, v)
        upd = decode_envelope(encode_envelope(Kind.DELTAS, v, v - 1, b.digest, [b.chain[-1][2]]), SPEC).parts[0]
        for n in SPEC.names:
            upd.tensors[n].add_to(sent[n])
    end = max(float(r.abs().max()) for r in b.residual(w).values())
    assert end < start / 50
    for n in SPEC.names:  # P_v = P_0 + Σ decoded deltas (up to float rounding), P_0 = W_0
        torch.testing.assert_close(b.public[n], w0[n] + sent[n], atol=1e-5, rtol=0)


def test_replica_state_round_trip():
    b = build_broadcaster("int8", SPEC)
    r = receive(b.message(1, 1, model(13), 2), SPEC, None)
    data = r.to_bytes(SPEC)
    back = Replica.from_bytes(data, SPEC)
    assert back is not None and back.version == 2 and same(back, r.tensors)
    bad = bytearray(data)
    bad[40] ^= 1
    assert Replica.from_bytes(bytes(bad), SPEC) is None


# ---- hostile blobs ------------------------------------------------------------------------------------------


def _delta_blob() -> tuple[bytes, Replica]:
    b = build_broadcaster("delta", SPEC, density=0.05)
    w = model(14)
    r = receive(b.message(1, 1, w, 0), SPEC, None)
    b.on_reply(1, 1)
    w = step(w, 15, 0.01)
    return b.message(1, 2, w, 1), r


@settings(max_examples=60)
@given(data=st.data())
def test_damaged_blob_is_a_clear_error(data):
    blob, replica = _delta_blob()
    how = data.draw(st.sampled_from(["flip", "truncate", "extend"]))
    if how == "flip":
        i = data.draw(st.integers(0, len(blob) - 1))
        bad = blob[:i] + bytes([blob[i] ^ data.draw(st.integers(1, 255))]) + blob[i + 1 :]
    elif how == "truncate":
        bad = blob[: data.draw(st.integers(0, len(blob) - 1))]
    else:
        bad = blob + data.draw(st.binary(min_size=1, max_size=8))
    with pytest.raises(WireError):  # DownlinkError or the dense blob's WireError, nothing else
        receive(bad, SPEC, replica)


def test_well_formed_but_wrong_messages():
    b = build_broadcaster("delta", SPEC, density=0.05)
    w = model(16)
    b.publish(w, 0)
    w = step(w, 17, 0.01)
    b.publish(w, 1)
    (_, _, part) = b.chain[-1]
    with pytest.raises(DownlinkError, match="deltas end at"):
        decode_envelope(encode_envelope(Kind.DELTAS, 2, 0, b.digest, [part]), SPEC)
    with pytest.raises(DownlinkError, match="expected from"):
        decode_envelope(encode_envelope(Kind.DELTAS, 1, 1, b.digest, [part]), SPEC)
    with pytest.raises(DownlinkError, match="full copy"):
        decode_envelope(encode_envelope(Kind.FULL, 1, 0, b.digest, [part]), SPEC)
    with pytest.raises(DownlinkError, match="part 0"):
        decode_envelope(encode_envelope(Kind.DELTAS, 1, 0, b.digest, [part[:-1] + b"\0"]), SPEC)
    with pytest.raises(DownlinkError, match="unknown message kind"):
        decode_envelope(encode_envelope(7, 1, 0, b.digest, []), SPEC)
    other = ModelSpec((("x", (3,)),))
    with pytest.raises(DownlinkError, match="fingerprint"):
        decode_envelope(encode_envelope(Kind.DELTAS, 1, 0, b.digest, [part]), other)
    with pytest.raises(DownlinkError, match="expected bytes"):
        receive("text", SPEC, None)  # type: ignore[arg-type]
    dense_sparse = encode(decode_envelope(encode_envelope(Kind.DELTAS, 1, 0, b.digest, [part]), SPEC).parts[0], SPEC)
    with pytest.raises(DownlinkError, match="sparse"):
        receive(dense_sparse, SPEC, None)


def test_registry_and_options():
    assert set(MODES) <= set(DOWNLINKS.names())
    with pytest.raises(ConfigError, match="unknown downlink mode"):
        build_broadcaster("gzip", SPEC)
    with pytest.raises(ConfigError, match="unknown option"):
        build_broadcaster("delta", SPEC, densty=0.1)
    with pytest.raises(ConfigError, match="history"):
        build_broadcaster("delta", SPEC, history=0)
    with pytest.raises(ConfigError):
        build_broadcaster("int8", SPEC, block=0)
    assert len(model_digest(model(0), SPEC)) == 16


# ---- through the server loop and the ClientApp (in-process engine, virtual clock) ---------------------------


def test_simulated_run_keeps_every_replica_on_the_public_model(monkeypatch):
    from flwr.app import Context, RecordDict

    from clients.app import app
    from fedcomp.downlink import Broadcaster
    from fedcomp.flower.session import REPLICA_KEY
    from fedcomp.task.config import NodeConfig, RunConfig
    from fedcomp.task.training import make_model, node_partition
    from simulations import scenario as scenarios
    from simulations.engines import InProcessEngine
    from simulations.runner import NODE_ID_BASE, drive

    published: dict[int, bytes] = {}
    original = Broadcaster.publish

    def recording(self, params, version):
        original(self, params, version)
        published[self.version] = self.digest

    monkeypatch.setattr(Broadcaster, "publish", recording)
    sc = scenarios.load(
        "downlink",
        ["methods=delta-down", "run.num_versions=10", "run.model=mlp", "sim.progress=false", "clients.0.count=2",
         "clients.1.count=2", "run.buffer_size=2"],
    )
    method = sc.methods[0]
    nodes = {NODE_ID_BASE + i: i for i in range(sc.num_clients)}
    engine = InProcessEngine(app, method.flat, nodes)
    submit, calls = engine.submit, []

    def restarting(task, model):  # the node of the 6th task lost its state (restart) just before it
        calls.append(task.task_id)
        if len(calls) == 6:
            old = engine.contexts[task.client]
            fresh = Context(old.run_id, old.node_id, old.node_config, RecordDict(), old.run_config)
            engine.contexts[task.client] = fresh
        return submit(task, model)

    engine.submit = restarting
    result = drive(sc, method, engine, nodes, None)
    s = result.summary
    assert s["versions"] == 10 and s["downlink"] == "delta"
    assert s["downlink_delta"] > 0 and s["downlink_resyncs"] >= 1 and s["downlink_vs_dense_fp32"] > 1
    run = RunConfig.from_flower(method.flat)
    model_spec = ModelSpec.from_module(make_model(run, node_partition(run, NodeConfig(0, sc.num_clients))))
    for ctx in engine.contexts.values():  # every node (the restarted one too) holds P_v of its version
        replica = Replica.from_bytes(bytes(ctx.state.array_records[REPLICA_KEY]["replica"].data), model_spec)
        assert replica is not None and replica.digest(model_spec) == published[replica.version]


# ---- the client encodes its replica only when it changed ----------------------------------------------------


def test_replica_is_encoded_again_only_when_it_changed(monkeypatch):
    import fedcomp.downlink.replica as replica_module

    encoded = []
    original = replica_module.encode_full
    monkeypatch.setattr(replica_module, "encode_full", lambda *a: encoded.append(a[2]) or original(*a))
    b = build_broadcaster("delta", SPEC, density=0.05, history=4)
    w = model(4)

    def task(client_state: bytes | None, task_id: int, version: int) -> bytes:
        """One task as the session runs it: load the saved replica, receive, save."""
        held = Replica.from_bytes(client_state, SPEC) if client_state is not None else None
        r = receive(b.message(1, task_id, w, version), SPEC, held)
        b.on_reply(1, task_id)
        assert same(r, b.public)
        return r.to_bytes(SPEC)

    state = task(None, 1, 0)
    assert encoded == [0]
    again = task(state, 2, 0)  # a 0-part delta: the same model, the same bytes, nothing encoded
    assert again == state and encoded == [0]
    w = step(w, 5, 0.01)
    state = task(again, 3, 1)  # a new version: encoded once
    assert encoded == [0, 1] and Replica.from_bytes(state, SPEC).version == 1
    held = Replica.from_bytes(state, SPEC)
    held.tensors["fc"].view(-1)[0] += 1.0  # changed in place: receive refuses it, never reuses stale bytes
    with pytest.raises(DownlinkError, match="fingerprint"):
        receive(b.message(1, 4, w, 1), SPEC, held)


def test_docstring_examples_hold():
    import doctest

    import fedcomp.downlink as package
    from fedcomp.downlink import broadcaster, envelope, model, replica, stats

    names = {n: getattr(package, n) for n in package.__all__} | {"torch": torch, "ModelSpec": ModelSpec}
    names["decode"] = decode
    for module in (package, broadcaster, envelope, model, replica, stats):
        result = doctest.testmod(module, extraglobs=names)
        assert result.failed == 0 and result.attempted > 0, module.__name__

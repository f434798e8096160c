"""The send step and the ack/nack ledger, through the public API (encode/decode included)."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import fedcomp
from fedcomp import ConfigError, ModelSpec


def grads(spec, seed):
    g = torch.Generator().manual_seed(seed)
    return {n: torch.randn(s, generator=g) for n, s in spec.entries}


SPEC = ModelSpec((("w", (64, 40)), ("b", (40,))))


def test_documented_round_trip():
    pipe = fedcomp.build("topk", SPEC, density=0.01)
    g = grads(SPEC, 0)
    blob = pipe.send(g, base_version=7, client_id=3)
    update = fedcomp.decode(blob, SPEC)
    assert (update.base_version, update.seq, update.client_id) == (7, 1, 3)
    assert update.tensors["w"].nnz == round(0.01 * 64 * 40)
    # 1-D tensors are small: grouped (the only small tensor here, so k = round(0.01 * 40) = 0 -> at least 1)
    assert not update.tensors["b"].is_dense and update.tensors["b"].nnz == 1
    acc = fedcomp.SparseAccumulator(SPEC)
    acc.add(update, weight=1.0)
    sent = acc.result(normalize="sum")
    # what was sent plus what the memory kept is exactly the gradient
    for name in ("w", "b"):
        torch.testing.assert_close(sent[name] + pipe.memory.residual(name), g[name])


def test_nack_restores_and_ack_forgets():
    pipe = fedcomp.build("topk", SPEC, density=0.01)
    g1, g2 = grads(SPEC, 1), grads(SPEC, 2)
    pipe.send(g1)
    b2 = pipe.send(g2)
    assert set(pipe.pending) == {1, 2}
    assert pipe.ack(2) and not pipe.ack(2)
    assert pipe.nack(1) and not pipe.nack(1)
    assert pipe.pending == {}
    # only update 2 was applied: everything else (update 1 included) is back in the memory
    sent2 = fedcomp.decode(b2, SPEC).to_dense()
    for name in ("w", "b"):
        torch.testing.assert_close(pipe.memory.residual(name) + sent2[name], g1[name] + g2[name])


def test_state_dict_resumes_identically():
    a = fedcomp.build("dgc", SPEC, density=0.01)
    a.send(grads(SPEC, 0))
    b = fedcomp.build("dgc", SPEC, density=0.01)
    b.load_state_dict(a.state_dict())
    g = grads(SPEC, 1)
    assert a.send(g) == b.send(g)


def test_options_route_to_memory_and_compressor():
    pipe = fedcomp.build("dgc", SPEC, density=0.01, momentum=0.5)
    assert pipe.memory.config.momentum == 0.5
    assert pipe.compressor.config.density == 0.01
    with pytest.raises(ConfigError):
        fedcomp.build("dgc", SPEC, densty=0.01)
    with pytest.raises(ConfigError):
        fedcomp.build("no-such-method", SPEC)


def test_composed_name_builds_sparsify_then_quantize():
    pipe = fedcomp.build("dgc+int8", SPEC, density=0.01)
    update = fedcomp.decode(pipe.send(grads(SPEC, 0)), SPEC)
    assert update.tensors["w"].values.coding == fedcomp.ValueCoding.INT8
    assert update.tensors["b"].values.coding == fedcomp.ValueCoding.INT8  # the small-tensor group, quantized too
    old = fedcomp.decode(fedcomp.build("dgc+int8", SPEC, density=0.01, small="dense").send(grads(SPEC, 0)), SPEC)
    assert old.tensors["b"].is_dense and old.tensors["b"].values.coding == fedcomp.ValueCoding.F32


def test_small_policy_routes_tensors():
    spec = ModelSpec((("w", (64, 40)), ("b", (40,)), ("c", (3, 3)), ("d", (2, 3, 4))))
    assert fedcomp.build("topk", spec).grouped == ("b", "c", "d")
    assert fedcomp.build("dgc+int8", spec, dense_below=10).grouped == ("b", "c")
    assert fedcomp.build("topk", spec, small="dense").grouped == ()
    assert fedcomp.build("topk", spec, small="each").grouped == ()
    assert fedcomp.build("int8", spec).grouped == ()  # quantizers code every tensor anyway
    with pytest.raises(ConfigError):
        fedcomp.build("topk", spec, small="sparse")
    update = fedcomp.decode(fedcomp.build("topk", spec, density=0.01, small="each").send(grads(spec, 0)), spec)
    assert [update.tensors[n].nnz for n in ("b", "c", "d")] == [1, 1, 1]


# ---- pending updates are kept as payloads, not blobs to decode again -----------------------------------------

METHODS = ["topk", "dgc", "randomk", "dgc+int8", "topk+int4", "topk+ternary", "topk+fp16", "qsgd", "int8", "sign",
           "ternary", "bf16", "identity"]


def dense(update):
    return {n: p.to_dense() for n, p in update.tensors.items()}


def saved_and_loaded(state):
    import io

    buf = io.BytesIO()
    torch.save(state, buf)  # what a client state goes through
    return torch.load(io.BytesIO(buf.getvalue()), weights_only=True)


@pytest.mark.parametrize("method", METHODS)
@settings(max_examples=6, deadline=None)
@given(seeds=st.lists(st.integers(0, 10**6), min_size=1, max_size=4))
def test_pending_payloads_are_what_was_sent(method, seeds):
    """After more sends (the memory moved on), each pending update is still exactly its blob: no payload aliases
    state a later step writes; a saved and reloaded state holds the same payloads."""
    pipe = fedcomp.build(method, SPEC)
    blobs = {}
    for seed in seeds:
        blob = pipe.send(grads(SPEC, seed), base_version=seed % 5, client_id=9)
        blobs[pipe.last_seq] = blob
    back = fedcomp.build(method, SPEC)
    back.load_state_dict(saved_and_loaded(pipe.state_dict()))
    for seq, blob in blobs.items():
        sent = fedcomp.decode(blob, SPEC)
        for kept in (pipe.pending[seq], back.pending[seq]):
            assert (kept.base_version, kept.seq, kept.client_id) == (sent.base_version, seq, 9)
            assert fedcomp.encode(kept, SPEC) == blob
            for n, t in dense(sent).items():
                assert torch.equal(dense(kept)[n], t)


def test_ack_and_nack_never_decode(monkeypatch):
    import fedcomp.client.saved

    pipe = fedcomp.build("dgc+int8", SPEC, density=0.05)
    pipe.send(grads(SPEC, 1))
    pipe.send(grads(SPEC, 2))

    def refuse(*args, **kwargs):
        raise AssertionError("a pending update was decoded again")

    monkeypatch.setattr(fedcomp.client.saved, "decode", refuse)  # where a pipeline's state decodes
    assert pipe.nack(1) and pipe.ack(2) and not pipe.pending


@pytest.mark.parametrize("memory", ["residual", "dgc"])
def test_state_with_pending_blobs_still_loads(memory):
    """States saved when pending updates were kept as encoded blobs load and resolve the same way."""
    new = fedcomp.build("topk+int8", SPEC, memory=memory, density=0.05)
    blobs = [new.send(grads(SPEC, seed)) for seed in (3, 4)]
    old_state = saved_and_loaded(new.state_dict() | {"pending": {1: blobs[0], 2: blobs[1]}})
    old = fedcomp.build("topk+int8", SPEC, memory=memory, density=0.05)
    old.load_state_dict(old_state)
    assert old.nack(1) and new.nack(1) and old.ack(2) and new.ack(2)
    for name in SPEC.names:
        assert torch.equal(old.memory.residual(name), new.memory.residual(name))
        assert torch.equal(old.totals.outstanding[name], new.totals.outstanding[name])
    assert old.send(grads(SPEC, 5)) == new.send(grads(SPEC, 5))

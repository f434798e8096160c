"""The send step and the ack/nack ledger, through the public API (encode/decode included)."""

import pytest
import torch

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
    assert update.tensors["b"].is_dense  # 1-D tensors go dense
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
    assert update.tensors["b"].values.coding == fedcomp.ValueCoding.F32

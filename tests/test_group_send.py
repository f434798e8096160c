"""The small tensors' group on flat state (``fedcomp.kernels.group``, ``fedcomp.memory.flat``) against the reference
steps (per tensor ``compensate``/``update``, one ``compress_group``), under Triton's interpreter on the CPU.

For hypothesis-made groups (many small tensors, empty ones, single elements; densities from one kept value to all
selected; every memory and rule the group step takes), several sends with a nack of a pending update and a
save/load in between: the same bytes as the reference pipeline, the bits of its memory state (signed zeros too),
the same saved state bytes; the group's state really is one buffer (a nack restores into it); the ops of the
group's step do not grow with the number of tensors (benchmarks/send_counts.py).
"""

from __future__ import annotations

import io
import os
from pathlib import Path

os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

pytest.importorskip("triton", reason="triton not installed")

from fedcomp.client.pipeline import build  # noqa: E402
from fedcomp.kernels.group import group_send, group_stages  # noqa: E402
from fedcomp.memory.dgc import DGCMemory  # noqa: E402
from fedcomp.memory.flat import FlatState  # noqa: E402
from fedcomp.spec import ModelSpec  # noqa: E402
from fedcomp.wire import encode  # noqa: E402
from tests.clientkit import benchmark_module

FAST = settings(max_examples=15, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
ROOT = Path(__file__).resolve().parents[1]

small_shapes = st.one_of(st.tuples(st.integers(0, 3)), st.tuples(st.integers(4, 90)), st.tuples(st.integers(1, 5),
                                                                                             st.integers(1, 9)))


def _spec(shapes, large: bool) -> ModelSpec:
    entries = [(f"s{i}", s) for i, s in enumerate(shapes)]
    if large:
        entries.insert(len(entries) // 2, ("w", (20, 8)))  # >= dense_below=64: outside the group
    return ModelSpec(tuple(entries))


def _tensors(obj) -> list[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, dict):
        return [t for k in sorted(obj, key=str) for t in _tensors(obj[k])]
    return []


def _bits_equal(a: dict, b: dict) -> bool:
    """Same tensors, bit for bit (a -0.0 where the reference has +0.0 fails)."""
    ta, tb = _tensors(a), _tensors(b)
    return len(ta) == len(tb) and all(
        x.shape == y.shape and x.dtype == y.dtype and torch.equal(x.view(torch.int32), y.view(torch.int32))
        for x, y in zip(ta, tb, strict=True) if x.dtype == torch.float32) and all(
        torch.equal(x, y) for x, y in zip(ta, tb, strict=True))


def _saved(state: dict) -> bytes:
    buf = io.BytesIO()
    torch.save(state, buf)
    return buf.getvalue()


@FAST
@given(
    shapes=st.lists(small_shapes, min_size=1, max_size=40),
    large=st.booleans(),
    name=st.sampled_from(["dgc", "dgc+int8", "dgc+int4", "topk", "topk+int8", "randomk"]),
    memory=st.sampled_from(["dgc", "residual"]),
    rule=st.sampled_from([{}, {"nesterov": True}, {"masking": False}, {"momentum": 0.0}]),
    density=st.sampled_from([1e-4, 0.05, 0.4, 1.0]),
    seed=st.integers(0, 2**16),
)
def test_group_on_flat_state_equals_the_reference(shapes, large, name, memory, rule, density, seed):
    spec = _spec(shapes, large)
    opts = dict(density=density, dense_below=64, **(rule if memory == "dgc" else {}))
    if "+" in name:
        opts["stochastic"] = False  # round to nearest: the kernel's codes are the reference's
    pipes = {b: build(name, spec, memory=memory, backend=b, **opts) for b in ("torch", "triton")}
    gen = torch.Generator().manual_seed(seed)
    for step in range(4):
        grads = {n: torch.randn(s, generator=gen) * (1 + step) for n, s in spec.entries}
        if step == 2:  # a saved state loads into a new pipeline: the flat state is rebuilt from the loaded views
            for b in pipes:
                state = pipes[b].state_dict()
                pipes[b] = build(name, spec, memory=memory, backend=b, **opts)
                pipes[b].load_state_dict(state)
        blobs = {b: p.send(grads) for b, p in pipes.items()}
        assert blobs["triton"] == blobs["torch"], f"step {step}"
        assert blobs["triton"] == encode(pipes["triton"].pending[pipes["triton"].last_seq], spec)
        if step == 1:
            assert all(p.nack(2) for p in pipes.values())  # restores into the flat state (step 2 reads it)
        assert _bits_equal(pipes["torch"].memory.state_dict(), pipes["triton"].memory.state_dict()), f"step {step}"
    ref, got = pipes["torch"], pipes["triton"]
    assert _saved(ref.memory.state_dict()) == _saved(got.memory.state_dict())  # the client state's bytes
    assert _bits_equal(ref.totals.state_dict(), got.totals.state_dict())


def _group_pipe(n_small: int, name: str = "dgc+int8", memory: str = "dgc", **opts):
    spec = ModelSpec(tuple((f"b{i}", (3 + i % 5,)) for i in range(n_small)) + (("e", (0,)),))
    if "+" in name:
        opts["stochastic"] = False
    pipe = build(name, spec, memory=memory, backend="triton", density=0.3, **opts)
    gen = torch.Generator().manual_seed(n_small)
    return pipe, spec, gen


def test_the_group_state_is_one_buffer_and_a_nack_restores_into_it():
    pipe, spec, gen = _group_pipe(12)
    for _ in range(2):  # the first send allocates the state (reference steps), the second binds it flat
        pipe.send({n: torch.randn(s, generator=gen) for n, s in spec.entries})
    mem = pipe.memory
    flat = mem.group_state(pipe.grouped)
    assert flat is not None and flat.velocity.dim() == 1 and flat.velocity.numel() == spec.total_numel
    for store, buf in ((mem.velocities, flat.velocity), (mem.momentums, flat.momentum)):
        assert torch.equal(torch.cat([store[n].reshape(-1) for n in pipe.grouped]), buf)
        assert all(store[n].untyped_storage().data_ptr() == buf.untyped_storage().data_ptr() for n in pipe.grouped)
    before = flat.velocity.clone()
    sent = pipe.pending[2]
    assert sent.nnz > 0 and pipe.nack(2)
    want = before.clone()
    at = 0
    for n in pipe.grouped:  # the nacked payloads, added at their names' ranges of the buffer
        p = sent.tensors[n]
        if p.nnz:
            want[at: at + p.shape[0]].index_add_(0, p.indices, p.values.dequantize())
        at += p.shape[0]
    assert torch.equal(mem.group_state(pipe.grouped).velocity, want) and not torch.equal(want, before)
    assert mem.group_state(pipe.grouped).velocity is flat.velocity  # the same buffer, cached


def test_flat_state_binding_keeps_names_order_and_values():
    stores = ({"a": torch.arange(3.0), "x": torch.ones(2, 2), "b": torch.zeros(0), "c": torch.tensor([7.0])},)
    before = {n: t.clone() for n, t in stores[0].items()}
    assert FlatState.bind(stores, ("a", "missing")) is None and stores[0]["a"] is not None
    flat = FlatState.bind(stores, ("a", "b", "c"))
    assert list(stores[0]) == ["a", "x", "b", "c"] and flat.offsets == (0, 3, 3)
    assert torch.equal(flat.bufs[0], torch.tensor([0.0, 1.0, 2.0, 7.0]))
    assert all(torch.equal(stores[0][n], before[n]) for n in before) and stores[0]["x"] is not flat.views[0].get("x")
    stores[0]["c"].add_(1.0)  # a write through the store lands in the buffer
    assert float(flat.bufs[0][3]) == 8.0
    assert FlatState.bind(stores, ("a", "b", "c"), flat) is flat
    stores[0]["a"] = stores[0]["a"].clone()  # rebound (as load_state_dict does): a new buffer
    again = FlatState.bind(stores, ("a", "b", "c"), flat)
    assert again is not flat and torch.equal(again.bufs[0], torch.tensor([0.0, 1.0, 2.0, 8.0]))


def test_where_the_group_step_does_not_apply_it_does_nothing():
    mem = DGCMemory()
    xs = {"b": torch.randn(5), "c": torch.randn(3)}
    pipe = build("dgc", ModelSpec((("b", (5,)), ("c", (3,)))), backend="triton")
    assert group_send(mem, pipe.compressor, xs, backend="triton") is None  # no state yet: the first step
    assert mem.state_dict() == {"u": {}, "v": {}}
    for n, x in xs.items():
        mem.step_state(n, x)
    assert group_send(mem, pipe.compressor, xs, backend="torch") is None  # the torch backend: the reference
    clipped = DGCMemory(DGCMemory.Config(clip_norm=1.0))
    for n, x in xs.items():
        clipped.step_state(n, x)
    assert group_send(clipped, pipe.compressor, xs, backend="triton") is None  # clipping: reference steps
    assert group_send(mem, pipe.compressor, xs, backend="triton") is not None
    assert group_stages(build("topk+fp16", pipe.spec).compressor) is None  # a quantizer without a kernel


def _send_counts():
    return benchmark_module("send_counts")


@pytest.mark.parametrize("name", ["topk", "topk+int8"])
def test_the_group_steps_ops_do_not_grow_with_the_tensors(name):
    """One group step of 4 and of 40 small tensors: the same torch ops (the reference takes a few per tensor)."""
    counts = _send_counts()
    ops = {}
    for n_small in (4, 40):
        pipe, spec, gen = _group_pipe(n_small, name, memory="residual")
        pipe.totals = None
        grads = {n: torch.randn(s, generator=gen) for n, s in spec.entries}
        pipe.send(grads)
        group = {n: grads[n] for n in pipe.grouped}
        with counts.SendCounts("cpu") as c:
            out = group_send(pipe.memory, pipe.compressor, group, backend="triton")
        assert out is not None and sum(p.nnz for p in out.values()) > 1
        ops[n_small] = c.totals()["torch_ops"]
    assert ops[40] == ops[4], ops


@pytest.mark.parametrize("case", ["all empty", "zero gradients", "one element each"])
@pytest.mark.parametrize("name", ["dgc", "dgc+int8"])
def test_edge_groups_equal_the_reference(case, name):
    """A group of empty tensors only (nothing to select: k = 0), zero gradients (a nonzero-free group selects
    nothing) and one-element tensors at density 1 (all selected): the reference's bytes and state bits, on the
    flat state from the second send on."""
    shapes = {"all empty": [(0,)] * 5, "zero gradients": [(3,), (0,), (7,)], "one element each": [(1,)] * 9}[case]
    spec = _spec(shapes, large=False)
    opts = dict(density=1.0 if case == "one element each" else 0.3, dense_below=64)
    if "+" in name:
        opts["stochastic"] = False
    pipes = {b: build(name, spec, backend=b, **opts) for b in ("torch", "triton")}
    gen = torch.Generator().manual_seed(7)
    for step in range(3):
        grads = {n: torch.randn(s, generator=gen) * (case != "zero gradients") for n, s in spec.entries}
        blobs = {b: p.send(grads) for b, p in pipes.items()}
        assert blobs["triton"] == blobs["torch"] == encode(pipes["triton"].pending[step + 1], spec)
        nnz = pipes["triton"].pending[step + 1].nnz
        assert nnz == (spec.total_numel if case == "one element each" else 0)
        assert _bits_equal(pipes["torch"].memory.state_dict(), pipes["triton"].memory.state_dict())
    assert pipes["triton"].memory.group_state(pipes["triton"].grouped) is not None

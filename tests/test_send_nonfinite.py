"""``Pipeline.send`` of an update holding NaN or Inf: refused with ``NonFiniteUpdate`` before any state changes, on
the torch path and the Triton kernel path (under the interpreter), for every compressor family. Error feedback
would keep a NaN for good (DGC's threshold never selects it, so it never leaves the velocity); the next finite
update must go out exactly as if the refused one had never come."""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # the Triton path on the CPU, as the kernel tests run it

import pytest  # noqa: E402
import torch  # noqa: E402
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from fedcomp.client.pipeline import NonFiniteUpdate, build  # noqa: E402
from fedcomp.spec import ModelSpec  # noqa: E402

SPEC = ModelSpec((("w", (16, 40)), ("b", (40,)), ("s", ())))
CASES = [("dgc", "torch"), ("dgc+int8", "torch"), ("topk", "torch"), ("int8", "torch"), ("qsgd", "torch"),
         ("sign", "torch"), ("dgc", "triton"), ("dgc+int8", "triton")]


def pipeline(name: str, backend: str):
    options = {} if name in ("int8", "qsgd", "sign") else {"density": 0.05}
    return build(name, SPEC, backend=backend, **options)


def grads(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {n: torch.randn(s, generator=g) for n, s in SPEC.entries}


@pytest.mark.parametrize("name, backend", CASES)
@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(where=st.sampled_from(["w", "b", "s"]), at=st.integers(0, 639),
       value=st.sampled_from([float("nan"), float("inf"), -float("inf")]))
def test_a_non_finite_update_is_refused_and_changes_nothing(name, backend, where, at, value):
    refused, twin = pipeline(name, backend), pipeline(name, backend)
    for pipe in (refused, twin):  # some history: a residual, a pending update
        pipe.send(grads(1))
    bad = {n: t.clone() for n, t in grads(2).items()}
    bad[where].view(-1)[at % bad[where].numel()] = value
    with pytest.raises(NonFiniteUpdate, match=f"NaN or Inf in \\['{where}'\\]"):
        refused.send(bad)
    assert refused.last_seq == twin.last_seq == 1 and sorted(refused.pending) == [1]
    # the next finite update goes out as from a client that never saw the refused one: the same bytes
    assert refused.send(grads(3)) == twin.send(grads(3))
    assert refused.state_dict()["next_seq"] == twin.state_dict()["next_seq"] == 3


def test_an_encode_that_fails_puts_the_update_back_into_the_memory(monkeypatch):
    """Any failure after the memory took the update (here the encode) restores it, as a nack does."""
    import fedcomp.client.pipeline as module

    refused, twin = pipeline("topk", "torch"), pipeline("topk", "torch")

    def broken(*args, **kw):
        raise RuntimeError("encode failed")

    monkeypatch.setattr(module, "encode_update", broken)
    with pytest.raises(RuntimeError, match="encode failed"):
        refused.send(grads(1))
    monkeypatch.undo()
    assert refused.pending == {}
    twin.send(grads(1))
    twin.nack(1)  # the same as the refused send: taken, then restored into the memory
    assert refused.send(grads(2)) == twin.send(grads(2))


SPECIALS = [float("nan"), float("inf"), -float("inf"), 3.4e38, -3.4e38, 6.5e4, 0.0, -0.0, 1e-45]


@settings(max_examples=60, deadline=None)
@given(tensors=st.lists(st.tuples(st.sampled_from([torch.float32, torch.float16, torch.bfloat16, torch.float64,
                                                   torch.int64]),
                                  st.lists(st.one_of(st.sampled_from(SPECIALS), st.floats(-1e6, 1e6)), max_size=40)),
                        min_size=1, max_size=6))
def test_the_check_names_exactly_the_tensors_isfinite_names(tensors):
    """One multi-tensor max per device finds what a per-tensor ``isfinite`` finds: no finite tensor flagged (huge
    values, fp16's largest, empty ones, integers) and every NaN or Inf found whatever else the tensor holds."""
    from fedcomp.client.finite import non_finite

    update = {f"t{i}": torch.tensor(values, dtype=torch.float64).to(dtype) if dtype != torch.int64
              else torch.tensor([int(v) for v in values if abs(v) < 1e6], dtype=dtype)
              for i, (dtype, values) in enumerate(tensors)}
    expected = sorted(n for n, t in update.items() if not bool(torch.isfinite(t).all()))
    assert non_finite(update) == expected


def test_the_check_costs_the_same_ops_for_4_tensors_as_for_40():
    """A per-tensor check cost a GPU send five ops per tensor (about 310 for a 62-tensor model, each a launch and
    host time); the multi-tensor one is a fixed few per device."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from fedcomp.client.finite import non_finite

    class Ops(TorchDispatchMode):
        count = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Ops.count += 1
            return func(*args, **(kwargs or {}))

    counts = []
    for n in (4, 40):
        update = {f"t{i}": torch.randn(3 + i) for i in range(n)}
        Ops.count = 0
        with Ops():
            assert non_finite(update) == []
        counts.append(Ops.count)
    assert counts[0] == counts[1], counts

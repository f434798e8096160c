"""``fedcomp check``: the pipeline's running totals, and the check of a run's outputs and client states."""

from __future__ import annotations

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import fedcomp
from fedcomp.pipeline import Pipeline
from fedcomp.wire import decode

SPEC = fedcomp.ModelSpec((("conv", (8, 3, 3, 3)), ("fc", (40, 30)), ("b", (40,))))


def balance(pipe: Pipeline) -> float:
    """max |computed - applied - residual - Σ pending| relative to the computed mass."""
    t = pipe.totals
    assert t is not None
    worst = 0.0
    for name, shape in SPEC.entries:
        pending = sum((decode(b, SPEC).to_dense()[name].double() for b in pipe.pending.values()), torch.zeros(shape))
        gap = t.computed[name] - t.applied.get(name, 0.0) - pipe.memory.residual(name).double() - pending
        worst = max(worst, float(gap.abs().max()) / (float(t.computed[name].abs().max()) + 1.0))
    return worst


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    compressor=st.sampled_from([("dgc", None), ("dgc+int8", "residual"), ("topk+int4", None), ("randomk", None)]),
    answers=st.lists(st.sampled_from(["ack", "nack", "wait"]), min_size=1, max_size=12),
    seed=st.integers(0, 2**16),
)
def test_totals_balance_over_acks_and_nacks_and_a_reload(compressor, answers, seed):
    name, memory = compressor
    gen = torch.Generator().manual_seed(seed)
    opts = {"seed": seed % 100} if name.startswith(("dgc", "randomk")) else {}
    pipe = fedcomp.build(name, SPEC, memory=memory, density=0.05, **opts)
    for answer in answers:
        pipe.send({n: torch.randn(s, generator=gen) * 3 for n, s in SPEC.entries})
        oldest = min(pipe.pending)
        if answer == "ack":
            assert pipe.ack(oldest)
        elif answer == "nack":
            assert pipe.nack(oldest)
    again = fedcomp.build(name, SPEC, memory=memory, density=0.05, **opts)
    again.load_state_dict(pipe.state_dict())
    assert again.totals is not None
    assert again.totals.acked + again.totals.nacked + len(again.pending) == again.last_seq
    assert balance(again) < 1e-6


def test_a_state_saved_before_totals_loads_with_totals_not_recorded():
    pipe = fedcomp.build("topk", SPEC, density=0.1)
    pipe.send({n: torch.ones(s) for n, s in SPEC.entries})
    state = pipe.state_dict()
    del state["totals"]
    old = fedcomp.build("topk", SPEC, density=0.1)
    old.load_state_dict(state)
    assert old.totals is None and list(old.pending) == [1]
    old.send({n: torch.ones(s) for n, s in SPEC.entries})  # keeps working, still not recorded
    assert old.totals is None and old.ack(1) and old.nack(2)


def test_a_memory_without_residual_records_no_totals():
    pipe = fedcomp.build("topk", SPEC, memory="none", density=0.1)
    pipe.send({n: torch.ones(s) for n, s in SPEC.entries})
    assert pipe.totals is None and pipe.state_dict()["totals"] is None

"""Many tensors' DGC steps in one launch per pass (fedcomp.kernels.dgc_batch) against the same steps started one by
one (fedcomp.kernels.dgc.start_planned), under Triton's interpreter: bitwise the same sends and state.

``TRITON_INTERPRET=1`` is set at import, before anything imports the kernel modules (see tests/test_kernels.py).
"""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

pytest.importorskip("triton", reason="triton not installed")

from fedcomp.kernels import dgc_batch  # noqa: E402
from fedcomp.kernels._dgc_select import DGCStep  # noqa: E402
from fedcomp.kernels.dgc import plan_dgc_step, start_planned  # noqa: E402
from fedcomp.kernels.pending import resolve_all  # noqa: E402

FAST = settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])

RULES = [
    dict(momentum=0.9),
    dict(momentum=0.9, nesterov=True, clip_norm=0.5),
    dict(momentum=0.5, masking=False),
    dict(momentum=0.9, clip_norm=1e9),  # a clip that never binds: the scale is exactly 1
    None,  # plain error feedback: no momentum state
]


def _state(sizes, rng, rule):
    return [(torch.zeros(n) if rule is not None else None, torch.zeros(n)) for n in sizes]


def _sends(sizes, densities, rule, steps, seed, *, batched, sample=(0.01, 64), spikes=False):
    """Run ``steps`` sends of gradient tensors of ``sizes``; each send's DGCSteps and the final (u, v) per tensor."""
    rng, gen = torch.Generator().manual_seed(seed), torch.Generator().manual_seed(seed + 1)
    state = _state(sizes, rng, rule)
    opts = {} if rule is None else rule
    sent = []
    for _ in range(steps):
        grads = [torch.randn(n, generator=rng) for n in sizes]
        if spikes:  # a few huge values: the sampled threshold misses them, retries and exact top-k follow
            for g in grads:
                g[torch.randint(len(g), (3,), generator=rng)] *= 1e4
        plans = [plan_dgc_step(g, u, v, k=max(1, round(d * len(g))), generator=gen, sample_rate=sample[0],
                               min_samples=sample[1], backend="triton", **opts)
                 for g, (u, v), d in zip(grads, state, densities, strict=True)]
        started = dgc_batch.start_dgc_steps(plans) if batched else [start_planned(p) for p in plans]
        sent.append(resolve_all(started))
    return sent, state


def _same_step(a: DGCStep, b: DGCStep) -> bool:
    return (torch.equal(a.indices, b.indices) and torch.equal(a.values, b.values)
            and torch.equal(a.threshold, b.threshold) and (a.passes, a.exact) == (b.passes, b.exact))


def _assert_same(batched, alone):
    (sent_b, state_b), (sent_a, state_a) = batched, alone
    for step_b, step_a in zip(sent_b, sent_a, strict=True):
        assert all(_same_step(b, a) for b, a in zip(step_b, step_a, strict=True))
    for (ub, vb), (ua, va) in zip(state_b, state_a, strict=True):
        assert torch.equal(vb, va)
        assert (ub is None and ua is None) or torch.equal(ub, ua)


@FAST
@given(sizes=st.lists(st.integers(2, 5000), min_size=2, max_size=6),
       density=st.sampled_from([0.001, 0.01, 0.1, 0.5]), rule=st.sampled_from(range(len(RULES))),
       spikes=st.booleans(), seed=st.integers(0, 2**16))
def test_a_batch_sends_and_keeps_what_the_steps_one_by_one_do(sizes, density, rule, spikes, seed):
    """Sizes across block boundaries (1024), tiny and large ``k``, every rule, retries and exact top-k (``spikes``):
    the batched launch's sends and state are bitwise those of the same plans started one by one."""
    densities = [density * (1 + i % 3) for i in range(len(sizes))]
    args = (sizes, densities, RULES[rule], 3, seed)
    _assert_same(_sends(*args, batched=True, sample=(0.02, 16), spikes=spikes),
                 _sends(*args, batched=False, sample=(0.02, 16), spikes=spikes))


def _count_launches(monkeypatch) -> dict[str, int]:
    """Launches of each DGC kernel from now on, by name (counted as the kernel is indexed by its grid)."""
    from fedcomp.kernels import _triton_dgc, _triton_dgc_multi

    launched: dict[str, int] = {}
    for module in (_triton_dgc, _triton_dgc_multi):
        for name in [n for n in vars(module) if n.endswith("_kernel")]:
            kernel = getattr(module, name)

            class Counted:
                def __init__(self, kernel, name):
                    self.kernel, self.name = kernel, name

                def __getitem__(self, grid):
                    launched[self.name] = launched.get(self.name, 0) + 1
                    return self.kernel[grid]

            monkeypatch.setattr(module, name, Counted(kernel, name))
    return launched


def test_the_batch_is_one_launch_per_pass(monkeypatch):
    """Eight tensors: one sample, one fused and one place launch in all (no one-tensor state pass runs), where
    one by one takes eight fused launches, for the same sends; state that is not 16-byte aligned is not batched."""
    launched = _count_launches(monkeypatch)
    sizes = [3000, 1024, 1025, 5000, 7, 2048, 999, 4096]
    args = (sizes, [0.01] * len(sizes), RULES[0], 1, 7)
    batched = _sends(*args, batched=True)
    multi = {name: n for name, n in launched.items() if "multi" in name}
    assert multi == {"dgc_multi_sample_kernel": 1, "dgc_multi_fused_kernel": 1, "dgc_multi_place_kernel": 1}
    assert "dgc_fused_kernel" not in launched and "dgc_sample_kernel" not in launched  # (a retry may mark again)
    launched.clear()
    _assert_same(batched, _sends(*args, batched=False))
    assert launched["dgc_fused_kernel"] == len(sizes)

    g, u, v = torch.randn(1001)[1:], torch.zeros(1001)[1:], torch.zeros(1001)[1:]  # 4 bytes past an aligned start
    plan = plan_dgc_step(g, u, v, k=10, generator=torch.Generator().manual_seed(0), backend="triton")
    assert dgc_batch._batch_key(plan) is None


def test_past_the_batch_bound_a_further_batch_starts(monkeypatch):
    """``MAX_TENSORS`` of 3 and seven compatible steps: batches of 3 and 3, the seventh alone (one-tensor kernels),
    every send and state bitwise those of the steps one by one."""
    monkeypatch.setattr(dgc_batch, "MAX_TENSORS", 3)
    launched = _count_launches(monkeypatch)
    sizes = [3000, 1024, 1025, 5000, 2048, 999, 4096]
    args = (sizes, [0.01] * len(sizes), RULES[0], 2, 11)
    batched = _sends(*args, batched=True)
    assert launched["dgc_multi_fused_kernel"] == launched["dgc_multi_sample_kernel"] == 2 * 2  # two batches a send
    assert launched["dgc_fused_kernel"] == 2  # the seventh, alone, each send
    _assert_same(batched, _sends(*args, batched=False))


def test_a_sample_far_larger_than_the_others_starts_alone():
    """The batch pads every tensor's sample to the largest: one tensor whose sample dwarfs the rest starts alone (the
    others still batched), so the padded matrix stays within ``PADDING`` times the samples, and within the tensors'
    elements whatever the run's ``sample_rate``."""

    def fitting(counts, members, sizes=None):
        return dgc_batch._fitting(counts, sizes or [100 * c for c in counts], members)

    counts = [50] * 20 + [2**22]  # 21 rows of 2**22 against 2**22 + 1,000 samples
    assert fitting(counts, list(range(10, 31))) == list(range(10, 30))
    assert fitting([50, 60, 70, 2**22], [0, 1, 2, 3]) == [0, 1, 2, 3]  # 4 rows: within 8 times
    many = [4096] * 50 + [2**20] + [4096] * 50  # 101 x 2**20 padded > 8 x (2**20 + 100 x 4096): the large leaves
    kept = fitting(many, list(range(101)))
    assert kept == [i for i in range(101) if i != 50]
    # sample_rate = 1 (every element sampled): the matrix holds no more values than the batch's tensors
    whole = [2**20] + [4096] * 50
    kept = fitting(whole, list(range(51)), sizes=whole)
    assert kept == list(range(1, 51)) and len(kept) * 4096 <= sum(whole[i] for i in kept)
    # above the floor the elements bound holds where 8 times the samples would not: 21 x 2**22 padded is under 8 x
    # the 14.7M samples, over the 14.7M elements
    large = [2**22] + [2**19] * 20
    kept = fitting(large, list(range(21)), sizes=large)
    assert kept == list(range(1, 21))
    # a small model sampled whole (as ResNet-18's small tensors are) stays one batch: its matrix is under the floor
    tiny = [9216] * 3 + [2304, 4608] * 5 + [64] * 8
    assert fitting(tiny, list(range(21)), sizes=tiny) == list(range(21))
    assert 21 * 9216 > sum(tiny)  # (over its elements, so an elements bound without the floor would split it)

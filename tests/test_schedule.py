"""Sparsity warm-up: the paper's exponential sequence, stage boundaries, no-warm-up and other final densities."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fedcomp.compressors.schedule import WarmupSchedule

PAPER = [0.25, 0.0625, 0.015625, 0.00390625]


def test_paper_sequence_one_stage_per_epoch():
    s = WarmupSchedule(0.001, warmup_epochs=4)
    assert s.stages == tuple(PAPER)
    assert [s.density(e) for e in range(6)] == PAPER + [0.001, 0.001]
    # sparsity 75%, 93.75%, 98.4375%, 99.6% (rounded as the paper writes it), then 99.9%
    assert [round(1 - s.density(e), 4) for e in range(5)] == [0.75, 0.9375, 0.9844, 0.9961, 0.999]


def test_stage_boundaries_spread_over_warmup():
    s = WarmupSchedule(0.001, warmup_epochs=8)  # 4 stages, 2 epochs each
    assert s.density(0) == 0.25 and s.density(1.999) == 0.25
    assert s.density(2) == 0.0625 and s.density(3.5) == 0.0625
    assert s.density(4) == 0.015625
    assert s.density(6) == 0.00390625 and s.density(7.999) == 0.00390625
    assert s.density(8) == 0.001 and s.density(1000) == 0.001


def test_fractional_rounds():
    s = WarmupSchedule(0.001, warmup_epochs=1)  # e.g. one epoch of a 164-epoch run, fed in fractions
    got = [s.density(e) for e in (0.0, 0.24, 0.25, 0.5, 0.75, 0.99, 1.0)]
    assert got == [0.25, 0.25, 0.0625, 0.015625, 0.00390625, 0.00390625, 0.001]


def test_no_warmup():
    s = WarmupSchedule(0.001, warmup_epochs=0)
    assert s.stages == ()
    assert all(s.density(e) == 0.001 for e in (0, 0.5, 3, 100))


@pytest.mark.parametrize(
    ("final", "stages"),
    [
        (0.01, [0.25, 0.0625, 0.015625]),
        (0.0625, [0.25]),  # 0.0625 itself is the final density, not a warm-up stage
        (0.1, [0.25]),
        (0.3, []),
        (1.0, []),
        (1e-4, [0.25, 0.0625, 0.015625, 0.00390625, 0.0009765625, 0.000244140625]),
    ],
)
def test_other_final_densities(final, stages):
    s = WarmupSchedule(final, warmup_epochs=len(stages) or 1)
    assert list(s.stages) == stages
    assert [s.density(e) for e in range(len(stages))] == stages
    assert s.density(len(stages) or 1) == final


@settings(max_examples=200, deadline=None)
@given(
    final=st.floats(1e-6, 1.0),
    warmup=st.floats(0.0, 50.0),
    e1=st.floats(0.0, 100.0),
    e2=st.floats(0.0, 100.0),
)
def test_density_never_increases_and_never_below_final(final, warmup, e1, e2):
    s = WarmupSchedule(final, warmup_epochs=warmup)
    lo, hi = sorted((e1, e2))
    assert s.density(hi) <= s.density(lo)
    assert s.density(lo) >= final
    assert s.density(max(warmup, hi)) == final


def test_rejects_bad_arguments():
    with pytest.raises(ValueError):
        WarmupSchedule(0.0)
    with pytest.raises(ValueError):
        WarmupSchedule(0.001, warmup_epochs=-1)

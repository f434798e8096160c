"""What ``Pipeline.send`` takes, for every registered compressor and the composed ones: tensors in any memory
layout (a channels-last convolution's gradient, a transposed view) are sent as their contiguous copies would be;
an update that lacks a tensor of the spec or holds one of another shape, or holds a magnitude of 2**64 or more, is
refused before anything changes; and below that bound no compressor overflows, however its memory adds up."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fedcomp.client.pipeline import MAX_MAGNITUDE, NonFiniteUpdate, UpdateMismatch, build
from fedcomp.compressors.base import COMPRESSORS
from fedcomp.spec import ModelSpec
from fedcomp.wire import decode

SPEC = ModelSpec((("conv", (16, 8, 3, 3)), ("w", (64, 40)), ("b", (40,)), ("s", ())))
NAMES = [*COMPRESSORS.names(), "dgc+int8", "dgc+int4", "topk+int8", "topk+sign", "randomk+ternary", "topk+qsgd"]
SPARSE = ("dgc", "topk", "randomk")


def pipeline(name: str):
    return build(name, SPEC, **({"density": 0.05} if name.split("+")[0] in SPARSE else {}))


def grads(seed: int, scale: float = 1.0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {n: (torch.rand(s, generator=g) * 2 - 1) * scale for n, s in SPEC.entries}


def strided(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The same values in other layouts: the conv weight channels-last, the matrix a transposed view."""
    return {"conv": tensors["conv"].to(memory_format=torch.channels_last), "w": tensors["w"].T.contiguous().T,
            "b": tensors["b"][None].expand(2, -1)[0], "s": tensors["s"]}


@pytest.mark.parametrize("name", NAMES)
def test_tensors_in_any_layout_are_sent_as_their_contiguous_copies(name):
    """The residual memory viewed its input flat: a channels-last gradient raised mid-step, after the tensors
    before it had given their mass to the memory (lost: no update pending held it)."""
    plain, other = pipeline(name), pipeline(name)
    for seed in range(3):
        x = grads(seed)
        assert not strided(x)["conv"].is_contiguous() and not strided(x)["w"].is_contiguous()
        assert other.send(strided(x)) == plain.send(x)
    other.nack(2)
    plain.nack(2)
    assert other.send(strided(grads(9))) == plain.send(grads(9))


@pytest.mark.parametrize("name", ["topk", "dgc+int8", "int8", "identity"])
@pytest.mark.parametrize("case", ["missing", "shape", "numel-alike"])
def test_an_update_that_does_not_fit_the_spec_is_refused_and_changes_nothing(name, case):
    refused, twin = pipeline(name), pipeline(name)
    for pipe in (refused, twin):
        pipe.send(grads(1))
    bad = grads(2)
    if case == "missing":
        del bad["w"]
    elif case == "shape":
        bad["b"] = torch.ones(41)
    else:
        bad["w"] = bad["w"].reshape(40, 64)
    with pytest.raises(UpdateMismatch, match="refused, the client's state is unchanged"):
        refused.send(bad)
    assert refused.last_seq == 1 and sorted(refused.pending) == [1]
    assert refused.send(grads(3)) == twin.send(grads(3))


@pytest.mark.parametrize("name", ["topk", "dgc+int8", "lowrank", "fp16"])
def test_a_magnitude_of_2_to_the_64_is_refused_and_changes_nothing(name):
    refused, twin = pipeline(name), pipeline(name)
    for pipe in (refused, twin):
        pipe.send(grads(1))
    bad = grads(2)
    bad["w"][3, 5] = -MAX_MAGNITUDE
    with pytest.raises(NonFiniteUpdate, match=r"\['w'\]"):
        refused.send(bad)
    assert refused.send(grads(3)) == twin.send(grads(3))


@pytest.mark.parametrize("name", NAMES)
@settings(max_examples=4, deadline=None)
@given(scale=st.sampled_from([1e18, 9e18, 1.8e19]), seed=st.integers(0, 1000))
def test_below_the_bound_no_step_overflows_however_the_memory_adds_up(name, scale, seed):
    """Six sends at up to 1.8e19, every other one nacked back into the memory: each payload decodes to finite
    values and every residual stays finite (``lowrank`` squared its column norms in float32 and kept an unscaled
    warm start, so a residual of 3.6e19 met a factor of 1e20 and its scales became Inf)."""
    pipe = pipeline(name)
    for step in range(6):
        x = grads(seed + step, scale)
        x["w"][0, 0] = scale
        update = decode(pipe.send(x), SPEC)
        assert all(bool(torch.isfinite(update.tensors[n].to_dense()).all()) for n in SPEC.names), step
        residuals = [pipe.residual_of(n) for n in SPEC.names]
        assert all(r is None or bool(torch.isfinite(r).all()) for r in residuals), step
        if step % 2:
            pipe.nack(pipe.last_seq)

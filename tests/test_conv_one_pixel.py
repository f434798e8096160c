"""``fedcomp.task.models.Conv2d``: a one-pixel output computed as one matrix product gives ``nn.Conv2d``'s output
and gradients (to float rounding), and the ``resnet`` family's last stage on 8x8 inputs takes that path."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from fedcomp.task import models
from fedcomp.task.models import Conv2d, build_model


def _pair(conv: Conv2d, x: torch.Tensor) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Output, input grad and weight (and bias) grads of ``conv`` and of ``nn.Conv2d``'s kernel, same weights."""
    ref = nn.Conv2d(conv.in_channels, conv.out_channels, conv.kernel_size, conv.stride, conv.padding,
                    bias=conv.bias is not None)
    ref.load_state_dict(conv.state_dict())
    outs = []
    for layer in (conv, ref):
        xi = x.clone().requires_grad_(True)
        y = layer(xi)
        (y * torch.linspace(-1, 1, y.numel()).reshape(y.shape)).sum().backward()
        outs.append([y.detach(), xi.grad] + [p.grad for p in layer.parameters()])
    return outs[0], outs[1]


@settings(max_examples=60, deadline=None)
@given(
    cin=st.integers(1, 5), cout=st.integers(1, 5), k=st.sampled_from([1, 2, 3, 5]), stride=st.integers(1, 3),
    padding=st.integers(0, 2), h=st.integers(1, 4), w=st.integers(1, 4), bias=st.booleans(), seed=st.integers(0, 99),
)
def test_same_output_and_grads_as_nn_conv2d(cin, cout, k, stride, padding, h, w, bias, seed):
    if h + 2 * padding < k or w + 2 * padding < k:
        return  # no output at all: nn.Conv2d refuses such an input too
    torch.manual_seed(seed)
    conv = Conv2d(cin, cout, k, stride=stride, padding=padding, bias=bias)
    fast, ref = _pair(conv, torch.randn(3, cin, h, w))
    assert len(fast) == len(ref)
    for a, b in zip(fast, ref, strict=True):
        assert a.shape == b.shape
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_unused_taps_get_zero_gradient():
    conv = Conv2d(3, 4, 3, padding=1, bias=False)
    x = torch.randn(2, 3, 1, 1)
    conv(x).sum().backward()
    grad = conv.weight.grad
    assert grad is not None and grad[:, :, 1, 1].abs().sum() > 0
    mask = torch.ones(3, 3, dtype=torch.bool)
    mask[1, 1] = False
    assert torch.count_nonzero(grad[:, :, mask]) == 0


def test_resnet_last_stage_takes_the_product_path(monkeypatch):
    calls = []
    real = models._one_pixel_taps

    def spy(conv, x):
        out = real(conv, x)
        calls.append((tuple(x.shape[-2:]), out))
        return out

    monkeypatch.setattr(models, "_one_pixel_taps", spy)
    model = build_model("resnet-1m", (1, 8, 8), 10, seed=0, norm="group")
    model(torch.randn(2, 1, 8, 8)).sum().backward()
    taken = [shape for shape, out in calls if out is not None]
    # stage 4: conv1 and the projection read the 2x2 map, conv2 the 1x1 map; the 8x8/4x4/2x2 stages keep the kernel
    assert sorted(taken) == [(1, 1), (2, 2), (2, 2)]
    assert len(calls) == 11


def test_other_cases_keep_the_kernel():
    x = torch.randn(2, 3, 1, 1)
    assert models._one_pixel_taps(Conv2d(3, 3, 3, padding=1, groups=3), x) is None
    assert models._one_pixel_taps(Conv2d(3, 3, 3, padding=1, dilation=2), x) is None
    assert models._one_pixel_taps(Conv2d(3, 3, 3, padding=1, padding_mode="reflect"), torch.randn(2, 3, 2, 2)) is None
    assert models._one_pixel_taps(Conv2d(3, 3, 3, padding=1), torch.randn(2, 3, 4, 4)) is None
    assert models._one_pixel_taps(Conv2d(3, 3, 3, padding=1), torch.randn(3, 1, 1)) is None  # unbatched
    assert models._one_pixel_taps(Conv2d(3, 3, 3, padding=1), x) == (1, 1)

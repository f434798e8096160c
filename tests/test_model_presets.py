"""Size presets of the ResNet family and option values given as text (issue 12, part 3)."""

from __future__ import annotations

import hashlib

import pytest
import torch

from fedcomp.registry import ConfigError
from fedcomp.spec import ModelSpec
from fedcomp.task.models import MODELS, RESNET_STAGES, build_model, num_parameters

CIFAR = (3, 32, 32)
DIGITS = (1, 8, 8)


def resnet_count(c_in: int, classes: int, depth: int, width: int) -> int:
    """Parameters of the ``resnet`` family from its architecture: 3x3 convs without bias, 2 affine parameters per
    norm channel, a 1x1 projection + norm where a block changes shape, a linear classifier."""
    conv3 = lambda a, b: 9 * a * b  # noqa: E731
    total = conv3(c_in, width) + 2 * width  # stem + norm
    cin = width
    for i, blocks in enumerate(RESNET_STAGES[depth]):
        cout = width * 2**i
        for j in range(blocks):
            a = cin if j == 0 else cout
            total += conv3(a, cout) + 2 * cout + conv3(cout, cout) + 2 * cout
            if a != cout or (i > 0 and j == 0):
                total += a * cout + 2 * cout
        cin = cout
    return total + cin * classes + classes


@pytest.mark.parametrize(
    "name, depth, width, expected",
    [("resnet-1m", 10, 32, 1_228_970), ("resnet18", 18, 64, 11_173_962), ("resnet-25m", 18, 96, 25_129_066)],
)
def test_preset_parameter_counts(name, depth, width, expected):
    model = build_model(name, CIFAR, 10)
    assert (model.config.depth, model.config.width) == (depth, width)
    assert num_parameters(model) == resnet_count(3, 10, depth, width) == expected
    spec = ModelSpec.from_module(model)
    assert spec.total_numel == expected and spec.dense_bytes == 4 * expected
    # same architecture as the family with the preset's options
    assert num_parameters(build_model("resnet", CIFAR, 10, depth=depth, width=width)) == expected
    # the 1-channel 8x8 stem has 2 x 9 x width fewer weights
    assert num_parameters(build_model(name, DIGITS, 10)) == expected - 18 * width


def test_preset_sizes_are_the_documented_ones():
    sizes = {n: num_parameters(build_model(n, CIFAR, 10)) for n in ("resnet-1m", "resnet18", "resnet-25m")}
    assert 1.1e6 <= sizes["resnet-1m"] <= 1.3e6
    assert 10.5e6 <= sizes["resnet18"] <= 11.5e6
    assert 24e6 <= sizes["resnet-25m"] <= 26e6


@pytest.mark.parametrize("depth", sorted(RESNET_STAGES))
def test_family_depths_count_and_run(depth):
    model = build_model("resnet", DIGITS, 10, depth=depth, width=8, seed=0)
    assert num_parameters(model) == resnet_count(1, 10, depth, 8)
    out = model(torch.randn(2, *DIGITS))
    assert out.shape == (2, 10)
    out.sum().backward()
    assert all(p.grad is not None for p in model.parameters())


def test_presets_run_on_8x8_and_32x32():
    for shape in (DIGITS, CIFAR):
        model = build_model("resnet-1m", shape, 10, seed=0)
        assert model(torch.randn(2, *shape)).shape == (2, 10)


def test_presets_and_family_registered():
    assert {"mlp", "cnn", "resnet20", "resnet", "resnet-1m", "resnet18", "resnet-25m"} <= set(MODELS.names())


def test_presets_seeded_init_reproducible():
    a = build_model("resnet-1m", DIGITS, seed=3)
    b = build_model("resnet-1m", DIGITS, seed=3)
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters(), strict=True))


def _digest(model: torch.nn.Module) -> str:
    h = hashlib.sha256()
    for k, t in model.state_dict().items():
        h.update(k.encode())
        h.update(t.detach().contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


@pytest.mark.parametrize(
    "name, shape, digest",
    [
        ("mlp", DIGITS, "be65c26e2a9b346e"),
        ("cnn", DIGITS, "6116a9f600e34d8e"),
        ("resnet20", CIFAR, "e1235803eeceb97c"),
        ("resnet20", DIGITS, "b9c44b6bc84d760e"),
    ],
)
def test_existing_models_seeded_identical(name, shape, digest):
    # digests of build_model(name, shape, 10, seed=0) taken before the size options were added (torch 2.13.0)
    assert _digest(build_model(name, shape, 10, seed=0)) == digest


@pytest.mark.parametrize("hidden", ["1024,1024", "1024x1024", "(1024, 1024)", " 1024 1024 ", (1024, 1024),
                                   [1024.0, "1024"]])
def test_mlp_hidden_as_text_or_tuple(hidden):
    model = build_model("mlp", DIGITS, 10, hidden=hidden)
    assert model.config.hidden == (1024, 1024)
    assert num_parameters(model) == 64 * 1024 + 1024 + 1024 * 1024 + 1024 + 1024 * 10 + 10 == 1_126_410


def test_single_hidden_and_linear_mlp():
    assert build_model("mlp", DIGITS, hidden=256).config.hidden == (256,)
    assert build_model("mlp", DIGITS, hidden="256").config.hidden == (256,)
    assert num_parameters(build_model("mlp", DIGITS, hidden="")) == 64 * 10 + 10


def test_integer_options_as_text():
    m = build_model("resnet", DIGITS, 10, depth="10", width="8")
    assert (m.config.depth, m.config.width) == (10, 8)
    r = build_model("resnet20", DIGITS, 10, depth=20.0, width="16", seed=0)
    assert _digest(r) == "b9c44b6bc84d760e"
    assert build_model("cnn", DIGITS, width="8", dropout="0.5").config.width == 8
    assert build_model("resnet20", CIFAR, width=32).fc.in_features == 128


@pytest.mark.parametrize(
    "name, options",
    [
        ("mlp", {"hidden": "1024,abc"}),
        ("mlp", {"hidden": "1024,0"}),
        ("mlp", {"hidden": 1.5}),
        ("mlp", {"hidden": True}),
        ("resnet", {"depth": 20}),
        ("resnet", {"depth": "18.5"}),
        ("resnet", {"width": 0}),
        ("resnet", {"width": float("inf")}),
        ("resnet", {"norm": "layer"}),
        ("resnet18", {"shortcut": "A"}),
        ("resnet20", {"width": "wide"}),
        ("cnn", {"dropout": "much"}),
    ],
)
def test_bad_option_values(name, options):
    with pytest.raises(ConfigError):
        build_model(name, DIGITS, **options)

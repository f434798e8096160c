"""Models: shapes, parameter counts, seeded init, forward/backward, option validation."""

from __future__ import annotations

import pytest
import torch

from fedcomp.registry import ConfigError
from fedcomp.spec import ModelSpec
from fedcomp.task.models import MODELS, build_model, num_parameters

DIGITS = (1, 8, 8)
CIFAR = (3, 32, 32)


def test_registry_names():
    assert {"mlp", "cnn", "resnet20", "cnn1d"} <= set(MODELS.names())


@pytest.mark.parametrize(
    "name, in_shape, lo, hi",
    [
        ("mlp", DIGITS, 5_000, 20_000),
        ("cnn", DIGITS, 10_000, 100_000),
        ("cnn", CIFAR, 10_000, 100_000),
        ("resnet20", DIGITS, 260_000, 280_000),
        ("resnet20", CIFAR, 265_000, 275_000),
    ],
)
def test_forward_backward_and_size(name, in_shape, lo, hi):
    model = build_model(name, in_shape=in_shape, num_classes=10, seed=0)
    assert lo <= num_parameters(model) <= hi
    x = torch.randn(5, *in_shape)
    y = torch.randint(0, 10, (5,))
    out = model(x)
    assert out.shape == (5, 10) and out.dtype == torch.float32
    torch.nn.functional.cross_entropy(out, y).backward()
    for n, p in model.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), n
    assert any(p.grad.abs().sum() > 0 for p in model.parameters())


def test_resnet20_exact_count_and_shortcuts():
    # He et al. 2016: ResNet-20 has 0.27M parameters; option A shortcuts add none.
    assert num_parameters(build_model("resnet20", CIFAR)) == 269_722
    b = num_parameters(build_model("resnet20", CIFAR, shortcut="B"))
    assert b == 269_722 + (16 * 32 + 2 * 32) + (32 * 64 + 2 * 64)
    assert num_parameters(build_model("resnet20", CIFAR, norm="group")) == 269_722
    assert not any(isinstance(m, torch.nn.BatchNorm2d) for m in build_model("resnet20", CIFAR, norm="group").modules())
    deeper = build_model("resnet20", CIFAR, depth=32)
    assert num_parameters(deeper) > 269_722
    # odd spatial size: option-A subsampling matches the strided conv
    assert build_model("resnet20", (3, 7, 7))(torch.randn(2, 3, 7, 7)).shape == (2, 10)


def test_num_classes_and_other_sizes():
    for name in ("mlp", "cnn", "resnet20"):
        m = build_model(name, in_shape=(2, 12, 10), num_classes=3)
        assert m(torch.randn(2, 2, 12, 10)).shape == (2, 3)


@pytest.mark.parametrize("name", ["mlp", "cnn", "resnet20"])
def test_seeded_init_reproducible(name):
    torch.manual_seed(123)
    a = build_model(name, DIGITS)
    torch.manual_seed(123)
    b = build_model(name, DIGITS)
    c = build_model(name, DIGITS)  # RNG has moved on
    for (n, pa), pb in zip(a.state_dict().items(), b.state_dict().values(), strict=True):
        assert torch.equal(pa, pb), n
    assert any(not torch.equal(pa, pc) for pa, pc in zip(a.parameters(), c.parameters(), strict=True))


def test_seed_argument_leaves_global_rng_alone():
    torch.manual_seed(7)
    expected = torch.rand(3)
    torch.manual_seed(7)
    m1 = build_model("cnn", DIGITS, seed=5)
    assert torch.equal(torch.rand(3), expected)
    m2 = build_model("cnn", DIGITS, seed=5)
    assert all(torch.equal(p, q) for p, q in zip(m1.parameters(), m2.parameters(), strict=True))
    m3 = build_model("cnn", DIGITS, seed=6)
    assert not all(torch.equal(p, q) for p, q in zip(m1.parameters(), m3.parameters(), strict=True))


def test_spec_covers_parameters_not_bn_buffers():
    m = build_model("resnet20", CIFAR)
    spec = ModelSpec.from_module(m)
    assert spec.total_numel == num_parameters(m)
    assert not any("running" in n for n in spec.names)


@pytest.mark.parametrize(
    "name, options",
    [
        ("cnn", {"widht": 8}),
        ("resnet20", {"depth": 21}),
        ("resnet20", {"shortcut": "C"}),
        ("resnet20", {"norm": "layer"}),
        ("mlp", {"hidden": (0,)}),
        ("nope", {}),
    ],
)
def test_bad_options(name, options):
    with pytest.raises(ConfigError):
        build_model(name, DIGITS, **options)


def test_bad_shapes():
    with pytest.raises(ConfigError):
        build_model("cnn", in_shape=(8, 8))
    with pytest.raises(ConfigError):
        build_model("cnn", DIGITS, num_classes=1)


@pytest.fixture
def one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)  # small convs are faster single-threaded, and the CI box has 2 cores
    yield
    torch.set_num_threads(n)


@pytest.mark.parametrize("name", ["mlp", "cnn"])
def test_learns_digits(name, one_thread):
    from fedcomp.task.data import batches, load_dataset

    train, test = load_dataset("digits")
    torch.manual_seed(0)
    model = build_model(name, train.in_shape, train.num_classes)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    gen = torch.Generator().manual_seed(0)
    for _ in range(2):
        for xb, yb in batches(train.x, train.y, 32, generator=gen):
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(xb), yb).backward()
            opt.step()
    with torch.no_grad():
        accuracy = (model(test.x).argmax(1) == test.y).float().mean().item()
    assert accuracy > 0.8


# ------------------------------------------------------------------------------------------------ cnn1d

SIGNAL = (1, 1, 40)  # mnist1d


def test_cnn1d_size_forward_backward():
    model = build_model("cnn1d", SIGNAL, num_classes=10, seed=0)
    assert num_parameters(model) == 1_117_898 >= 1_000_000
    assert ModelSpec.from_module(model).total_numel == num_parameters(model)  # GroupNorm: no buffers left out
    x, y = torch.randn(6, *SIGNAL), torch.randint(0, 10, (6,))
    out = model(x)
    assert out.shape == (6, 10) and out.dtype == torch.float32
    torch.nn.functional.cross_entropy(out, y).backward()
    for n, p in model.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all() and p.grad.abs().sum() > 0, n


def test_cnn1d_other_lengths_channels_and_options():
    for shape in ((1, 1, 1), (1, 1, 7), (1, 1, 100), (3, 1, 40), (2, 3, 16)):
        assert build_model("cnn1d", shape, num_classes=4)(torch.randn(2, *shape)).shape == (2, 4), shape
    assert num_parameters(build_model("cnn1d", (1, 1, 100))) == 1_117_898  # the head does not grow with the length
    small = build_model("cnn1d", SIGNAL, width=8, hidden=16, norm="none")
    assert num_parameters(small) == (8 * 5 + 8) + (8 * 16 * 5 + 16) + (16 * 32 * 3 + 32) + (32 * 32 * 5 + 32) + (
        160 * 16 + 16
    ) + (16 * 10 + 10)
    assert any(isinstance(m, torch.nn.BatchNorm1d) for m in build_model("cnn1d", SIGNAL, norm="batch").modules())
    for bad in ({"norm": "layer"}, {"width": 0}, {"hidden": "x"}):
        with pytest.raises(ConfigError):
            build_model("cnn1d", SIGNAL, **bad)


def test_cnn1d_seeded_init_reproducible():
    a, b, c = (build_model("cnn1d", SIGNAL, seed=s) for s in (4, 4, 5))
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters(), strict=True))
    assert not all(torch.equal(p, q) for p, q in zip(a.parameters(), c.parameters(), strict=True))


def test_cnn1d_fits_a_batch_of_mnist1d(one_thread):
    from fedcomp.task.data import load_dataset

    train, _ = load_dataset("mnist1d", num_samples=200)
    x, y = train.x[:128], train.y[:128]
    model = build_model("cnn1d", train.in_shape, train.num_classes, seed=0)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    for _ in range(40):
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    with torch.no_grad():
        accuracy = (model(x).argmax(1) == y).float().mean().item()
    assert accuracy > 0.9  # 10 classes: a model that cannot learn stays near 0.1

"""Server optimizers: hand-computed steps, torch.optim cross-checks, FedAvg equivalence, state round trip."""

from __future__ import annotations

import math

import pytest
import torch

from fedcomp.registry import ConfigError
from fedcomp.server.optimizers import SERVER_OPTIMIZERS, build_server_optimizer


def _params(*values):
    return {"w": torch.tensor(values, dtype=torch.float32)}


def test_registry_names_and_defaults():
    assert {"sgd", "adam"} <= set(SERVER_OPTIMIZERS.names())
    sgd = build_server_optimizer("sgd").config
    assert (sgd.lr, sgd.momentum, sgd.nesterov) == (1.0, 0.0, False)
    adam = build_server_optimizer("adam").config
    assert (adam.beta1, adam.beta2, adam.eps, adam.bias_correction) == (0.9, 0.99, 1e-3, False)


def test_sgd_plain_step_by_hand():
    p = _params(1.0, 2.0)
    build_server_optimizer("sgd", lr=0.5).step(p, {"w": torch.tensor([0.5, -1.0])})
    assert p["w"].tolist() == [0.75, 2.5]


def test_sgd_default_is_fedavg_on_deltas():
    torch.manual_seed(0)
    old = {"a": torch.randn(3, 4), "b": torch.randn(5)}
    clients = [{k: v + torch.randn_like(v) for k, v in old.items()} for _ in range(4)]
    weights = [1.0, 2.0, 3.0, 4.0]
    pseudo = {k: sum(w * (old[k] - c[k]) for w, c in zip(weights, clients, strict=True)) / sum(weights) for k in old}
    params = {k: v.clone() for k, v in old.items()}
    build_server_optimizer("sgd").step(params, pseudo)
    for k in old:
        avg = sum(w * c[k] for w, c in zip(weights, clients, strict=True)) / sum(weights)
        torch.testing.assert_close(params[k], avg)


@pytest.mark.parametrize("nesterov, expected", [(False, [0.9, 0.71]), (True, [0.81, 0.539])])
def test_sgd_momentum_by_hand(nesterov, expected):
    p = _params(1.0)
    opt = build_server_optimizer("sgd", lr=0.1, momentum=0.9, nesterov=nesterov)
    got = []
    for _ in range(2):
        opt.step(p, {"w": torch.tensor([1.0])})
        got.append(p["w"].item())
    assert got == pytest.approx(expected, rel=1e-6)


@pytest.mark.parametrize("nesterov", [False, True])
def test_sgd_matches_torch_optim(nesterov):
    torch.manual_seed(1)
    w0 = torch.randn(7, 3)
    grads = [torch.randn(7, 3) for _ in range(5)]
    mine = {"w": w0.clone()}
    opt = build_server_optimizer("sgd", lr=0.3, momentum=0.8, nesterov=nesterov)
    ref = torch.nn.Parameter(w0.clone())
    tor = torch.optim.SGD([ref], lr=0.3, momentum=0.8, nesterov=nesterov)
    for g in grads:
        opt.step(mine, {"w": g})
        ref.grad = g.clone()
        tor.step()
    torch.testing.assert_close(mine["w"], ref.detach())


def _adaptive_reference(kind, gs, lr, b1, b2, eps, x0, bias_correction=False):
    """Scalar re-derivation of Reddi et al. (2021), Algorithm 2 (server side), with g = -Δ."""
    x, m, v = x0, 0.0, 0.0
    for t, g in enumerate(gs, start=1):
        m = b1 * m + (1 - b1) * g
        if kind == "adam":
            v = b2 * v + (1 - b2) * g * g
        elif kind == "yogi":
            v = v - (1 - b2) * g * g * math.copysign(1.0, v - g * g) * (v != g * g)
        else:
            v = v + g * g
        mh, vh = m, v
        if bias_correction:
            mh = m / (1 - b1**t)
            vh = v if kind == "adagrad" else v / (1 - b2**t)
        x = x - lr * mh / (math.sqrt(vh) + eps)
    return x


def test_fedadam_two_steps_by_hand():
    p = _params(1.0)
    opt = build_server_optimizer("adam", lr=0.1)
    opt.step(p, {"w": torch.tensor([2.0])})
    # m = 0.2, v = 0.04: x = 1 - 0.1 * 0.2 / (0.2 + 1e-3)
    assert p["w"].item() == pytest.approx(1 - 0.1 * 0.2 / 0.201, rel=1e-6)
    opt.step(p, {"w": torch.tensor([2.0])})
    # m = 0.38, v = 0.0796
    assert p["w"].item() == pytest.approx(1 - 0.1 * 0.2 / 0.201 - 0.1 * 0.38 / (math.sqrt(0.0796) + 1e-3), rel=1e-6)


@pytest.mark.parametrize("kind", ["adam", "yogi", "adagrad"])
@pytest.mark.parametrize("bias_correction", [False, True])
def test_adaptive_matches_scalar_reference(kind, bias_correction):
    gs = [2.0, -1.0, 0.3, 0.7, 3.0, -0.1]  # no exact v == g^2 ties (float32 vs float64 sign)
    x0 = 0.7
    p = _params(x0, x0)
    opt = build_server_optimizer(kind, lr=0.05, beta1=0.8, beta2=0.95, eps=1e-2, bias_correction=bias_correction)
    for g in gs:
        opt.step(p, {"w": torch.tensor([g, -g])})
    want = _adaptive_reference(kind, gs, 0.05, 0.8, 0.95, 1e-2, x0, bias_correction)
    want_neg = _adaptive_reference(kind, [-g for g in gs], 0.05, 0.8, 0.95, 1e-2, x0, bias_correction)
    assert p["w"].tolist() == pytest.approx([want, want_neg], rel=1e-5)


def test_yogi_second_moment_grows_additively():
    p = _params(0.0)
    opt = build_server_optimizer("yogi", beta2=0.9)
    opt.step(p, {"w": torch.tensor([2.0])})
    assert opt.state["v"]["w"].item() == pytest.approx(0.4)  # 0 + 0.1 * 4
    opt.step(p, {"w": torch.tensor([2.0])})
    assert opt.state["v"]["w"].item() == pytest.approx(0.8)  # v < g^2: v += 0.1 * g^2
    opt.step(p, {"w": torch.tensor([0.0])})
    assert opt.state["v"]["w"].item() == pytest.approx(0.8)  # g = 0 leaves v


def test_adam_with_bias_correction_matches_torch_adam():
    torch.manual_seed(2)
    w0 = torch.randn(4, 5)
    mine = {"w": w0.clone()}
    opt = build_server_optimizer("adam", lr=0.01, beta1=0.9, beta2=0.99, eps=1e-3, bias_correction=True)
    ref = torch.nn.Parameter(w0.clone())
    tor = torch.optim.Adam([ref], lr=0.01, betas=(0.9, 0.99), eps=1e-3)
    for _ in range(6):
        g = torch.randn(4, 5)
        opt.step(mine, {"w": g})
        ref.grad = g.clone()
        tor.step()
    torch.testing.assert_close(mine["w"], ref.detach())


@pytest.mark.parametrize(
    "name, options",
    [
        ("sgd", {"lr": 0.5, "momentum": 0.9, "nesterov": True}),
        ("sgd", {}),
        ("adam", {"lr": 0.03}),
        ("adam", {"lr": 0.03, "bias_correction": True}),
        ("yogi", {"lr": 0.03}),
        ("adagrad", {"lr": 0.03, "bias_correction": True}),
    ],
)
def test_state_dict_round_trip_continues_identically(name, options):
    torch.manual_seed(3)
    params = {"a": torch.randn(6, 2), "b": torch.randn(3)}
    grads = [{k: torch.randn_like(v) for k, v in params.items()} for _ in range(5)]
    opt = build_server_optimizer(name, **options)
    for g in grads[:3]:
        opt.step(params, g)
    saved, snapshot = opt.state_dict(), {k: v.clone() for k, v in params.items()}
    for g in grads[3:]:
        opt.step(params, g)
    # the saved state is a copy: later steps did not change it
    resumed = build_server_optimizer(name, **options)
    resumed.load_state_dict(saved)
    for g in grads[3:]:
        resumed.step(snapshot, g)
    assert resumed.steps == opt.steps == 5
    for k in params:
        assert torch.equal(params[k], snapshot[k]), k
    # loading copies: stepping the resumed optimizer does not touch the dict it was loaded from
    again = build_server_optimizer(name, **options)
    again.load_state_dict(saved)
    assert again.state_dict().keys() == saved.keys()


def test_fresh_optimizer_state_differs_from_resumed():
    params = _params(1.0)
    opt = build_server_optimizer("adam", lr=0.1)
    for _ in range(3):
        opt.step(params, {"w": torch.tensor([1.0])})
    a, b = _params(0.0), _params(0.0)
    resumed = build_server_optimizer("adam", lr=0.1)
    resumed.load_state_dict(opt.state_dict())
    resumed.step(a, {"w": torch.tensor([1.0])})
    build_server_optimizer("adam", lr=0.1).step(b, {"w": torch.tensor([1.0])})
    assert a["w"].item() != b["w"].item()  # state matters, so the round-trip test can fail


def test_subset_and_validation():
    params = {"a": torch.ones(2), "b": torch.ones(3)}
    opt = build_server_optimizer("adam", lr=0.1)
    opt.step(params, {"a": torch.ones(2)})
    assert torch.equal(params["b"], torch.ones(3)) and not torch.equal(params["a"], torch.ones(2))
    before = {k: v.clone() for k, v in params.items()}
    with pytest.raises(ValueError, match="'c'"):
        opt.step(params, {"a": torch.ones(2), "c": torch.ones(1)})
    with pytest.raises(ValueError, match="'b'.*shape"):
        opt.step(params, {"a": torch.ones(2), "b": torch.ones(2)})
    assert all(torch.equal(before[k], params[k]) for k in params)  # nothing applied
    assert opt.steps == 1


def test_in_place_on_model_parameters():
    model = torch.nn.Linear(3, 2)
    params = dict(model.named_parameters())
    before = model.weight.detach().clone()
    build_server_optimizer("sgd", lr=1.0).step(params, {"weight": torch.ones(2, 3)})
    torch.testing.assert_close(model.weight.detach(), before - 1)


@pytest.mark.parametrize(
    "name, options",
    [
        ("sgd", {"nesterov": True}),
        ("sgd", {"lr": -1.0}),
        ("sgd", {"momentum": 1.0}),
        ("adam", {"beta2": 1.0}),
        ("adam", {"eps": 0.0}),
        ("adam", {"lr": float("nan")}),
        ("adam", {"momentum": 0.9}),
        ("lamb", {}),
    ],
)
def test_bad_configs(name, options):
    with pytest.raises(ConfigError):
        build_server_optimizer(name, **options)

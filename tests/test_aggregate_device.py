"""The server's update buffer through the kernel path: ``SparseAccumulator`` with the Triton decode + scatter-add
(run here by Triton's interpreter) sums exactly what the reference does, and ``aggregate-device`` is validated."""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

triton = pytest.importorskip("triton", reason="triton not installed")

import fedcomp.server.aggregate as aggregate_module  # noqa: E402
from fedcomp.client.pipeline import build  # noqa: E402
from fedcomp.protocol import ProtocolConfig  # noqa: E402
from fedcomp.registry import ConfigError  # noqa: E402
from fedcomp.server.aggregate import SparseAccumulator  # noqa: E402
from fedcomp.spec import ModelSpec  # noqa: E402
from fedcomp.wire import decode  # noqa: E402

SPEC = ModelSpec((("conv", (16, 8, 3, 3)), ("fc", (40, 64)), ("bias", (40,))))
COMPRESSORS = ["dgc", "dgc+int8", "topk+int4", "int8", "sign", "fp16", "identity"]


def updates(compressor: str, seed: int, count: int):
    """``count`` decoded updates of random gradients through a real pipeline (what the server receives)."""
    gen = torch.Generator().manual_seed(seed)
    opts = {"density": 0.05} if compressor.split("+")[0] in ("dgc", "topk") else {}
    pipe = build(compressor, SPEC, **opts)
    out = []
    for _ in range(count):
        grads = {name: torch.randn(shape, generator=gen) for name, shape in SPEC.entries}
        out.append(decode(pipe.send(grads), SPEC))
    return out


@settings(max_examples=10, deadline=None)
@given(compressor=st.sampled_from(COMPRESSORS), seed=st.integers(0, 2**16),
       weights=st.lists(st.floats(0.01, 4.0, allow_nan=False), min_size=1, max_size=4))
def test_kernel_buffer_equals_reference(compressor, seed, weights):
    ups = updates(compressor, seed, len(weights))
    ref, got = SparseAccumulator(SPEC, backend="torch"), SparseAccumulator(SPEC, backend="triton")
    for u, w in zip(ups, weights, strict=True):
        ref.add(u, weight=w)
        got.add(u, weight=w)
    for normalize in ("weights", "sum", "count"):
        r, g = ref.result(normalize), got.result(normalize)
        for name in SPEC.names:
            # sparse: the same single rounding per add; dense: fma vs mul-then-add, at most 1 ulp per add
            torch.testing.assert_close(g[name], r[name], rtol=1e-6, atol=1e-6)


def test_the_accumulator_goes_through_the_kernel(monkeypatch):
    calls = []
    real = aggregate_module.scatter_add

    def spy(target, payload, weight=1.0, *, backend=None):
        calls.append(backend)
        real(target, payload, weight, backend=backend)

    monkeypatch.setattr(aggregate_module, "scatter_add", spy)
    acc = SparseAccumulator(SPEC, backend="triton")
    acc.add(updates("dgc", 0, 1)[0], weight=0.5)
    assert calls == ["triton"] * len(SPEC.names)
    assert acc.buffers["fc"].device == torch.device("cpu")


@pytest.mark.parametrize("device, message", [
    ("tpu", "aggregate_device must be"),
    ("not a device", "aggregate_device must be"),
    pytest.param("cuda", "no CUDA device", marks=pytest.mark.skipif(torch.cuda.is_available(), reason="has CUDA")),
])
def test_bad_aggregate_device_is_a_config_error(device, message):
    with pytest.raises(ConfigError, match=message):
        ProtocolConfig(aggregate_device=device)


def test_protocol_puts_the_buffer_on_aggregate_device():
    from fedcomp.server import ServerProtocol
    from fedcomp.server.optimizers import SERVER_OPTIMIZERS
    from fedcomp.server.staleness import STALENESS

    params = {name: torch.zeros(shape) for name, shape in SPEC.entries}
    proto = ServerProtocol(SPEC, params, SERVER_OPTIMIZERS.build("sgd", lr=1.0), STALENESS.build("constant"),
                           ProtocolConfig(buffer_size=1, aggregate_device="cpu:0"))
    assert proto.accumulator.device == torch.device("cpu:0")  # the config's device, not the default "cpu"


def test_buffers_and_result_live_on_the_accumulator_device():
    """CPU-decoded payloads are added into buffers on another device (``meta`` here: shape-only, no GPU needed)."""
    acc = SparseAccumulator(SPEC, device="meta")
    for compressor in ("dgc", "dgc+int8", "fp16"):
        acc.add(updates(compressor, 1, 1)[0], weight=0.5)
    result = acc.result("sum")
    assert {t.device.type for t in [*acc.buffers.values(), *result.values()]} == {"meta"}
    assert {name: tuple(t.shape) for name, t in result.items()} == dict(SPEC.entries)

"""Compressors keep the payload on the device of the tensor they compress (a GPU client's update never hops to
the CPU inside a compressor). Checked without a GPU on PyTorch's ``meta`` device, which runs every shape-only op:
a tensor created on the CPU by mistake shows up as a ``cpu`` device here."""

from __future__ import annotations

import pytest
import torch

from fedcomp.compressors.base import COMPRESSORS

# DGC's selection reads counts from the data (``.item()``), which meta tensors do not have; its device path is
# checked against the reference by tests/test_client_device.py and benchmarks/check_kernels.py.
DATA_DEPENDENT = {"dgc"}


@pytest.mark.parametrize("name", sorted(set(COMPRESSORS.names()) - DATA_DEPENDENT))
@pytest.mark.parametrize("shape", [(64, 64), (3000,)])
def test_payload_stays_on_the_tensors_device(name, shape):
    payload = COMPRESSORS.build(name).compress(torch.empty(shape, device="meta"), "w")
    v = payload.values
    tensors = {"values": v.data, "indices": payload.indices, "scales": v.scales}
    assert {k: t.device.type for k, t in tensors.items() if t is not None} == {
        k: "meta" for k, t in tensors.items() if t is not None
    }


def test_every_compressor_but_the_data_dependent_ones_is_covered():
    assert DATA_DEPENDENT < set(COMPRESSORS.names())

"""fedcomp: compressed federated training over slow, unreliable links.

The documented path (README, "Python API")::

    spec = fedcomp.ModelSpec.from_module(model)
    pipe = fedcomp.build("dgc", spec, density=0.001)
    blob = pipe.send({n: p.grad for n, p in model.named_parameters()}, base_version=0)
    update = fedcomp.decode(blob, spec)            # validates; raises WireError
    acc = fedcomp.SparseAccumulator(spec); acc.add(update, weight=1.0)

This package never imports Flower.
"""

from fedcomp import compressors, memory  # noqa: F401  (registers the built-ins)
from fedcomp.client.pipeline import Pipeline, build, build_compressor
from fedcomp.compressors.base import COMPRESSORS
from fedcomp.memory.base import MEMORIES
from fedcomp.payload import TensorPayload, Update, ValueCoding, Values
from fedcomp.registry import ConfigError
from fedcomp.server.aggregate import SparseAccumulator
from fedcomp.spec import ModelSpec
from fedcomp.wire import WireError, decode, encode

__version__ = "0.1.0"

__all__ = [
    "COMPRESSORS",
    "MEMORIES",
    "ConfigError",
    "ModelSpec",
    "Pipeline",
    "SparseAccumulator",
    "TensorPayload",
    "Update",
    "ValueCoding",
    "Values",
    "WireError",
    "build",
    "build_compressor",
    "decode",
    "encode",
]

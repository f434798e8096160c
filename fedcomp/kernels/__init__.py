"""GPU kernel path: fused Triton kernels for the DGC step, quantize-and-pack with error feedback and the server's
scatter-add, each with the contract of the torch reference it replaces, and the wire encode of a whole update on
the device (the bytes of ``fedcomp.wire.encode``; see docs/kernels.md).

CUDA tensors take the Triton kernels, CPU tensors the torch reference (``backend=`` overrides). Importing this
package never imports triton: the kernel modules are loaded on the first Triton call.
"""

from fedcomp.kernels._backend import interpreting, resolve, triton_available
from fedcomp.kernels._dgc_select import DGCStep
from fedcomp.kernels.dgc import fused_dgc_step
from fedcomp.kernels.encode import device_encode, encode_update
from fedcomp.kernels.hooks import fused_send
from fedcomp.kernels.quant import Quantized, ef_quantize, pack_codes
from fedcomp.kernels.scatter import scatter_add

__all__ = [
    "DGCStep",
    "Quantized",
    "device_encode",
    "ef_quantize",
    "encode_update",
    "fused_dgc_step",
    "fused_send",
    "interpreting",
    "pack_codes",
    "resolve",
    "scatter_add",
    "triton_available",
]

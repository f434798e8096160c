"""The Grid transport of the product's ServerApp: ``fedcomp.flower.transport.GridTransport`` (it lives in the
Flower adapter, where ``Compressed(..., mode="async")`` uses it too)."""

from fedcomp.flower.transport import ERROR_NAMES, GridTransport

__all__ = ["ERROR_NAMES", "GridTransport"]

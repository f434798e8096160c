"""fedcomp on Flower: the one part of fedcomp that imports ``flwr``.

Two lines add compressed updates with error feedback to any Flower app::

    from fedcomp.flower import Compressed, compression_mod

    app = ClientApp(mods=[compression_mod])                           # client: no arguments
    strategy = Compressed(FedAvg(), compressor="dgc+int8", density=0.01)   # server: wraps any strategy
    strategy = Compressed(FedAvg(), "dgc+int8", density=0.01, mode="async", buffer_size=2, max_staleness=4)
                                                                       # or: async (FedBuff), asyncmode.py

The pieces the product's own apps are built from live here too: ``records`` (message layout), ``config``
(run/node config, ``Compression``), ``session`` (a node's error-feedback state, sequence numbers, pending
updates, acks/nacks, replica), ``transport`` (the Grid transport of the async loop), ``processes`` and ``cli``
(launcher helpers).
"""

from fedcomp.flower.config import Compression, NodeConfig, RunConfig
from fedcomp.flower.grid import PromptGrid
from fedcomp.flower.mod import compression_mod
from fedcomp.flower.session import ClientSession
from fedcomp.flower.strategy import Compressed

__all__ = [
    "ClientSession",
    "Compressed",
    "Compression",
    "NodeConfig",
    "PromptGrid",
    "RunConfig",
    "compression_mod",
]

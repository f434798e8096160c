"""fedcomp on Flower: the one part of fedcomp that imports ``flwr``.

Two lines add compressed updates with error feedback to any Flower app::

    from fedcomp.flower import Compressed, compression_mod

    app = ClientApp(mods=[compression_mod])                           # client: no arguments
    strategy = Compressed(FedAvg(), compressor="dgc+int8", density=0.01)   # server: wraps any strategy
    strategy = Compressed(FedAvg(), "dgc+int8", density=0.01, mode="async", buffer_size=2, max_staleness=4)
                                                                       # or: async (FedBuff), loopmode.py
    strategy = Compressed(FedAvg(), "dgc+int8", density=0.01, loop="fedcomp", over_selection=0.3)
                                                                       # or: sync rounds on fedcomp's loop

The adapter's other pieces, which the product's own apps use too: ``records`` (message layout), ``session`` (a
node's error-feedback state, sequence numbers, pending updates, acks/nacks, replica), ``transport`` (the Grid
transport of fedcomp's loops). The run and node config (``RunConfig``, ``NodeConfig``; ``Compression``, re-exported
here) are ``fedcomp.task.config``; the launchers' process helpers ``fedcomp.tools.processes``.
"""

from fedcomp.flower.grid import PromptGrid
from fedcomp.flower.mod import compression_mod, current_task, hand_update
from fedcomp.flower.session import ClientSession
from fedcomp.flower.strategy import Compressed
from fedcomp.task.config import Compression

__all__ = [
    "ClientSession",
    "Compressed",
    "Compression",
    "PromptGrid",
    "compression_mod",
    "current_task",
    "hand_update",
]

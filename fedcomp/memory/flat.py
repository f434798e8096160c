"""A memory's per-name state tensors of a group of names kept as views of one flat buffer per kind, so a step over the
whole group (``fedcomp.kernels.group``) is a few ops on the buffers instead of a few per name.

``FlatState.bind(stores, names, cached)`` rebinds ``store[name]`` of every store (DGC: ``velocities`` and
``momentums``; plain error feedback: ``errors``) to a view of that store's buffer, copying what was there; the
stores keep their keys, order, shapes and values, so ``state_dict``, ``load_state_dict``, ``restore`` (which adds
into the view: into the buffer) and the saved bytes are what they were. ``None`` when a name has no state yet (its
first step allocates it by the reference steps) or the tensors span devices. Example::

    flat = FlatState.bind((mem.velocities, mem.momentums), ("b1", "b2"))
    flat.bufs[0][:3]                    # is mem.velocities["b1"].view(-1) when b1 has 3 elements
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class FlatState:
    """``bufs[i]``: the 1-D buffer of ``stores[i]`` over ``names`` (in order, back to back from ``offsets[j]``);
    ``views[i][name]``: the view ``stores[i][name]`` was rebound to (a later rebinding invalidates the cache)."""

    names: tuple[str, ...]
    offsets: tuple[int, ...]
    bufs: tuple[torch.Tensor, ...]
    views: tuple[dict[str, torch.Tensor], ...]

    def holds(self, stores: Sequence[dict[str, torch.Tensor]], names: Sequence[str]) -> bool:
        """Whether every store still holds this state's views for exactly ``names``."""
        return (self.names == tuple(names) and len(stores) == len(self.views)
                and all(s.get(n) is v for s, views in zip(stores, self.views, strict=True) for n, v in views.items()))

    @staticmethod
    def bind(stores: Sequence[dict[str, torch.Tensor]], names: Sequence[str],
             cached: FlatState | None = None) -> FlatState | None:
        """``cached`` when it still holds (``holds``), else new buffers with every ``store[name]`` rebound to a view
        of its store's buffer (values copied); ``None`` if a name is missing from a store or the state spans devices
        or dtypes (nothing is rebound then)."""
        names = tuple(names)
        if cached is not None and cached.holds(stores, names):
            return cached
        if any(n not in s for s in stores for n in names):
            return None
        first = [s[n] for s in stores for n in names]
        if len({(t.device, t.dtype) for t in first}) > 1:
            return None
        offsets, at = [], 0
        for n in names:
            offsets.append(at)
            at += stores[0][n].numel()
        device = first[0].device if first else torch.device("cpu")
        bufs, views = [], []
        for store in stores:
            buf = torch.cat([store[n].reshape(-1) for n in names]) if names else torch.zeros(0, device=device)
            by_name = {n: buf[a: a + store[n].numel()].view(store[n].shape)
                       for n, a in zip(names, offsets, strict=True)}
            store.update(by_name)  # same keys: the stores' order is kept
            bufs.append(buf)
            views.append(by_name)
        return FlatState(names, tuple(offsets), tuple(bufs), tuple(views))

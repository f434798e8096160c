"""Work of many tensors cut into fixed-size chunks, one program each, for the kernels that take a table of tensors
(``_triton_encode``'s index kernels, ``_triton_scatter.put_many_kernel``, ``_triton_quant.quant_many_kernel``): a
program reads its tensor and its first element from the table, so tensors of any sizes share one launch without a
program left idle.

    >>> first, owner, start = chunks([3, 0, 5], 2)
    >>> first.tolist(), owner.tolist(), start.tolist()
    ([0, 2, 2], [0, 0, 2, 2, 2], [0, 2, 0, 2, 4])

``table`` lays out such a launch's table: per tensor its columns, then per chunk its tensor and first element::

    >>> tab, programs = table([[10, 11, 12]], [3, 0, 5], 2)
    >>> tab.tolist(), programs
    ([10, 11, 12, 0, 0, 2, 2, 2, 0, 2, 0, 2, 4], 5)
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def chunks(counts: Sequence[int] | np.ndarray, size: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """For tensors of ``counts`` elements cut into chunks of ``size``: each tensor's first chunk, and each chunk's
    tensor and first element (int64; an empty tensor has no chunk)."""
    counts = np.asarray(counts, dtype=np.int64)
    per = -(-counts // size)
    first = np.concatenate([[0], np.cumsum(per)[:-1]]).astype(np.int64)
    owner = np.repeat(np.arange(counts.size, dtype=np.int64), per)
    return first, owner, (np.arange(owner.size, dtype=np.int64) - first[owner]) * size


def table(columns: Sequence[Sequence[int]], counts: Sequence[int] | np.ndarray, size: int) -> tuple[np.ndarray, int]:
    """The int64 table of one launch over tensors of ``counts`` elements in chunks of ``size``, column-major:
    ``columns`` (one value per tensor each: ``tab[col * T + t]``), then each chunk's tensor and first element
    (``tab[len(columns) * T + col * C + c]``, col 0 and 1); and ``C``, the number of chunks (the launch's programs)."""
    _, owner, start = chunks(counts, size)
    tab = np.concatenate([*(np.asarray(c, dtype=np.int64) for c in columns), owner, start]).astype(np.int64)
    return tab, owner.size

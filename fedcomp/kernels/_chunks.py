"""Work of many tensors cut into fixed-size chunks, one program each, for the kernels that take a table of tensors
(``_triton_encode``'s index kernels, ``_triton_scatter.put_many_kernel``): a program reads its tensor and its
first element from the table, so tensors of any sizes share one launch without a program left idle.

    >>> first, owner, start = chunks([3, 0, 5], 2)
    >>> first.tolist(), owner.tolist(), start.tolist()
    ([0, 2, 2], [0, 0, 2, 2, 2], [0, 2, 0, 2, 4])
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

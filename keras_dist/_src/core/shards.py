"""Shard arithmetic shared by every backend: who gets which samples.

One rule everywhere: `numpy.array_split` order. The first ``count % parts``
parts get one sample more, parts keep sample order and may be empty, and
every sample is in exactly one part.
"""

from __future__ import annotations

import numpy as np
from keras import tree


def shard_bounds(count: int, index: int, parts: int) -> tuple[int, int]:
    """Start and stop of part `index` of `count` samples split `parts` ways."""
    base, extra = divmod(count, parts)
    start = index * base + min(index, extra)
    return start, start + base + (1 if index < extra else 0)


def shard_size(count: int, index: int, parts: int) -> int:
    """Number of samples in part `index` (see `shard_bounds`)."""
    start, stop = shard_bounds(count, index, parts)
    return stop - start


def split_batch(batch, count: int) -> list:
    """Splits every array of `batch` along axis 0 into `count` parts.

    Parts differ in size by at most one sample and keep sample order; a batch
    with fewer samples than `count` gives some empty parts. Every sample is in
    exactly one part.
    """
    leaves = [x for x in tree.flatten(batch) if x is not None]
    if not leaves:
        raise ValueError("Cannot split a batch that holds no arrays.")
    sizes = {np.shape(x)[0] for x in leaves}
    if len(sizes) != 1:
        raise ValueError(
            "All arrays of a batch must have the same number of samples "
            f"(first dimension); got sizes {sorted(sizes)}."
        )
    parts = [[] for _ in range(count)]
    for leaf in tree.flatten(batch):
        pieces = [None] * count if leaf is None else np.array_split(leaf, count)
        for i, piece in enumerate(pieces):
            parts[i].append(piece)
    return [tree.pack_sequence_as(batch, p) for p in parts]

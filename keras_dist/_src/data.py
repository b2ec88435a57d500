"""Input helpers shared by the backends: iterate batches, split them exactly."""

from __future__ import annotations

import numpy as np
from keras import tree


def iterate_numpy_batches(dataset):
    """Yields the batches of `dataset` as (nested) NumPy arrays.

    Accepts a `tf.data.Dataset`, a `keras.utils.PyDataset`, a torch
    `DataLoader` or any iterable of (nested) arrays.
    """
    if _is_tf_dataset(dataset):
        yield from dataset.as_numpy_iterator()
        return
    if hasattr(dataset, "__getitem__") and hasattr(dataset, "num_batches"):
        for i in range(len(dataset)):
            yield tree.map_structure(np.asarray, dataset[i])
        return
    for batch in dataset:
        yield tree.map_structure(np.asarray, batch)


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


def _is_tf_dataset(dataset) -> bool:
    module = type(dataset).__module__
    return module.startswith("tensorflow") and hasattr(
        dataset, "as_numpy_iterator"
    )

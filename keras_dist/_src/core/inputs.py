"""Input helpers shared by the backends: iterate batches, split them exactly."""

from __future__ import annotations

import inspect
import math

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


def _is_tf_dataset(dataset) -> bool:
    module = type(dataset).__module__
    return module.startswith("tensorflow") and hasattr(
        dataset, "as_numpy_iterator"
    )


_STEPS_ARGUMENT = {
    "fit": "steps_per_epoch",
    "evaluate": "steps",
    "predict": "steps",
}


def check_call_inputs(name, method, args, kwargs) -> None:
    """Refuses input that would make `fit`/`evaluate`/`predict` hang or fail
    obscurely: an empty input, or an infinite one without a step count.

    Raises:
        ValueError: saying what is wrong with the input and what to do.
    """
    if name not in _STEPS_ARGUMENT:
        return
    try:
        bound = inspect.signature(method).bind(*args, **kwargs)
    except TypeError:
        return  # let Keras report the bad call itself
    x = bound.arguments.get("x")
    steps = bound.arguments.get(_STEPS_ARGUMENT[name])
    if x is None:
        return
    leaves = [leaf for leaf in tree.flatten(x) if leaf is not None]
    if leaves and all(_is_array(leaf) for leaf in leaves):
        if any(np.ndim(leaf) == 0 for leaf in leaves):
            return
        if min(np.shape(leaf)[0] for leaf in leaves) == 0:
            raise ValueError(
                f"`{name}` got input with 0 samples. Pass at least one "
                "sample (check the data loading or the split that produced "
                "it)."
            )
        return
    size = _known_size(x)
    if size == 0:
        raise ValueError(
            f"`{name}` got a {type(x).__name__} that yields no batch. Pass "
            "a non-empty input (check filters and the data source)."
        )
    if size == math.inf and steps is None:
        raise ValueError(
            f"`{name}` got an infinite {type(x).__name__} (e.g. from "
            f"`.repeat()`) and no `{_STEPS_ARGUMENT[name]}`: it would never "
            f"finish an epoch. Pass `{_STEPS_ARGUMENT[name]}=N`, or make the "
            "input finite."
        )


def _is_array(x) -> bool:
    return hasattr(x, "shape") and hasattr(x, "dtype") and not _is_tf_dataset(x)


def _known_size(x):
    """Number of batches of `x` if cheaply known: int, math.inf or None."""
    if _is_tf_dataset(x):
        import tensorflow as tf

        cardinality = int(x.cardinality())
        if cardinality == tf.data.INFINITE_CARDINALITY:
            return math.inf
        if cardinality == tf.data.UNKNOWN_CARDINALITY:
            return None
        return cardinality
    num_batches = getattr(type(x), "num_batches", None)
    if num_batches is not None and hasattr(x, "__getitem__"):
        try:
            count = x.num_batches  # keras.utils.PyDataset
        except Exception:  # noqa: BLE001 - user code; Keras reports it
            return None
        return math.inf if count is None else count
    return None


def check_batch_consistency(first, batch, index: int) -> None:
    """Raises if `batch` differs from `first` in structure or sample shape.

    Only the batch (first) dimension may change between batches.
    """
    try:
        tree.assert_same_structure(first, batch)
    except (ValueError, TypeError) as error:
        raise ValueError(
            f"Batch {index} of the input has a different structure than the "
            f"first batch ({_describe(batch)} vs {_describe(first)}). Every "
            "batch must have the same structure."
        ) from error
    for a, b in zip(tree.flatten(first), tree.flatten(batch)):
        if a is None or b is None:
            continue
        if np.shape(a)[1:] != np.shape(b)[1:]:
            raise ValueError(
                f"Batch {index} of the input has an element of shape "
                f"{tuple(np.shape(b))} where the first batch had "
                f"{tuple(np.shape(a))}. Only the first (batch) dimension "
                "may change between batches; pad or resize the samples."
            )


def _describe(batch) -> str:
    return str(
        tree.map_structure(
            lambda x: None if x is None else tuple(np.shape(x)), batch
        )
    )

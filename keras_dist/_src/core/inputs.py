"""Input helpers shared by the backends: iterate batches, split them exactly."""

from __future__ import annotations

import inspect
import itertools
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


class DistributedDataset:
    """Each global batch of a dataset, split across every replica.

    The one wrapper behind `Strategy.distribute_dataset` (a `tf.data.Dataset`
    on TensorFlow goes to tf.distribute's own instead). Every global batch is
    split with `core.shards.split_batch` (``numpy.array_split`` sizes) into
    `num_replicas` parts, so every sample goes to exactly one replica; this
    process keeps the parts of `local_replicas` and hands them to `place`,
    the backend's one job: put them on their devices as the per-replica
    value its `strategy.run` takes.

    Args:
        dataset: any input `iterate_numpy_batches` accepts.
        num_replicas: replicas over every process.
        local_replicas: the indices (in ``range(num_replicas)``) of this
            process's replicas, in its device order.
        place: callable taking the list of this process's parts.
    """

    def __init__(self, dataset, num_replicas, local_replicas, place):
        self._source = dataset
        self._num_replicas = int(num_replicas)
        self._local = list(local_replicas)
        self._place = place

    def __iter__(self):
        from keras_dist._src.core.shards import split_batch

        for batch in iterate_numpy_batches(self._source):
            parts = split_batch(batch, self._num_replicas)
            yield self._place([parts[i] for i in self._local])


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
    """Checks the input arguments of a `fit`/`evaluate`/`predict` call.

    Binds the call to `method`'s signature and runs `check_input` on ``x``
    and, for `fit`, on ``validation_data``. The one input check of every
    backend (the hook calls it before the engine sees the call).

    Raises:
        ValueError: saying what is wrong with the input and what to do.
    """
    if name not in _STEPS_ARGUMENT:
        return
    try:
        bound = inspect.signature(method).bind(*args, **kwargs)
    except TypeError:
        return  # let Keras report the bad call itself
    arguments = bound.arguments
    steps_name = _STEPS_ARGUMENT[name]
    check_input(
        arguments.get("x"),
        arguments.get(steps_name),
        steps_name=steps_name,
        what=f"`{name}`",
    )
    validation = arguments.get("validation_data") if name == "fit" else None
    if validation is not None:
        vx = validation[0] if isinstance(validation, (tuple, list)) else None
        check_input(
            validation if vx is None else vx,
            arguments.get("validation_steps"),
            steps_name="validation_steps",
            what="`validation_data`",
        )


def check_input(x, steps, steps_name: str = "steps", what: str = "the input"):
    """Refuses an input that would make a Keras loop hang or fail obscurely.

    Args:
        x: the input (``x`` of the call, or of ``validation_data``).
        steps: the step count given for it, or None.
        steps_name: the argument that sets `steps`, for the message.
        what: what the input is for (``"`fit`"``...), for the message.

    Raises:
        ValueError: for arrays with 0 samples, a dataset known to yield no
            batch, or an infinite input without a step count.
    """
    if x is None:
        return
    leaves = [leaf for leaf in tree.flatten(x) if leaf is not None]
    if leaves and all(_is_array(leaf) for leaf in leaves):
        if any(np.ndim(leaf) == 0 for leaf in leaves):
            return
        if min(np.shape(leaf)[0] for leaf in leaves) == 0:
            raise ValueError(
                f"{what} got input with 0 samples (shape "
                f"{tuple(np.shape(leaves[0]))}). Pass at least one sample "
                "(check the data loading or the split that produced it)."
            )
        return
    size = _known_size(x)
    if size == 0:
        raise ValueError(
            f"{what} got a {type(x).__name__} that yields no batch. Pass "
            "a non-empty input (check filters and the data source)."
        )
    if size == math.inf and steps is None:
        raise ValueError(
            f"{what} got an infinite {type(x).__name__} (e.g. from "
            f"`.repeat()`) and no `{steps_name}`: it would never finish an "
            f"epoch. Pass `{steps_name}=N`, or make the input finite."
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
    if isinstance(x, (itertools.count, itertools.cycle)):
        return math.inf
    if isinstance(x, itertools.repeat):
        try:
            return x.__length_hint__()  # repeat(v, n)
        except TypeError:  # repeat(v): no length, never ends
            return math.inf
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

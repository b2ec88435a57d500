"""The input of the chief's loop under ParameterServerStrategy.

Each worker reads its own part of the input (`TrainInput`: NumPy arrays,
a `tf.data.Dataset` or a function that builds one on each worker); a
step's batch is `batch_size` samples read by one worker. `class_weight`
and `validation_split` do what Keras's `fit` does; `evaluate` and
`predict` read the chief's own batches (`local_batches`).
"""

from __future__ import annotations

import math

import keras
import numpy as np
import tensorflow as tf
from keras import tree


def _pack(x, y, sample_weight):
    if y is None and sample_weight is None:
        return (x,)
    if sample_weight is None:
        return (x, y)
    return (x, y, sample_weight)


def _count(data) -> int:
    return int(np.shape(tree.flatten(data)[0])[0])


def _refuse_python_iterators(x, method: str) -> None:
    """A generator, an iterator or a torch DataLoader is none of the inputs
    the ParameterServerStrategy loop takes: one clear error instead of an
    IndexError from counting its samples."""
    if isinstance(x, (tf.data.Dataset, keras.utils.PyDataset)) or (
        _is_dataset_function(x)
    ):
        return
    leaves = [t for t in tree.flatten(x) if t is not None]
    if leaves and all(np.ndim(t) > 0 for t in leaves):
        return
    if method == "fit":
        why = (
            "its Python code would run in the chief only, and the workers "
            "run TensorFlow graphs. Pass NumPy arrays, a tf.data.Dataset "
            "of TensorFlow ops (not from_generator), or a function that "
            "builds a tf.data.Dataset on each worker (e.g. from files)."
        )
    else:
        why = (
            "pass NumPy arrays, a tf.data.Dataset (tf.data.Dataset."
            "from_generator wraps a generator), a function that builds one, "
            "or a keras.utils.PyDataset."
        )
    raise ValueError(
        f"`{method}` under ParameterServerStrategy got a "
        f"{type(x).__name__}, which it cannot read: {why}"
    )


def _is_dataset_function(x) -> bool:
    return callable(x) and not isinstance(
        x, (tf.data.Dataset, keras.utils.PyDataset)
    )


def _call_dataset_function(fn, context=None):
    import inspect

    try:
        takes_context = bool(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        takes_context = False
    if not takes_context:
        return fn()
    return fn(context or tf.distribute.InputContext())


def _worker_index():
    """This worker's index, in a function that runs on a worker (a
    per-worker dataset function): a tensor, filled in at call time."""
    return tf.distribute.coordinator.experimental_get_current_worker_index()


def _class_weight_fn(class_weight):
    """Keras's `class_weight` as a `tf.data` map function: adds each
    sample's class weight as its `sample_weight` (as Keras's `fit` does:
    classes are ``argmax(y)`` for one-hot labels, else ``round(y)``)."""
    if not isinstance(class_weight, dict) or not class_weight:
        raise ValueError(
            "`class_weight` must be a non-empty dict mapping class indices "
            f"(int) to weights; got {class_weight!r}."
        )
    size = max(int(c) for c in class_weight) + 1
    table = tf.constant(
        [float(class_weight.get(c, 1.0)) for c in range(size)], "float32"
    )

    def add_weights(*data):
        x, y, sw = keras.utils.unpack_x_y_sample_weight(data)
        if sw is not None:
            raise ValueError(
                "`class_weight` and `sample_weight` cannot be used together "
                "(as in Keras's fit): fold the class weights into "
                "`sample_weight`."
            )
        if y is None or tree.is_nested(y):
            raise ValueError(
                "`class_weight` needs a single target `y` (a model with one "
                "output); use `sample_weight` otherwise."
            )
        if y.shape.rank >= 2 and (y.shape[-1] or 1) > 1:
            classes = tf.argmax(y, axis=-1, output_type=tf.int32)
        elif y.shape.rank >= 2:
            classes = tf.cast(tf.round(tf.squeeze(y, axis=-1)), tf.int32)
        else:
            classes = tf.cast(tf.round(y), tf.int32)
        return x, y, tf.gather(table, classes)

    return add_weights


def split_validation(x, y, sample_weight, validation_split):
    """Keras's `validation_split` on arrays: the last fraction of the
    samples (before any shuffling) is held out.

    Returns:
        ``((x, y, sample_weight), (vx, vy, vw))``.

    Raises:
        ValueError: for input that is not arrays, or a split that leaves
            no sample on one side.
    """
    if isinstance(x, (tf.data.Dataset, keras.utils.PyDataset)) or (
        _is_dataset_function(x)
    ):
        raise ValueError(
            "`validation_split` works with NumPy arrays (or tensors) only, "
            "as in Keras's fit: hold out the validation samples yourself "
            "and pass them as `validation_data`."
        )
    arrays = tree.map_structure(
        lambda t: None if t is None else np.asarray(t),
        (x, y, sample_weight),
    )
    count = _count(arrays[0])
    split_at = int(math.floor(count * (1.0 - validation_split)))
    if split_at == 0 or split_at == count:
        raise ValueError(
            f"`validation_split={validation_split}` of {count} samples "
            f"leaves {split_at} to train and {count - split_at} to "
            "validate: choose a split that keeps samples on both sides."
        )

    def cut(lo, hi):
        return tree.map_structure(
            lambda t: None if t is None else t[lo:hi], arrays
        )

    return cut(0, split_at), cut(split_at, count)


class TrainInput:
    """What each worker reads: a per-worker dataset, its element spec and
    the steps of an epoch.

    Each worker reads its own part of the input (`num_workers` shards, by
    the worker's index): NumPy samples ``i`` with ``i % num_workers ==
    worker``, a `tf.data` dataset's elements (batches, if it is batched)
    likewise; a dataset function that takes an argument gets a
    `tf.distribute.InputContext` with ``num_input_pipelines`` the number
    of workers and ``input_pipeline_id`` this worker's index (a tensor) to
    shard with (`dataset.shard(ctx.num_input_pipelines,
    ctx.input_pipeline_id)`). Every per-worker dataset repeats.
    """

    def __init__(
        self,
        x,
        y,
        sample_weight,
        batch_size,
        shuffle,
        steps,
        num_workers=1,
        class_weight=None,
    ):
        self.num_workers = int(num_workers)
        weigh = None if class_weight is None else _class_weight_fn(class_weight)
        if isinstance(x, keras.utils.PyDataset):
            raise NotImplementedError(
                "A PyDataset cannot feed ParameterServerStrategy workers: "
                "its Python code (`__getitem__`) runs in the chief only, and "
                "the workers run TensorFlow graphs. Pass NumPy arrays, a "
                "tf.data.Dataset, or a function that builds a "
                "tf.data.Dataset on each worker (e.g. from files; it may "
                "take a tf.distribute.InputContext to shard by worker). "
                "`evaluate` and `predict` do accept a PyDataset (they run on "
                "the chief)."
            )
        _refuse_python_iterators(x, "fit")
        if isinstance(x, tf.data.Dataset):
            cardinality = int(x.cardinality())
            if steps is None:
                if cardinality < 0:
                    raise ValueError(
                        "`fit` under ParameterServerStrategy got a tf.data "
                        "dataset of "
                        + (
                            "infinite"
                            if cardinality == tf.data.INFINITE_CARDINALITY
                            else "unknown"
                        )
                        + " size: pass `steps_per_epoch` (the steps "
                        "scheduled per epoch, over all workers)."
                    )
                steps = cardinality
            if 0 <= cardinality < self.num_workers:
                raise ValueError(
                    f"The tf.data dataset has {cardinality} element(s) "
                    f"(batches), fewer than the {self.num_workers} workers, "
                    "and each worker reads its own elements: use smaller "
                    "batches, or fewer workers."
                )
            self.source = self._from_dataset(x, weigh)
            spec_dataset = x if weigh is None else x.map(weigh)
            self.spec = spec_dataset.element_spec
            self.steps = int(steps)
            self.batch_size = None
            return
        if _is_dataset_function(x):
            if steps is None:
                raise ValueError(
                    "`fit` under ParameterServerStrategy got a dataset "
                    "function: pass `steps_per_epoch` (the steps scheduled "
                    "per epoch, over all workers), since the size of what "
                    "each worker builds is not known on the chief."
                )
            workers = self.num_workers

            def dataset_fn():
                context = tf.distribute.InputContext(
                    num_input_pipelines=workers,
                    input_pipeline_id=_worker_index() if workers > 1 else 0,
                    num_replicas_in_sync=1,
                )
                dataset = _call_dataset_function(x, context)
                return dataset if weigh is None else dataset.map(weigh)

            spec_dataset = _call_dataset_function(x)
            if weigh is not None:
                spec_dataset = spec_dataset.map(weigh)
            self.spec = spec_dataset.element_spec
            self.source = dataset_fn
            self.steps = int(steps)
            self.batch_size = None
            return
        data = tree.map_structure(
            lambda t: None if t is None else np.asarray(t),
            _pack(x, y, sample_weight),
        )
        batch_size = int(batch_size or 32)
        count = _count(data)
        self.batch_size = batch_size
        self.steps = int(steps or max(1, math.ceil(count / batch_size)))
        workers = self.num_workers
        if count < workers:
            raise ValueError(
                f"`fit` got {count} sample(s) for {workers} workers, and "
                "each worker reads its own samples: pass at least one "
                "sample per worker."
            )
        shard_size = math.ceil(count / workers)

        def dataset_fn():
            # Worker w reads samples w, w + workers, ...: its own part, in
            # its own random order with `shuffle`.
            dataset = tf.data.Dataset.from_tensor_slices(data)
            if workers > 1:
                dataset = dataset.shard(workers, _worker_index())
            if shuffle:
                dataset = dataset.shuffle(
                    shard_size, reshuffle_each_iteration=True
                )
            # Batched, then repeated: every pass over this worker's part
            # ends with its own last (partial) batch, so one worker's
            # epoch is one device's (`steps` = ceil(count / batch_size)):
            # no batch runs across an epoch's end.
            dataset = dataset.batch(batch_size).repeat()
            return dataset if weigh is None else dataset.map(weigh)

        self.source = dataset_fn
        spec_dataset = tf.data.Dataset.from_tensor_slices(data).batch(
            batch_size
        )
        if weigh is not None:
            spec_dataset = spec_dataset.map(weigh)
        self.spec = spec_dataset.element_spec

    def _from_dataset(self, dataset, weigh):
        """A per-worker dataset function reading `dataset`'s elements of
        this worker (the dataset's graph is serialized to each worker, as
        `create_per_worker_dataset` does with a dataset)."""
        from keras_dist._src.framework_glue import tensorflow_private as tfp

        serialized = tfp.serialize_dataset_to_graph(dataset)
        spec = dataset.element_spec
        workers = self.num_workers

        def dataset_fn():
            restored = tfp.deserialize_dataset_from_graph(serialized, spec)
            if workers > 1:
                restored = restored.shard(workers, _worker_index())
            restored = restored.repeat()
            return restored if weigh is None else restored.map(weigh)

        return dataset_fn


def local_batches(x, y, sample_weight, batch_size, steps):
    """The chief's own batches (evaluate/predict): a finite iterable."""
    if isinstance(x, tf.data.Dataset):
        dataset = x if steps is None else x.take(steps)
        if steps is None and int(x.cardinality()) < 0:
            raise ValueError(
                "evaluate/predict got a tf.data dataset of infinite or "
                "unknown size: pass `steps`."
            )
        return dataset
    if _is_dataset_function(x):
        dataset = _call_dataset_function(x)
        return local_batches(dataset, None, None, None, steps)
    if isinstance(x, keras.utils.PyDataset):
        return (x[i] for i in range(steps or len(x)))
    _refuse_python_iterators(x, "evaluate/predict")
    data = _pack(x, y, sample_weight)
    data = tree.map_structure(
        lambda t: None if t is None else np.asarray(t), data
    )
    dataset = tf.data.Dataset.from_tensor_slices(data).batch(
        int(batch_size or 32)
    )
    return dataset if steps is None else dataset.take(steps)

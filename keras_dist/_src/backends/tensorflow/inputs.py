"""Exact splitting of global batches across tf.distribute replicas."""

from __future__ import annotations

import tensorflow as tf
from keras import tree

from keras_dist._src.context import current_call
from keras_dist._src.core.inputs import DistributedDataset
from keras_dist._src.framework_glue import tensorflow_private

GLOBAL_COUNT_KEY = "keras_dist_global_count"


BATCH_KEY = "keras_dist_batch"


LOCAL_COUNT_KEY = "keras_dist_local_count"


COUNT_PER_SAMPLE_KEY = "keras_dist_count_per_sample"


EXACT_CALLS = ("fit", "evaluate")


def without_count(data):
    if isinstance(data, dict) and BATCH_KEY in data:
        return data[BATCH_KEY]
    return data


def dataset_element(args):
    """The element of a dataset whose `map` function got `*args`.

    tf.data passes a tuple element's items as separate arguments. One
    argument that is itself a tuple or list is therefore a one-item tuple
    (Keras's `(x,)` for a multi-input `x` without targets) and stays
    wrapped; unwrapped, `(a, b)` would read as `x=a, y=b`."""
    if len(args) == 1 and not isinstance(args[0], (tuple, list)):
        return args[0]
    return args


def distribute_global_batches(strategy, dataset, options=None):
    """Splits each global batch of `dataset` across replicas, exactly.

    Where tf.distribute can rebatch the dataset in replica order (one
    worker, or one replica a worker; the batch size is found in the
    dataset's graph: arrays, `tf.data` batched with `.batch`), its own fast
    rebatching splits every global batch; in `fit`/`evaluate` a per-sample
    copy of the global batch size travels with the data, so the exact step
    needs no collective to learn it. Elsewhere (input from generators and
    PyDatasets, where tf.distribute would give each replica a whole batch,
    making the global batch N times too large; workers of several
    replicas, to which it deals the parts in turn) keras_dist splits every
    batch itself like `numpy.array_split`, in sample order, and hands
    replicas their parts in turn through `distribute_datasets_from_function`.
    """
    replicas = strategy.num_replicas_in_sync
    with_count = current_call() in EXACT_CALLS
    native = getattr(
        type(strategy),
        "_native_distribute",
        tf.distribute.MirroredStrategy.experimental_distribute_dataset,
    )
    # tf.distribute's multi-worker rebatching deals a global batch's parts
    # to the workers in turn (worker 0 gets parts 0 and 2 of 4, worker 1
    # parts 1 and 3), so a replica's part is not the one of its place:
    # predict's rows came back permuted and Dropout's masks were another
    # replica's. Where a worker has several replicas, keras_dist splits
    # every batch itself.
    extended = strategy.extended
    native_order = (
        not extended._in_multi_worker_mode()
        or len(extended.worker_devices) == 1
    )
    if native_order and int(tensorflow_private.static_batch_size(dataset)) >= 0:
        if with_count:

            def add_count(*batch):
                # Each sample carries the global batch size, so the step
                # needs no collective to learn it. tf.distribute cuts
                # ceil-sized parts (10 over 3 gives 4, 4, 2); where that
                # leaves a part empty (6 over 4 would give 2, 2, 2, 0),
                # zero samples (carrying 0) are appended up to the next
                # multiple: with cross-replica BatchNormalization an empty
                # part aborts the step. Only then: padding rows go through
                # the forward pass, and a batch-dependent `add_loss`
                # (activity regularizers) would see them.
                batch = dataset_element(batch)
                leaves = [t for t in tree.flatten(batch) if t is not None]
                count = tf.shape(leaves[0])[0]
                ceil = (count + replicas - 1) // replicas
                missing = tf.where(
                    ceil * (replicas - 1) >= count,
                    (replicas - count % replicas) % replicas,
                    0,
                )
                batch = tree.map_structure(
                    lambda t: pad_rows(t, missing),
                    batch,
                )
                per_sample = tf.concat(
                    [tf.fill([count], count), tf.zeros([missing], "int32")],
                    axis=0,
                )
                return {BATCH_KEY: batch, COUNT_PER_SAMPLE_KEY: per_sample}

            dataset = dataset.map(add_count)
        return for_keras(native(strategy, dataset, options))

    def split(*batch):
        batch = dataset_element(batch)
        leaves = [t for t in tree.flatten(batch) if t is not None]
        count = tf.shape(leaves[0])[0]
        base, extra = count // replicas, count % replicas

        def part(i):
            i = tf.cast(i, "int32")
            start = i * base + tf.minimum(i, extra)
            stop = start + base + tf.cast(i < extra, "int32")
            shard = tree.map_structure(
                lambda t: None if t is None else t[start:stop], batch
            )
            if not with_count:
                return shard
            # An empty part becomes one zero sample (masked in the step):
            # with cross-replica BatchNormalization an empty shard aborts
            # the step with a collective shape mismatch.
            empty = tf.cast(tf.equal(stop, start), "int32")
            shard = tree.map_structure(lambda t: pad_rows(t, empty), shard)
            return {
                BATCH_KEY: shard,
                GLOBAL_COUNT_KEY: count,
                LOCAL_COUNT_KEY: stop - start,
            }

        return tf.data.Dataset.range(replicas).map(part)

    def local_parts(input_context):
        # Each worker yields the parts of its own replicas, in order (one
        # worker: every part).
        local = replicas // input_context.num_input_pipelines
        first = input_context.input_pipeline_id * local

        def parts_of(*batch):
            return split(*batch).skip(first).take(local)

        return dataset.flat_map(parts_of)

    return for_keras(
        strategy.distribute_datasets_from_function(local_parts, options)
    )


#: The calls whose epoch iterators (Keras's) may start their input lazily.
_KERAS_CALLS = ("fit", "evaluate", "predict")


def for_keras(distributed):
    """`distributed` as Keras's epoch iterator gets it in `fit`, `evaluate`
    and `predict`: its iterators are created at their first use.

    Keras's epoch iterator creates an iterator of the distributed input at
    the start of every epoch and, when it has no `steps_per_epoch`, another
    one at the end that it never reads (the next epoch makes a new one).
    On N devices each is a multi-device iterator that traces functions per
    device: 0.5-1.3 s on 4 CPU devices, paid by `tf.distribute` itself
    with Keras. Here that unread iterator costs nothing. Outside those
    calls (a custom loop passing an iterator to a `tf.function`) the
    dataset is returned as it is.
    """
    if current_call() not in _KERAS_CALLS:
        return distributed
    return _LazyIterators(distributed)


class _LazyIterators:
    """A distributed dataset whose iterators start at their first use.

    `iterators_made` counts the real iterators made (each draws a new
    order from a reshuffling `tf.data` shuffle): a resumed `fit` makes as
    many as the interrupted one had, with `make_iterator`
    (`checkpoint.input_replay`).
    """

    def __init__(self, distributed):
        self._distributed = distributed
        self.iterators_made = 0

    def __iter__(self):
        return LazyIterator(self)

    def make_iterator(self):
        """Makes (and drops) one real iterator, as a first use does."""
        LazyIterator(self).resolve()

    def _make(self):
        self.iterators_made += 1
        return iter(self._distributed)

    def __getattr__(self, name):
        if name.startswith("__") or name == "_distributed":
            raise AttributeError(name)  # copy/pickle before __init__
        return getattr(self._distributed, name)


class LazyIterator:
    """An iterator of a distributed dataset, created at its first use
    (`resolve`: what a step function is given)."""

    def __init__(self, lazy):
        self._lazy = lazy
        self._iterator = None

    def resolve(self):
        """The real iterator (created now if it was not yet)."""
        if self._iterator is None:
            self._iterator = self._lazy._make()
        return self._iterator

    def __iter__(self):
        return self

    def __next__(self):
        return next(self.resolve())

    def __getattr__(self, name):
        if name.startswith("__") or name in ("_lazy", "_iterator"):
            raise AttributeError(name)
        return getattr(self.resolve(), name)


def pad_rows(tensor, count):
    if tensor is None:
        return None
    zeros = tf.zeros(
        tf.concat([[count], tf.shape(tensor)[1:]], axis=0), tensor.dtype
    )
    return tf.concat([tensor, zeros], axis=0)


def distribute_iterable(engine, dataset):
    """`core.inputs.DistributedDataset` over the engine's replicas, for
    inputs other than a `tf.data.Dataset` (which tf.distribute distributes).
    """
    count = engine.num_replicas_in_sync

    def place(parts):
        if count == 1:
            return tree.map_structure(tf.convert_to_tensor, parts[0])
        return engine.tf_strategy.experimental_distribute_values_from_function(
            lambda ctx: tree.map_structure(
                tf.convert_to_tensor, parts[ctx.replica_id_in_sync_group]
            )
        )

    return DistributedDataset(dataset, count, range(count), place)

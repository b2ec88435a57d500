"""Every private TensorFlow name keras_dist reaches (``tensorflow.python``),
by use.

tf.distribute and tf.data keep some of what keras_dist needs out of the
public ``tf`` namespace: the multi-worker strategy's implementation class
(to give a worker one replica per simulated CPU), the eager context (the
coordination service's key-value store, the global seed and op-seed
generator), a dataset's static batch size and auto-sharding, the
parameter-server's dataset serialization. Each reach is a function here.
"""

from __future__ import annotations


def collective_all_reduce_extended_class() -> type:
    """tf.distribute's multi-worker implementation class, to subclass.

    Reaches ``tensorflow.python.distribute.collective_all_reduce_strategy
    .CollectiveAllReduceExtended`` (and its ``_initialize_local_devices``,
    which keras_dist's subclass overrides): TensorFlow's public
    ``MultiWorkerMirroredStrategy`` has no setting for a replica per
    simulated CPU device.
    """
    from tensorflow.python.distribute import (
        collective_all_reduce_strategy,
    )

    return collective_all_reduce_strategy.CollectiveAllReduceExtended


def eager_context():
    """TensorFlow's eager context (``context.context()``).

    Reaches ``tensorflow.python.eager.context``: the coordination
    service's key-value store and barrier (``set_config_key_value``,
    ``get_config_key_value``, ``delete_config_key_value``,
    ``wait_at_barrier``) have no public API.
    """
    from tensorflow.python.eager import context

    return context.context()


def eager_global_seed() -> int | None:
    """The global seed of the eager context (None if none was set).

    Reaches ``context.context()._seed``: ``tf.random.set_seed`` has no
    public getter.
    """
    return eager_context()._seed  # noqa: SLF001 - TF keeps its eager seed here


def eager_op_seed_generator():
    """The eager context's op-seed generator (a ``random.Random``), or
    None where this TensorFlow has none.

    Reaches ``context.context()._rng``: the generator that op seeds are
    drawn from after ``tf.random.set_seed`` has no public API, and a
    worker's shuffles depend on its state.
    """
    return getattr(eager_context(), "_rng", None)


def static_batch_size(dataset) -> int:
    """The batch size tf.distribute computes statically from a batched
    dataset's graph (-1 where unknown; may raise where not computable).

    Reaches ``tensorflow.python.data.experimental.ops.distribute
    .compute_batch_size``: tf.data has no public equivalent.
    """
    from tensorflow.python.data.experimental.ops import distribute

    return distribute.compute_batch_size(dataset)


def auto_shard_dataset(dataset, num_shards: int, index: int, replicas: int):
    """`dataset` sharded by files (else by data) as tf.distribute does.

    Reaches ``tensorflow.python.distribute.input_ops.auto_shard_dataset``:
    the public ``AutoShardPolicy`` applies only inside a strategy's
    ``experimental_distribute_dataset``.
    """
    from tensorflow.python.distribute import input_ops

    return input_ops.auto_shard_dataset(dataset, num_shards, index, replicas)


def is_aggregating_variable(value) -> bool:
    """Whether `value` is tf.distribute's central-storage variable.

    Reaches ``tensorflow.python.distribute.ps_values.AggregatingVariable``,
    which TensorFlow does not export.
    """
    from tensorflow.python.distribute import ps_values

    return isinstance(value, ps_values.AggregatingVariable)


def serialize_dataset_to_graph(dataset):
    """`dataset`'s graph, serialized to be rebuilt on each worker.

    Reaches ``tensorflow.python.distribute.coordinator.values
    .serialize_dataset_to_graph``, what ``create_per_worker_dataset``
    does with a dataset, not public on its own.
    """
    from tensorflow.python.distribute.coordinator import values

    return values.serialize_dataset_to_graph(dataset)


def deserialize_dataset_from_graph(serialized, element_spec):
    """The dataset `serialize_dataset_to_graph` serialized.

    Reaches ``tensorflow.python.distribute.coordinator.values
    .deserialize_dataset_from_graph`` (see `serialize_dataset_to_graph`).
    """
    from tensorflow.python.distribute.coordinator import values

    return values.deserialize_dataset_from_graph(serialized, element_spec)

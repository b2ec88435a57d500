"""TensorFlow backend: tf.distribute's ParameterServerStrategy driven by
keras_dist's own coordinator loop.

Keras 3's `fit` has no coordinator code: it hands a `tf.data` dataset to
``strategy.experimental_distribute_dataset``, which a ParameterServerStrategy
refuses. Here the chief owns the loop: each worker gets its own dataset
(`ClusterCoordinator.create_per_worker_dataset`), every training step is
Keras's own `train_step` (the model's override included), scheduled with
`ClusterCoordinator.schedule` on whichever worker is free, and the epoch
ends at `ClusterCoordinator.join`. Batch callbacks run at those join points
(once per epoch, after its last step), since nothing is known of a step's
outcome before. `evaluate` and `predict` run on the chief, reading the
variables from the ps tasks: exactly one device's result.

Counters and metrics stay exact under concurrent workers: every Keras
variable's `assign_add`/`assign_sub` becomes TensorFlow's atomic update
(`keras_glue.parameter_server`).
"""

from __future__ import annotations

import keras
import numpy as np
import tensorflow as tf

from keras_dist._src.errors import KerasDistError, VariablesOutsideScopeError
from keras_dist._src.keras_glue import internals as glue


class ParameterServerEngine:
    """Variables on ps tasks; steps scheduled on worker tasks."""

    def __init__(self, plan, runtime, input_options):
        self.devices = tuple(plan.devices)
        self.plan = plan
        self.runtime = runtime
        self.input_options = input_options
        resolver = tf.distribute.cluster_resolver.SimpleClusterResolver(
            tf.train.ClusterSpec(plan.cluster),
            task_type="chief",
            task_id=0,
            rpc_layer="grpc",
        )
        self.tf_strategy = tf.distribute.ParameterServerStrategy(
            resolver, variable_partitioner=plan.variable_partitioner
        )
        self.coordinator = tf.distribute.coordinator.ClusterCoordinator(
            self.tf_strategy
        )

    @property
    def num_replicas_in_sync(self) -> int:
        return self.tf_strategy.num_replicas_in_sync

    def scope(self):
        return self.tf_strategy.scope()

    def call_scope(self):
        return self.tf_strategy.scope()

    def prepare_call(self, name, method, args, kwargs):
        return args, kwargs

    def attach(self, model) -> None:
        if glue.tf_distribute_strategy(model) is not self.tf_strategy:
            raise VariablesOutsideScopeError(
                f"Model {model.name!r} was created outside strategy.scope(), "
                "so its variables are not on the ps tasks. Create the model "
                "(not only compile it) inside `with strategy.scope():`."
            )
        check_not_sharded(model)

    def model_methods(self, model) -> dict:
        """`fit`, `evaluate` and `predict` for `model` (the hook wraps
        these in place of Keras's own)."""
        from keras_dist._src.backends.tensorflow import ps_loop

        return ps_loop.model_methods(self, model)

    def run(self, fn, args, kwargs):
        """Schedules `fn` on a worker; returns a `RemoteValue`."""
        function = fn if hasattr(fn, "get_concrete_function") else None
        if function is None:
            function = tf.function(fn)

        def replica(*a, **k):
            return self.tf_strategy.run(function, args=a, kwargs=k)

        return self.coordinator.schedule(
            tf.function(replica), args=args, kwargs=kwargs
        )

    def reduce(self, op, value, axis):
        value = _fetch(value)
        if axis is None:
            return value
        reduce = np.sum if str(op).lower().endswith("sum") else np.mean
        return reduce(np.asarray(value), axis=axis)

    def gather(self, value, axis):
        return _fetch(value)

    def distribute_dataset(self, dataset):
        """A per-worker dataset (`dataset`, or a function building one)."""
        return self.coordinator.create_per_worker_dataset(dataset)

    def local_results(self, value):
        return (_fetch(value),)

    def placement(self, variable):
        """Whole shapes; a sharded variable's first shard's shape."""
        shape = tuple(variable.shape)
        value = glue.variable_value(variable)
        shards = getattr(value, "variables", None)
        if shards and len(shards) > 1:
            local = tuple(shards[0].shape)
            return ("ps",) + (None,) * (len(shape) - 1), local
        return (None,) * len(shape), shape


def _fetch(value):
    if hasattr(value, "fetch"):
        return value.fetch()
    if hasattr(value, "numpy"):
        return value.numpy()
    return value


def check_not_sharded(model) -> None:
    """Refuses variables that the partitioner split (`ShardedVariable`).

    Keras's `train_step` takes the gradient of each whole variable (it
    reads ``variable.handle``, which a ShardedVariable lacks: "'Sharded
    Variable' object has no attribute 'handle'"), and Keras's Embedding
    concatenates the whole table before each lookup, which defeats the
    sharding.

    Raises:
        KerasDistError: naming the variables and what to do.
    """
    variables = list(model.variables)
    if model.optimizer is not None:
        variables += list(model.optimizer.variables)
    sharded = [
        v.path
        for v in variables
        if len(getattr(glue.variable_value(v), "variables", ()) or ()) > 1
    ]
    if not sharded:
        return
    embeddings = [
        layer.name
        for layer in glue.flatten_layers(model)
        if isinstance(layer, keras.layers.Embedding)
    ]
    hint = (
        f" (Embedding layers {embeddings}: Keras's Embedding gathers the "
        "whole table before each lookup, so sharding it saves nothing)"
        if embeddings
        else ""
    )
    raise KerasDistError(
        "keras_dist's ParameterServerStrategy cannot train variables that "
        f"the variable_partitioner split over the ps tasks: {sharded}"
        f"{hint}. Keras's train_step takes the gradient of each whole "
        "variable, which a ShardedVariable does not have. Pass "
        "variable_partitioner=None (variables are then placed whole, "
        "round-robin over the ps tasks), or a partitioner that leaves these "
        "variables whole (e.g. MinSizePartitioner with a larger "
        "min_shard_bytes). For a large embedding table use "
        "keras_dist.layers.ShardedEmbedding (same arguments as Embedding, "
        "no partitioner needed): its rows are split over the ps tasks and "
        "each lookup gathers only the rows it uses."
    )


def create_engine(plan, runtime, input_options):
    """The engine of a `ParameterServerPlan`."""
    return ParameterServerEngine(plan, runtime, input_options)

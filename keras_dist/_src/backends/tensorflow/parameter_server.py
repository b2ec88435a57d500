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

import numpy as np
import tensorflow as tf

from keras_dist._src.backends.tensorflow.ps_loop import check_not_sharded
from keras_dist._src.backends.tensorflow.strategy_engine import (
    StrategyEngine,
)
from keras_dist._src.cluster.parameter_server import wait_until_listening
from keras_dist._src.keras_glue import internals as glue


class ParameterServerEngine(StrategyEngine):
    """Variables on ps tasks; steps scheduled on worker tasks."""

    outside_scope_effect = "its variables are not on the ps tasks"

    def __init__(self, plan, runtime, input_options):
        self.plan = plan
        self.runtime = runtime
        self.input_options = input_options
        # Tasks may start together (keras-dist launch --ps): connecting
        # before a task listens would fail.
        wait_until_listening(plan.cluster)
        resolver = tf.distribute.cluster_resolver.SimpleClusterResolver(
            tf.train.ClusterSpec(plan.cluster),
            task_type="chief",
            task_id=0,
            rpc_layer="grpc",
        )
        super().__init__(
            plan.devices,
            tf.distribute.ParameterServerStrategy(
                resolver, variable_partitioner=plan.variable_partitioner
            ),
        )
        self.coordinator = tf.distribute.coordinator.ClusterCoordinator(
            self.tf_strategy
        )

    def attach(self, model) -> None:
        """Checks that `model` was built in the scope and is not sharded."""
        self.check_model_strategy(model)
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
        """`value` fetched to the chief; summed or averaged over `axis`."""
        value = _fetch(value)
        if axis is None:
            return value
        reduce = np.sum if str(op).lower().endswith("sum") else np.mean
        return reduce(np.asarray(value), axis=axis)

    def gather(self, value, axis):
        """`value` fetched to the chief (one value: nothing to join)."""
        return _fetch(value)

    def distribute_dataset(self, dataset):
        """A per-worker dataset (`dataset`, or a function building one)."""
        return self.coordinator.create_per_worker_dataset(dataset)

    def local_results(self, value):
        """`value` fetched to the chief, as the one local result."""
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


def create_engine(plan, runtime, input_options):
    """The engine of a `ParameterServerPlan`."""
    return ParameterServerEngine(plan, runtime, input_options)

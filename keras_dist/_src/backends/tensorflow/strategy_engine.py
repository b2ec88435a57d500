"""What every TensorFlow engine over one tf.distribute strategy shares.

`StrategyEngine` holds the engine contract's glue that is the same for
every strategy (`contract.Engine`): the replica count, the scopes, the
arguments of `fit`/`evaluate`/`predict` passed as they are, `run`,
`reduce`, `gather`, the local results and replicated placement, all on
`self.tf_strategy`, and the check that a model was built in its scope.
The engines subclass it: `engine.ReplicaEngine` (keras_dist's exact step:
Mirrored, MultiWorkerMirrored, CentralStorage, OneDevice), `tpu.TPUEngine`
and `parameter_server.ParameterServerEngine`, which override what their
strategy does otherwise.

Everything here runs once per call of the engine, never per step inside
a traced step function.
"""

from __future__ import annotations

import tensorflow as tf

from keras_dist._src.backends.contract import EngineDefaults
from keras_dist._src.errors import VariablesOutsideScopeError
from keras_dist._src.keras_glue import internals as glue
from keras_dist._src.values import PerReplica, ReduceOp


class StrategyEngine(EngineDefaults):
    """The engine contract on the tf.distribute strategy `tf_strategy`.

    Args:
        devices: this process's devices (keras_dist names).
        tf_strategy: the `tf.distribute.Strategy` the engine runs on.
    """

    devices: tuple
    #: What a model built outside the scope lacks (said by `attach`).
    outside_scope_effect = "its variables are not mirrored"

    def __init__(self, devices, tf_strategy):
        self.devices = tuple(devices)
        self.tf_strategy = tf_strategy

    @property
    def num_replicas_in_sync(self) -> int:
        """Replicas taking part in each step, over all workers."""
        return self.tf_strategy.num_replicas_in_sync

    def scope(self):
        """The strategy's scope: variables created in it are distributed."""
        return self.tf_strategy.scope()

    def call_scope(self):
        """The scope fit/evaluate/predict run in."""
        return self.tf_strategy.scope()

    def prepare_call(self, name, method, args, kwargs):
        """The arguments of `name` (fit, evaluate, ...) unchanged."""
        return args, kwargs

    def attach(self, model) -> None:
        """Checks that `model` was created in the strategy's scope."""
        self.check_model_strategy(model)

    def check_model_strategy(self, model) -> None:
        """Raises unless `model` was created in this strategy's scope.

        Raises:
            VariablesOutsideScopeError: naming the model and the fix.
        """
        if glue.tf_distribute_strategy(model) is not self.tf_strategy:
            raise VariablesOutsideScopeError(
                f"Model {model.name!r} was created outside strategy.scope(), "
                f"so {self.outside_scope_effect}. Create the model (not only "
                "compile it) inside `with strategy.scope():`."
            )

    def run(self, fn, args, kwargs):
        """`fn` once per replica (`tf.distribute.Strategy.run`)."""
        return self.tf_strategy.run(fn, args=args, kwargs=kwargs)

    def reduce(self, op, value, axis):
        """`value`'s replicas reduced with `op` (and over `axis`)."""
        if isinstance(value, PerReplica):
            value = self._to_distributed(value)
        tf_op = tf.distribute.ReduceOp[ReduceOp.from_any(op).value]
        return self.tf_strategy.reduce(tf_op, value, axis=axis)

    def gather(self, value, axis):
        """`value`'s replicas concatenated along `axis`."""
        if isinstance(value, PerReplica):
            value = self._to_distributed(value)
        return self.tf_strategy.gather(value, axis=axis)

    def distribute_dataset(self, dataset):
        """`dataset` split across the replicas by the strategy."""
        return self.tf_strategy.experimental_distribute_dataset(dataset)

    def local_results(self, value):
        """The values of `value` on this process's replicas."""
        return tuple(self.tf_strategy.experimental_local_results(value))

    def placement(self, variable):
        """Replicated: every device holds the whole variable."""
        shape = tuple(variable.shape)
        return (None,) * len(shape), shape

    def _to_distributed(self, per_replica):
        values = per_replica.values
        return self.tf_strategy.experimental_distribute_values_from_function(
            lambda ctx: values[ctx.replica_id_in_sync_group]
        )

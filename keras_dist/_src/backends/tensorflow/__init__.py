"""The TensorFlow backend of keras_dist (see `engine`).

Same inner files as every backend: `devices`, `runtime`, `data_parallel`,
`inputs`, `batch_norm`, `sharded`; this module re-exports the contract's
functions and holds `ENGINES`, the registry of plan type -> engine.

`strategy_engine.StrategyEngine` is the engine contract's glue shared by
every engine over one tf.distribute strategy (`tpu.TPUEngine` and
`parameter_server.ParameterServerEngine` subclass it directly);
`engine.ReplicaEngine` extends it for every strategy with a replica per
device (the exact per-replica step: `replica_step`,
`replica_losses`, `gradients`, `step_context`); the policies subclass it:
`mirrored`, `multi_worker`, `central_storage` (`one_device` keeps Keras's
own step). `data_parallel.create_engine` picks the policy of a
`ReplicatedPlan`.
"""

from keras_dist._src import plan as _plan
from keras_dist._src.backends import dispatch as _dispatch
from keras_dist._src.backends.contract import Capabilities as _Capabilities
from keras_dist._src.backends.tensorflow import (
    central_storage,
    data_parallel,
    parameter_server,
    sharded,
    tpu,
)
from keras_dist._src.backends.tensorflow.devices import (
    default_devices,
    export_state,
    host_array,
    import_state,
    list_devices,
    nameable_devices,
    simulate_cpu_devices,
    variables_distributed,
)
from keras_dist._src.backends.tensorflow.doctor import (
    all_reduce_check,
    framework_versions,
)
from keras_dist._src.backends.tensorflow.runtime import create_runtime
from keras_dist._src.framework_glue import (
    tensorflow_private as _tensorflow_private,
)

#: Which engine runs each plan type (a strategy's plan -> its policy).
ENGINES = {
    _plan.ReplicatedPlan: data_parallel.create_engine,
    _plan.LayoutPlan: sharded.create_engine,
    _plan.ShardedPlan: sharded.create_engine,
    _plan.CentralStoragePlan: central_storage.create_engine,
    _plan.TPUPlan: tpu.create_engine,
    _plan.ParameterServerPlan: parameter_server.create_engine,
}


def create_engine(plan, runtime, input_options):
    """This process's engine for `plan` (chosen by the plan's type)."""
    return _dispatch(ENGINES, plan, runtime, input_options)


NAME = "tensorflow"
#: What the shared code needs to know of this backend.
CAPABILITIES = _Capabilities(
    native_tf_data=True,
    refused_plans=(_plan.LayoutPlan, _plan.ShardedPlan),
    op_seed_generator=_tensorflow_private.eager_op_seed_generator,
    connect_tpu=tpu.connect_tpu,
)

__all__ = [
    "CAPABILITIES",
    "NAME",
    "all_reduce_check",
    "create_engine",
    "create_runtime",
    "default_devices",
    "export_state",
    "framework_versions",
    "host_array",
    "import_state",
    "list_devices",
    "nameable_devices",
    "simulate_cpu_devices",
    "variables_distributed",
]

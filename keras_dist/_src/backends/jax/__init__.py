"""The JAX backend of keras_dist (see `data_parallel` for how it trains).

Same inner files as every backend: `devices`, `runtime`, `data_parallel`,
`inputs`, `batch_norm`, `sharded`; this module re-exports the contract's
functions and holds `ENGINES`, the registry of plan type -> engine.
"""

from keras_dist._src import plan as _plan
from keras_dist._src.backends import dispatch as _dispatch
from keras_dist._src.backends.contract import Capabilities as _Capabilities
from keras_dist._src.backends.jax import (
    central_storage,
    data_parallel,
    sharded,
    tpu,
)
from keras_dist._src.backends.jax.devices import (
    default_devices,
    export_state,
    host_array,
    import_state,
    list_devices,
    nameable_devices,
    simulate_cpu_devices,
    variables_distributed,
)
from keras_dist._src.backends.jax.doctor import (
    all_reduce_check,
    framework_versions,
)
from keras_dist._src.backends.jax.runtime import create_runtime
from keras_dist._src.backends.parameter_server import unsupported_engine

#: Which engine runs each plan type (a strategy's plan -> its policy).
ENGINES = {
    _plan.ReplicatedPlan: data_parallel.create_engine,
    _plan.LayoutPlan: sharded.create_engine,
    _plan.ShardedPlan: sharded.create_engine,
    _plan.CentralStoragePlan: central_storage.create_engine,
    _plan.TPUPlan: tpu.create_engine,
    _plan.ParameterServerPlan: unsupported_engine,
}


def create_engine(plan, runtime, input_options):
    """This process's engine for `plan` (chosen by the plan's type)."""
    return _dispatch(ENGINES, plan, runtime, input_options)


NAME = "jax"
#: What the shared code needs to know of this backend.
CAPABILITIES = _Capabilities(
    stateful_train_function=True,
    refused_plans=(_plan.ParameterServerPlan,),
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

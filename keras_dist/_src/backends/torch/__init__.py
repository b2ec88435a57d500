"""The PyTorch backend of keras_dist (see `engine`).

Same inner files as every backend: `devices`, `runtime`, `engine`,
`data_parallel`, `inputs`, `batch_norm`, `sharded`; this module re-exports
the contract's functions and holds `ENGINES`, the registry of plan type ->
engine. One engine (`engine.TorchEngine`, a process per device) holds the
glue every plan needs; each plan type has a small policy subclass of it:
`data_parallel.MirroredEngine` (replicated variables, DDP) and
`sharded.DTensorEngine` (DTensor layouts over a mesh).
"""

from keras_dist._src import plan as _plan
from keras_dist._src.backends import dispatch as _dispatch
from keras_dist._src.backends.contract import Capabilities as _Capabilities
from keras_dist._src.backends.parameter_server import unsupported_engine
from keras_dist._src.backends.torch import (
    central_storage,
    data_parallel,
    sharded,
    tpu,
)
from keras_dist._src.backends.torch.devices import (
    default_devices,
    export_state,
    host_array,
    import_state,
    list_devices,
    nameable_devices,
    simulate_cpu_devices,
    variables_distributed,
)
from keras_dist._src.backends.torch.doctor import (
    all_reduce_check,
    framework_versions,
)
from keras_dist._src.backends.torch.runtime import create_runtime

#: Which engine runs each plan type (a strategy's plan -> its policy).
ENGINES = {
    _plan.ReplicatedPlan: data_parallel.create_engine,
    _plan.LayoutPlan: sharded.create_engine,
    _plan.ShardedPlan: sharded.create_engine,
    _plan.ParameterServerPlan: unsupported_engine,
    _plan.CentralStoragePlan: central_storage.create_engine,
    _plan.TPUPlan: tpu.create_engine,
}


def create_engine(plan, runtime, input_options):
    """This process's engine for `plan` (chosen by the plan's type)."""
    return _dispatch(ENGINES, plan, runtime, input_options)


NAME = "torch"
#: What the shared code needs to know of this backend.
CAPABILITIES = _Capabilities(
    process_per_device=True,
    refused_plans=(
        _plan.ParameterServerPlan,
        _plan.CentralStoragePlan,
        _plan.TPUPlan,
    ),
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

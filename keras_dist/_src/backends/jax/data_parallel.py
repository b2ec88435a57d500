"""JAX data parallelism: the policy of replicated variables.

Variables are replicated (`NamedSharding(mesh, P())`) and each batch is
sharded along its first axis (`P("keras_dist_replica")`) by the one JAX
engine (`engine.SPMDEngine`); XLA's SPMD partitioner inserts the gradient
all-reduce. Keras's own JAX trainer already lays variables out this way
when a `keras.distribution.Distribution` is active, so the policy hands the
engine one (an exact variant of `DataParallel`) for the strategy scope.

A batch whose size does not divide by the replica count (the last one of
an epoch, say) is replicated instead of sharded: every device computes the
same, exact result, and nothing is padded or dropped. One device needs no
mesh at all (`OneDeviceEngine`: Keras's own step, placed on it).
"""

from __future__ import annotations

import jax
import numpy as np
from jax.sharding import Mesh
from keras import distribution as keras_distribution

from keras_dist._src.backends.contract import EngineDefaults
from keras_dist._src.backends.jax.devices import BATCH_AXIS, devices_by_name
from keras_dist._src.backends.jax.engine import (
    SPMDEngine,
    gather_parts,
    reduce_parts,
)
from keras_dist._src.backends.jax.inputs import distribute_dataset
from keras_dist._src.devices import normalize_device
from keras_dist._src.errors import VariablesOutsideScopeError
from keras_dist._src.values import local_results


class _ExactDataParallel(keras_distribution.DataParallel):
    """`DataParallel` that replicates batches it cannot split evenly."""

    def get_data_layout(self, data_shape):
        num = self.device_mesh.shape[0]
        if len(data_shape) == 0 or data_shape[0] is None:
            return super().get_data_layout(data_shape)
        if data_shape[0] % num != 0:
            return keras_distribution.TensorLayout(
                [None] * len(data_shape), self.device_mesh
            )
        return super().get_data_layout(data_shape)


class OneDeviceEngine(EngineDefaults):
    """Everything placed on one device; Keras's own step, unchanged."""

    def __init__(self, device: str):
        self.devices = (device,)
        self._device = devices_by_name()[device]

    @property
    def num_replicas_in_sync(self) -> int:
        return 1

    def scope(self):
        return jax.default_device(self._device)

    def call_scope(self):
        return jax.default_device(self._device)

    def prepare_call(self, name, method, args, kwargs):
        return args, kwargs

    def attach(self, model) -> None:
        for variable in model.variables:
            devices = variable.value.devices()
            if devices != {self._device}:
                where = (
                    "under another strategy over several devices"
                    if len(devices) > 1
                    else "outside strategy.scope()"
                )
                raise VariablesOutsideScopeError(
                    f"Variable {variable.path!r} of model {model.name!r} "
                    f"lives on {sorted(map(str, devices))}, not on "
                    f"{self.devices[0]}: it was created {where}. Build "
                    "the model inside the scope of the strategy that "
                    "trains it."
                )

    def run(self, fn, args, kwargs):
        with self.scope():
            return fn(*args, **kwargs)

    def reduce(self, op, value, axis):
        return reduce_parts(op, value, axis, 1)

    def gather(self, value, axis):
        return gather_parts(value, axis)

    def local_results(self, value):
        return local_results(value)

    def placement(self, variable):
        """Replicated: every device holds the whole variable."""
        shape = tuple(variable.shape)
        return (None,) * len(shape), shape

    def distribute_dataset(self, dataset):
        return distribute_dataset(dataset, [self._device])


class ReplicatedPolicy:
    """Every variable replicated over a 1-D mesh of `devices`."""

    batch_axis = BATCH_AXIS

    def __init__(self, devices):
        by_name = devices_by_name()
        self.devices = tuple(devices)
        self.mesh = Mesh(
            np.array([by_name[d] for d in self.devices]), (BATCH_AXIS,)
        )
        device_mesh = keras_distribution.DeviceMesh(
            shape=(len(self.devices),),
            axis_names=[BATCH_AXIS],
            devices=list(self.devices),
        )
        self.distribution = _ExactDataParallel(
            device_mesh=device_mesh, auto_shard_dataset=False
        )

    def check_variables(self, model) -> None:
        """Every variable must be mirrored on every device of the mesh."""
        mesh_devices = set(self.mesh.devices.flat)
        for variable in model.variables:
            sharding = variable.value.sharding
            if set(sharding.device_set) != mesh_devices:
                raise VariablesOutsideScopeError(
                    f"Variable {variable.path!r} of model {model.name!r} is "
                    f"not mirrored on {list(self.devices)}: it was created "
                    "outside strategy.scope(). Build (and load weights into) "
                    "the model inside `with strategy.scope():`."
                )

    def check_built(self, model) -> None:
        """Nothing to check: any variable can be replicated."""
        del model


class MirroredEngine(SPMDEngine):
    """Replicated variables, batch-sharded data, one jitted SPMD step (over
    the devices of every process when the runtime spans several)."""

    def __init__(self, plan, runtime, input_options=None):
        super().__init__(
            ReplicatedPolicy(plan.devices), plan, runtime, input_options
        )


def create_engine(plan, runtime, input_options):
    """The engine of a `ReplicatedPlan`: one device needs no mesh at all
    (Keras's own step, placed on it); otherwise `MirroredEngine`."""
    devices = [normalize_device(d) for d in plan.devices]
    if len(devices) == 1 and runtime.world_size == 1:
        return OneDeviceEngine(devices[0])
    return MirroredEngine(plan, runtime, input_options)

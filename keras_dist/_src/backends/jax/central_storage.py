"""JAX CentralStorage: variables in host memory, computation on devices.

The policy of `CentralStorageStrategy`: every variable (model, optimizer
and metric state) is replicated over the mesh of the compute devices, as
under `MirroredStrategy`, but lives in host memory (``memory_kind=
"pinned_host"`` where the devices offer it, else ``"unpinned_host"``)
between steps. Each jitted step moves the state to device memory
(`jax.device_put` with a ``"device"`` memory kind inside the step), runs
Keras's own step on the global batch (XLA inserts the gradient
all-reduce) and writes the new state back to host memory (the step's
output shardings). Device memory holds the state only while a step runs.
"""

from __future__ import annotations

import contextlib
import weakref

import jax

from keras_dist._src.backends.jax import engine as engine_lib
from keras_dist._src.backends.jax import steps as steps_lib
from keras_dist._src.backends.jax.data_parallel import ReplicatedPolicy
from keras_dist._src.errors import UnsupportedBackendError
from keras_dist._src.keras_glue import internals as glue

#: Host memory kinds, the preferred first.
HOST_MEMORY_KINDS = ("pinned_host", "unpinned_host")


def host_memory_kind(devices) -> str:
    """The host memory kind every one of `devices` can address.

    Raises:
        UnsupportedBackendError: when some device addresses no host memory.
    """
    for kind in HOST_MEMORY_KINDS:
        if all(
            kind in {m.kind for m in d.addressable_memories()} for d in devices
        ):
            return kind
    offered = sorted(
        {m.kind for d in devices for m in d.addressable_memories()}
    )
    raise UnsupportedBackendError(
        "CentralStorageStrategy on JAX keeps variables in host memory, but "
        f"these devices address only the memory kinds {offered} (none of "
        f"{list(HOST_MEMORY_KINDS)}). Use MirroredStrategy on this platform."
    )


class HostPolicy(ReplicatedPolicy):
    """Replicated variables over the compute devices, in host memory."""

    def __init__(self, devices):
        super().__init__(devices)
        self.memory_kind = host_memory_kind(list(self.mesh.devices.flat))


class CentralStorageEngine(engine_lib.SPMDEngine):
    """The SPMD engine with its state kept in host memory between steps."""

    def __init__(self, plan, runtime, input_options=None):
        policy = HostPolicy(plan.devices)
        super().__init__(policy, plan, runtime, input_options)
        self.memory_kind = policy.memory_kind
        self.parameter_device = self.memory_kind
        self._models = weakref.WeakSet()
        self._depth = 0

    def sharding_of(self, value):
        """Every state value is kept in host memory."""
        sharding = super().sharding_of(value)
        return sharding.with_memory_kind(self.memory_kind)

    def attach(self, model) -> None:
        """Installs the steps that compute on the devices.

        Keras's symbolic build (before a first `fit` or `evaluate`, after a
        `predict`, say) traces the model with its variables' values as
        constants, which must be in device memory: it gets them there (the
        call moves them back to host memory at its end).
        """
        self.policy.check_variables(model)
        _HostStepFunctions(self, model).install()

        @contextlib.contextmanager
        def on_device_if_building():
            if glue.symbolic_build_pending(model):
                self._place(model, "device")
            yield

        glue.symbolic_build_in(model, on_device_if_building)
        self._models.add(model)

    @contextlib.contextmanager
    def call_scope(self):
        """fit/evaluate/predict; when the outermost one ends, every variable
        of the attached models is in host memory (Keras writes the step's
        state back into them with their device layouts)."""
        self._depth += 1
        try:
            with super().call_scope():
                yield
        finally:
            self._depth -= 1
            if self._depth == 0:
                self.to_host()

    def to_host(self) -> None:
        """Moves every variable of the attached models (model, optimizer
        and metric state) to host memory."""
        for model in list(self._models):
            self._place(model, self.memory_kind)

    def _place(self, model, memory_kind) -> None:
        """Moves every variable of `model` (model, optimizer and metric
        state) to `memory_kind`, each keeping its device layout."""
        optimizer = getattr(model, "optimizer", None)
        variables = list(model.variables) + list(model.metrics_variables)
        if optimizer is not None:
            variables += list(optimizer.variables)
        for variable in variables:
            value = glue.variable_value(variable)
            if not isinstance(value, jax.Array):
                continue
            sharding = self.sharding_of(value).with_memory_kind(memory_kind)
            if value.sharding != sharding:
                glue.set_variable_value(
                    variable, jax.device_put(value, sharding)
                )


class _HostStepFunctions(steps_lib.StepFunctions):
    """Keras's steps, with the state moved to the devices at the start of
    each step and back to host memory at its end."""

    def _compile(self, step, out_shardings):
        host = out_shardings[1]

        def staged(state, data):
            device_state = jax.tree_util.tree_map(
                lambda x, s: jax.device_put(x, s.with_memory_kind("device")),
                state,
                host,
            )
            outputs, new_state = step(device_state, data)
            new_state = jax.tree_util.tree_map(jax.device_put, new_state, host)
            return outputs, new_state

        return super()._compile(staged, out_shardings)


def create_engine(plan, runtime, input_options):
    """The engine of a `CentralStoragePlan` (one process)."""
    if runtime.world_size > 1:
        raise UnsupportedBackendError(
            "CentralStorageStrategy runs on the devices of one host; this "
            f"job has {runtime.world_size} processes. Use "
            "MultiWorkerMirroredStrategy for several hosts."
        )
    return CentralStorageEngine(plan, runtime, input_options)

"""The contract every backend implements, written down once.

A backend is a package (``keras_dist._src.backends.<name>``) with the same
inner modules as every other (`INNER_MODULES`) and the free functions of
`BackendModule`. Its `create_runtime` returns a `Runtime` (cluster
membership and host-value collectives, `keras_dist._src.runtime`) and its
`create_engine` the engine of a strategy's plan, an `Engine` (a registry
`ENGINES` maps plan types to each backend's policies).
`tests/test_contract.py` checks every backend against all of it (same
signatures), and `tests/test_runtime.py` checks the runtimes' behaviour.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from typing import Any, Protocol, runtime_checkable

from keras_dist._src.backends.capability import (
    Capabilities as _Capabilities,
)
from keras_dist._src.plan import TOPOLOGIES
from keras_dist._src.runtime import Runtime


@runtime_checkable
class Engine(Protocol):
    """Runs replicated computation on a fixed list of devices."""

    devices: tuple[str, ...]

    @property
    def num_replicas_in_sync(self) -> int:
        """Number of replicas that take part in each step."""

    def scope(self) -> contextlib.AbstractContextManager:
        """Context in which variables are created mirrored."""

    def call_scope(self) -> contextlib.AbstractContextManager:
        """Context around `fit`/`evaluate`/`predict` of an attached model."""

    def prepare_call(
        self, name: str, method: Callable, args: tuple, kwargs: dict
    ) -> tuple[tuple, dict]:
        """Adjusts the arguments of an attached model's `name` call."""

    def attach(self, model) -> None:
        """Validates `model` and installs the replicated step functions."""

    def run(self, fn: Callable, args: tuple, kwargs: dict) -> Any:
        """Calls `fn` once per replica; returns per-replica results."""

    def reduce(self, op, value, axis: int | None) -> Any:
        """Combines a per-replica `value` across replicas."""

    def gather(self, value, axis: int) -> Any:
        """Concatenates a per-replica `value` along `axis`."""

    def distribute_dataset(self, dataset) -> Any:
        """Returns an iterable of per-replica batches of `dataset`."""

    def local_results(self, value) -> tuple:
        """Returns the per-replica parts of `value`."""

    def placement(self, variable) -> tuple[tuple, tuple]:
        """The layout of `variable` over the mesh (one entry per dimension:
        None, an axis name or a tuple of names) and the shape of the
        shard one device holds."""


class EngineDefaults:
    """What an engine has unless it says otherwise: the optional
    capabilities of an `Engine` (`OPTIONAL_ENGINE_CAPABILITIES`), declared
    once with their defaults. Every backend's engine classes derive from
    it, so that the front end reads ``engine.mesh`` or calls
    ``engine.lay_out(model)`` without asking whether the engine has them
    (`tests/test_contract.py` checks that every engine class does)."""

    #: The engine's device mesh (a JAX `Mesh`, or the plan's
    #: `DeviceMesh` on torch), or None for an engine without one.
    mesh = None
    #: ``model_methods(model) -> {name: bound method}``: calls of an
    #: attached model that the engine runs itself (ParameterServerStrategy
    #: runs `fit`'s coordinator loop), or None: Keras's own.
    model_methods = None

    def lay_out(self, model) -> None:
        """Places a built model's variables (optimizer's included) where
        the engine places variables itself after they are made (torch's
        DTensor variables); engines whose variables take their place when
        created (JAX, TensorFlow) do nothing."""


#: The optional capabilities `EngineDefaults` declares.
OPTIONAL_ENGINE_CAPABILITIES = ("mesh", "model_methods", "lay_out")


# What a backend declares it can do (`backends.capabilities()`).
Capabilities = _Capabilities


class BackendModule(Protocol):
    """Free functions of a backend module (``keras_dist._src.backends.<b>``)."""

    NAME: str
    CAPABILITIES: Capabilities

    def list_devices(self, device_type: str | None = None) -> list[str]:
        """Devices this process can use, as ``"type:index"`` names."""

    def nameable_devices(self, device_type: str | None = None) -> list[str]:
        """Devices a strategy may name (torch: one CPU device per core)."""

    def default_devices(self) -> list[str]:
        """Devices a `MirroredStrategy()` without arguments uses."""

    def simulate_cpu_devices(self, count: int) -> None:
        """Splits the host CPU into `count` devices; before backend start."""

    def host_array(self, value):
        """The whole value of a tensor or variable as a NumPy array on the
        host (gathered if it is sharded; may be a collective)."""

    def export_state(self, value, is_chief: bool = True):
        """The parts of `value` this process writes into a checkpoint, with
        no cross-process gather: ``(global_shape, [(start_offsets, numpy
        array), ...])`` (a sharded value: the shards this process owns,
        each written by one process; a whole value: by the chief only)."""

    def import_state(self, variable, reader) -> None:
        """Sets `variable` from a checkpoint whatever layout it was saved
        under: reads (``reader(index)``, a tuple of slices or None for the
        whole value, returning a NumPy array) only the regions this
        process holds."""

    def variables_distributed(self, model) -> bool:
        """Whether `model` has variables placed by a multi-device strategy."""

    def create_runtime(
        self, kind: str, devices: Sequence[str], environment
    ) -> Runtime:
        """This process's `Runtime` for a strategy of topology `kind`
        (`plan.TOPOLOGIES`; may join the job: e.g.
        `jax.distributed.initialize`, a torch process group)."""

    def create_engine(self, plan, runtime: Runtime, input_options) -> Engine:
        """Returns this process's engine for `plan` (a `plan.Plan`), chosen
        by the plan's type from the backend's `ENGINES` registry."""

    def framework_versions(self) -> dict:
        """The framework's package versions (`keras-dist doctor`)."""

    def all_reduce_check(self, devices: list[str]) -> tuple[float, float, str]:
        """One all-reduce over `devices` with the framework's own
        collectives (`keras-dist doctor`): ``(result, expected, what it
        reduced over)``."""


#: Topologies a backend's `create_runtime` accepts.
KINDS = TOPOLOGIES
#: Inner modules every backend package has (the same layout everywhere).
INNER_MODULES = (
    "devices",
    "runtime",
    "engine",
    "data_parallel",
    "sharded",
    "central_storage",
    "tpu",
    "inputs",
    "batch_norm",
    "doctor",
)

CONTRACT_FUNCTIONS = (
    "list_devices",
    "nameable_devices",
    "default_devices",
    "simulate_cpu_devices",
    "variables_distributed",
    "host_array",
    "export_state",
    "import_state",
    "create_runtime",
    "create_engine",
    "framework_versions",
    "all_reduce_check",
)
ENGINE_METHODS = (
    "scope",
    "call_scope",
    "prepare_call",
    "attach",
    "run",
    "reduce",
    "gather",
    "distribute_dataset",
    "local_results",
    "placement",
)

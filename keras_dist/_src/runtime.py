"""The Runtime: host-level services every backend gives a strategy.

A Runtime knows where this process stands in the job (from a
`ClusterEnvironment`) and moves *host values* between processes: barrier,
broadcast, all-reduce and all-gather of (nested) NumPy arrays and Python
scalars or strings. Checkpointing (chief writes, others wait), preemption
(agree on the step to stop at) and metrics use it; it is written once here
over four primitives on flat 1-D arrays that each backend implements with
its own engine (`torch.distributed`, `jax.experimental.multihost_utils`,
tf.distribute's collective ops). Device-side collectives of the replicated
step stay in each backend's data-parallel code.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any, Protocol, runtime_checkable

import numpy as np
from keras import tree

from keras_dist._src.cluster.environments import (
    ClusterEnvironment,
    detect_environment,
)
from keras_dist._src.plan import Topology

REDUCE_OPS = ("sum", "mean", "max", "min")


@runtime_checkable
class Runtime(Protocol):
    """Cluster membership and host-value collectives of one process."""

    environment: ClusterEnvironment

    @property
    def rank(self) -> int:
        """This process's index in the job (worker index)."""

    @property
    def world_size(self) -> int:
        """Number of processes in the job."""

    @property
    def local_rank(self) -> int:
        """Index among the processes of this host."""

    @property
    def is_chief(self) -> bool:
        """Whether this is process 0 (it prints and writes files)."""

    def barrier(self, name: str = "barrier") -> None:
        """Returns once every process has called `barrier`."""

    def broadcast(self, value: Any, root: int = 0) -> Any:
        """Returns process `root`'s `value` on every process."""

    def all_reduce(self, value: Any, op: str = "sum") -> Any:
        """Combines `value` over processes with ``sum/mean/max/min``."""

    def all_gather(self, value: Any) -> list:
        """Returns every process's `value`, in rank order."""

    def shutdown(self) -> None:
        """Leaves the job (idempotent); called at exit."""


class HostRuntime:
    """Implements `Runtime` over four primitives on flat 1-D arrays.

    Subclasses implement ``_barrier()``, ``_broadcast(flat, root)``,
    ``_all_reduce(flat, op)`` and ``_all_gather(flat)`` (same length on every
    process). Values may be nested structures (lists, tuples, dicts) of NumPy
    arrays, Python numbers, bools and strings; arrays keep dtype and shape,
    numbers come back as Python numbers. Strings are broadcast and gathered
    (not reduced), and may differ in length between processes.
    """

    environment: ClusterEnvironment

    def __init__(self, environment: ClusterEnvironment | None = None):
        self.environment = environment or ClusterEnvironment()

    @property
    def rank(self) -> int:
        """This process's index in the job (worker index)."""
        return self.environment.rank

    @property
    def world_size(self) -> int:
        """Number of processes in the job."""
        return self.environment.world_size

    @property
    def local_rank(self) -> int:
        """Index among the processes of this host."""
        return self.environment.local_rank

    @property
    def is_chief(self) -> bool:
        """Whether this is process 0 (it prints and writes files)."""
        return self.rank == 0

    # -- public collectives ---------------------------------------------------
    def barrier(self, name: str = "barrier") -> None:
        """Returns once every process has called `barrier`."""
        del name
        if self.world_size > 1:
            self._barrier()

    def broadcast(self, value: Any, root: int = 0) -> Any:
        """Returns process `root`'s `value` on every process.

        Every process passes a value of the same structure (arrays of the
        same shape and dtype); strings may differ.
        """
        self._check_root(root)
        if self.world_size == 1:
            return _copy(value)

        def leaf(x):
            if isinstance(x, str):
                data = np.frombuffer(x.encode(), np.uint8)
                size = self._broadcast(np.array([data.size], np.float64), root)
                buffer = np.zeros(int(size[0]), np.float64)
                if self.rank == root:
                    buffer[:] = data
                out = self._broadcast(buffer, root)
                return bytes(out.astype(np.uint8)).decode()
            array, restore = _to_flat(x)
            return restore(self._broadcast(array, root))

        return tree.map_structure(leaf, value)

    def all_reduce(self, value: Any, op: str = "sum") -> Any:
        """Combines `value` over processes; `op` is sum, mean, max or min."""
        op = str(op).lower()
        if op not in REDUCE_OPS:
            raise ValueError(f"Unknown reduce op {op!r}; use {REDUCE_OPS}.")
        if self.world_size == 1:
            return _copy(value)

        def leaf(x):
            if isinstance(x, str):
                raise TypeError("Strings cannot be all-reduced.")
            array, restore = _to_flat(x)
            if op == "mean":
                out = self._all_reduce(array, "sum") / self.world_size
            else:
                out = self._all_reduce(array, op)
            return restore(out, keep_float=op == "mean")

        return tree.map_structure(leaf, value)

    def all_gather(self, value: Any) -> list:
        """Returns every process's `value` (same structure), in rank order."""
        if self.world_size == 1:
            return [_copy(value)]
        leaves = tree.flatten(value)
        gathered = [[] for _ in range(self.world_size)]
        for x in leaves:
            if isinstance(x, str):
                parts = [
                    self.broadcast(x, root) for root in range(self.world_size)
                ]
            else:
                array, restore = _to_flat(x)
                parts = [restore(p) for p in self._all_gather(array)]
            for i, part in enumerate(parts):
                gathered[i].append(part)
        return [tree.pack_sequence_as(value, g) for g in gathered]

    def shutdown(self) -> None:
        """Leaves the job (nothing to do for one process)."""

    # -- the job's key-value store: no collective ------------------------------
    @property
    def has_key_values(self) -> bool:
        """Whether `publish` and `wait_for` work in this job."""
        return False

    def publish(self, key: str, text: str) -> None:
        """Sets `key` to `text` (non-empty) in the job's key-value store.

        Not a collective: no other process needs to call anything.
        """
        raise NotImplementedError(f"{type(self).__name__} has no key store")

    def wait_for(self, key: str, seconds: float) -> str | None:
        """The text some process published under `key`, once it has; None
        if nothing was published within `seconds`."""
        raise NotImplementedError(f"{type(self).__name__} has no key store")

    def _check_root(self, root: int) -> None:
        if not 0 <= root < self.world_size:
            raise ValueError(
                f"root {root} is outside 0..{self.world_size - 1}."
            )

    # -- primitives ----------------------------------------------------------
    def _barrier(self) -> None:
        raise NotImplementedError

    def _broadcast(self, flat: np.ndarray, root: int) -> np.ndarray:
        raise NotImplementedError

    def _all_reduce(self, flat: np.ndarray, op: str) -> np.ndarray:
        raise NotImplementedError

    def _all_gather(self, flat: np.ndarray) -> list[np.ndarray]:
        raise NotImplementedError

    def __repr__(self):
        return (
            f"{type(self).__name__}(rank={self.rank}, "
            f"world_size={self.world_size}, "
            f"source={self.environment.source!r})"
        )


class LocalRuntime(HostRuntime):
    """The runtime of a one-process job: every collective is the identity."""


@dataclasses.dataclass(frozen=True)
class Membership:
    """Whether this process trains alone or as one process of a job.

    Attributes:
        job: this process joins (or starts) a job of processes; False: it
            trains alone (a `LocalRuntime`).
        environment: where this process stands (None: nothing given or
            detected; a process-per-device backend then starts the other
            ranks itself).
    """

    job: bool
    environment: ClusterEnvironment | None = None


def membership(
    topology,
    devices: Sequence[str],
    environment: ClusterEnvironment | None,
    *,
    process_per_device: bool,
    in_job: Callable[[], bool] = lambda: False,
) -> Membership:
    """The one rule, for every backend, that turns a strategy's topology
    into "alone" or "one process of a job".

    - One device: alone.
    - A backend with a process per device (torch): one device outside a
      launched job (``in_job()``, asked only here: reading the launcher's
      variables can raise) and with no environment given is alone;
      anything else is a job (several devices on one host: the backend
      starts a process per device).
    - A backend whose one process drives several devices (JAX, TensorFlow):
      a multi-worker strategy joins the job its launcher describes (the
      given or detected environment); on one worker, and for every other
      topology, the process is alone.
    """
    topology = Topology(topology)
    if topology is Topology.ONE_DEVICE:
        return Membership(job=False)
    if process_per_device:
        if environment is None and len(devices) == 1 and not in_job():
            return Membership(job=False)
        if topology is Topology.MULTI_WORKER and environment is None:
            environment = detect_environment()
        return Membership(job=True, environment=environment)
    if topology is not Topology.MULTI_WORKER:
        return Membership(job=False)
    environment = environment or detect_environment()
    return Membership(environment.is_distributed, environment)


def _copy(value):
    return tree.map_structure(
        lambda x: x.copy() if isinstance(x, np.ndarray) else x, value
    )


def _to_flat(x):
    """A float64 (or int64) 1-D copy of `x`, and how to restore it."""
    if isinstance(x, (bool, np.bool_)):
        return np.array([float(x)]), lambda a, keep_float=False: bool(a[0])
    if isinstance(x, (int, np.integer)) and not isinstance(x, bool):
        return (
            np.array([x], np.int64),
            lambda a, keep_float=False: (
                float(a[0]) if keep_float else int(a[0])
            ),
        )
    if isinstance(x, (float, np.floating)):
        return np.array([x], np.float64), lambda a, keep_float=False: float(
            a[0]
        )
    array = np.asarray(x)
    shape, dtype = array.shape, array.dtype
    wide = np.int64 if np.issubdtype(dtype, np.integer) else np.float64

    def restore(a, keep_float=False):
        a = np.asarray(a).reshape(shape)
        return a if keep_float else a.astype(dtype)

    return array.reshape(-1).astype(wide), restore


def runtime_of(model=None) -> Runtime:
    """The runtime of `model`'s strategy, else of the active strategy's.

    Outside every strategy (a plain Keras model) it is a one-process
    `LocalRuntime`.
    """
    from keras_dist._src.context import current_strategy
    from keras_dist._src.keras_glue.hook import strategy_of

    strategy = strategy_of(model) if model is not None else None
    strategy = strategy or current_strategy()
    if strategy is None:
        return _LOCAL
    return strategy.runtime


_LOCAL = LocalRuntime()

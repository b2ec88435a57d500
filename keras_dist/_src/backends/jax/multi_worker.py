"""JAX over several processes: one SPMD step over every device of every
worker, through `jax.distributed`.

Each process runs the same program. The mesh spans the devices of all
processes; variables are replicated over it and each global batch is
sharded along its first axis. Every process reads the whole input (shard
policy DATA: the same global batches, since the chief's generator states
are replicated at the start of each call) and `jax.make_array_from_callback`
builds the global batch from each process's addressable shards, so no
process needs identical seeds and NumPy input works (both fail with
`keras.distribution` on several processes). Variables take the chief's
values when they are created and when a model is attached.
"""

from __future__ import annotations

import contextlib

import jax
import numpy as np
from jax.experimental import multihost_utils
from keras import tree

from keras_dist._src.backends.jax.data_parallel import MirroredEngine
from keras_dist._src.cluster.supervision import (
    ProgressWatchdog,
    liveness_timeout,
)
from keras_dist._src.core import policies
from keras_dist._src.core.lockstep import GatheredAdapter
from keras_dist._src.core.rng import replicate_chief_generators
from keras_dist._src.keras_glue import internals as glue


def _global_array(value, sharding):
    """A global array of `sharding` whose data is the host array `value`
    (the same on every process); no cross-process equality check."""
    host = np.asarray(value)
    return jax.make_array_from_callback(
        host.shape, sharding, lambda index: host[index]
    )


def _host_value(x):
    """This process's copy of a replicated (or local) array, on the host."""
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        return np.asarray(x.addressable_data(0))
    return np.asarray(x)


def _from_chief(value):
    """The chief's `value` (a host array) on every process."""
    return np.asarray(multihost_utils.broadcast_one_to_all(value))


class MultiWorkerEngine(MirroredEngine):
    """`MirroredEngine` whose mesh spans the devices of every process."""

    def __init__(self, devices, sync_batch_norm: bool, runtime, options):
        super().__init__(devices, sync_batch_norm)
        self.runtime = runtime
        self.input_options = options
        # Predictions and logs must be readable on every process.
        self.predict_out_shardings = (self.replicated, self.replicated)
        self._watchdog = None

    @contextlib.contextmanager
    def scope(self):
        def from_chief(original):
            def distribute_tensor(tensor, layout):
                # Variables created in the scope take the chief's initial
                # value.
                sharding = getattr(layout, "backend_layout", layout)
                if isinstance(tensor, jax.core.Tracer) or not isinstance(
                    sharding, jax.sharding.Sharding
                ):
                    return original(tensor, layout)
                return _global_array(_from_chief(_host_value(tensor)), sharding)

            return distribute_tensor

        restore = glue.replace_jax_distribute_tensor(from_chief)
        try:
            with super().scope():
                yield
        finally:
            restore()

    def prepare_call(self, name, method, args, kwargs):
        """FILE/OFF input: each process reads its share (`core.policies`)
        and `GatheredAdapter` assembles the global batches."""
        return policies.prepare_worker_call(
            self,
            name,
            method,
            args,
            kwargs,
            lambda inner, what: GatheredAdapter(
                inner, what, self.runtime, _process_allgather
            ),
        )

    @contextlib.contextmanager
    def call_scope(self):
        replicate_chief_generators(self.runtime)
        # XLA's CPU collectives wait forever for a hung peer: give up after
        # the liveness timeout without a step.
        outer = self._watchdog is None
        if outer:
            self._watchdog = ProgressWatchdog(
                self.runtime.rank, liveness_timeout()
            ).start()
        try:
            with super().call_scope():
                yield
        finally:
            if outer:
                self._watchdog.stop()
                self._watchdog = None

    def attach(self, model) -> None:
        super().attach(model)
        self.sync_variables(model.variables)

    def sync_variables(self, variables) -> None:
        """Gives every process the chief's values of `variables` (e.g. after
        the chief alone loaded weights)."""
        for variable in variables:
            value = _from_chief(_host_value(variable.value))
            glue.set_variable_value(
                variable, _global_array(value, self.replicated)
            )

    def place_batch(self, batch):
        """Global batch arrays built from every process's copy of it."""
        if self._watchdog is not None:
            self._watchdog.progress()  # the previous step has finished

        def place(x):
            if x is None:
                return None
            shape = np.shape(x)
            if shape and shape[0] % len(self.devices) == 0:
                return _global_array(x, self.sharded)
            return _global_array(x, self.replicated)

        return tree.map_structure(place, batch, none_is_leaf=True)

    def place_state(self, state):
        """Replicates state that is not yet a global replicated array (e.g.
        optimizer variables built at the first step) with the chief's
        values."""
        replicated = self.replicated

        def place(x):
            if getattr(x, "sharding", None) == replicated:
                return x
            return _global_array(_from_chief(_host_value(x)), replicated)

        return tree.map_structure(place, state)


def _process_allgather(arrays) -> list:
    """Every process's `arrays` (a list of NumPy arrays of the same shapes
    everywhere), in process order, through JAX's own collective. 64-bit
    values travel as uint32 pairs (JAX computes in 32 bits by default)."""

    def words(x):
        x = np.ascontiguousarray(x)
        if x.dtype.itemsize == 8 and x.ndim:
            return x.view(np.uint32)
        return x

    stacked = multihost_utils.process_allgather([words(x) for x in arrays])
    return [
        [
            np.asarray(g[w]).view(x.dtype)
            if x.dtype.itemsize == 8 and x.ndim
            else np.asarray(g[w])
            for g, x in zip(stacked, arrays)
        ]
        for w in range(jax.process_count())
    ]

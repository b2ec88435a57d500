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

import base64
import contextlib
import pickle

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
from keras_dist._src.core.rng import replicate_chief_generators
from keras_dist._src.keras_glue import data as keras_data


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

    def __init__(self, devices, sync_batch_norm: bool, runtime, policy):
        super().__init__(devices, sync_batch_norm)
        self.runtime = runtime
        self.shard_policy = policy
        # Predictions and logs must be readable on every process.
        self.predict_out_shardings = (self.replicated, self.replicated)
        self._watchdog = None

    @contextlib.contextmanager
    def scope(self):
        from keras.src.backend.jax import distribution_lib

        original = distribution_lib.distribute_tensor

        def distribute_tensor(tensor, layout):
            # Variables created in the scope take the chief's initial value.
            sharding = getattr(layout, "backend_layout", layout)
            if isinstance(tensor, jax.core.Tracer) or not isinstance(
                sharding, jax.sharding.Sharding
            ):
                return original(tensor, layout)
            return _global_array(_from_chief(_host_value(tensor)), sharding)

        distribution_lib.distribute_tensor = distribute_tensor
        try:
            with super().scope():
                yield
        finally:
            distribution_lib.distribute_tensor = original

    def prepare_call(self, name, method, args, kwargs):
        """FILE/OFF input: each process reads its share (`core.policies`)
        and `GatheredAdapter` assembles the global batches."""
        return policies.prepare_arguments(
            name,
            method,
            args,
            kwargs,
            self.shard_policy,
            self.runtime.rank,
            self.runtime.world_size,
            lambda inner, what: GatheredAdapter(self.runtime, inner, what),
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
            variable._value = _global_array(value, self.replicated)

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


def _pad(batch, rows):
    """`batch` with `rows` zero samples appended to every leaf."""

    def pad(x):
        if x is None or rows == 0:
            return x
        return np.concatenate([x, np.zeros((rows,) + x.shape[1:], x.dtype)])

    return tree.map_structure(pad, batch, none_is_leaf=True)


class GatheredAdapter(keras_data.DataAdapter):
    """Global batches assembled from every process's local batches.

    For shard policies FILE and OFF on JAX: `inner` is Keras's adapter over
    this process's share. Before each step the processes all-gather how
    many samples each holds; when none has a batch, iteration ends on every
    process at once. Each local batch is padded to the largest, gathered
    with `multihost_utils.process_allgather`, and the padding dropped, so
    step ``k``'s global batch is every process's ``k``-th local batch in
    process order (a process that ran out adds nothing) and every process
    holds it, as under DATA. Costs one all-gather of the batch a step.

    Args:
        runtime: the job's Runtime (for the structure of an empty share).
        inner: the Keras `DataAdapter` of this process's input.
        what: what the input is for, used in error messages.
    """

    def __init__(self, runtime, inner, what: str):
        self.runtime = runtime
        self.inner = inner
        self.what = what
        self._template = None
        count = inner.num_batches
        known = np.array([count is not None, count or 0], np.int64)
        gathered = multihost_utils.process_allgather(known)
        self._num_batches = (
            int(gathered[:, 1].max()) if gathered[:, 0].all() else None
        )

    def _global_batches(self):
        iterator = iter(self.inner.get_numpy_iterator())
        exhausted, first = False, True
        while True:
            batch = None
            if not exhausted:
                try:
                    batch = next(iterator)
                except StopIteration:
                    exhausted = True
            if batch is not None:
                batch = tree.map_structure(
                    lambda x: None if x is None else np.asarray(x),
                    batch,
                    none_is_leaf=True,
                )
                if self._template is None:
                    self._template = tree.map_structure(
                        lambda x: None if x is None else x[:0],
                        batch,
                        none_is_leaf=True,
                    )
            n_local = 0 if batch is None else policies.num_samples(batch)
            state = np.array([n_local, self._template is None], np.int64)
            sizes, lacking = multihost_utils.process_allgather(state).T
            if not sizes.any():
                if first:
                    raise ValueError(
                        f"The input of {self.what} yielded no batch on any "
                        "worker (an empty data set). Pass at least one "
                        "sample."
                    )
                return
            first = False
            if lacking.any():
                self._share_template()
            local = self._template if batch is None else batch
            padded = _pad(local, int(sizes.max()) - n_local)
            gathered = multihost_utils.process_allgather(padded)

            yield tree.map_structure(
                lambda x, sizes=sizes: (
                    None
                    if x is None
                    else np.concatenate([x[w, :n] for w, n in enumerate(sizes)])
                ),
                gathered,
                none_is_leaf=True,
            )

    def _share_template(self):
        """Gives a process that has had no batch the others' structure."""
        mine = "" if self._template is None else _encode(self._template)
        theirs = [t for t in self.runtime.all_gather(mine) if t]
        if self._template is None:
            self._template = pickle.loads(base64.b64decode(theirs[0]))

    def get_numpy_iterator(self):
        """Yields the global batches (NumPy), the same on every process."""
        return self._global_batches()

    def get_jax_iterator(self):
        """Yields the global batches (NumPy; the engine places them)."""
        return self._global_batches()

    def get_tf_dataset(self):
        raise NotImplementedError("GatheredAdapter is for the JAX backend.")

    def get_torch_dataloader(self):
        raise NotImplementedError("GatheredAdapter is for the JAX backend.")

    @property
    def num_batches(self):
        return self._num_batches

    @property
    def batch_size(self):
        return self.inner.batch_size

    @property
    def has_partial_batch(self):
        return None

    @property
    def partial_batch_size(self):
        return None

    def on_epoch_begin(self):
        self.inner.on_epoch_begin()

    def on_epoch_end(self):
        self.inner.on_epoch_end()


def _encode(template) -> str:
    return base64.b64encode(pickle.dumps(template)).decode("ascii")

"""JAX's one engine: a jitted SPMD step over a `Mesh`, for every plan.

What differs between plans is a small *policy* (`data_parallel.py`:
replicated variables; `sharded.py`: variables laid out over the mesh): the
mesh, the axis that splits the batch, the Keras `Distribution` that lays
out variables created in the scope, and the checks of a model's
variables. Everything else is here, once: placing batches (split along the
batch axis, or replicated when a batch does not divide), placing state with
each variable's own sharding, jitting Keras's own steps with those
shardings (`steps.StepFunctions`, with per-replica BatchNormalization),
custom loops, and — when the
mesh spans several processes (`jax.distributed`) — global arrays built from
each process's copy, the chief's initial values and the progress watchdog.

Because the step computes on the global batch, the loss is the global mean,
metrics are exact and BatchNormalization sees the statistics of the whole
batch; XLA's SPMD partitioner inserts the collectives (the gradient
all-reduce for replicated variables; all-gathers and reduce-scatters for
sharded ones).
"""

from __future__ import annotations

import collections
import contextlib

import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding, PartitionSpec
from keras import distribution as keras_distribution
from keras import tree

from keras_dist._src.backends.contract import EngineDefaults
from keras_dist._src.backends.jax.chief_values import (
    from_chief,
    parts_that_differ,
    process_allgather,
)
from keras_dist._src.backends.jax.devices import OWN_MESHES
from keras_dist._src.backends.jax.inputs import (
    distribute_dataset,
    select_replica,
    stack_outputs,
)
from keras_dist._src.backends.jax.steps import StepFunctions
from keras_dist._src.cluster.supervision import (
    ProgressWatchdog,
    liveness_timeout,
)
from keras_dist._src.core import policies
from keras_dist._src.core.lockstep import GatheredAdapter
from keras_dist._src.core.rng import replicate_chief_generators
from keras_dist._src.keras_glue import internals as glue
from keras_dist._src.options import InputOptions
from keras_dist._src.values import PerReplica, ReduceOp, local_results


class SPMDEngine(EngineDefaults):
    """One jitted SPMD step on global batches; a policy lays out state.

    Args:
        policy: the plan's policy (`mesh`, `batch_axis`, `distribution`,
            `check_variables(model)`, `describe_layout(variable)`).
        plan: the strategy's plan.
        runtime: this process's runtime; several processes make every
            array a global one.
        input_options: how input is sharded between processes.
    """

    def __init__(self, policy, plan, runtime, input_options=None):
        self.policy = policy
        self.plan = plan
        self.runtime = runtime
        self.input_options = input_options or InputOptions()
        self.sync_batch_norm = bool(plan.sync_batch_norm)
        self.devices = tuple(plan.devices)
        self.mesh = policy.mesh
        OWN_MESHES.add(self.mesh)
        self.batch_axis = policy.batch_axis
        self.replicated = NamedSharding(self.mesh, PartitionSpec())
        self.sharded = NamedSharding(self.mesh, PartitionSpec(self.batch_axis))
        self.distribution = policy.distribution
        self.multi_process = runtime.world_size > 1
        # Predictions and logs must be readable on every process.
        self.predict_out_shardings = (
            (self.replicated, self.replicated) if self.multi_process else None
        )
        self._watchdog = None
        if self.multi_process:
            glue.replace_variable_array(_gathering_array)
        # XLA's CPU runtime runs each simulated device's part of a step on a
        # shared pool of max(cores, devices) threads, and its all-reduce
        # blocks a thread until every device arrives. Each device admits 32
        # executions in flight; the launch of the 33rd blocks a pool thread.
        # With many steps queued (`fit` dispatches far ahead of a loaded
        # CPU), blocked launches can hold the threads the last device needs
        # to reach the all-reduce: after 40 s XLA aborts the process
        # ("Expected 4 threads to join the rendezvous, but only 3 of them
        # arrived"; Keras's own `DataParallel` aborts the same way). It is a
        # deadlock, not a slow thread: with XLA's rendezvous timeout raised to
        # 200 s, two of the four devices waited all 200 s. So on
        # CPU devices at most `max_in_flight` steps may be in flight, well
        # under XLA's 32. Measured with 64-step fits for 60 s under 8 busy
        # processes on 2 cores: unbounded (4 of 4 runs) and 30 in flight
        # (1 of 1) aborted; 16 (6 runs; 2 more under 12 busy processes),
        # 8 (3), 4 (4) and 2 (3) did not. In A/B runs of 96 repeats 8 in
        # flight stayed 2-4 % above unbounded dispatch and 16 level with it
        # (benchmarks/bench_fit.py); so 16. Accelerators
        # keep unbounded dispatch.
        self.max_in_flight = steps_in_flight(self.mesh.devices.flat)
        # An output of each dispatched step that may still run, oldest first.
        self.in_flight = collections.deque()

    def wait_for_last_step(self, keep: int = 0) -> None:
        """Blocks until at most `keep` dispatched steps may still run (a
        no-op where dispatch is unbounded)."""
        while len(self.in_flight) > keep:
            jax.block_until_ready(self.in_flight.popleft())

    @property
    def num_replicas_in_sync(self) -> int:
        """Replicas of the model: the size of the batch axis."""
        return int(self.mesh.shape[self.batch_axis])

    # -- scopes ---------------------------------------------------------------
    def scope(self):
        """Variables created here get the policy's layout from Keras (and,
        over several processes, the chief's initial values)."""
        return self.distribution_scope(self.distribution)

    @contextlib.contextmanager
    def distribution_scope(self, distribution):
        """`scope` with `distribution` (a Keras distribution over this
        engine's mesh) active."""
        restore = None
        if self.multi_process:
            restore = glue.replace_jax_distribute_tensor(_from_chief_tensor)
        try:
            with distribution.scope():
                yield
        finally:
            if restore is not None:
                restore()

    @contextlib.contextmanager
    def call_scope(self):
        """fit/evaluate/predict run with no Keras distribution active (also
        inside `strategy.scope()`): the step functions place state and
        batches themselves, so that an uneven batch can be replicated."""
        outer = self._watchdog is None
        if self.multi_process:
            replicate_chief_generators(self.runtime)
            if outer:
                # XLA's CPU collectives wait forever for a hung peer: give
                # up after the liveness timeout without a step.
                self._watchdog = ProgressWatchdog(
                    self.runtime.rank, liveness_timeout()
                ).start()
        active = keras_distribution.distribution()
        keras_distribution.set_distribution(None)
        try:
            yield
        finally:
            keras_distribution.set_distribution(active)
            if self.multi_process and outer:
                self._watchdog.stop()
                self._watchdog = None

    def prepare_call(self, name, method, args, kwargs):
        """FILE/OFF input between processes: each reads its share
        (`core.policies`) and `GatheredAdapter` assembles global batches."""
        if not self.multi_process:
            return args, kwargs
        return policies.prepare_worker_call(
            self,
            name,
            method,
            args,
            kwargs,
            lambda inner, what: GatheredAdapter(
                inner, what, self.runtime, process_allgather
            ),
        )

    # -- models ---------------------------------------------------------------
    def attach(self, model) -> None:
        """Checks the model's variables and installs the step functions."""
        self.policy.check_variables(model)
        if self.multi_process:
            self.sync_variables(model.variables)
        StepFunctions(self, model).install()

    def check_built(self, model) -> None:
        """Before a step function is made (the model has its variables):
        the policy's checks."""
        self.policy.check_built(model)

    def sync_variables(self, variables) -> None:
        """Gives every process the chief's values of `variables` (e.g. after
        the chief alone loaded weights).

        First one small collective compares fingerprints of every part of
        each variable that several processes hold
        (`chief_values.parts_that_differ`);
        only a variable whose copies differ travels, whole, from the
        chief. Variables made in the scope already hold the chief's
        values, so attaching a model moves none of them."""
        variables = list(variables)
        for variable in parts_that_differ(variables):
            sharding = self.sharding_of(variable.value)
            value = from_chief(host_value(variable.value))
            glue.set_variable_value(variable, self.put(value, sharding))

    def sharding_of(self, value):
        """The sharding a state value keeps: its own when it lies on this
        engine's mesh, else replicated (e.g. a variable made outside any
        distribution)."""
        sharding = getattr(value, "sharding", None)
        if isinstance(sharding, NamedSharding) and sharding.mesh == self.mesh:
            return sharding
        return self.replicated

    def put(self, value, sharding):
        """`value` (a host array, the same on every process) as an array of
        `sharding`."""
        if self.multi_process:
            return _global_array(value, sharding)
        return jax.device_put(value, sharding)

    def place_batch(self, batch):
        """Splits `batch` along the batch axis, or replicates an array whose
        first dimension the axis does not divide."""
        if self._watchdog is not None:
            self._watchdog.progress()  # the previous step has finished
        n = self.num_replicas_in_sync

        def place(x):
            if x is None:
                return None
            shape = np.shape(x)
            if shape and shape[0] % n == 0:
                return self.put(x, self.sharded)
            return self.put(x, self.replicated)

        return tree.map_structure(place, batch, none_is_leaf=True)

    def place_group(self, group):
        """Places a stacked group of batches (steps on the leading axis):
        each batch split along the batch axis, which must divide it."""
        if self._watchdog is not None:
            self._watchdog.progress()
        sharding = NamedSharding(
            self.mesh, PartitionSpec(None, self.batch_axis)
        )
        return tree.map_structure(
            lambda x: None if x is None else self.put(x, sharding),
            group,
            none_is_leaf=True,
        )

    def relocate(self, x, sharding):
        """`x` as an array of `sharding` (as it is if it already is one);
        over several processes, with the chief's value."""
        if getattr(x, "sharding", None) == sharding:
            return x
        if self.multi_process:
            return self.put(from_chief(host_value(x)), sharding)
        return jax.device_put(x, sharding)

    def place_state(self, state, shardings):
        """Puts every array of `state` that is not yet where `shardings` say
        (e.g. optimizer variables built at the first step)."""
        return jax.tree_util.tree_map(self.relocate, state, shardings)

    def state_shardings(self, model):
        """Shardings of (trainable, non-trainable, optimizer, metrics)."""
        optimizer = getattr(model, "optimizer", None)
        groups = (
            model.trainable_variables,
            model.non_trainable_variables,
            optimizer.variables if optimizer is not None else [],
            model.metrics_variables,
        )
        return tuple(
            [self.sharding_of(v.value) for v in group] for group in groups
        )

    # -- custom loops ---------------------------------------------------------
    def run(self, fn, args, kwargs):
        """Calls `fn` once per replica on its device (one process)."""
        if self.multi_process or self.num_replicas_in_sync != len(self.devices):
            raise NotImplementedError(
                "strategy.run on JAX runs one replica per device of one "
                "process with replicated variables; this strategy's "
                "replicas span processes or several devices each. Use "
                "model.fit, or a jitted function over global arrays."
            )
        self.wait_for_last_step()
        n = len(self.devices)
        outputs = []
        for i, device in enumerate(self.mesh.devices.flat):
            a = select_replica(args, i, n)
            k = select_replica(kwargs, i, n)
            with jax.default_device(device):
                a, k = jax.device_put((a, k), device)
                outputs.append(fn(*a, **k))
        return stack_outputs(outputs)

    def reduce(self, op, value, axis):
        """Combines a per-replica value across replicas."""
        return reduce_parts(op, value, axis, self.num_replicas_in_sync)

    def gather(self, value, axis):
        """Concatenates a per-replica value along `axis`."""
        return gather_parts(value, axis)

    def local_results(self, value):
        """The per-replica parts of `value`."""
        return local_results(value)

    def placement(self, variable):
        """The variable's layout (from its sharding) and one device's shard
        shape."""
        value = variable.value
        shape = tuple(value.shape)
        sharding = getattr(value, "sharding", None)
        if not isinstance(sharding, NamedSharding):
            return (None,) * len(shape), shape
        spec = tuple(sharding.spec) + (None,) * (
            len(shape) - len(sharding.spec)
        )
        layout = tuple(
            tuple(e) if isinstance(e, (tuple, list)) else e for e in spec
        )
        return layout, tuple(sharding.shard_shape(shape))

    def distribute_dataset(self, dataset):
        """Per-replica batches on this process's devices."""
        return distribute_dataset(dataset, list(self.mesh.devices.flat))


def steps_in_flight(devices) -> int | None:
    """How many steps may run at once: 16 on CPU devices (XLA's CPU
    collectives deadlock when many are queued, see `SPMDEngine`); None
    (unbounded asynchronous dispatch) on GPUs and TPUs."""
    if all(d.platform == "cpu" for d in devices):
        return 16
    return None


# -- values -------------------------------------------------------------------
def reduce_parts(op, value, axis, count):
    """`Strategy.reduce` over the per-replica parts of `value`."""
    parts = [np.asarray(p) for p in local_results(value)]
    if not isinstance(value, PerReplica) and count > 1 and axis is None:
        if op is ReduceOp.SUM:
            raise ValueError(
                "reduce(SUM, value) needs a per-replica value (for example "
                "the result of strategy.run); got a plain value, which is the "
                "same on every replica."
            )
        return jax.numpy.asarray(parts[0])
    if axis is None:
        stacked = np.stack(parts)
        out = stacked.sum(0) if op is ReduceOp.SUM else stacked.mean(0)
    else:
        joined = np.concatenate(parts, axis=axis)
        out = joined.sum(axis) if op is ReduceOp.SUM else joined.mean(axis)
    return jax.numpy.asarray(out)


def gather_parts(value, axis):
    """`Strategy.gather`: the per-replica parts joined along `axis`."""
    parts = [np.asarray(p) for p in local_results(value)]
    return jax.numpy.asarray(np.concatenate(parts, axis=axis))


# -- several processes --------------------------------------------------------
def _global_array(value, sharding):
    """A global array of `sharding` whose data is the host array `value`
    (the same on every process); no cross-process equality check."""
    host = np.asarray(value)
    return jax.make_array_from_callback(
        host.shape, sharding, lambda index: host[index]
    )


def host_value(x):
    """The whole value of an array on this process's host: a replicated
    array's local copy, a sharded one's shards gathered from every
    process."""
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        if x.sharding.is_fully_replicated:
            return np.asarray(x.addressable_data(0))
        return np.asarray(multihost_utils.process_allgather(x, tiled=True))
    return np.asarray(x)


def _gathering_array(original):
    def __array__(self, dtype=None):
        value = self.value
        if (
            isinstance(value, jax.Array)
            and not value.is_fully_addressable
            and not value.sharding.is_fully_replicated
        ):
            # A collective: every process must read (e.g. get_weights()).
            return np.asarray(host_value(value), dtype=dtype)
        return original(self, dtype)

    return __array__


def _from_chief_tensor(original):
    def distribute_tensor(tensor, layout):
        # Variables created in the scope take the chief's initial value.
        sharding = getattr(layout, "backend_layout", layout)
        if isinstance(tensor, jax.core.Tracer) or not isinstance(
            sharding, jax.sharding.Sharding
        ):
            return original(tensor, layout)
        return _global_array(from_chief(host_value(tensor)), sharding)

    return distribute_tensor

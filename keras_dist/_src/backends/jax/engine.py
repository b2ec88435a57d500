"""JAX's one engine: a jitted SPMD step over a `Mesh`, for every plan.

What differs between plans is a small *policy* (`data_parallel.py`:
replicated variables; `sharded.py`: variables laid out over the mesh): the
mesh, the axis that splits the batch, the Keras `Distribution` that lays
out variables created in the scope, and the checks of a model's
variables. Everything else is here, once: placing batches (split along the
batch axis, or replicated when a batch does not divide), placing state with
each variable's own sharding, jitting Keras's own steps with those
shardings, per-replica BatchNormalization, custom loops, and — when the
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
import keras
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding, PartitionSpec
from keras import distribution as keras_distribution
from keras import tree

from keras_dist._src.backends.jax.batch_norm import average_moving_statistics
from keras_dist._src.backends.jax.devices import OWN_MESHES
from keras_dist._src.backends.jax.inputs import (
    distribute_dataset,
    select_replica,
    stack_outputs,
)
from keras_dist._src.cluster.supervision import (
    ProgressWatchdog,
    liveness_timeout,
)
from keras_dist._src.core import policies
from keras_dist._src.core.inputs import check_batch_consistency
from keras_dist._src.core.lockstep import GatheredAdapter
from keras_dist._src.core.rng import replicate_chief_generators
from keras_dist._src.keras_glue import internals as glue
from keras_dist._src.options import InputOptions
from keras_dist._src.values import PerReplica, ReduceOp, local_results


class SPMDEngine:
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
    @contextlib.contextmanager
    def scope(self):
        """Variables created here get the policy's layout from Keras (and,
        over several processes, the chief's initial values)."""
        restore = None
        if self.multi_process:
            restore = glue.replace_jax_distribute_tensor(_from_chief_tensor)
        try:
            with self.distribution.scope():
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
        _StepFunctions(self, model).install()

    def check_built(self, model) -> None:
        """Before a step function is made (the model has its variables):
        the policy's checks."""
        self.policy.check_built(model)

    def sync_variables(self, variables) -> None:
        """Gives every process the chief's values of `variables` (e.g. after
        the chief alone loaded weights)."""
        for variable in variables:
            sharding = self.sharding_of(variable.value)
            value = _from_chief(host_value(variable.value))
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

    def relocate(self, x, sharding):
        """`x` as an array of `sharding` (as it is if it already is one);
        over several processes, with the chief's value."""
        if getattr(x, "sharding", None) == sharding:
            return x
        if self.multi_process:
            return self.put(_from_chief(host_value(x)), sharding)
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


class _StepFunctions:
    """The distributed train/test/predict functions of one model."""

    def __init__(self, engine, model):
        self.engine = engine
        self.model = model
        self._first_batch = None
        self._batch_index = 0
        self._iterator = None

    def install(self) -> None:
        model = self.model
        model.__dict__["make_train_function"] = self.make_train_function
        model.__dict__["make_test_function"] = self.make_test_function
        model.__dict__["make_predict_function"] = self.make_predict_function
        model.train_function = None
        model.test_function = None
        model.predict_function = None

    def _compile(self, step, out_shardings):
        model = self.model
        if model.run_eagerly or not model.jit_compile:
            return step
        return jax.jit(step, donate_argnums=0, out_shardings=out_shardings)

    def _wrap(self, step, shardings, concatenate_outputs=False):
        engine = self.engine
        # With steps_per_execution > 1, predict's outputs of the steps of one
        # call must be concatenated (Keras's own predict function does so).
        iterator_step = _iterator_step(
            self.model, step, concatenate_outputs=concatenate_outputs
        )
        last_state = [None]

        def function(state, iterator):
            # On CPU devices, at most `max_in_flight` steps run at once (see
            # `SPMDEngine`): wait for the oldest before dispatching another.
            bound = engine.max_in_flight
            if bound is not None:
                engine.wait_for_last_step(keep=bound - 1)
            if state is not last_state[0]:
                state = engine.place_state(state, shardings)
            outputs, state = iterator_step(state, self._placed(iterator))
            if bound is not None:
                # One output of the step's executable is ready when all
                # are: waiting on one leaf costs less than on every leaf.
                leaves = jax.tree_util.tree_leaves(outputs)
                if leaves:
                    engine.in_flight.append(leaves[:1])
                else:
                    # Only the state: it is donated to the next step, so it
                    # cannot be waited on later; wait now.
                    jax.block_until_ready(state)
            last_state[0] = state
            return outputs, state

        return function

    def _placed(self, iterator):
        """Places each batch; checks it matches the first batch's shapes."""
        if iterator is not self._iterator:  # a new epoch or a new input
            self._iterator = iterator
            self._first_batch = None
        for batch in _one_batch_at_a_time(self.model, iterator):
            if self._first_batch is None:
                self._first_batch = batch
                self._batch_index = 1
            else:
                self._batch_index += 1
                check_batch_consistency(
                    self._first_batch, batch, self._batch_index
                )
            yield self.engine.place_batch(batch)

    def make_train_function(self, force=False):
        """Jits the model's `train_step` with the state's shardings."""
        model = self.model
        if model.train_function is not None and not force:
            return model.train_function
        self.engine.check_built(model)
        state = self.engine.state_shardings(model)
        replicated = self.engine.replicated
        if self.engine.sync_batch_norm:
            step = self._compile(model.train_step, (replicated, state))
        else:
            step = self._per_replica_train_step()
        model.train_function = self._wrap(step, state)
        return model.train_function

    def _per_replica_train_step(self):
        """Each device trains on its shard (so BatchNormalization sees only
        that shard's statistics); gradients are averaged with `pmean` before
        the optimizer applies them, metric updates are summed with `psum`
        and BatchNormalization's moving statistics are averaged."""
        model = self.model
        engine = self.engine
        axis = engine.batch_axis
        compiled = {}

        def local_step(state, data):
            _, _, _, old_metrics = state
            optimizer = model.optimizer
            apply = type(optimizer).stateless_apply.__get__(optimizer)

            def averaged_apply(optimizer_variables, grads, trainable):
                grads = jax.lax.pmean(grads, axis)
                return apply(optimizer_variables, grads, trainable)

            optimizer.__dict__["stateless_apply"] = averaged_apply
            try:
                _, new_state = model.train_step(state, data)
            finally:
                optimizer.__dict__.pop("stateless_apply", None)
            trainable, non_trainable, opt_vars, metrics = new_state
            non_trainable = average_moving_statistics(non_trainable, axis)
            metrics = [
                old + jax.lax.psum(new - old, axis)
                for old, new in zip(old_metrics, metrics)
            ]
            mapping = list(zip(model.metrics_variables, metrics))
            with keras.StatelessScope(state_mapping=mapping):
                logs = model.get_metrics_result()
            return logs, (trainable, non_trainable, opt_vars, metrics)

        def step(state, data):
            sharded = all(
                x is None or engine.sharded == x.sharding
                for x in tree.flatten(data)
            )
            if sharded not in compiled:
                spec = PartitionSpec(axis) if sharded else PartitionSpec()
                mapped = jax.shard_map(
                    local_step,
                    mesh=engine.mesh,
                    in_specs=(PartitionSpec(), spec),
                    out_specs=PartitionSpec(),
                    check_vma=False,
                )
                compiled[sharded] = self._compile(
                    mapped, (engine.replicated, engine.replicated)
                )
            return compiled[sharded](state, data)

        return step

    def make_test_function(self, force=False):
        """Jits the model's `test_step` with the state's shardings."""
        model = self.model
        if model.test_function is not None and not force:
            return model.test_function
        self.engine.check_built(model)
        trainable, non_trainable, _, metrics = self.engine.state_shardings(
            model
        )
        state = (trainable, non_trainable, metrics)
        step = self._compile(model.test_step, (self.engine.replicated, state))
        model.test_function = self._wrap(step, state)
        return model.test_function

    def make_predict_function(self, force=False):
        """Jits the model's `predict_step`; outputs stay batch-sharded."""
        model = self.model
        if model.predict_function is not None and not force:
            return model.predict_function
        self.engine.check_built(model)
        trainable, non_trainable, _, _ = self.engine.state_shardings(model)
        state = (trainable, non_trainable)

        def predict_step(state, data):
            outputs, non_trainable = model.predict_step(state, data)
            return outputs, (state[0], non_trainable)

        out = self.engine.predict_out_shardings
        if out is None:
            out = (None, state)
        else:
            out = (out[0], state)
        step = self._compile(predict_step, out)
        model.predict_function = self._wrap(
            step, state, concatenate_outputs=True
        )
        return model.predict_function


def _one_batch_at_a_time(model, iterator):
    """The batches of Keras's JAX epoch iterator one by one.

    With `steps_per_execution` > 1, Keras 3.16 and later read groups of
    that many batches stacked on a new leading axis (a partial group at
    an epoch's end as a list): each step here splits its own batch over
    the replicas, so a group is taken apart first (else its step axis
    would be split as if it were the batch)."""
    # `for`, not `yield from`: the caller makes a generator of this one
    # per call and drops it after a few batches, and `yield from` would
    # close Keras's iterator with it.
    if model.steps_per_execution <= 1 or not glue.keras_stacks_jax_steps():
        for batch in iterator:  # noqa: UP028 - see above
            yield batch
        return
    for group in iterator:
        if glue.is_partial_step_group(group):
            yield from group
            continue
        leaves = [x for x in tree.flatten(group) if x is not None]
        for i in range(np.shape(leaves[0])[0] if leaves else 0):
            yield tree.map_structure(
                lambda x, i=i: None if x is None else x[i],
                group,
                none_is_leaf=True,
            )


def _iterator_step(model, step, concatenate_outputs=False):
    """`step(state, batch)` as a function of `(state, iterator)` that runs
    up to `model.steps_per_execution` batches, as Keras 3.15's JAX
    trainer does: one batch a step, the outputs of the steps concatenated
    when `concatenate_outputs` (predict), else the last step's."""
    steps = model.steps_per_execution
    if steps <= 1:
        return lambda state, iterator: step(state, next(iterator))

    def concatenate(outputs):
        return tree.map_structure(
            lambda *parts: jax.numpy.concatenate(parts), *outputs
        )

    if not model.run_eagerly and model.jit_compile:
        concatenate = jax.jit(concatenate)

    def iterator_step(state, iterator):
        outputs, state = step(state, next(iterator))
        collected = [outputs]
        for _ in range(steps - 1):
            try:
                data = next(iterator)
            except StopIteration:
                break
            outputs, state = step(state, data)
            collected.append(outputs)
        if concatenate_outputs:
            return concatenate(collected), state
        return outputs, state

    return iterator_step


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


def _from_chief(value):
    """The chief's `value` (a host array) on every process."""
    return np.asarray(multihost_utils.broadcast_one_to_all(value))


def _from_chief_tensor(original):
    def distribute_tensor(tensor, layout):
        # Variables created in the scope take the chief's initial value.
        sharding = getattr(layout, "backend_layout", layout)
        if isinstance(tensor, jax.core.Tracer) or not isinstance(
            sharding, jax.sharding.Sharding
        ):
            return original(tensor, layout)
        return _global_array(_from_chief(host_value(tensor)), sharding)

    return distribute_tensor


def process_allgather(arrays) -> list:
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

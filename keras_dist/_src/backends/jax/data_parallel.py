"""JAX backend: one jitted step on the global batch, sharded over a `Mesh`.

Variables are replicated (`NamedSharding(mesh, P())`) and each batch is
sharded along its first axis (`P("batch")`); XLA's SPMD partitioner inserts
the gradient all-reduce. Keras's own JAX trainer already compiles its step
this way when a `keras.distribution.Distribution` is active, so the engine
activates one (an exact variant of `DataParallel`) inside the strategy scope.

Because the step computes on the global batch, the loss is the global mean,
metrics are exact and BatchNormalization sees the statistics of the whole
batch. A batch whose size does not divide by the replica count (the last one
of an epoch, say) is replicated instead of sharded: every device computes the
same, exact result, and nothing is padded or dropped.
"""

from __future__ import annotations

import contextlib

import jax
import keras
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec
from keras import distribution as keras_distribution
from keras import tree

from keras_dist._src.backends.jax.batch_norm import average_moving_statistics
from keras_dist._src.backends.jax.devices import BATCH_AXIS, devices_by_name
from keras_dist._src.backends.jax.inputs import (
    distribute_dataset,
    select_replica,
    stack_outputs,
)
from keras_dist._src.core.inputs import check_batch_consistency
from keras_dist._src.devices import normalize_device
from keras_dist._src.errors import (
    VariablesOutsideScopeError,
)
from keras_dist._src.keras_glue import internals as glue
from keras_dist._src.options import InputOptions
from keras_dist._src.values import PerReplica, ReduceOp, local_results


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


class OneDeviceEngine:
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
                raise VariablesOutsideScopeError(
                    f"Variable {variable.path!r} of model {model.name!r} "
                    f"lives on {sorted(map(str, devices))}, not on "
                    f"{self.devices[0]}: it was created outside "
                    "strategy.scope(). Build the model inside the scope."
                )

    def run(self, fn, args, kwargs):
        with self.scope():
            return fn(*args, **kwargs)

    def reduce(self, op, value, axis):
        return _reduce(op, value, axis, 1)

    def gather(self, value, axis):
        return _gather(value, axis)

    def local_results(self, value):
        return local_results(value)

    def distribute_dataset(self, dataset):
        return distribute_dataset(dataset, [self._device])


class MirroredEngine:
    """Replicated variables, batch-sharded data, one jitted SPMD step."""

    # Predictions stay batch-sharded (one process reads every shard).
    predict_out_shardings = None

    def __init__(self, devices, sync_batch_norm: bool):
        self.sync_batch_norm = bool(sync_batch_norm)
        self.devices = tuple(devices)
        by_name = devices_by_name()
        self._jax_devices = [by_name[d] for d in self.devices]
        self.mesh = Mesh(np.array(self._jax_devices), (BATCH_AXIS,))
        self.replicated = NamedSharding(self.mesh, PartitionSpec())
        self.sharded = NamedSharding(self.mesh, PartitionSpec(BATCH_AXIS))
        device_mesh = keras_distribution.DeviceMesh(
            shape=(len(self.devices),),
            axis_names=[BATCH_AXIS],
            devices=list(self.devices),
        )
        self.distribution = _ExactDataParallel(
            device_mesh=device_mesh, auto_shard_dataset=False
        )
        # XLA's CPU runtime runs each simulated device's part of a step on a
        # shared pool of max(cores, devices) threads, and its all-reduce
        # blocks a thread until every device arrives. With a step still
        # running while the next one (or a callback's read of its logs) is
        # dispatched, the pools can be left without a thread for the last
        # device: after 40 s XLA aborts the process ("Expected 4 threads to
        # join the rendezvous, but only 3 of them arrived"; Keras's own
        # `DataParallel` aborts the same way under load). So on CPU devices
        # each step completes before `fit` goes on; accelerators keep
        # asynchronous dispatch.
        self.serialize_steps = all(
            d.platform == "cpu" for d in self._jax_devices
        )

    @property
    def num_replicas_in_sync(self) -> int:
        return len(self.devices)

    def scope(self):
        # Variables created here get a replicated layout from Keras itself.
        return self.distribution.scope()

    @contextlib.contextmanager
    def call_scope(self):
        # fit/evaluate/predict run with no Keras distribution active (also
        # when called inside `strategy.scope()`): the engine's step functions
        # place state and batches themselves, which lets a batch that does
        # not divide among replicas be replicated.
        active = keras_distribution.distribution()
        keras_distribution.set_distribution(None)
        try:
            yield
        finally:
            keras_distribution.set_distribution(active)

    def prepare_call(self, name, method, args, kwargs):
        return args, kwargs

    def attach(self, model) -> None:
        mesh_devices = set(self._jax_devices)
        for variable in model.variables:
            sharding = variable.value.sharding
            if set(sharding.device_set) != mesh_devices:
                raise VariablesOutsideScopeError(
                    f"Variable {variable.path!r} of model {model.name!r} is "
                    f"not mirrored on {list(self.devices)}: it was created "
                    "outside strategy.scope(). Build (and load weights into) "
                    "the model inside `with strategy.scope():`."
                )
        _StepFunctions(self, model).install()

    def place_batch(self, batch):
        """Shards `batch` along axis 0, or replicates it if that is uneven."""

        def place(x):
            if x is None:
                return None
            shape = np.shape(x)
            if shape and shape[0] % len(self.devices) == 0:
                return jax.device_put(x, self.sharded)
            return jax.device_put(x, self.replicated)

        return tree.map_structure(place, batch, none_is_leaf=True)

    def place_state(self, state):
        """Replicates every array of `state` that is not yet replicated."""
        replicated = self.replicated

        def place(x):
            if getattr(x, "sharding", None) == replicated:
                return x
            return jax.device_put(x, replicated)

        return tree.map_structure(place, state)

    def run(self, fn, args, kwargs):
        n = len(self.devices)
        outputs = []
        for i, device in enumerate(self._jax_devices):
            a = select_replica(args, i, n)
            k = select_replica(kwargs, i, n)
            with jax.default_device(device):
                a, k = jax.device_put((a, k), device)
                outputs.append(fn(*a, **k))
        return stack_outputs(outputs)

    def reduce(self, op, value, axis):
        return _reduce(op, value, axis, len(self.devices))

    def gather(self, value, axis):
        return _gather(value, axis)

    def local_results(self, value):
        return local_results(value)

    def distribute_dataset(self, dataset):
        return distribute_dataset(dataset, self._jax_devices)


class _StepFunctions:
    """The replicated train/test/predict functions of one model."""

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

    def _wrap(self, step, concatenate_outputs=False):
        engine = self.engine
        # With steps_per_execution > 1, predict's outputs of the steps of one
        # call must be concatenated (Keras's own predict function does so).
        iterator_step = glue.make_function(
            self.model, step, concatenate_outputs=concatenate_outputs
        )
        last_state = [None]

        def function(state, iterator):
            if state is not last_state[0]:
                state = engine.place_state(state)
            outputs, state = iterator_step(state, self._placed(iterator))
            if engine.serialize_steps:
                jax.block_until_ready((outputs, state))
            last_state[0] = state
            return outputs, state

        return function

    def _placed(self, iterator):
        """Places each batch; checks it matches the first batch's shapes."""
        if iterator is not self._iterator:  # a new epoch or a new input
            self._iterator = iterator
            self._first_batch = None
        for batch in iterator:
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
        """Jits the model's `train_step` with replicated state."""
        model = self.model
        if model.train_function is not None and not force:
            return model.train_function
        replicated = self.engine.replicated
        if self.engine.sync_batch_norm:
            step = self._compile(model.train_step, (replicated, replicated))
        else:
            step = self._per_replica_train_step()
        model.train_function = self._wrap(step)
        return model.train_function

    def _per_replica_train_step(self):
        """Each device trains on its shard (so BatchNormalization sees only
        that shard's statistics); gradients are averaged with `pmean` before
        the optimizer applies them, metric updates are summed with `psum`
        and BatchNormalization's moving statistics are averaged."""
        model = self.model
        engine = self.engine
        compiled = {}

        def local_step(state, data):
            _, _, _, old_metrics = state
            optimizer = model.optimizer
            apply = type(optimizer).stateless_apply.__get__(optimizer)

            def averaged_apply(optimizer_variables, grads, trainable):
                grads = jax.lax.pmean(grads, BATCH_AXIS)
                return apply(optimizer_variables, grads, trainable)

            optimizer.__dict__["stateless_apply"] = averaged_apply
            try:
                _, new_state = model.train_step(state, data)
            finally:
                optimizer.__dict__.pop("stateless_apply", None)
            trainable, non_trainable, opt_vars, metrics = new_state
            non_trainable = average_moving_statistics(non_trainable)
            metrics = [
                old + jax.lax.psum(new - old, BATCH_AXIS)
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
                spec = PartitionSpec(BATCH_AXIS) if sharded else PartitionSpec()
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
        """Jits the model's `test_step` with replicated state."""
        model = self.model
        if model.test_function is not None and not force:
            return model.test_function
        replicated = self.engine.replicated
        step = self._compile(model.test_step, (replicated, replicated))
        model.test_function = self._wrap(step)
        return model.test_function

    def make_predict_function(self, force=False):
        """Jits the model's `predict_step`; outputs stay batch-sharded."""
        model = self.model
        if model.predict_function is not None and not force:
            return model.predict_function

        def predict_step(state, data):
            outputs, non_trainable = model.predict_step(state, data)
            return outputs, (state[0], non_trainable)

        step = self._compile(predict_step, self.engine.predict_out_shardings)
        model.predict_function = self._wrap(step, concatenate_outputs=True)
        return model.predict_function


def create_engine(kind, devices, runtime, sync_batch_norm: bool, input_options):
    """Returns the replicator of a `kind` strategy over `devices`.

    One device needs no mesh at all (Keras's own step, placed on it).
    """
    devices = [normalize_device(d) for d in devices]
    if kind == "multi_worker" and runtime.world_size > 1:
        from keras_dist._src.backends.jax.multi_worker import MultiWorkerEngine

        return MultiWorkerEngine(
            devices, sync_batch_norm, runtime, input_options or InputOptions()
        )
    del kind, runtime
    if len(devices) == 1:
        return OneDeviceEngine(devices[0])
    # One worker (this process): every shard policy reads the whole input.
    del input_options
    return MirroredEngine(devices, sync_batch_norm)


def _reduce(op, value, axis, count):
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


def _gather(value, axis):
    parts = [np.asarray(p) for p in local_results(value)]
    return jax.numpy.asarray(np.concatenate(parts, axis=axis))

"""TensorFlow backend: tf.distribute's MirroredStrategy and MirroredVariables.

Models built in the scope get MirroredVariables, and Keras's TF trainer runs
its step with `tf.distribute.Strategy.run` on per-replica batches of a
distributed dataset. keras_dist replaces that per-replica step with an exact
one: Keras divides each replica's loss by the replica count ("mean of
per-replica means"), which is wrong whenever shards differ in size (the last
batch of an epoch). Here each replica's data loss is weighted by its share of
the global batch, gradients are summed by tf.distribute's all-reduce, metric
variables (SUM-aggregated MirroredVariables) add up numerators and
denominators across replicas, and BatchNormalization layers are switched to
Keras's synchronized (cross-replica) statistics.
"""

from __future__ import annotations

import threading
import warnings

import keras
import tensorflow as tf
from keras import tree
from keras.src.backend.tensorflow.trainer import TensorFlowTrainer
from keras.src.losses import loss as loss_module
from keras.src.trainers import data_adapters
from keras.src.trainers.trainer import Trainer
from tensorflow.python.data.experimental.ops import (
    distribute as tfdata_distribute,
)

from keras_dist._src.devices import normalize_device
from keras_dist._src.errors import (
    DevicesAlreadyInitializedError,
    VariablesOutsideScopeError,
)
from keras_dist._src.strategy import current_call
from keras_dist._src.values import PerReplica, ReduceOp

NAME = "tensorflow"
_MEAN_REDUCTIONS = ("sum_over_batch_size", "mean")


def _tf_name(device: str) -> str:
    kind, index = device.split(":")
    return f"/device:{kind.upper()}:{index}"


def list_devices(device_type: str | None = None) -> list[str]:
    """Logical devices of this process as ``"type:index"`` names."""
    names = []
    for device in tf.config.list_logical_devices():
        if device.device_type not in ("CPU", "GPU", "TPU"):
            continue
        names.append(normalize_device(device.name))
    if device_type:
        names = [n for n in names if n.startswith(device_type.lower() + ":")]
    return names


def default_devices() -> list[str]:
    """Every GPU (or TPU) if there is one, else every logical CPU."""
    for kind in ("gpu", "tpu", "cpu"):
        devices = list_devices(kind)
        if devices:
            return devices
    raise RuntimeError("TensorFlow reports no devices at all.")


def simulate_cpu_devices(count: int) -> None:
    """Splits the host CPU into `count` logical devices.

    Raises:
        DevicesAlreadyInitializedError: if TensorFlow has started already.
    """
    cpus = tf.config.list_physical_devices("CPU")
    try:
        tf.config.set_logical_device_configuration(
            cpus[0], [tf.config.LogicalDeviceConfiguration()] * int(count)
        )
    except RuntimeError as error:
        current = len(tf.config.list_logical_devices("CPU"))
        if current == count:
            return
        raise DevicesAlreadyInitializedError(
            f"Cannot simulate {count} CPU devices: TensorFlow has already "
            f"initialised its devices ({current} CPU). Call "
            f"keras_dist.simulate_cpu_devices({count}) (or set "
            "KERAS_DIST_CPU_DEVICES) before any TensorFlow operation, e.g. "
            "right after `import keras_dist`."
        ) from error


def variables_distributed(model) -> bool:
    """Whether `model` was built in the scope of a keras_dist strategy (and
    not only of a plain `tf.distribute` one, which keras_dist leaves alone).
    """
    strategy = getattr(model, "_distribute_strategy", None)
    return getattr(type(strategy), "_keras_dist", False)


class _EngineBase:
    devices: tuple
    is_chief = True  # one process drives every device

    def local_results(self, value):
        return tuple(self.tf_strategy.experimental_local_results(value))

    def prepare_call(self, name, method, args, kwargs):
        return args, kwargs

    def run(self, fn, args, kwargs):
        return self.tf_strategy.run(fn, args=args, kwargs=kwargs)

    def reduce(self, op, value, axis):
        if isinstance(value, PerReplica):
            value = self._to_distributed(value)
        tf_op = tf.distribute.ReduceOp[ReduceOp.from_any(op).value]
        return self.tf_strategy.reduce(tf_op, value, axis=axis)

    def gather(self, value, axis):
        if isinstance(value, PerReplica):
            value = self._to_distributed(value)
        return self.tf_strategy.gather(value, axis=axis)

    def distribute_dataset(self, dataset):
        if isinstance(dataset, tf.data.Dataset):
            return self.tf_strategy.experimental_distribute_dataset(dataset)
        return _DistributedIterable(self, dataset)

    def _to_distributed(self, per_replica):
        values = per_replica.values
        return self.tf_strategy.experimental_distribute_values_from_function(
            lambda ctx: values[ctx.replica_id_in_sync_group]
        )


class OneDeviceEngine(_EngineBase):
    """Keras's own step on one device, placed with `tf.device`."""

    def __init__(self, device: str):
        self.devices = (device,)
        self.tf_strategy = tf.distribute.get_strategy()
        self._tf_device = _tf_name(device)

    @property
    def num_replicas_in_sync(self) -> int:
        return 1

    def scope(self):
        return tf.device(self._tf_device)

    def call_scope(self):
        return tf.device(self._tf_device)

    def attach(self, model) -> None:
        for variable in model.variables:
            value = variable.value
            if isinstance(value, tf.distribute.DistributedValues):
                raise VariablesOutsideScopeError(
                    f"Variable {variable.path!r} of model {model.name!r} was "
                    "created under another (multi-device) strategy. Build "
                    "the model inside this strategy's scope."
                )
            if not value.device.upper().endswith(self._tf_device.upper()[1:]):
                raise VariablesOutsideScopeError(
                    f"Variable {variable.path!r} of model {model.name!r} "
                    f"lives on {value.device!r}, not on {self.devices[0]}: "
                    "it was created outside strategy.scope(). Build the model "
                    "inside the scope."
                )

    def run(self, fn, args, kwargs):
        with self.scope():
            return fn(*args, **kwargs)


class MirroredEngine(_EngineBase):
    """`tf.distribute.MirroredStrategy` with an exact per-replica step."""

    def __init__(self, devices, sync_batch_norm: bool):
        self.devices = tuple(devices)
        self.sync_batch_norm = sync_batch_norm
        self.tf_strategy = _new_mirrored_strategy(
            [_tf_name(d) for d in self.devices]
        )
        self._warned = False

    @property
    def num_replicas_in_sync(self) -> int:
        return self.tf_strategy.num_replicas_in_sync

    def scope(self):
        return self.tf_strategy.scope()

    def call_scope(self):
        return self.tf_strategy.scope()

    def attach(self, model) -> None:
        strategy = getattr(model, "_distribute_strategy", None)
        if strategy is not self.tf_strategy:
            raise VariablesOutsideScopeError(
                f"Model {model.name!r} was created outside strategy.scope(), "
                "so its variables are not mirrored. Create the model (not "
                "only compile it) inside `with strategy.scope():`."
            )
        extended = self.tf_strategy.extended
        for variable in model.variables:
            if not extended.variable_created_in_scope(variable.value):
                raise VariablesOutsideScopeError(
                    f"Variable {variable.path!r} of model {model.name!r} was "
                    "created outside strategy.scope(). Build the model and "
                    "all its layers inside the scope."
                )
        for layer in model._flatten_layers(include_self=False):
            if isinstance(layer, keras.layers.BatchNormalization):
                _set_batch_norm_sync(layer, self.sync_batch_norm)
        self._install_steps(model)

    def _install_steps(self, model) -> None:
        cls = type(model)
        custom_loss = cls.compute_loss is not Trainer.compute_loss
        custom_train = cls.train_step is not TensorFlowTrainer.train_step
        custom_test = cls.test_step is not TensorFlowTrainer.test_step
        engine = self

        if custom_loss or custom_train or custom_test:
            self._warn(
                f"Model {model.name!r} overrides train_step, test_step or "
                "compute_loss: keras_dist runs it per replica as tf.distribute "
                "does, so a loss it computes is a per-replica mean; shards of "
                "unequal size (the last batch of an epoch) are then weighted "
                "equally rather than by their size."
            )

        def make_train_function(force=False):
            if model.train_function is not None and not force:
                return model.train_function

            def step(data):
                return model.train_step(_without_count(data))

            if not (custom_loss or custom_train):

                def step(data):
                    return _exact_step(engine, model, data, training=True)

            model.train_function = model._make_function(step)
            return model.train_function

        def make_test_function(force=False):
            if model.test_function is not None and not force:
                return model.test_function

            def step(data):
                return model.test_step(_without_count(data))

            if not (custom_loss or custom_test):

                def step(data):
                    return _exact_step(engine, model, data, training=False)

            model.test_function = model._make_function(step)
            return model.test_function

        def maybe_symbolic_build(iterator=None, data_batch=None):
            # Keras builds metrics and optimizer variables here, from shapes
            # only. Its own version takes a batch from the distributed input
            # (consuming batches of a generator, and losing those the
            # iterator had prefetched) and sums the replicas' parts (which
            # fails when they differ in size). The input's element spec has
            # all the shapes and dtypes needed, without reading any data.
            if iterator is not None:
                data_batch = iterator.data_adapter.get_tf_dataset().element_spec
            with engine.tf_strategy.scope():
                model._symbolic_build(data_batch=data_batch)

        model.__dict__["make_train_function"] = make_train_function
        model.__dict__["make_test_function"] = make_test_function
        model.__dict__["_maybe_symbolic_build"] = maybe_symbolic_build
        model.train_function = None
        model.test_function = None

    def _warn(self, message):
        if not self._warned:
            self._warned = True
            warnings.warn(message, stacklevel=4)


_strategies_created = 0


def _new_mirrored_strategy(tf_devices):
    """A MirroredStrategy of keras_dist's, built once per engine.

    * Its collective group keys are its own: every MirroredStrategy starts
      them at 1, so a second strategy over other devices in the same process
      collides with the first ("joining a group with size 4, but that group
      has size 2"); tf.distribute reads the key base from the class.
    * It splits each global batch itself (`_split_global_batches`).
    """
    global _strategies_created
    _strategies_created += 1
    cls = type(
        "MirroredStrategy",
        (tf.distribute.MirroredStrategy,),
        {
            "_collective_key_base": 100_000 * _strategies_created,
            "_keras_dist": True,
            "experimental_distribute_dataset": _distribute_global_batches,
        },
    )
    return cls(devices=tf_devices)


_GLOBAL_COUNT = "keras_dist_global_count"
_BATCH = "keras_dist_batch"
_LOCAL_COUNT = "keras_dist_local_count"
_COUNT_PER_SAMPLE = "keras_dist_count_per_sample"
_EXACT_CALLS = ("fit", "evaluate")


def _without_count(data):
    if isinstance(data, dict) and _BATCH in data:
        return data[_BATCH]
    return data


def _distribute_global_batches(strategy, dataset, options=None):
    """Splits each global batch of `dataset` across replicas, exactly.

    Where tf.distribute can rebatch the dataset (its batch size is found in
    the dataset's graph: arrays, `tf.data` batched with `.batch`), its own
    fast rebatching splits every global batch; in `fit`/`evaluate` a
    per-sample copy of the global batch size travels with the data, so the
    exact step needs no collective to learn it. Elsewhere (input from
    generators and PyDatasets) tf.distribute would give each replica a whole
    batch, making the global batch N times too large: keras_dist then splits
    every batch itself like `numpy.array_split`, in sample order, and hands
    replicas their parts in turn through `distribute_datasets_from_function`.
    """
    replicas = strategy.num_replicas_in_sync
    with_count = current_call() in _EXACT_CALLS
    native = tf.distribute.MirroredStrategy.experimental_distribute_dataset
    if int(tfdata_distribute.compute_batch_size(dataset)) >= 0:
        if with_count:

            def add_count(*batch):
                # Each sample carries the global batch size, so the step
                # needs no collective to learn it. A batch whose size does
                # not divide by the replica count gets zero samples
                # (carrying 0) appended up to the next multiple, so that
                # tf.distribute's ceil-sized parts are never empty (6 over 4
                # would give 2, 2, 2, 0): with cross-replica
                # BatchNormalization an empty part aborts the step.
                batch = batch[0] if len(batch) == 1 else batch
                leaves = [t for t in tree.flatten(batch) if t is not None]
                count = tf.shape(leaves[0])[0]
                missing = (replicas - count % replicas) % replicas
                batch = tree.map_structure(
                    lambda t: _pad_rows(t, missing),
                    batch,
                )
                per_sample = tf.concat(
                    [tf.fill([count], count), tf.zeros([missing], "int32")],
                    axis=0,
                )
                return {_BATCH: batch, _COUNT_PER_SAMPLE: per_sample}

            dataset = dataset.map(add_count)
        return native(strategy, dataset, options)

    def split(*batch):
        batch = batch[0] if len(batch) == 1 else batch
        leaves = [t for t in tree.flatten(batch) if t is not None]
        count = tf.shape(leaves[0])[0]
        base, extra = count // replicas, count % replicas

        def part(i):
            i = tf.cast(i, "int32")
            start = i * base + tf.minimum(i, extra)
            stop = start + base + tf.cast(i < extra, "int32")
            shard = tree.map_structure(
                lambda t: None if t is None else t[start:stop], batch
            )
            if not with_count:
                return shard
            # An empty part becomes one zero sample (masked in the step):
            # with cross-replica BatchNormalization an empty shard aborts
            # the step with a collective shape mismatch.
            empty = tf.cast(tf.equal(stop, start), "int32")
            shard = tree.map_structure(lambda t: _pad_rows(t, empty), shard)
            return {
                _BATCH: shard,
                _GLOBAL_COUNT: count,
                _LOCAL_COUNT: stop - start,
            }

        return tf.data.Dataset.range(replicas).map(part)

    parts = dataset.flat_map(split)
    return strategy.distribute_datasets_from_function(lambda _: parts, options)


def create_engine(devices, sync_batch_norm: bool, input_options):
    """Returns the engine for `devices` (one device: no tf.distribute)."""
    devices = [normalize_device(d) for d in devices]
    if len(devices) == 1:
        return OneDeviceEngine(devices[0])
    # One worker (this process): every shard policy reads the whole input.
    del input_options
    return MirroredEngine(devices, sync_batch_norm)


def _exact_step(engine, model, data, training):
    """One replica's share of an exact global-batch step."""
    context = tf.distribute.get_replica_context()
    replicas = context.num_replicas_in_sync
    padded_input = isinstance(data, dict) and _BATCH in data
    rebatched = padded_input and _COUNT_PER_SAMPLE in data
    if rebatched:  # tf.distribute's rebatching; padding samples carry 0
        per_sample = data[_COUNT_PER_SAMPLE]
        local_count = tf.math.count_nonzero(per_sample, dtype="int32")
        global_count = tf.cast(tf.reduce_max(per_sample), "float32")
        data = data[_BATCH]
    elif padded_input:  # keras_dist's own split, already padded
        global_count = tf.cast(data[_GLOBAL_COUNT], "float32")
        local_count = data[_LOCAL_COUNT]
        data = data[_BATCH]
    x, y, sample_weight = (
        data_adapters.data_adapter_utils.unpack_x_y_sample_weight(data)
    )
    x = _check_input_shapes(model, x)
    first = next(i for i in tree.flatten(x) if i is not None)
    rows = tf.shape(first)[0]
    if not padded_input:  # train_on_batch: not through our dataset
        local_count = rows
        global_count = context.all_reduce(
            tf.distribute.ReduceOp.SUM, tf.cast(rows, "float32")
        )
    unpadded = (x, y, sample_weight)
    valid = None
    if padded_input:
        # An empty part arrives as one zero sample (see
        # _distribute_global_batches): weight 0 in the loss, left out of
        # the metrics and of the BatchNormalization statistics.
        valid = tf.sequence_mask(local_count, rows, dtype="float32")
        if sample_weight is None:
            sample_weight = valid
        else:
            sample_weight = tree.map_structure(
                lambda w: None if w is None else w * _expand_like(valid, w),
                sample_weight,
            )
        unpadded = tree.map_structure(
            lambda t: None if t is None else t[:local_count],
            (x, y, unpadded[2]),
        )
    share = tf.math.divide_no_nan(
        tf.cast(rows, "float32") * replicas, global_count
    )
    _REPLICA.valid = valid

    with tf.GradientTape() as tape:
        kwargs = {"training": training} if model._call_has_training_arg else {}
        y_pred = model(x, **kwargs)
        # Keras scales both parts by 1/replicas ("mean of means").
        data_loss = None
        if model._compile_loss is not None:
            data_loss = model._compile_loss(y, y_pred, sample_weight)
        extra = [model._aggregate_additional_loss(v) for v in model.losses]
        if data_loss is None and not extra:
            raise ValueError(
                "No loss to compute. Provide a `loss` argument in `compile()`."
            )
        zero = tf.zeros((), dtype="float32")
        data_loss = zero if data_loss is None else data_loss
        extra_loss = tf.add_n(extra) if extra else tf.zeros_like(data_loss)
        _check_mean_reductions(model)
        # Keras's loss is a mean over the part's rows, padding included;
        # the tracker wants the mean over its real samples.
        real_mean = data_loss * tf.math.divide_no_nan(
            tf.cast(rows, data_loss.dtype),
            tf.cast(local_count, data_loss.dtype),
        )
        model._loss_tracker.update_state(
            loss_module.unscale_loss_for_distribution(real_mean + extra_loss),
            sample_weight=local_count,
        )
        loss = data_loss * tf.cast(share, data_loss.dtype) + extra_loss
        if training and model.optimizer is not None:
            loss = model.optimizer.scale_loss(loss)

    _REPLICA.valid = None
    if training:
        if model.trainable_weights:
            weights = model.trainable_weights
            gradients = tape.gradient(loss, weights)
            model.optimizer.apply_gradients(zip(gradients, weights))
        else:
            warnings.warn(
                "The model does not have any trainable weights.", stacklevel=2
            )
    # Metrics see the real samples only (unweighted metrics ignore weights).
    x, y, sample_weight = unpadded
    if padded_input:
        y_pred = tree.map_structure(lambda t: t[:local_count], y_pred)
    return model.compute_metrics(x, y, y_pred, sample_weight=sample_weight)


def _set_batch_norm_sync(layer, sync: bool) -> None:
    """Gives `layer` global-batch (or per-replica) moments in training.

    Keras's own ``synchronized=True`` path fails with shards of unequal or
    zero size (a collective shape mismatch in the backward pass, seen with
    Keras 3.15 and TF 2.21), and computes the variance as E[x^2] - E[x]^2.
    This replacement all-reduces sums and counts (so shards of any size,
    including empty ones, are weighted exactly), takes the variance in a
    second pass around the global mean, and defines the gradient of each
    all-reduce explicitly, so every replica runs the same collectives.
    """
    layer.synchronized = False
    if not sync:
        layer.__dict__.pop("_moments", None)
        # Keras creates the moving statistics with aggregation "none", which
        # tf.distribute resolves by keeping the first replica's update; the
        # mean over replicas (what the JAX and torch backends do) uses every
        # replica's statistics.
        for variable in (layer.moving_mean, layer.moving_variance):
            value = variable.value
            if hasattr(value, "_aggregation"):
                value._aggregation = tf.VariableAggregation.MEAN
        return
    original = type(layer)._moments.__get__(layer)

    def moments(inputs, mask):
        context = tf.distribute.get_replica_context()
        if (
            mask is not None
            or context is None
            or context.num_replicas_in_sync == 1
        ):
            return original(inputs, mask)
        valid = getattr(_REPLICA, "valid", None)
        return _global_moments(context, inputs, layer._reduction_axes, valid)

    layer.__dict__["_moments"] = moments


def _global_moments(context, inputs, axes, valid):
    """Count-weighted mean and variance over all replicas' samples."""
    dtype = inputs.dtype
    x = tf.cast(inputs, "float32")
    weight = tf.ones_like(x)
    if valid is not None:
        # The mask is per sample of the step's batch; a layer whose first
        # axis is something else (after a reshape) is left unmasked.
        mask = _expand_like(valid, x)
        weight = tf.cond(
            tf.equal(tf.shape(valid)[0], tf.shape(x)[0]),
            lambda: weight * mask,
            lambda: weight,
        )
    sums = tf.stack(
        [
            tf.reduce_sum(x * weight, axis=axes),
            tf.reduce_sum(weight, axis=axes),
        ]
    )
    total = _all_reduce_sum(context, sums)
    count = total[1]
    mean = tf.math.divide_no_nan(total[0], count)
    centered = tf.reduce_sum(
        weight * tf.square(x - _keep_dims(mean, axes, x.shape.rank)),
        axis=axes,
    )
    variance = tf.math.divide_no_nan(_all_reduce_sum(context, centered), count)
    return tf.cast(mean, dtype), tf.cast(variance, dtype)


def _keep_dims(value, axes, rank):
    axes = sorted(a % rank for a in axes)
    for axis in axes:
        value = tf.expand_dims(value, axis)
    return value


def _all_reduce_sum(context, value):
    """All-reduce (SUM) whose gradient is the all-reduced upstream gradient."""

    @tf.custom_gradient
    def reduce(local):
        def grad(upstream):
            return context.all_reduce(tf.distribute.ReduceOp.SUM, upstream)

        return context.all_reduce(tf.distribute.ReduceOp.SUM, local), grad

    return reduce(value)


_REPLICA = threading.local()


def _expand_like(vector, tensor):
    """Reshapes a per-sample `vector` to broadcast against `tensor`."""
    rank = tensor.shape.rank or 1
    return tf.reshape(vector, [-1] + [1] * (rank - 1))


def _pad_rows(tensor, count):
    if tensor is None:
        return None
    zeros = tf.zeros(
        tf.concat([[count], tf.shape(tensor)[1:]], axis=0), tensor.dtype
    )
    return tf.concat([tensor, zeros], axis=0)


def _check_input_shapes(model, x):
    """Checks at run time that `x` matches the model's input shapes.

    Inputs from generators reach the step with unknown dimensions, so a batch
    of the wrong shape would otherwise fail deep inside a layer. EnsureShape
    fails with "Shape of tensor ... is not compatible with expected shape
    [?, ...]" (an assert with control dependencies cost 5-10 % of a small
    model's step on CPU).
    """
    try:
        inputs = model.inputs
    except (AttributeError, ValueError):  # subclassed models have none
        return x
    if not inputs:
        return x
    try:
        pairs = list(zip(tree.flatten(inputs), tree.flatten(x), strict=True))
    except ValueError:
        return x
    checked = []
    for spec, tensor in pairs:
        shape = getattr(spec, "shape", None)
        if (
            isinstance(tensor, tf.Tensor)
            and shape is not None
            and len(shape) == tensor.shape.rank
        ):
            tensor = tf.ensure_shape(tensor, [None] + list(shape)[1:])
        checked.append(tensor)
    return tree.pack_sequence_as(x, checked)


def _check_mean_reductions(model):
    flat = getattr(model._compile_loss, "_flat_losses", None) or []
    for entry in flat:
        reduction = getattr(entry.loss, "reduction", "sum_over_batch_size")
        if reduction not in _MEAN_REDUCTIONS:
            raise ValueError(
                f"Loss {entry.name or entry.loss!r} uses reduction "
                f"{reduction!r}; keras_dist's exact replicated step supports "
                f"losses with reduction in {_MEAN_REDUCTIONS} (the Keras "
                "default). Use the default reduction, or override "
                "`compute_loss` to compute the loss yourself."
            )


class _DistributedIterable:
    """Per-replica batches from any iterable of global batches."""

    def __init__(self, engine, dataset):
        self._engine = engine
        self._dataset = dataset

    def __iter__(self):
        from keras_dist._src.data import iterate_numpy_batches, split_batch

        count = self._engine.num_replicas_in_sync
        for batch in iterate_numpy_batches(self._dataset):
            parts = split_batch(batch, count)
            if count == 1:
                yield tree.map_structure(tf.convert_to_tensor, parts[0])
                continue
            strategy = self._engine.tf_strategy
            yield strategy.experimental_distribute_values_from_function(
                lambda ctx, parts=parts: tree.map_structure(
                    tf.convert_to_tensor, parts[ctx.replica_id_in_sync_group]
                )
            )

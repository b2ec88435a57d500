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

import warnings

import keras
import numpy as np
import tensorflow as tf
from keras import tree

from keras_dist._src.backends.tensorflow.batch_norm import (
    REPLICA_STATE,
    set_batch_norm_sync,
)
from keras_dist._src.backends.tensorflow.devices import tf_device_name
from keras_dist._src.backends.tensorflow.inputs import (
    BATCH_KEY,
    COUNT_PER_SAMPLE_KEY,
    GLOBAL_COUNT_KEY,
    LOCAL_COUNT_KEY,
    distribute_global_batches,
    distribute_iterable,
    pad_rows,
)
from keras_dist._src.devices import normalize_device
from keras_dist._src.errors import (
    VariablesOutsideScopeError,
)
from keras_dist._src.keras_glue import internals as glue
from keras_dist._src.keras_glue.dropout import draws_per_sample_mask
from keras_dist._src.keras_glue.losses import (
    warn_user_losses,
    watch_user_losses,
)
from keras_dist._src.options import InputOptions
from keras_dist._src.patching import InstancePatches
from keras_dist._src.values import PerReplica, ReduceOp

_MEAN_REDUCTIONS = ("sum_over_batch_size", "mean")

_MISSING = object()


class _EngineBase:
    devices: tuple

    def local_results(self, value):
        return tuple(self.tf_strategy.experimental_local_results(value))

    def placement(self, variable):
        """Replicated: every device holds the whole variable."""
        shape = tuple(variable.shape)
        return (None,) * len(shape), shape

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
        return distribute_iterable(self, dataset)

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
        self._tf_device = tf_device_name(device)

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
            [tf_device_name(d) for d in self.devices]
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
        strategy = glue.tf_distribute_strategy(model)
        if strategy is not self.tf_strategy:
            raise VariablesOutsideScopeError(
                f"Model {model.name!r} was created outside strategy.scope(), "
                "so its variables are not mirrored. Create the model (not "
                "only compile it) inside `with strategy.scope():`."
            )
        # Saving builds reference objects with variables: made distributed
        # here, they would need a collective that a chief-only save (a
        # callback's) makes alone.
        glue.cache_saving_attr_skipsets()
        extended = self.tf_strategy.extended
        for variable in model.variables:
            if not extended.variable_created_in_scope(variable.value):
                raise VariablesOutsideScopeError(
                    f"Variable {variable.path!r} of model {model.name!r} was "
                    "created outside strategy.scope(). Build the model and "
                    "all its layers inside the scope."
                )
        for layer in glue.flatten_layers(model):
            if isinstance(layer, keras.layers.BatchNormalization):
                set_batch_norm_sync(layer, self.sync_batch_norm)
            if type(layer) is keras.layers.Dropout:
                if "call" not in layer.__dict__:
                    layer.__dict__["call"] = _global_dropout(layer)
                model.__dict__["_keras_dist_dropout"] = True
        self._install_steps(model)

    def _install_steps(self, model) -> None:
        cls = type(model)
        trainer = glue.tensorflow_trainer()
        custom_train = cls.train_step is not trainer.train_step
        custom_test = cls.test_step is not trainer.test_step
        engine = self

        def make_step_function(attribute, training, custom):
            def make(force=False):
                if getattr(model, attribute) is not None and not force:
                    return getattr(model, attribute)

                def step(data):
                    if custom:  # the model's own train_step or test_step
                        return _override_step(engine, model, data, training)
                    return _exact_step(engine, model, data, training=training)

                function = _split_single_batches(
                    engine, model, _make_function(model, step)
                )
                setattr(model, attribute, function)
                return function

            return make

        make_train_function = make_step_function(
            "train_function", True, custom_train
        )
        make_test_function = make_step_function(
            "test_function", False, custom_test
        )

        def make_predict_function(force=False):
            if model.predict_function is not None and not force:
                return model.predict_function
            trainer.make_predict_function(model, force=True)
            inner = model.predict_function

            def predict_function(data):
                # `predict_on_batch` passes `[(x,)]` with the whole batch,
                # which tf.distribute would hand to every replica (N times
                # the rows): split it like a global batch first.
                return inner([engine._distribute_batch(d) for d in data])

            model.predict_function = predict_function
            return predict_function

        def maybe_symbolic_build(iterator=None, data_batch=None):
            # Keras builds metrics and optimizer variables here, from shapes
            # only. Its own version takes a batch from the distributed input
            # (consuming batches of a generator, and losing those the
            # iterator had prefetched) and sums the replicas' parts (which
            # fails when they differ in size). The input's element spec has
            # all the shapes and dtypes needed, without reading any data.
            if iterator is not None:
                data_batch = glue.epoch_iterator_element_spec(iterator)
            with engine.tf_strategy.scope():
                if not (custom_train or custom_test):
                    glue.symbolic_build(model, data_batch)
                    return
                # An overridden step's batch need not be the model's input
                # (a GAN's real samples and noise): build what Keras builds
                # if the batch fits, else the optimizer (its variables may
                # not be created inside the replicated step).
                try:
                    glue.symbolic_build(model, data_batch)
                except (ValueError, TypeError):
                    optimizer = model.optimizer
                    if optimizer is not None and not optimizer.built:
                        optimizer.build(model.trainable_variables)

        model.__dict__["make_train_function"] = make_train_function
        model.__dict__["make_test_function"] = make_test_function
        model.__dict__["make_predict_function"] = make_predict_function
        model.predict_function = None
        glue.replace_maybe_symbolic_build(model, maybe_symbolic_build)
        model.train_function = None
        model.test_function = None

    def _distribute_counted_batch(self, batch):
        """Per-replica parts of a global `batch` in the padded form of
        keras_dist's own split (`distribute_global_batches`): each part
        with the global and its own sample count, an empty part as one
        zero sample."""
        from keras_dist._src.core.shards import split_batch

        batch = tree.map_structure(
            lambda t: None if t is None else np.asarray(t), batch
        )
        first = next(t for t in tree.flatten(batch) if t is not None)
        count = np.int32(np.shape(first)[0])
        parts = []
        for part in split_batch(batch, self.num_replicas_in_sync):
            leaves = [t for t in tree.flatten(part) if t is not None]
            local = np.int32(np.shape(leaves[0])[0])
            if local == 0:
                part = tree.map_structure(
                    lambda t: (
                        None
                        if t is None
                        else np.zeros((1,) + t.shape[1:], t.dtype)
                    ),
                    part,
                )
            parts.append(
                {
                    BATCH_KEY: part,
                    GLOBAL_COUNT_KEY: count,
                    LOCAL_COUNT_KEY: local,
                }
            )
        return self.tf_strategy.experimental_distribute_values_from_function(
            lambda ctx: tree.map_structure(
                lambda t: None if t is None else tf.convert_to_tensor(t),
                parts[ctx.replica_id_in_sync_group],
            )
        )

    def _distribute_batch(self, batch):
        """Per-replica parts of a global `batch`; distributed input as is."""
        leaves = tf.nest.flatten(batch)
        if any(isinstance(t, tf.distribute.DistributedValues) for t in leaves):
            return batch
        from keras_dist._src.core.shards import split_batch

        batch = tree.map_structure(
            lambda t: None if t is None else np.asarray(t), batch
        )
        parts = split_batch(batch, self.num_replicas_in_sync)
        return self.tf_strategy.experimental_distribute_values_from_function(
            lambda ctx: tree.map_structure(
                lambda t: None if t is None else tf.convert_to_tensor(t),
                parts[ctx.replica_id_in_sync_group],
            )
        )

    def _warn(self, message):
        if not self._warned:
            self._warned = True
            warnings.warn(message, stacklevel=4)


def _split_single_batches(engine, model, function):
    """`train_on_batch` and `test_on_batch` hand Keras's step function a
    generator of one whole batch, which tf.distribute would give to every
    replica (N copies of the batch: exact for the gradient of a mean loss,
    but not for Dropout's mask, drawn for N times the rows): split it like
    a global batch of `fit` first.

    The step's logs are then one replica's view of the metrics (its own
    part's); Keras resets the metrics before these calls, so the metrics'
    results read here, summed over replicas, are the batch's logs."""

    def split(iterator):
        if isinstance(
            iterator, (tf.data.Iterator, tf.distribute.DistributedIterator)
        ):
            return function(iterator)
        iterator = iter([engine._distribute_counted_batch(d) for d in iterator])
        logs = function(iterator)
        if not isinstance(logs, dict):
            return logs
        results = model.get_metrics_result()
        return {key: results.get(key, value) for key, value in logs.items()}

    return split


def _make_function(model, step):
    """Keras's step function; with `steps_per_execution` > 1, one traced
    step called that many times.

    Keras runs several steps in one `tf.while_loop` whose body reads the
    next input with `get_next_as_optional` inside a `tf.cond`; with a
    distributed iterator of tf.distribute's rebatched input the traced
    graph leaves a placeholder unfed ("You must feed a value for
    placeholder tensor 'while/cond/Placeholder'"). Here each step is its
    own call (a host round trip per step instead of per execution).
    """
    executions = model.steps_per_execution
    if executions <= 1:
        return glue.make_function(model, step)
    traced = glue.make_function(model, step)

    def single(iterator):
        # Keras reads `steps_per_execution` when it traces the function.
        model.steps_per_execution = 1
        try:
            return traced(iterator)
        finally:
            model.steps_per_execution = executions

    def function(iterator):
        if not isinstance(
            iterator, (tf.data.Iterator, tf.distribute.DistributedIterator)
        ):  # train_on_batch and test_on_batch: one batch
            return single(iterator)
        outputs = None
        for index in range(executions):
            # A call past the input's end still runs the step's ops that
            # do not wait for data: the random generators' advance (the
            # epochs after a shorter last execution drew other Dropout
            # masks than one device). Their states are put back then.
            saved = _seed_states(model) if index else None
            try:
                outputs = single(iterator)
            except (StopIteration, tf.errors.OutOfRangeError):
                if outputs is None:
                    raise
                for variable, value in saved or ():
                    variable.assign(value)
                break
        return outputs

    return function


def _seed_states(model):
    """(variable, value) of the state of every random generator a step of
    `model` may advance: its layers' and Keras's global one."""
    generators = []
    for layer in glue.flatten_layers(model, include_self=True):
        generators.extend(glue.layer_seed_generators(layer))
    generators.append(glue.global_seed_generator())
    seen, states = set(), []
    for generator in generators:
        state = getattr(generator, "state", None)
        if state is None or id(state) in seen:
            continue
        seen.add(id(state))
        states.append((state, tf.identity(glue.variable_value(state))))
    return states


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
            "experimental_distribute_dataset": distribute_global_batches,
        },
    )
    return cls(devices=tf_devices)


def create_engine(plan, runtime, input_options):
    """The engine of a `ReplicatedPlan` on this process's devices.

    One device needs no tf.distribute (Keras's own step, placed on it).
    """
    devices = [normalize_device(d) for d in plan.devices]
    sync_batch_norm = plan.sync_batch_norm
    if plan.topology == "multi_worker" and runtime.world_size > 1:
        from keras_dist._src.backends.tensorflow.multi_worker import (
            MultiWorkerEngine,
        )

        return MultiWorkerEngine(
            devices, sync_batch_norm, runtime, input_options or InputOptions()
        )
    if len(devices) == 1:
        return OneDeviceEngine(devices[0])
    # One worker (this process): every shard policy reads the whole input.
    return MirroredEngine(devices, sync_batch_norm)


def _override_step(engine, model, data, training):
    """One replica's run of the model's own train_step or test_step on
    its real samples, with one device's semantics (`overrides`)."""
    from keras_dist._src.backends.tensorflow import overrides

    context = tf.distribute.get_replica_context()
    data, local_count, global_count, padded_input = _replica_part(context, data)
    if padded_input:  # an empty part: no row (its share is 0)
        data = overrides.real_rows(data, local_count)
    REPLICA_STATE.valid = None
    REPLICA_STATE.dropout = None
    if training and model.__dict__.get("_keras_dist_dropout"):
        REPLICA_STATE.dropout = _part_position(context, local_count) + (
            tf.cast(global_count, "int32"),
        )
    try:
        return overrides.run_override_step(
            model, data, local_count, global_count, training
        )
    finally:
        REPLICA_STATE.dropout = None


def _replica_part(context, data):
    """(this replica's batch, its sample count, the global batch's sample
    count, whether the batch came padded through keras_dist's input)."""
    padded_input = isinstance(data, dict) and BATCH_KEY in data
    rebatched = padded_input and COUNT_PER_SAMPLE_KEY in data
    if rebatched:  # tf.distribute's rebatching; padding samples carry 0
        per_sample = data[COUNT_PER_SAMPLE_KEY]
        local_count = tf.math.count_nonzero(per_sample, dtype="int32")
        global_count = tf.cast(tf.reduce_max(per_sample), "float32")
        data = data[BATCH_KEY]
    elif padded_input:  # keras_dist's own split, already padded
        global_count = tf.cast(data[GLOBAL_COUNT_KEY], "float32")
        local_count = data[LOCAL_COUNT_KEY]
        data = data[BATCH_KEY]
    if not padded_input:  # train_on_batch: not through our dataset
        first = next(i for i in tree.flatten(data) if i is not None)
        local_count = tf.shape(first)[0]
        global_count = context.all_reduce(
            tf.distribute.ReduceOp.SUM, tf.cast(local_count, "float32")
        )
    return data, local_count, global_count, padded_input


def _exact_step(engine, model, data, training):
    """One replica's share of an exact global-batch step."""
    context = tf.distribute.get_replica_context()
    data, local_count, global_count, padded_input = _replica_part(context, data)
    x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
    x = _check_input_shapes(model, x)
    first = next(i for i in tree.flatten(x) if i is not None)
    rows = tf.shape(first)[0]
    valid = None
    if padded_input:
        # An empty part arrives as one zero sample (see
        # distribute_global_batches): left out of the BatchNormalization
        # statistics here, of the loss (its share of the global batch is
        # 0) and the metrics in `_loss_step`. Not made a sample weight: a
        # 1-D weight does not broadcast against a per-timestep mask.
        valid = tf.sequence_mask(local_count, rows, dtype="float32")
    REPLICA_STATE.valid = valid
    REPLICA_STATE.dropout = None
    if training and model.__dict__.get("_keras_dist_dropout"):
        REPLICA_STATE.dropout = _part_position(context, local_count) + (
            tf.cast(global_count, "int32"),
        )
    with tf.GradientTape() as tape, watch_user_losses(model) as user_losses:
        takes_training = glue.call_has_training_arg(model)
        kwargs = {"training": training} if takes_training else {}
        y_pred = model(x, **kwargs)
    REPLICA_STATE.dropout = None
    if user_losses.found:
        warn_user_losses(model, user_losses.layers)
    return _loss_step(
        model,
        tape,
        training,
        (x, y, sample_weight, y_pred),
        local_count,
        global_count,
    )


def _part_position(context, local_count):
    """(first row, row count) of this replica's part in the global batch:
    the parts lie in replica order (both input splits keep sample order)."""
    replicas = context.num_replicas_in_sync
    replica = context.replica_id_in_sync_group
    counts = context.all_reduce(
        tf.distribute.ReduceOp.SUM,
        tf.one_hot(replica, replicas, dtype="int32")
        * tf.cast(local_count, "int32"),
    )
    start = tf.reduce_sum(
        counts * tf.cast(tf.range(replicas) < replica, "int32")
    )
    return start, tf.cast(local_count, "int32")


def _global_dropout(layer):
    """A `Dropout.call` that drops what one device drops.

    Keras's TF dropout is stateless: the mask depends on the seed (drawn
    from the layer's seed generator, whose state every replica shares) and
    on the shape. Each replica used to draw a mask for its own part's
    shape with the same seed, so every part got the first rows of one
    device's mask. Here, in keras_dist's training step, the mask is drawn
    for the global batch's shape (the layer's own call on ones: same seed,
    same generator advance, same values as on one device) and this replica
    keeps its rows (padding rows, weighted 0, get zeros). Elsewhere
    (inference, `training=True` outside the step) it is Keras's call.
    """
    original = type(layer).call.__get__(layer)

    def call(inputs, training=False):
        position = getattr(REPLICA_STATE, "dropout", None)
        if not training or position is None or not draws_per_sample_mask(layer):
            return original(inputs, training=training)
        start, count, global_count = position
        inputs = tf.convert_to_tensor(inputs)
        shape = tf.shape(inputs)
        probe = tf.ones(
            tf.concat([[global_count], shape[1:]], axis=0), inputs.dtype
        )
        kept = original(probe, training=True)[start : start + count]
        kept = pad_rows(kept, shape[0] - count)
        return inputs * kept

    return call


def _loss_step(model, tape, training, data, local_count, global_count):
    """The loss, gradients, update and metrics of one replica's part.

    `model.compute_loss` (Keras's, or the model's override) gets this
    replica's real samples only (padding removed; an empty part keeps its
    one zero sample, weighted 0), with Keras's per-replica 1/N loss
    scaling switched off, so it returns the loss of its samples as it
    would on one device: a mean over them for the usual losses. That loss,
    weighted by the part's share of the global batch (local / global
    count, the shares summing to 1), adds up across replicas to the loss
    of the global batch, and so do the gradients.
    """
    context = tf.distribute.get_replica_context()
    x, y, sample_weight, y_pred = data
    rows = tf.maximum(local_count, 1)

    def real(t):
        return None if t is None else t[:rows]

    if glue.uses_keras_compute_loss(model):
        _check_mean_reductions(model)
    with tape:  # the slicing too: the loss's gradient flows through it
        x, y, sample_weight = tree.map_structure(real, (x, y, sample_weight))
        y_pred = _slice_keeping_masks(y_pred, rows)
        weight = tf.math.divide_no_nan(
            tf.cast(local_count, "float32"), global_count
        )
        scaling = _no_replica_loss_scaling(model, weight)
        masked = _masked_means(context, y_pred, local_count, weight)
        with scaling, masked, _own_losses(model, y_pred):
            loss = model.compute_loss(
                x=x,
                y=y,
                y_pred=y_pred,
                sample_weight=sample_weight,
                training=training,
            )
        loss = tf.convert_to_tensor(loss)
        glue.loss_tracker(model).update_state(
            tf.cast(loss, "float32"), sample_weight=local_count
        )
        weighted = loss * tf.cast(weight, loss.dtype)
        if training and model.optimizer is not None:
            weighted = model.optimizer.scale_loss(weighted)
    REPLICA_STATE.valid = None
    if training:
        if model.trainable_weights:
            weights = model.trainable_weights
            gradients = tape.gradient(weighted, weights)
            apply_global_gradients(context, model.optimizer, gradients, weights)
        else:
            warnings.warn(
                "The model does not have any trainable weights.", stacklevel=2
            )
    # Metrics see the real samples only (unweighted metrics ignore weights).
    x, y, sample_weight = tree.map_structure(
        lambda t: None if t is None else t[:local_count],
        (x, y, sample_weight),
    )
    y_pred = _slice_keeping_masks(y_pred, local_count)
    return model.compute_metrics(x, y, y_pred, sample_weight=sample_weight)


def _slice_keeping_masks(structure, rows):
    """The first `rows` rows of each tensor, with its Keras mask (from
    `Embedding(mask_zero=True)`, `Masking`, `compute_mask`) sliced alike:
    a slice is a new tensor, which Keras's losses and metrics would see
    unmasked."""

    def cut(t):
        if t is None:
            return None
        mask = glue.keras_mask(t)
        part = t[:rows]
        if mask is not None:
            glue.set_keras_mask(part, mask[:rows])
        return part

    return tree.map_structure(cut, structure)


class _masked_means:
    """One device's masked mean for Keras's losses over masked outputs.

    With a mask on the prediction, Keras's mean losses divide by the
    count of its unmasked entries: on a replica, its own count. Weighted
    by the replica's share of the rows, the parts would add up to one
    device's loss only if every part had as many unmasked entries per
    row. Here each loss over a masked output of the model is rescaled so
    that, times the share, it is the part's weighted sum over the
    global count of unmasked entries (one all-reduce of the counts, made
    before the loss, since no collective may run while Keras's loss
    functions are replaced). Exact on any split; other losses as before.
    """

    _REDUCTIONS = ("sum_over_batch_size", "mean")

    def __init__(self, context, y_pred, local_count, share):
        self._share = share
        self._masks = []
        for leaf in tree.flatten(y_pred):
            mask = None if leaf is None else glue.keras_mask(leaf)
            if mask is not None:
                self._masks.append(mask)
        self._totals = []
        if self._masks:
            counts = tf.stack(
                [
                    tf.reduce_sum(tf.cast(m[:local_count], "float32"))
                    for m in self._masks
                ]
            )
            totals = context.all_reduce(tf.distribute.ReduceOp.SUM, counts)
            self._totals = tf.unstack(totals, num=len(self._masks))

    def __enter__(self):
        self._original = glue.loss_reduction()
        if not self._masks:
            return self
        original, masks, totals = self._original, self._masks, self._totals
        share = self._share

        def reduce_weighted_values(
            values,
            sample_weight=None,
            mask=None,
            reduction="sum_over_batch_size",
            dtype=None,
        ):
            loss = original(
                values,
                sample_weight=sample_weight,
                mask=mask,
                reduction=reduction,
                dtype=dtype,
            )
            index = next((i for i, m in enumerate(masks) if m is mask), None)
            if index is None or reduction not in self._REDUCTIONS:
                return loss
            # Keras's value: the part's weighted sum / its own count.
            own = tf.reduce_sum(tf.cast(mask, "float32"))
            factor = tf.math.divide_no_nan(own, totals[index] * share)
            return loss * tf.cast(factor, loss.dtype)

        glue.set_loss_reduction(reduce_weighted_values)
        return self

    def __exit__(self, *exc):
        glue.set_loss_reduction(self._original)
        return False


class _no_replica_loss_scaling:
    """One-device loss semantics while `compute_loss` runs.

    Keras's losses divide by the replica count under tf.distribute
    (`scale_loss_for_distribution`), and its per-output loss trackers
    multiply back and weight each replica's value by its static batch size
    (unknown in a traced step, so every replica weighs 1). Both are
    switched off. On one device Keras's TF trainer weighs each batch's
    per-output loss by that same static batch size, which is unknown for
    batches from `tf.data` (arrays included): every batch weighs 1, and
    the logged per-output loss is the mean of the batches' means (its
    total `loss`, weighted by `tf.shape`, is not). Here each part's mean
    weighs its share of the global batch (the shares add up to 1), so
    each global batch weighs 1 as on one device.
    """

    def __init__(self, model, share):
        self._model = model
        self._share = share

    def __enter__(self):
        self._scale, self._unscale = glue.loss_distribution_scaling()
        glue.set_loss_distribution_scaling(_identity, _identity)
        self._patches = InstancePatches()
        compile_loss = glue.compile_loss(self._model)
        for metric in getattr(compile_loss, "metrics", None) or []:
            if metric is None:
                continue
            original = metric.update_state

            def update_state(value, sample_weight=None, original=original):
                return original(
                    tf.cast(value, "float32"), sample_weight=self._share
                )

            self._patches.set(metric, "update_state", update_state)
        return self

    def __exit__(self, *exc):
        glue.set_loss_distribution_scaling(self._scale, self._unscale)
        self._patches.restore()
        return False


class _own_losses:
    """`model.losses` restricted to this replica's own.

    Keras keeps `add_loss` values in one list per layer, shared by the
    replicas' threads: when a collective (cross-replica BatchNormalization)
    lets another replica's forward pass run in between, this replica's
    `model.losses` also holds the other's values (not on this replica's
    tape: the gradients stay right, the logged loss does not). Each
    replica's ops are placed on its device, which tells them apart.
    """

    def __init__(self, model, y_pred):
        self._model = model
        leaves = [t for t in tree.flatten(y_pred) if t is not None]
        self._device = getattr(leaves[0], "device", "") if leaves else ""

    def __enter__(self):
        self._old = glue.own_losses_override(self._model, _MISSING)
        if not self._device:
            return self
        losses = self._model.losses
        own = [
            v for v in losses if getattr(v, "device", "") in ("", self._device)
        ]
        if own and len(own) != len(losses):
            glue.set_losses_override(self._model, own)
        return self

    def __exit__(self, *exc):
        if self._old is _MISSING:
            glue.clear_losses_override(self._model)
        else:
            glue.set_losses_override(self._model, self._old)
        return False


def _identity(value):
    return value


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
    for entry in glue.compiled_loss_entries(model):
        reduction = getattr(entry.loss, "reduction", "sum_over_batch_size")
        if reduction not in _MEAN_REDUCTIONS:
            raise ValueError(
                f"Loss {entry.name or entry.loss!r} uses reduction "
                f"{reduction!r}; keras_dist's exact replicated step supports "
                f"losses with reduction in {_MEAN_REDUCTIONS} (the Keras "
                "default). Use the default reduction, or override "
                "`compute_loss` to compute the loss yourself."
            )


def apply_global_gradients(context, optimizer, gradients, weights, apply=None):
    """Applies the all-reduced `gradients` on every replica, as one device.

    Keras's TF optimizer clips (``clipnorm``, ``global_clipnorm``,
    ``clipvalue``) each replica's own gradient before tf.distribute sums
    them, and its gradient accumulation and EMA overwrite put a `merge_call`
    inside `tf.cond` (which tf.distribute refuses). Here the gradients are
    summed first; every replica then holds the global gradient and runs the
    whole optimizer (loss-scale unscaling and finite check, clipping,
    accumulation, weight decay, update, EMA, constraints) on its own copy
    of each mirrored variable, with no further collective: the copies
    receive identical updates and stay equal, as tf.distribute's own update
    keeps them. `apply` is the optimizer's `apply` to call (default: the
    optimizer's own).
    """
    apply = apply or optimizer.apply
    present = [i for i, g in enumerate(gradients) if g is not None]
    if not present:  # Keras's optimizer raises its own error
        apply(gradients, weights)
        return
    reduced = context.all_reduce(
        tf.distribute.ReduceOp.SUM, [gradients[i] for i in present]
    )
    gradients = list(gradients)
    for i, g in zip(present, reduced):
        gradients[i] = g
    with _local_optimizer(context, optimizer, weights):
        apply(gradients, weights)


class _local_optimizer:
    """Points variables at this replica's copies and the optimizer at its
    non-distributed (backend-neutral) update paths, for the duration."""

    def __init__(self, context, optimizer, weights):
        self._context = context
        self._optimizer = optimizer
        self._weights = weights

    def __enter__(self):
        self._swapped = []
        self._patches = InstancePatches()
        optimizers = [self._optimizer]
        inner = getattr(self._optimizer, "inner_optimizer", None)
        if inner is not None:
            optimizers.append(inner)
        variables = list(self._weights)
        for opt in optimizers:
            variables.extend(opt.variables)
            for name, method in glue.replica_local_optimizer_methods(opt):
                self._patches.set(opt, name, method)
        seen = set()
        for variable in variables:
            value = glue.variable_value(variable)
            if id(variable) in seen or not isinstance(
                value, tf.distribute.DistributedValues
            ):
                continue
            seen.add(id(variable))
            self._swapped.append((variable, value))
            glue.set_variable_value(variable, value._get_on_device_or_primary())

        def no_merge_call(*args, **kwargs):
            raise RuntimeError(
                "keras_dist internal error: a collective inside the "
                "replica-local optimizer update."
            )

        self._patches.set(self._context, "merge_call", no_merge_call)
        return self

    def __exit__(self, *exc):
        for variable, value in reversed(self._swapped):
            glue.set_variable_value(variable, value)
        self._patches.restore()
        return False

"""One replica's share of keras_dist's exact global-batch step on TF.

`ReplicaEngine` (`engine`) runs `exact_step` (Keras's own `train_step` or
`test_step`, rewritten) or `override_step` (the model's own) once per
replica with `tf.distribute.Strategy.run`. Keras divides each replica's
loss by the replica count ("mean of per-replica means"), which is wrong
whenever parts differ in size (the last batch of an epoch). Here each
replica's data loss is weighted by its share of the global batch, the
gradients are summed by an all-reduce before the optimizer runs
(`gradients`), metric variables (SUM-aggregated) add up numerators and
denominators across replicas, Dropout draws one device's mask for the
global batch, and padding rows stay out of BatchNormalization's moments.

Each step creates one `step_context.StepContext` for its replica (counts,
row position, real-row mask), passed to the helpers here and found by the
readers called deep inside Keras (BatchNormalization, Dropout, an
overridden step's replacements): see `step_context` for why those look it
up by replica context.
"""

from __future__ import annotations

import warnings

import keras
import tensorflow as tf
from keras import tree

from keras_dist._src.backends.tensorflow import overrides, step_context
from keras_dist._src.backends.tensorflow.gradients import (
    apply_global_gradients,
)
from keras_dist._src.backends.tensorflow.inputs import (
    BATCH_KEY,
    COUNT_PER_SAMPLE_KEY,
    GLOBAL_COUNT_KEY,
    LOCAL_COUNT_KEY,
    pad_rows,
)
from keras_dist._src.backends.tensorflow.replica_losses import (
    MaskedMeans,
    NoReplicaLossScaling,
    OwnLosses,
    check_mean_reductions,
    first_rows,
    slice_keeping_masks,
)
from keras_dist._src.keras_glue import internals as glue
from keras_dist._src.keras_glue.dropout import draws_per_sample_mask
from keras_dist._src.keras_glue.losses import (
    warn_user_losses,
    watch_user_losses,
)


def override_step(model, data, training):
    """One replica's run of the model's own train_step or test_step on
    its real samples, with one device's semantics (`overrides`)."""
    replica = tf.distribute.get_replica_context()
    data, local_count, global_count, padded_input = _replica_part(replica, data)
    if padded_input:  # an empty part: no row (its share is 0)
        data = overrides.real_rows(data, local_count)
    with step_context.StepContext.enter(local_count, global_count) as step:
        if training and model.__dict__.get("_keras_dist_dropout"):
            step.dropout = _part_position(replica, local_count) + (
                tf.cast(global_count, "int32"),
            )
        return overrides.run_override_step(model, data, step, training)


def _replica_part(replica, data):
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
        global_count = replica.all_reduce(
            tf.distribute.ReduceOp.SUM, tf.cast(local_count, "float32")
        )
    return data, local_count, global_count, padded_input


def exact_step(model, data, training):
    """One replica's share of an exact global-batch step."""
    replica = tf.distribute.get_replica_context()
    data, local_count, global_count, padded_input = _replica_part(replica, data)
    x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
    x = check_input_shapes(model, x)
    first = next(i for i in tree.flatten(x) if i is not None)
    rows = tf.shape(first)[0]
    with step_context.StepContext.enter(local_count, global_count) as step:
        if padded_input:
            # An empty part arrives as one zero sample (see
            # distribute_global_batches): left out of the
            # BatchNormalization statistics here, of the loss (its share
            # of the global batch is 0) and the metrics in `_loss_step`.
            # Not made a sample weight: a 1-D weight does not broadcast
            # against a per-timestep mask.
            step.valid = tf.sequence_mask(local_count, rows, dtype="float32")
        if training and model.__dict__.get("_keras_dist_dropout"):
            step.dropout = _part_position(replica, local_count) + (
                tf.cast(global_count, "int32"),
            )
        with (
            tf.GradientTape() as tape,
            watch_user_losses(model) as user_losses,
        ):
            takes_training = glue.call_has_training_arg(model)
            kwargs = {"training": training} if takes_training else {}
            y_pred = model(x, **kwargs)
        step.dropout = None
        if user_losses.found:
            warn_user_losses(model, user_losses.layers)
        return _loss_step(
            model, tape, training, (x, y, sample_weight, y_pred), step
        )


def _part_position(replica, local_count):
    """(first row, row count) of this replica's part in the global batch:
    the parts lie in replica order (both input splits keep sample order)."""
    replicas = replica.num_replicas_in_sync
    index = replica.replica_id_in_sync_group
    counts = replica.all_reduce(
        tf.distribute.ReduceOp.SUM,
        tf.one_hot(index, replicas, dtype="int32")
        * tf.cast(local_count, "int32"),
    )
    start = tf.reduce_sum(counts * tf.cast(tf.range(replicas) < index, "int32"))
    return start, tf.cast(local_count, "int32")


def global_dropout(layer):
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
        step = step_context.current()
        position = None if step is None else step.dropout
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


def _loss_step(model, tape, training, data, step):
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
    replica = step.replica
    local_count, global_count = step.local_count, step.global_count
    x, y, sample_weight, y_pred = data
    rows = tf.maximum(local_count, 1)
    if glue.uses_keras_compute_loss(model):
        check_mean_reductions(model)
    with tape:  # the slicing too: the loss's gradient flows through it
        x, y, sample_weight = first_rows((x, y, sample_weight), rows)
        y_pred = slice_keeping_masks(y_pred, rows)
        weight = tf.math.divide_no_nan(
            tf.cast(local_count, "float32"), global_count
        )
        scaling = NoReplicaLossScaling(model, weight)
        masked = MaskedMeans(replica, y_pred, local_count, weight)
        with scaling, masked, OwnLosses(model, y_pred):
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
    step.valid = None
    # Metrics see the real samples only (unweighted metrics ignore weights).
    # They are updated before the optimizer (Keras updates them after; they
    # read the step's predictions, not the weights), so that their
    # replicas' counts ride in the gradients' all-reduce.
    x, y, sample_weight = first_rows((x, y, sample_weight), local_count)
    y_pred = slice_keeping_masks(y_pred, local_count)
    logs = model.compute_metrics(x, y, y_pred, sample_weight=sample_weight)
    metrics = GlobalMetrics(model, logs)
    if training:
        if model.trainable_weights:
            weights = model.trainable_weights
            gradients = tape.gradient(weighted, weights)
            metrics.summed = apply_global_gradients(
                replica,
                model.optimizer,
                gradients,
                weights,
                extra=metrics.to_sum,
            )
        else:
            warnings.warn(
                "The model does not have any trainable weights.", stacklevel=2
            )
    return metrics.results(replica)


class GlobalMetrics:
    """The step's logs with each metric's value over the global batch so
    far.

    Inside the step each replica's `result()` reads its own view of a
    metric: its own part's counts for tf.distribute's on-read variables (a
    metric built in the scope), and for a metric built outside the scope
    (one variable that every replica updates) whatever the replicas had
    added when it read. Keras then averages the replicas' results. That is
    the global value only for a mean over equal parts; a ratio such as
    `Precision`, a weighted mean or a partial last batch differ (the
    epoch's logs, read outside the step, were exact). Here the on-read
    variables are summed across replicas (`to_sum`, in the gradients'
    all-reduce when the step trains, else in their own) and every metric's
    `stateless_result` is taken from the global values, so the per-batch
    logs (progress bar, batch callbacks) equal one device's too. Left as
    is: a model whose `compute_metrics` or `get_metrics_result` is its own,
    and a metric with an on-read variable that is not summed across
    replicas.
    """

    def __init__(self, model, logs):
        self.logs = logs
        self.metrics = []
        self.to_sum = []  # this replica's values of the on-read variables
        self.summed = None  # their sums, once all-reduced
        self._index = {}  # id(variable) -> position in to_sum
        trainer = glue.tensorflow_trainer()
        cls = type(model)
        if (
            cls.compute_metrics is not trainer.compute_metrics
            or cls.get_metrics_result is not trainer.get_metrics_result
            or not isinstance(logs, dict)
        ):
            return
        for metric in model.metrics:
            values = [glue.variable_value(v) for v in metric.variables]
            on_read = [
                (variable, value)
                for variable, value in zip(metric.variables, values)
                if isinstance(value, tf.distribute.DistributedValues)
            ]
            if not values or any(v.aggregation != "sum" for v, _ in on_read):
                continue
            self.metrics.append(metric)
            for variable, value in on_read:
                self._index[id(variable)] = len(self.to_sum)
                self.to_sum.append(
                    tf.identity(value._get_on_device_or_primary())
                )

    def results(self, replica):
        """The logs, each metric's value global (collective)."""
        if not self.metrics:
            return self.logs
        if self.summed is None:
            # Also the merge point after which a variable that every
            # replica updates holds all their updates (ops made after it
            # come after every replica's earlier ops on that variable).
            self.summed = (
                replica.all_reduce(tf.distribute.ReduceOp.SUM, self.to_sum)
                if self.to_sum
                else replica.merge_call(lambda strategy: [])
            )
        results = dict(self.logs)
        for metric in self.metrics:
            result = metric.stateless_result(
                [
                    self.summed[self._index[id(v)]]
                    if id(v) in self._index
                    else tf.identity(v.value)
                    for v in metric.variables
                ]
            )
            if isinstance(result, dict):
                results.update(result)
            else:
                results[metric.name] = result
        return results


def check_input_shapes(model, x):
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

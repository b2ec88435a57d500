"""A model's own `train_step`/`test_step` under keras_dist's TF strategies.

tf.distribute runs an overridden step once per replica on the replica's
part of the global batch, where Keras's losses divide by the replica
count ("mean of per-replica means", wrong for parts of unequal size),
Keras's optimizer clips each replica's gradient before summing, and a
`Mean` updated with the part's loss weighs every replica alike. Here the
user's step runs per replica with one device's semantics, while it runs:

* Keras's loss functions return the part's own mean (no 1/N scaling);
* `optimizer.apply` (and `apply_gradients`) of every optimizer of the
  model weights the part's gradients by its share of the global batch
  (local / global sample count), sums them across replicas, and runs the
  whole optimizer on the global gradient (`apply_global_gradients`);
* a `keras.metrics.Mean` updated with a scalar (a loss) and no sample
  weight weighs it by the same share; metrics over samples (MAE, accuracy)
  already add up numerators and denominators across replicas;
* synchronised BatchNormalization weights its cross-replica gradient terms
  by the same share (`batch_norm._all_reduce_sum`).

So a step written with Keras's losses (`compute_loss` or loss objects with
a mean reduction), `optimizer.apply` and metrics trains and logs as on one
device, GANs with several optimizers included. A loss that is not a mean
over the part's samples (a sum, a masked mean over timesteps), gradients
changed by hand before `apply`, and logs returned without a metric (they
are the first replica's) are not exact.

The replacements are installed once on the instances and dispatch on the
replica's `step_context.StepContext` (its `override_share` set while the
user's step runs), found by replica context: tf.distribute switches
replica threads at every collective, so nothing process-wide may be set
and restored around one (see `step_context`).
"""

from __future__ import annotations

import keras
import tensorflow as tf
from keras import tree

from keras_dist._src.backends.tensorflow import step_context
from keras_dist._src.backends.tensorflow.gradients import (
    apply_global_gradients,
)
from keras_dist._src.keras_glue import internals as glue

_INSTALLED = "_keras_dist_override_dispatch"
_INSTALLED_RESULT = "_keras_dist_override_result"


def run_override_step(model, data, step, training):
    """Runs the model's own `train_step` (or `test_step`) on this
    replica's real samples, with one device's semantics (module doc);
    `step` is the replica's `StepContext`."""
    share = tf.math.divide_no_nan(
        tf.cast(step.local_count, "float32"),
        tf.cast(step.global_count, "float32"),
    )
    _install(model)
    step.override_share = share
    try:
        user_step = model.train_step if training else model.test_step
        return user_step(data)
    finally:
        step.override_share = None


def _active():
    """(replica context, share) in an overridden step, else None."""
    step = step_context.current()
    if step is None or step.override_share is None:
        return None
    return step.replica, step.override_share


def _install(model) -> None:
    _install_loss_scaling()
    for metric in _means(model):
        if not metric.__dict__.get(_INSTALLED):
            metric.__dict__["update_state"] = _mean_update(metric)
            metric.__dict__[_INSTALLED] = True
    for metric in _leaf_metrics(model):
        if not metric.__dict__.get(_INSTALLED_RESULT) and metric.variables:
            metric.__dict__["result"] = _global_result(metric)
            metric.__dict__[_INSTALLED_RESULT] = True
    for optimizer in _optimizers(model):
        if not optimizer.__dict__.get(_INSTALLED):
            optimizer.__dict__["apply"] = _optimizer_apply(optimizer)
            optimizer.__dict__[_INSTALLED] = True


def _install_loss_scaling() -> None:
    scale, unscale = glue.loss_distribution_scaling()
    if getattr(scale, _INSTALLED, False):
        return

    def scaled(value):
        return value if _active() is not None else scale(value)

    def unscaled(value):
        return value if _active() is not None else unscale(value)

    setattr(scaled, _INSTALLED, True)
    glue.set_loss_distribution_scaling(scaled, unscaled)


def _leaf_metrics(model):
    """Every metric of `model` that holds its own state: the compiled
    metrics' and losses' containers are opened."""
    found = list(model.metrics) + [glue.loss_tracker(model)]
    compile_loss = glue.compile_loss(model)
    found += list(getattr(compile_loss, "metrics", None) or [])
    for layer in glue.flatten_layers(model, include_self=True):
        found += list(getattr(layer, "_metrics", None) or [])
    seen, leaves = set(), []
    while found:
        metric = found.pop(0)
        if not isinstance(metric, keras.metrics.Metric) or id(metric) in seen:
            continue
        seen.add(id(metric))
        inner = getattr(metric, "metrics", None)
        if isinstance(inner, (list, tuple)) and inner:
            found.extend(inner)
        else:
            leaves.append(metric)
    return leaves


def _means(model):
    """Every `keras.metrics.Mean` (not a metric wrapper) of `model`."""
    return [
        metric
        for metric in _leaf_metrics(model)
        if isinstance(metric, keras.metrics.Mean)
        and type(metric).update_state is keras.metrics.Mean.update_state
    ]


def _global_result(metric):
    """`metric.result()` that, in an overridden step, reads the sums of
    its variables over the replicas (what a read outside the step gives):
    the step's logs are then the global batch's, as on one device."""
    original = type(metric).result.__get__(metric)

    def result():
        state = _active()
        if state is None:
            return original()
        context = state[0]
        values = context.all_reduce(
            tf.distribute.ReduceOp.SUM,
            [tf.convert_to_tensor(v.value) for v in metric.variables],
        )
        mapping = list(zip(metric.variables, values))
        with keras.StatelessScope(state_mapping=mapping):
            return original()

    return result


def _optimizers(model):
    found = [getattr(model, "optimizer", None)] + list(vars(model).values())
    seen, optimizers = set(), []
    for value in found:
        if isinstance(value, keras.optimizers.Optimizer) and id(value) not in (
            seen
        ):
            seen.add(id(value))
            optimizers.append(value)
    return optimizers


def _mean_update(metric):
    original = type(metric).update_state.__get__(metric)

    def update_state(values, sample_weight=None):
        state = _active()
        if state is not None and sample_weight is None:
            values = tf.convert_to_tensor(values)
            if values.shape.rank == 0:  # a loss: this part's mean
                sample_weight = state[1]
                # A part with no rows (share 0) has no mean: a user's
                # `ops.mean` over it is NaN, which a weight of 0 keeps.
                values = tf.where(
                    sample_weight > 0, values, tf.zeros_like(values)
                )
        return original(values, sample_weight=sample_weight)

    return update_state


def _optimizer_apply(optimizer):
    original = type(optimizer).apply.__get__(optimizer)

    def apply(grads, trainable_variables=None):
        state = _active()
        if state is None:
            return original(grads, trainable_variables)
        context, share = state
        if trainable_variables is None:
            trainable_variables = glue.optimizer_trainable_variables(optimizer)
        grads = [_scale(g, share) for g in grads]
        return apply_global_gradients(
            context, optimizer, grads, list(trainable_variables), original
        )

    return apply


def _scale(gradient, share):
    if gradient is None:
        return None
    if isinstance(gradient, tf.IndexedSlices):
        return tf.IndexedSlices(
            _scale(gradient.values, share),
            gradient.indices,
            gradient.dense_shape,
        )
    return gradient * tf.cast(share, gradient.dtype)


def real_rows(data, count):
    """The first `count` rows of every tensor of `data`."""
    return tree.map_structure(lambda t: None if t is None else t[:count], data)

"""Global-batch (or per-replica) BatchNormalization moments on TF.

The moments are called deep inside Keras's layer, with Keras's arguments:
the rows that are real (not padding) come from the replica's
`step_context.StepContext` (found by replica context; see that module).
"""

from __future__ import annotations

import tensorflow as tf

from keras_dist._src.backends.tensorflow import step_context
from keras_dist._src.core.batch_norm import global_moments
from keras_dist._src.keras_glue import internals as glue


def set_batch_norm_sync(layer, sync: bool) -> None:
    """Gives `layer` global-batch (or per-replica) moments in training.

    Keras's own ``synchronized=True`` path fails with shards of unequal or
    zero size (a collective shape mismatch in the backward pass, seen with
    Keras 3.15 and TF 2.21), and computes the variance as E[x^2] - E[x]^2.
    This replacement all-reduces sums and counts (so shards of any size,
    including empty ones, are weighted exactly), takes the variance in a
    second pass around the global mean (`core.batch_norm.global_moments`,
    the formula torch uses too), and defines the gradient of each
    all-reduce explicitly, so every replica runs the same collectives.
    """
    layer.synchronized = False
    if not sync:
        glue.restore_batch_norm_moments(layer)
        # Keras creates the moving statistics with aggregation "none", which
        # tf.distribute resolves by keeping the first replica's update; the
        # mean over replicas (what the JAX and torch backends do) uses every
        # replica's statistics.
        for variable in (layer.moving_mean, layer.moving_variance):
            value = variable.value
            if hasattr(value, "_aggregation"):
                value._aggregation = tf.VariableAggregation.MEAN
        return
    original = glue.original_batch_norm_moments(layer)

    def moments(inputs, mask):
        context = tf.distribute.get_replica_context()
        if (
            mask is not None
            or context is None
            or context.num_replicas_in_sync == 1
        ):
            return original(inputs, mask)
        step = step_context.current()
        valid = None if step is None else step.valid
        share = None if step is None else step.override_share
        axes = glue.batch_norm_reduction_axes(layer)
        return _global_moments(context, inputs, axes, valid, share)

    glue.replace_batch_norm_moments(layer, moments)


def _global_moments(context, inputs, axes, valid, share=None):
    """Count-weighted moments over all replicas (`core.batch_norm`); `share`
    as in `_all_reduce_sum`."""
    weight = None
    if valid is not None:
        # The mask is per sample of the step's batch; a layer whose first
        # axis is something else (after a reshape) is left unmasked.
        weight = tf.cond(
            tf.equal(tf.shape(valid)[0], tf.shape(inputs)[0]),
            lambda: expand_like(tf.cast(valid, "float32"), inputs),
            lambda: tf.ones([1] * (inputs.shape.rank or 1), "float32"),
        )
    return global_moments(
        inputs,
        axes,
        lambda value: _all_reduce_sum(context, value, share),
        weight,
    )


def _all_reduce_sum(context, value, share=None):
    """All-reduce (SUM) whose gradient is the all-reduced upstream gradient.

    In a user's own step (`overrides`) each replica's gradients are
    weighted by its `share` of the global batch when they are summed at
    `optimizer.apply`; the upstream terms are weighted the same way here
    (and divided by this replica's share, which `apply` multiplies back),
    so the cross-replica terms get the weights the rest of the gradient
    gets. Keras's own step needs none: its loss already carries the share.
    """

    @tf.custom_gradient
    def reduce(local):
        def grad(upstream):
            if share is None:
                return context.all_reduce(tf.distribute.ReduceOp.SUM, upstream)
            weighted = context.all_reduce(
                tf.distribute.ReduceOp.SUM, upstream * share
            )
            return tf.math.divide_no_nan(weighted, share)

        return context.all_reduce(tf.distribute.ReduceOp.SUM, local), grad

    return reduce(value)


def expand_like(vector, tensor):
    """Reshapes a per-sample `vector` to broadcast against `tensor`."""
    rank = tensor.shape.rank or 1
    return tf.reshape(vector, [-1] + [1] * (rank - 1))

"""The one formula for global-batch BatchNormalization moments.

Every backend that synchronises BatchNormalization across processes or
replicas itself (TensorFlow and torch; JAX's jitted step sees the global
array and lets XLA do it) calls `global_moments` with its own differentiable
all-reduce. It is written with `keras.ops`, so the same lines run as TF ops
inside a replica context and as torch ops inside a rank's step.

The variance is taken in two passes, around the global mean
(``sum(w * (x - mean)^2) / sum(w)``), not as ``E[x^2] - E[x]^2``: the
latter loses every digit when the mean is large against the spread (inputs
around 1e4 with unit spread give a variance of 0 or below in float32). The
cost is a second all-reduce of one value per channel.
"""

from __future__ import annotations

from keras import ops


def global_moments(x, axes, all_reduce_sum, weight=None):
    """Count-weighted mean and variance of `x` over every replica's samples.

    Args:
        x: this replica's (or rank's) input to the layer.
        axes: the layer's reduction axes
            (`keras_glue.internals.batch_norm_reduction_axes`).
        all_reduce_sum: the backend's differentiable all-reduce: takes a
            float32 tensor and returns its sum over replicas, with the
            all-reduced upstream gradient as its gradient.
        weight: optional weight broadcastable against `x`: 1 for a sample
            that counts, 0 for padding or a stand-in sample of an empty
            shard. None counts every sample.

    Returns:
        ``(mean, variance)`` with the reduction axes removed, in `x`'s
        dtype; computed in float32. A channel with no sample at all on any
        replica gets 0 for both.
    """
    dtype = x.dtype
    x = ops.cast(x, "float32")
    w = ops.ones_like(x)
    if weight is not None:
        w = w * ops.cast(weight, "float32")
    first = all_reduce_sum(
        ops.stack([ops.sum(x * w, axis=axes), ops.sum(w, axis=axes)])
    )
    count = first[1]
    mean = ops.divide_no_nan(first[0], count)
    centered = ops.sum(w * ops.square(x - _keep_dims(mean, axes, x)), axes)
    variance = ops.divide_no_nan(all_reduce_sum(centered), count)
    return ops.cast(mean, dtype), ops.cast(variance, dtype)


def gathered_moments(x, axes, all_gather, weight=None):
    """`global_moments` with one collective: per-replica moments combined.

    Args:
        x: this replica's (or rank's) input to the layer.
        axes: the layer's reduction axes.
        all_gather: the backend's differentiable all-gather: takes a float32
            tensor and returns the replicas' tensors stacked on a new first
            axis (the same on every replica), with gradients flowing back to
            each replica's own part.
        weight: as in `global_moments`.

    Returns:
        ``(mean, variance)`` as `global_moments` returns them.
    """
    dtype = x.dtype
    x = ops.cast(x, "float32")
    if weight is None:
        total = ops.sum(x, axis=axes)
        size = ops.cast(ops.size(x), "float32")
        per_channel = ops.cast(ops.size(total), "float32")
        count = ops.ones_like(total) * ops.divide_no_nan(size, per_channel)
        # No sample here (an empty batch): the sums are 0; divide by 1.
        mean = total / ops.maximum(count, 1.0)
        m2 = ops.sum(ops.square(x - _keep_dims(mean, axes, x)), axis=axes)
    else:
        w = ops.ones_like(x) * ops.cast(weight, "float32")
        count = ops.sum(w, axis=axes)
        mean = ops.sum(x * w, axis=axes) / ops.maximum(count, 1.0)
        m2 = ops.sum(w * ops.square(x - _keep_dims(mean, axes, x)), axis=axes)
    gathered = all_gather(ops.stack([count, mean, m2]))
    return combine_moments(
        gathered[:, 0], gathered[:, 1], gathered[:, 2], dtype
    )


def combine_moments(counts, means, m2s, dtype="float32"):
    """Combines per-replica ``(count, mean, M2)`` stacked on axis 0.

    ``M2`` is the sum of squared deviations from the replica's own mean.
    Every term of the combination is non-negative, so a mean that dwarfs the
    spread loses nothing (Chan, Golub and LeVeque's pairwise update).

    Returns:
        ``(mean, variance)`` of all the replicas' samples, cast to `dtype`;
        0 for both where no replica has a sample.
    """
    count = ops.sum(counts, axis=0)
    mean = ops.divide_no_nan(ops.sum(counts * means, axis=0), count)
    spread = ops.sum(counts * ops.square(means - mean[None]), axis=0)
    variance = ops.divide_no_nan(ops.sum(m2s, axis=0) + spread, count)
    return ops.cast(mean, dtype), ops.cast(variance, dtype)


def _keep_dims(value, axes, x):
    rank = len(x.shape)
    for axis in sorted(a % rank for a in axes):
        value = ops.expand_dims(value, axis)
    return value

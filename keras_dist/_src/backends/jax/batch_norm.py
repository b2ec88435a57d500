"""BatchNormalization across replicas on JAX.

With the default ``sync_batch_norm=True`` nothing is needed: the jitted step
computes on the global, batch-sharded array, so XLA reduces each moment
over every replica's samples (global-batch statistics, exactly one device's
numerics). With ``sync_batch_norm=False`` each replica normalises with its
own shard's statistics (inside `shard_map`), and the moving statistics are
then averaged over replicas, as on the other backends.
"""

from __future__ import annotations

import jax

from keras_dist._src.backends.jax.devices import BATCH_AXIS


def average_moving_statistics(non_trainable, axis=BATCH_AXIS):
    """Per-replica step: floating non-trainable variables (the moving mean
    and variance) become their mean over replicas; others pass through."""
    return [
        jax.lax.pmean(v, axis)
        if jax.numpy.issubdtype(v.dtype, jax.numpy.floating)
        else v
        for v in non_trainable
    ]

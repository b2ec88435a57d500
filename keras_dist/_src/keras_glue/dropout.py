"""Which `Dropout` calls a sharded step must draw for the global batch.

Keras's dropout mask depends on the seed and the batch shape, so a replica
drawing for its own part gets the first rows of one device's mask. The
backends then draw the mask for the whole global batch and keep their rows;
this says when that applies (one rule for every backend).
"""

from __future__ import annotations


def draws_per_sample_mask(layer) -> bool:
    """Whether `layer` (a `keras.layers.Dropout`) draws a mask per sample:
    a rate strictly between 0 and 1 and no fixed batch entry in its
    `noise_shape`."""
    noise = layer.noise_shape
    return 0.0 < layer.rate < 1.0 and (noise is None or noise[0] is None)

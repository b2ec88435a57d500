"""Per-replica batches of a dataset for custom loops on JAX."""

from __future__ import annotations

import jax
from keras import tree

from keras_dist._src.values import PerReplica


class DistributedDataset:
    """Splits each global batch of a dataset across replica devices."""

    def __init__(self, dataset, devices):
        self._dataset = dataset
        self._devices = devices

    def __iter__(self):
        from keras_dist._src.core.inputs import iterate_numpy_batches
        from keras_dist._src.core.shards import split_batch

        for batch in iterate_numpy_batches(self._dataset):
            parts = split_batch(batch, len(self._devices))
            placed = [
                jax.device_put(part, device)
                for part, device in zip(parts, self._devices)
            ]
            yield stack_outputs(placed)


# -- per-replica helpers ------------------------------------------------------
def select_replica(structure, index, count):
    def pick(x):
        if isinstance(x, PerReplica):
            if len(x) != count:
                raise ValueError(
                    f"A per-replica value has {len(x)} parts but the "
                    f"strategy has {count} replicas."
                )
            return x.values[index]
        return x

    return (
        tree.map_structure(pick, structure, none_is_leaf=True)
        if structure
        else structure
    )


def stack_outputs(outputs):
    if len(outputs) == 1:
        return outputs[0]
    return tree.map_structure(lambda *xs: PerReplica(xs), *outputs)

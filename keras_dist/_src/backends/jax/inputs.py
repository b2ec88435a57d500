"""Per-replica batches and values for custom loops on JAX."""

from __future__ import annotations

import jax
from keras import tree

from keras_dist._src.core.inputs import DistributedDataset
from keras_dist._src.values import PerReplica


def distribute_dataset(dataset, devices):
    """`core.inputs.DistributedDataset` over `devices` (one process)."""

    def place(parts):
        return stack_outputs(
            [
                jax.device_put(part, device)
                for part, device in zip(parts, devices)
            ]
        )

    return DistributedDataset(dataset, len(devices), range(len(devices)), place)


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

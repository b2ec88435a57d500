"""TensorFlow data parallelism on one host: tf.distribute's
MirroredStrategy and MirroredVariables, with keras_dist's exact step.

Models built in the scope get MirroredVariables; `engine.ReplicaEngine`
runs the exact per-replica step. The policy here builds the strategy
(collective keys of its own, each global batch split exactly) and gives
BatchNormalization layers global-batch (or, with
``sync_batch_norm=False``, per-replica) statistics (`batch_norm`).
"""

from __future__ import annotations

import tensorflow as tf
from keras import layers

from keras_dist._src.backends.tensorflow.batch_norm import (
    set_batch_norm_sync,
)
from keras_dist._src.backends.tensorflow.devices import tf_device_name
from keras_dist._src.backends.tensorflow.engine import ReplicaEngine
from keras_dist._src.backends.tensorflow.inputs import (
    distribute_global_batches,
)
from keras_dist._src.backends.tensorflow.replica_losses import (
    keep_losses_per_thread,
)
from keras_dist._src.keras_glue import internals as glue


class MirroredEngine(ReplicaEngine):
    """`tf.distribute.MirroredStrategy` with an exact per-replica step.

    Args:
        devices: the devices (keras_dist names), one replica each.
        sync_batch_norm: BatchNormalization over the global batch (True)
            or over each replica's part.
        tf_strategy: the strategy to run on (default: a new
            MirroredStrategy over `devices`).
    """

    def __init__(self, devices, sync_batch_norm: bool, tf_strategy=None):
        if tf_strategy is None:
            tf_strategy = _new_mirrored_strategy(
                [tf_device_name(d) for d in devices]
            )
        super().__init__(devices, tf_strategy)
        self.sync_batch_norm = sync_batch_norm

    def prepare_layer(self, layer) -> None:
        """BatchNormalization: global-batch (or per-replica) moments."""
        if isinstance(layer, layers.BatchNormalization):
            set_batch_norm_sync(layer, self.sync_batch_norm)

    def attach(self, model) -> None:
        """Also: with cross-replica BatchNormalization, whose collective
        interleaves the replicas' forward passes, each replica keeps its
        own `add_loss` values (`replica_losses.PerThreadLosses`)."""
        super().attach(model)
        if self.sync_batch_norm and any(
            isinstance(layer, layers.BatchNormalization)
            for layer in glue.flatten_layers(model)
        ):
            keep_losses_per_thread(model)


_strategies_created = 0


def _new_mirrored_strategy(tf_devices):
    """A MirroredStrategy of keras_dist's, built once per engine.

    * Its collective group keys are its own (they matter on GPUs, where it
      runs tf.distribute's collectives): every MirroredStrategy starts
      them at 1, so a second strategy over other devices in the same process
      collides with the first ("joining a group with size 4, but that group
      has size 2"); tf.distribute reads the key base from the class.
    * It splits each global batch itself (`inputs.distribute_global_batches`).
    * On CPU devices it sums on one device (`ReductionToOneDevice`: copies to
      the first device, one `add_n` a tensor, copies back) instead of
      tf.distribute's default there, the RING collective: the devices share
      the host's memory, and summing on one device measured 0.84-0.91 of the
      ring's step time (guides/performance.md). GPUs keep
      tf.distribute's choice (NCCL).
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
    cross_device_ops = None
    if all(
        tf.DeviceSpec.from_string(d).device_type == "CPU" for d in tf_devices
    ):
        cross_device_ops = tf.distribute.ReductionToOneDevice()
    return cls(devices=tf_devices, cross_device_ops=cross_device_ops)

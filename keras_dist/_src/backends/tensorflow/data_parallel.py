"""TensorFlow data parallelism: the engine of a `ReplicatedPlan`.

Replicated variables, each global batch split exactly across the
replicas. The plan chooses the policy: one device (`one_device`: Keras's
own step, no tf.distribute), the devices of this process (`mirrored`:
tf.distribute's MirroredStrategy) or every device of every worker
(`multi_worker`: MultiWorkerMirroredStrategy). The last two run
keras_dist's exact per-replica step (`engine`, `replica_step`).
"""

from __future__ import annotations

from keras_dist._src.backends.tensorflow.gradients import (
    apply_global_gradients,
)
from keras_dist._src.backends.tensorflow.mirrored import MirroredEngine
from keras_dist._src.backends.tensorflow.multi_worker import (
    MultiWorkerEngine,
)
from keras_dist._src.backends.tensorflow.one_device import OneDeviceEngine
from keras_dist._src.devices import normalize_device
from keras_dist._src.options import InputOptions

__all__ = [
    "MirroredEngine",
    "MultiWorkerEngine",
    "OneDeviceEngine",
    "apply_global_gradients",
    "create_engine",
]


def create_engine(plan, runtime, input_options):
    """The engine of a `ReplicatedPlan` on this process's devices.

    One device needs no tf.distribute (Keras's own step, placed on it).
    """
    devices = [normalize_device(d) for d in plan.devices]
    sync_batch_norm = plan.sync_batch_norm
    if runtime.world_size > 1:  # a job of workers (`runtime.membership`)
        return MultiWorkerEngine(
            devices, sync_batch_norm, runtime, input_options or InputOptions()
        )
    if len(devices) == 1:
        return OneDeviceEngine(devices[0])
    # One worker (this process): every shard policy reads the whole input.
    return MirroredEngine(devices, sync_batch_norm)

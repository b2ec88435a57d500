"""`CentralStorageStrategy`: one copy of the variables, replicas compute."""

from __future__ import annotations

from collections.abc import Sequence

from keras_dist._src import backends as backend_lib
from keras_dist._src.plan import CentralStoragePlan, Topology
from keras_dist._src.strategy import Strategy


class CentralStorageStrategy(Strategy):
    """Synchronous data parallelism with every variable held once.

    As in `tf.distribute.experimental.CentralStorageStrategy`, variables
    (and optimizer state) are not mirrored: one copy lives off the compute
    devices, and each replica computes its share of the global batch on its
    own device. The step is MirroredStrategy's exact one (global-batch
    loss, metrics and BatchNormalization), so results equal one device's.

    * TensorFlow: tf.distribute's CentralStorageStrategy; variables live on
      the parameter device (the CPU, or the one compute device), and every
      variable Keras creates with aggregation "none" gets one.
    * JAX: variables, optimizer state and metrics are kept in host memory
      (``memory_kind="pinned_host"``) between steps; each step moves them
      to the devices, computes there and writes them back.
    * torch: not available (raises `UnsupportedBackendError`).

    Args:
        devices: the compute devices; defaults to every GPU/TPU, else every
            (simulated) CPU device.

    Raises:
        UnsupportedBackendError: on torch, or with several workers.
    """

    topology = Topology.MIRRORED

    def __init__(self, devices: Sequence[str] | None = None):
        # Before the runtime: on torch it would start a process per
        # device only for the engine to refuse.
        backend_lib.refuse_unsupported(CentralStoragePlan)
        if devices is None:
            devices = backend_lib.get().default_devices()
        super().__init__(list(devices), sync_batch_norm=True)

    def _make_plan(self, devices):
        return CentralStoragePlan(
            topology=self.topology,
            devices=tuple(devices),
            sync_batch_norm=True,
        )

    @property
    def parameter_device(self) -> str:
        """Where the variables live: a TF device, or JAX's memory kind."""
        return self._engine.parameter_device

    def __repr__(self):
        return f"CentralStorageStrategy(devices={list(self.devices)})"

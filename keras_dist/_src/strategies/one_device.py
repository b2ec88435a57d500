"""`OneDeviceStrategy`: one device, one process; the baseline."""

from __future__ import annotations

from keras_dist._src import backends as backend_lib
from keras_dist._src.plan import Topology
from keras_dist._src.strategy import Strategy


class OneDeviceStrategy(Strategy):
    """Runs on a single device: the default, and the one-replica baseline.

    Args:
        device: a device name such as ``"gpu:0"``; defaults to the first
            accelerator, or ``"cpu:0"``.
    """

    topology = Topology.ONE_DEVICE

    def __init__(self, device: str | None = None):
        if device is None:
            device = backend_lib.get().default_devices()[0]
        super().__init__([device])

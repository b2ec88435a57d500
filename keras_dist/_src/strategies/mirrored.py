"""`MirroredStrategy`: synchronous data parallelism on one host."""

from __future__ import annotations

from collections.abc import Sequence

from keras_dist._src import backends as backend_lib
from keras_dist._src.options import InputOptions
from keras_dist._src.plan import Topology
from keras_dist._src.strategy import Strategy


class MirroredStrategy(Strategy):
    """Synchronous data parallelism over the devices of one host.

    Variables are mirrored on every device, each global batch is split across
    the replicas and gradients are all-reduced, so every replica holds the
    same weights after each step.

    On torch each device is a process: without a launcher the strategy
    starts the others by re-running this script, so everything before it
    runs once per process. Use `keras_dist.print` or `Strategy.print` (or
    `keras_dist.on_chief`) for output and files. Data made before the
    strategy must be the same on every process: load it from files, or
    seed it (``keras.utils.set_random_seed(0)`` or
    ``np.random.default_rng(0)``), since unseeded random data differs
    between processes and each would train on its own. The initial
    weights are the chief's on every process, whatever the seeds. A
    script read from standard input cannot be re-run: save it to a file.

    Logs one line saying what trains where at the first ``fit`` (silenced
    by ``KERAS_DIST_VERBOSE=0``) and warns when it finds one device.

    Args:
        devices: device names; defaults to every GPU/TPU, else every
            (simulated) CPU device.
        sync_batch_norm: use global-batch BatchNormalization statistics
            (default) or per-replica ones.
        input_options: an `InputOptions`: how input is sharded between
            workers (matters where there are several processes).
    """

    topology = Topology.MIRRORED

    def __init__(
        self,
        devices: Sequence[str] | None = None,
        sync_batch_norm: bool = True,
        input_options: InputOptions | None = None,
    ):
        # Found, not named: one device found is worth a warning.
        self._many_devices_meant = devices is None
        if devices is None:
            devices = backend_lib.get().default_devices()
        super().__init__(
            list(devices),
            sync_batch_norm=sync_batch_norm,
            input_options=input_options,
        )

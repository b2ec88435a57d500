"""The concrete strategies, registered under names with aliases."""

from __future__ import annotations

from collections.abc import Sequence

from keras_dist._src import backend as backend_lib
from keras_dist._src.options import InputOptions
from keras_dist._src.strategy import Strategy


class OneDeviceStrategy(Strategy):
    """Runs on a single device: the default, and the one-replica baseline.

    Args:
        device: a device name such as ``"gpu:0"``; defaults to the first
            accelerator, or ``"cpu:0"``.
    """

    def __init__(self, device: str | None = None):
        if device is None:
            device = backend_lib.get().default_devices()[0]
        super().__init__([device])


class MirroredStrategy(Strategy):
    """Synchronous data parallelism over the devices of one host.

    Variables are mirrored on every device, each global batch is split across
    the replicas and gradients are all-reduced, so every replica holds the
    same weights after each step.

    Args:
        devices: device names; defaults to every GPU/TPU, else every
            (simulated) CPU device.
        sync_batch_norm: use global-batch BatchNormalization statistics
            (default) or per-replica ones.
        input_options: an `InputOptions`: how input is sharded between
            workers (matters where there are several processes).
    """

    def __init__(
        self,
        devices: Sequence[str] | None = None,
        sync_batch_norm: bool = True,
        input_options: InputOptions | None = None,
    ):
        if devices is None:
            devices = backend_lib.get().default_devices()
        super().__init__(
            list(devices),
            sync_batch_norm=sync_batch_norm,
            input_options=input_options,
        )


_REGISTRY = {
    "one_device": OneDeviceStrategy,
    "mirrored": MirroredStrategy,
}
_ALIASES = {
    "single_device": "one_device",
    "onedevice": "one_device",
    "default": "one_device",
    "data_parallel": "mirrored",
    "dp": "mirrored",
}


def available_strategies() -> list[str]:
    """Returns the names (and aliases) `strategy_from_name` accepts."""
    return sorted(set(_REGISTRY) | set(_ALIASES))


def strategy_from_name(name: str, **kwargs) -> Strategy:
    """Creates a strategy by name, e.g. ``strategy_from_name("mirrored")``.

    Raises:
        ValueError: for an unknown name, listing the known ones.
    """
    key = str(name).lower().replace("-", "_")
    key = _ALIASES.get(key, key)
    if key not in _REGISTRY:
        raise ValueError(
            f"Unknown strategy {name!r}. Known: {available_strategies()}."
        )
    return _REGISTRY[key](**kwargs)

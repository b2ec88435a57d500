"""TensorFlow devices: logical device names and simulated CPU devices."""

from __future__ import annotations

import numpy as np
import tensorflow as tf

from keras_dist._src.devices import normalize_device, too_late_to_simulate
from keras_dist._src.errors import (
    DevicesAlreadyInitializedError,
)
from keras_dist._src.keras_glue import internals as glue


def tf_device_name(device: str) -> str:
    kind, index = device.split(":")
    return f"/device:{kind.upper()}:{index}"


def list_devices(device_type: str | None = None) -> list[str]:
    """Logical devices of this process as ``"type:index"`` names."""
    names = []
    for device in tf.config.list_logical_devices():
        if device.device_type not in ("CPU", "GPU", "TPU"):
            continue
        name = normalize_device(device.name)
        # In a multi-worker job TensorFlow also lists the other workers'
        # devices (``/job:worker/task:1/...``), which share local names.
        if name not in names:
            names.append(name)
    if device_type:
        names = [n for n in names if n.startswith(device_type.lower() + ":")]
    return names


def nameable_devices(device_type: str | None = None) -> list[str]:
    """Devices a strategy may name: exactly those `list_devices` lists."""
    return list_devices(device_type)


def default_devices() -> list[str]:
    """Every GPU (or TPU) if there is one, else every logical CPU."""
    for kind in ("gpu", "tpu", "cpu"):
        devices = list_devices(kind)
        if devices:
            return devices
    raise RuntimeError("TensorFlow reports no devices at all.")


def simulate_cpu_devices(count: int) -> None:
    """Splits the host CPU into `count` logical devices.

    Raises:
        DevicesAlreadyInitializedError: if TensorFlow has started already.
    """
    cpus = tf.config.list_physical_devices("CPU")
    try:
        tf.config.set_logical_device_configuration(
            cpus[0], [tf.config.LogicalDeviceConfiguration()] * int(count)
        )
    except RuntimeError as error:
        current = len(tf.config.list_logical_devices("CPU"))
        if current == count:
            return
        raise DevicesAlreadyInitializedError(
            f"Cannot simulate {count} CPU devices: TensorFlow has already "
            f"initialised its devices ({current} CPU). "
            f"{too_late_to_simulate('TensorFlow', count)}"
        ) from error


def variables_distributed(model) -> bool:
    """Whether `model` was built in the scope of a keras_dist strategy (and
    not only of a plain `tf.distribute` one, which keras_dist leaves alone).
    """
    strategy = glue.tf_distribute_strategy(model)
    return getattr(type(strategy), "_keras_dist", False)


def host_array(value) -> np.ndarray:
    """The value of a tensor or variable on the host (a tf.distribute
    MirroredVariable reads as its primary copy)."""
    return np.asarray(tf.identity(value).numpy())


def export_state(value, is_chief: bool = True):
    """The parts of a value this process writes into a checkpoint: the
    whole value, by the chief only (every process reads it, since reading
    a sync-on-read variable of a multi-worker job is a collective).

    Returns:
        ``(global_shape, [(start_offsets, numpy_array), ...])``.
    """
    array = host_array(value)
    if not array.flags.owndata or not array.flags.writeable:
        array = array.copy()
    shape = tuple(int(n) for n in array.shape)
    if not is_chief:
        return shape, []
    return shape, [((0,) * len(shape), array)]


def import_state(variable, reader) -> None:
    """Sets `variable` to the whole saved value (``reader(None)``)."""
    whole = np.asarray(reader(None))
    variable.assign(whole.astype(variable.dtype, copy=False))

"""JAX devices: names, simulated CPU devices, keras_dist's mesh axis."""

from __future__ import annotations

import os

import jax
import numpy as np

from keras_dist._src.devices import too_late_to_simulate
from keras_dist._src.errors import (
    DevicesAlreadyInitializedError,
)

# keras_dist's own mesh axis name: tells its variables from those of a
# `keras.distribution` layout (whose meshes compare equal to ours otherwise).
BATCH_AXIS = "keras_dist_replica"
#: Meshes built by keras_dist engines (tells their variables from those of
#: a user's own `keras.distribution`, whose meshes may use any names).
OWN_MESHES: set = set()


def devices_by_name() -> dict:
    devices = {}
    for device in jax.devices():
        devices[f"{device.platform}:{device.id}"] = device
    if jax.default_backend() != "cpu":
        try:
            for device in jax.devices("cpu"):
                devices.setdefault(f"cpu:{device.id}", device)
        except RuntimeError:
            pass
    return devices


def list_devices(device_type: str | None = None) -> list[str]:
    """Devices of this process as ``"type:index"`` names."""
    names = list(devices_by_name())
    if device_type:
        names = [n for n in names if n.startswith(device_type.lower() + ":")]
    return names


def nameable_devices(device_type: str | None = None) -> list[str]:
    """Devices a strategy may name: exactly those `list_devices` lists."""
    return list_devices(device_type)


def default_devices() -> list[str]:
    """Every device of JAX's default platform (GPUs/TPUs, else CPUs)."""
    return [f"{d.platform}:{d.id}" for d in jax.devices()]


def backends_initialized() -> bool:
    from keras_dist._src.framework_glue import jax_private

    return jax_private.backends_initialized()


def simulate_cpu_devices(count: int) -> None:
    """Makes JAX's CPU platform expose `count` devices.

    Raises:
        DevicesAlreadyInitializedError: if JAX has already started.
    """
    if backends_initialized():
        current = len(jax.devices("cpu"))
        if current == count:
            return
        raise DevicesAlreadyInitializedError(
            f"Cannot simulate {count} CPU devices: JAX has already started "
            f"with {current}. {too_late_to_simulate('JAX', count)}"
        )
    jax.config.update("jax_num_cpu_devices", int(count))
    # Keep child processes (and XLA itself) consistent with the request.
    flag = f"--xla_force_host_platform_device_count={int(count)}"
    flags = [
        f
        for f in os.environ.get("XLA_FLAGS", "").split()
        if not f.startswith("--xla_force_host_platform_device_count")
    ]
    os.environ["XLA_FLAGS"] = " ".join(flags + [flag])


def variables_distributed(model) -> bool:
    """Whether a variable of `model` is laid out on a keras_dist mesh."""
    for variable in model.variables:
        mesh = getattr(getattr(variable.value, "sharding", None), "mesh", None)
        if mesh is not None and (
            mesh in OWN_MESHES or BATCH_AXIS in mesh.axis_names
        ):
            return True
    return False


def host_array(value) -> np.ndarray:
    """The whole value of a JAX array on this host: a replicated array's
    local copy, one sharded over processes gathered from all of them (a
    collective: every process must call it)."""
    if getattr(value, "is_fully_addressable", True) is False:
        if value.sharding.is_fully_replicated:
            value = value.addressable_data(0)
        else:
            from jax.experimental import multihost_utils

            value = multihost_utils.process_allgather(value, tiled=True)
    return np.asarray(value)


def _own(array: np.ndarray) -> np.ndarray:
    """`array`, copied where it may share memory with a device buffer."""
    if not array.flags.owndata or not array.flags.writeable:
        array = array.copy()
    return array


def _bounds(index, shape) -> tuple:
    """``((start, stop), ...)`` of a tuple of slices over `shape`."""
    index = tuple(index or ())
    out = []
    for axis, size in enumerate(shape):
        part = index[axis] if axis < len(index) else slice(None)
        start, stop, _ = part.indices(size)
        out.append((start, max(start, stop)))
    return tuple(out)


def export_state(value, is_chief: bool = True):
    """The parts of a JAX array this process writes into a checkpoint.

    No collective: a sharded value is exported shard by shard, each
    distinct shard by one device that holds it (chosen the same way on
    every process, spread over its holders); a replicated value, or one
    this process holds alone in a job of several, whole by the chief only.

    Returns:
        ``(global_shape, [(start_offsets, numpy_array), ...])``.
    """
    shape = tuple(int(n) for n in np.shape(value))
    if (
        not isinstance(value, jax.Array)
        or value.sharding.is_fully_replicated
        or (value.is_fully_addressable and jax.process_count() > 1)
    ):
        if not is_chief:
            return shape, []
        if isinstance(value, jax.Array) and value.is_fully_addressable:
            return shape, [((0,) * len(shape), _own(np.asarray(value)))]
        local = (
            value.addressable_data(0) if isinstance(value, jax.Array) else value
        )
        return shape, [((0,) * len(shape), _own(np.asarray(local)))]
    holders = {}
    for device, index in value.sharding.devices_indices_map(shape).items():
        holders.setdefault(_bounds(index, shape), []).append(device)
    local = {shard.device: shard for shard in value.addressable_shards}
    pieces = []
    for ordinal, region in enumerate(sorted(holders)):
        devices = sorted(holders[region], key=lambda d: d.id)
        shard = local.get(devices[ordinal % len(devices)])
        if shard is not None:
            start = tuple(a for a, _ in region)
            pieces.append((start, _own(np.asarray(shard.data))))
    return shape, pieces


def import_state(variable, reader) -> None:
    """Sets `variable` from a checkpoint: each process reads only the
    regions its devices hold (``reader(index)``: the saved region `index`,
    a tuple of slices, None for all, as a NumPy array), whatever layout
    the checkpoint was written under."""
    from keras_dist._src.keras_glue import internals as glue

    value = glue.variable_value(variable)
    if (
        isinstance(value, jax.Array)
        and not value.is_fully_addressable
        and tuple(value.shape) == tuple(variable.shape)
    ):
        shape, dtype, cache = tuple(value.shape), value.dtype, {}

        def part(index):
            region = _bounds(index, shape)
            if region not in cache:
                wanted = tuple(slice(a, b) for a, b in region)
                cache[region] = np.asarray(reader(wanted)).astype(
                    dtype, copy=False
                )
            return cache[region]

        array = jax.make_array_from_callback(shape, value.sharding, part)
        glue.set_variable_value(variable, array)
        return
    whole = np.asarray(reader(None))
    variable.assign(whole.astype(variable.dtype, copy=False))

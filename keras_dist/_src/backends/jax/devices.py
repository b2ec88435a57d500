"""JAX devices: names, simulated CPU devices, keras_dist's mesh axis."""

from __future__ import annotations

import os

import jax
import numpy as np

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


def default_devices() -> list[str]:
    """Every device of JAX's default platform (GPUs/TPUs, else CPUs)."""
    return [f"{d.platform}:{d.id}" for d in jax.devices()]


def backends_initialized() -> bool:
    from jax._src import xla_bridge

    check = getattr(xla_bridge, "backends_are_initialized", None)
    if check is not None:
        return bool(check())
    return bool(getattr(xla_bridge, "_backends", {}))


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
            f"with {current}. Call keras_dist.simulate_cpu_devices({count}) "
            "(or set KERAS_DIST_CPU_DEVICES) before any JAX computation, "
            "e.g. right after `import keras_dist`."
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

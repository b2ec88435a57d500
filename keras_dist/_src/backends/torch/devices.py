"""Torch devices: one process per device; simulated CPU device counts."""

from __future__ import annotations

import os

import numpy as np
import torch

from keras_dist._src.devices import ENV_CPU_DEVICES
from keras_dist._src.errors import (
    DevicesAlreadyInitializedError,
)

_simulated_cpus: int | None = None


_engine_cpus: int | None = None


# -- devices ------------------------------------------------------------------
def _simulated_cpu_count() -> int | None:
    if _simulated_cpus is not None:
        return _simulated_cpus
    env = os.environ.get(ENV_CPU_DEVICES)
    if env and env.isdigit() and int(env) > 0:
        return int(env)
    return None


def _cpu_count() -> int:
    return _simulated_cpu_count() or os.cpu_count() or 1


def list_devices(device_type: str | None = None) -> list[str]:
    """Devices this process would train on, as ``"type:index"`` names.

    Every GPU, then the simulated CPU devices (`keras_dist.simulate_cpu_devices`
    or ``KERAS_DIST_CPU_DEVICES``), else one CPU device: the same list as on
    JAX and TensorFlow, and what ``MirroredStrategy()`` uses. A strategy may
    still name more CPU devices (`nameable_devices`): each is a process.

    Args:
        device_type: ``"cpu"`` or ``"gpu"`` to filter, or None.
    """
    names = []
    if torch.cuda.is_available():
        names = [f"gpu:{i}" for i in range(torch.cuda.device_count())]
    cpus = _simulated_cpu_count() or 1
    names += [f"cpu:{i}" for i in range(cpus)]
    return _of_type(names, device_type)


def nameable_devices(device_type: str | None = None) -> list[str]:
    """Devices a strategy may name: every GPU, then one CPU device per core
    (or the simulated count), since on torch each device is a process."""
    names = []
    if torch.cuda.is_available():
        names = [f"gpu:{i}" for i in range(torch.cuda.device_count())]
    names += [f"cpu:{i}" for i in range(_cpu_count())]
    return _of_type(names, device_type)


def _of_type(names: list[str], device_type: str | None) -> list[str]:
    if device_type:
        names = [n for n in names if n.startswith(device_type.lower() + ":")]
    return names


def default_devices() -> list[str]:
    """Every GPU; else the simulated CPU devices; else ``["cpu:0"]``."""
    gpus = list_devices("gpu")
    return gpus if gpus else list_devices("cpu")


def simulate_cpu_devices(count: int) -> None:
    """Makes `list_devices`/`default_devices` report `count` CPU devices.

    On torch each CPU device is one gloo process, so ``MirroredStrategy()``
    then starts `count` processes. The request is exported in the
    environment so that started ranks see the same devices.

    Raises:
        DevicesAlreadyInitializedError: if a strategy already runs with a
            different CPU count.
    """
    global _simulated_cpus
    count = int(count)
    if _engine_cpus is not None and _engine_cpus != count:
        raise DevicesAlreadyInitializedError(
            f"Cannot simulate {count} CPU devices: a keras_dist strategy "
            f"already runs with {_engine_cpus}. Call "
            f"keras_dist.simulate_cpu_devices({count}) (or set "
            f"{ENV_CPU_DEVICES}) before creating the strategy."
        )
    _simulated_cpus = count
    os.environ[ENV_CPU_DEVICES] = str(count)


def torch_device(device: str) -> torch.device:
    kind, index = device.split(":")
    if kind == "gpu":
        return torch.device("cuda", int(index))
    return torch.device("cpu")


def variables_distributed(model) -> bool:
    """Whether `model` has variables created in the scope of a strategy with
    several replicas (torch variables carry no placement: the compile hook
    marks each variable with the strategy whose scope created it)."""
    from keras_dist._src.keras_glue.hook import created_in

    for variable in model.variables:
        strategy = created_in(variable)
        if strategy is not None and strategy.num_replicas_in_sync > 1:
            return True
    return False


def claim_cpu_devices(count: int) -> None:
    """Records that a strategy runs on `count` CPU processes, so that a later
    request for another simulated count is refused."""
    global _engine_cpus
    _engine_cpus = int(count)


def host_array(value) -> np.ndarray:
    """The whole value of a tensor on the host (a DTensor is gathered from
    every rank: a collective that every rank must make)."""
    if hasattr(value, "full_tensor"):  # torch.distributed.tensor.DTensor
        value = value.full_tensor()
    return value.detach().cpu().numpy()


def _numpy(tensor) -> np.ndarray:
    """A NumPy copy of a local tensor (never a view of its storage)."""
    return np.array(tensor.detach().cpu().numpy(), copy=True)


def export_state(value, is_chief: bool = True):
    """The parts of a tensor this rank writes into a checkpoint.

    No collective: a DTensor is exported as this rank's local shard with
    its offset (by the rank at coordinate 0 of every mesh dimension the
    value is replicated over); a plain tensor, whole, by the chief only.

    Returns:
        ``(global_shape, [(start_offsets, numpy_array), ...])``.
    """
    shape = tuple(int(n) for n in value.shape)
    if hasattr(value, "device_mesh") and hasattr(value, "to_local"):
        mesh, placements = value.device_mesh, value.placements
        coordinate = mesh.get_coordinate()
        if coordinate is None:
            return shape, []
        for dim, placement in enumerate(placements):
            if placement.is_partial():
                raise ValueError(
                    f"Cannot checkpoint a DTensor with a Partial placement "
                    f"({placements}): reduce it first."
                )
            if placement.is_replicate() and coordinate[dim] != 0:
                return shape, []
        local_shape, offset = _local_shape_and_offset(value)
        local = value.to_local()
        if local.numel() == 0 and int(np.prod(shape)) != 0:
            return shape, []
        return shape, [(tuple(int(o) for o in offset), _numpy(local))]
    if not is_chief:
        return shape, []
    return shape, [((0,) * len(shape), _numpy(value))]


def _local_shape_and_offset(value):
    from keras_dist._src.framework_glue import torch_private

    return torch_private.local_shape_and_global_offset(
        tuple(value.shape), value.device_mesh, value.placements
    )


def import_state(variable, reader) -> None:
    """Sets `variable` from a checkpoint: a DTensor's rank reads only its
    local shard's region (``reader(index)``: the saved region `index`, a
    tuple of slices, None for all, as a NumPy array), whatever layout the
    checkpoint was written under; a plain tensor reads the whole value."""
    from keras_dist._src.keras_glue import internals as glue

    target = glue.variable_value(variable)
    if hasattr(target, "device_mesh") and hasattr(target, "to_local"):
        local_shape, offset = _local_shape_and_offset(target)
        index = tuple(
            slice(int(o), int(o) + int(n)) for o, n in zip(offset, local_shape)
        )
        region = np.asarray(reader(index)).astype(variable.dtype, copy=False)
        local = target.to_local()
        with torch.no_grad():
            local.copy_(torch.as_tensor(region).reshape(local.shape))
        return
    whole = np.asarray(reader(None))
    variable.assign(whole.astype(variable.dtype, copy=False))

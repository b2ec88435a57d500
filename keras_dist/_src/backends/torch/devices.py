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
def _cpu_count() -> int:
    if _simulated_cpus is not None:
        return _simulated_cpus
    env = os.environ.get(ENV_CPU_DEVICES)
    if env and env.isdigit() and int(env) > 0:
        return int(env)
    return os.cpu_count() or 1


def list_devices(device_type: str | None = None) -> list[str]:
    """Devices torch can run a rank on, as ``"type:index"`` names.

    Every GPU, then one CPU device per core (or the simulated count set with
    `keras_dist.simulate_cpu_devices`): on torch each device is a process,
    so the list is the same on every rank of a host.

    Args:
        device_type: ``"cpu"`` or ``"gpu"`` to filter, or None.
    """
    names = []
    if torch.cuda.is_available():
        names = [f"gpu:{i}" for i in range(torch.cuda.device_count())]
    names += [f"cpu:{i}" for i in range(_cpu_count())]
    if device_type:
        names = [n for n in names if n.startswith(device_type.lower() + ":")]
    return names


def default_devices() -> list[str]:
    """Every GPU; else the simulated CPU devices; else ``["cpu:0"]``."""
    gpus = list_devices("gpu")
    if gpus:
        return gpus
    simulated = _simulated_cpus or os.environ.get(ENV_CPU_DEVICES)
    return list_devices("cpu") if simulated else ["cpu:0"]


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

"""PyTorch backend: not yet available (one process per device with DDP)."""

from __future__ import annotations

from keras_dist._src.errors import UnsupportedBackendError

NAME = "torch"

_MESSAGE = (
    "keras_dist strategies do not run under KERAS_BACKEND=torch yet (PyTorch "
    "support, one process per device with DistributedDataParallel, is "
    "planned). Use KERAS_BACKEND=jax or KERAS_BACKEND=tensorflow."
)


def list_devices(device_type: str | None = None) -> list[str]:
    """Devices torch can see, as ``"type:index"`` names."""
    import torch

    names = [f"cpu:{i}" for i in range(1)]
    if torch.cuda.is_available():
        names = [f"gpu:{i}" for i in range(torch.cuda.device_count())] + names
    if device_type:
        names = [n for n in names if n.startswith(device_type.lower() + ":")]
    return names


def default_devices() -> list[str]:
    """Every GPU, else the CPU."""
    return list_devices("gpu") or list_devices("cpu")


def simulate_cpu_devices(count: int) -> None:
    """Not available yet on torch."""
    raise UnsupportedBackendError(_MESSAGE)


def create_engine(devices, sync_batch_norm: bool):
    """Not available yet on torch."""
    raise UnsupportedBackendError(_MESSAGE)

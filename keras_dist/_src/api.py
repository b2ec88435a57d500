"""Top-level helpers: simulated devices and device listing."""

from __future__ import annotations

from keras_dist._src import backends as backend_lib
from keras_dist._src.devices import requested_cpu_devices_from_env


def simulate_cpu_devices(count: int) -> None:
    """Splits the host CPU into `count` devices, for development and tests.

    Must run before the backend starts computing (right after
    ``import keras_dist``); setting ``KERAS_DIST_CPU_DEVICES=N`` in the
    environment does the same at import. JAX gets N host-platform devices,
    TensorFlow N logical CPU devices. Real GPUs and TPUs need no call.

    Raises:
        ValueError: if `count` is not a positive integer.
        DevicesAlreadyInitializedError: if the backend has already started.
        UnsupportedBackendError: on a backend without simulated devices.
    """
    if not isinstance(count, int) or isinstance(count, bool) or count < 1:
        raise ValueError(
            f"simulate_cpu_devices needs a positive integer; got {count!r}."
        )
    backend_lib.get().simulate_cpu_devices(count)


def list_devices(device_type: str | None = None) -> list[str]:
    """Returns the devices this process would train on, as ``"type:index"``.

    ``MirroredStrategy()`` uses exactly these: every GPU, else the
    simulated CPU devices, else one CPU device (``cpu:0``). Set
    ``KERAS_DIST_CPU_DEVICES=N`` (or call `simulate_cpu_devices`) for N. On
    torch a strategy may also name CPU devices up to one per core
    (``devices=["cpu:0", "cpu:1"]``): each is a process.

    Args:
        device_type: ``"cpu"``, ``"gpu"`` or ``"tpu"`` to filter, or None.
    """
    return backend_lib.get().list_devices(device_type)


def _apply_env() -> None:
    count = requested_cpu_devices_from_env()
    if count is not None:
        simulate_cpu_devices(count)

"""CentralStorage on torch: refused, with what to use instead."""

from __future__ import annotations

from keras_dist._src.errors import UnsupportedBackendError


def create_engine(plan, runtime, input_options):
    """Raises: torch has no central-storage engine.

    Raises:
        UnsupportedBackendError: always, naming the alternatives.
    """
    del plan, runtime, input_options
    raise UnsupportedBackendError(
        "CentralStorageStrategy is not available on the torch backend: "
        "keras_dist drives one device per process there (DistributedData"
        "Parallel), so there is no single copy of the variables for several "
        "devices to share. Use keras_dist.MirroredStrategy() on torch (same "
        "results: a copy per device, gradients all-reduced), or run with "
        "KERAS_BACKEND=tensorflow or KERAS_BACKEND=jax for "
        "CentralStorageStrategy."
    )

"""Layouts over a mesh on torch (DTensor): not built yet."""

from __future__ import annotations

from keras_dist._src.errors import UnsupportedBackendError


def create_engine(plan, runtime, input_options):
    """Raises until the DTensor engine lands.

    Raises:
        UnsupportedBackendError: always.
    """
    del runtime, input_options
    raise UnsupportedBackendError(
        f"{type(plan).__name__} is not available on the torch backend yet. "
        "Use KERAS_BACKEND=jax, or MirroredStrategy on torch."
    )

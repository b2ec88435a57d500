"""TPUs on torch: refused (no torch_xla release for this torch)."""

from __future__ import annotations

from keras_dist._src.errors import UnsupportedBackendError


def create_engine(plan, runtime, input_options):
    """Raises: torch has no TPU engine.

    Raises:
        UnsupportedBackendError: always, pointing to JAX.
    """
    del plan, runtime, input_options
    raise UnsupportedBackendError(
        "TPUStrategy is not available on the torch backend: there is no "
        "torch_xla release for this torch. Run the same script with "
        "KERAS_BACKEND=jax (pip install 'jax[tpu]' on the TPU VM), where "
        "TPUStrategy builds a topology-aware mesh."
    )

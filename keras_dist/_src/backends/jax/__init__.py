"""The JAX backend of keras_dist (see `data_parallel` for how it trains).

Same inner files as every backend: `devices`, `runtime`, `data_parallel`,
`inputs`, `batch_norm`; this module re-exports the contract's functions.
"""

from keras_dist._src.backends.jax.data_parallel import create_engine
from keras_dist._src.backends.jax.devices import (
    default_devices,
    list_devices,
    simulate_cpu_devices,
    variables_distributed,
)
from keras_dist._src.backends.jax.runtime import create_runtime

NAME = "jax"

__all__ = [
    "NAME",
    "create_engine",
    "create_runtime",
    "default_devices",
    "list_devices",
    "simulate_cpu_devices",
    "variables_distributed",
]

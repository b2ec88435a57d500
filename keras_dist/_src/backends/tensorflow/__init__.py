"""The TensorFlow backend of keras_dist (see `data_parallel`).

Same inner files as every backend: `devices`, `runtime`, `data_parallel`,
`inputs`, `batch_norm`; this module re-exports the contract's functions.
"""

from keras_dist._src.backends.tensorflow.data_parallel import create_engine
from keras_dist._src.backends.tensorflow.devices import (
    default_devices,
    list_devices,
    simulate_cpu_devices,
    variables_distributed,
)
from keras_dist._src.backends.tensorflow.runtime import create_runtime

NAME = "tensorflow"

__all__ = [
    "NAME",
    "create_engine",
    "create_runtime",
    "default_devices",
    "list_devices",
    "simulate_cpu_devices",
    "variables_distributed",
]

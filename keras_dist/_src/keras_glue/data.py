"""Keras's data adapters, the private part of its input pipeline.

keras_dist builds Keras's own adapter over one process's share of the input
(shard policies FILE and OFF) and wraps it in a backend's lockstep adapter.
Known to work with the Keras releases in `SUPPORTED_KERAS`.
"""

from __future__ import annotations

from keras.src.trainers import data_adapters
from keras.src.trainers.data_adapters import (
    array_data_adapter,
    data_adapter,
    data_adapter_utils,
)

#: Base class of Keras's data adapters (a lockstep adapter subclasses it).
DataAdapter = data_adapter.DataAdapter

#: Keras's `PyDataset` class.
PyDataset = data_adapters.py_dataset_adapter.PyDataset


def get_data_adapter(**kwargs):
    """Keras's adapter for `fit`-style arguments (`x`, `y`, `batch_size`...)."""
    return data_adapters.get_data_adapter(**kwargs)


def is_data_adapter(x) -> bool:
    """Whether `x` is already a Keras data adapter."""
    return isinstance(x, data_adapter.DataAdapter)


def is_tf_dataset(x) -> bool:
    """Whether `x` is a `tf.data.Dataset` (without importing TensorFlow)."""
    return data_adapters.is_tf_dataset(x)


def can_convert_arrays(arrays) -> bool:
    """Whether Keras takes `arrays` as array input (NumPy, tensors...)."""
    return array_data_adapter.can_convert_arrays(arrays)


def unpack_x_y_sample_weight(data):
    """Keras's split of a `(x, y, sample_weight)` tuple (or `x` alone)."""
    return data_adapter_utils.unpack_x_y_sample_weight(data)

"""TensorFlow on one device: Keras's own step, placed with `tf.device`."""

from __future__ import annotations

import tensorflow as tf

from keras_dist._src.backends.tensorflow.devices import tf_device_name
from keras_dist._src.backends.tensorflow.engine import ReplicaEngine
from keras_dist._src.errors import VariablesOutsideScopeError


class OneDeviceEngine(ReplicaEngine):
    """Keras's own step on one device, placed with `tf.device`.

    `reduce`, `gather` and datasets go through the default strategy (one
    replica); no step is installed.
    """

    def __init__(self, device: str):
        super().__init__((device,), tf.distribute.get_strategy())
        self._tf_device = tf_device_name(device)

    @property
    def num_replicas_in_sync(self) -> int:
        """One replica."""
        return 1

    def scope(self):
        """Variables created in it are placed on the device."""
        return tf.device(self._tf_device)

    def call_scope(self):
        """fit/evaluate/predict run on the device."""
        return tf.device(self._tf_device)

    def attach(self, model) -> None:
        """Checks that every variable of `model` lives on the device."""
        for variable in model.variables:
            value = variable.value
            if isinstance(value, tf.distribute.DistributedValues):
                raise VariablesOutsideScopeError(
                    f"Variable {variable.path!r} of model {model.name!r} was "
                    "created under another (multi-device) strategy. Build "
                    "the model inside this strategy's scope."
                )
            if not value.device.upper().endswith(self._tf_device.upper()[1:]):
                raise VariablesOutsideScopeError(
                    f"Variable {variable.path!r} of model {model.name!r} "
                    f"lives on {value.device!r}, not on {self.devices[0]}: "
                    "it was created outside strategy.scope(). Build the model "
                    "inside the scope."
                )

    def run(self, fn, args, kwargs):
        """`fn` called once, on the device."""
        with self.scope():
            return fn(*args, **kwargs)

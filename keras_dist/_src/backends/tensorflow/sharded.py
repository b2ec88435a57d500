"""Layouts over a mesh on TensorFlow: refused, with the reason.

Keras 3's TensorFlow `distribution_lib` is a self-declared prototype
("DO NOT USE"): TensorFlow variables never consult a layout, so
`keras.distribution.ModelParallel` leaves every variable whole. A DTensor
spike with Adam trained silently wrong (max difference 1315 from one
device). Rather than run something that is not what it says, keras_dist
refuses `ModelParallel` and `ShardedDataParallel` here and says what to
use instead.
"""

from __future__ import annotations

from keras_dist._src.errors import UnsupportedBackendError


def create_engine(plan, runtime, input_options):
    """Raises: TensorFlow has no honest engine for layouts over a mesh.

    Raises:
        UnsupportedBackendError: always, naming the alternatives.
    """
    del plan, runtime, input_options
    raise UnsupportedBackendError(
        "ModelParallel and ShardedDataParallel are not "
        "available on the TensorFlow backend: Keras 3's TensorFlow "
        "distribution_lib is a prototype in which variables never consult "
        "a layout, and tf.experimental.dtensor with Keras 3 optimizers "
        "trains wrongly. Run the same script with KERAS_BACKEND=jax or "
        "KERAS_BACKEND=torch for layouts over a mesh, or use "
        "keras_dist.MirroredStrategy / MultiWorkerMirroredStrategy (data "
        "parallel) on TensorFlow."
    )

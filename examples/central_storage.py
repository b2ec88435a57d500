"""CentralStorageStrategy: variables held once, compute on every device.

The variables (and the optimizer's and metrics' state) live in one place
off the compute devices (TensorFlow: the parameter device, ``/cpu:0``;
JAX: host memory), and each of 4 simulated CPU devices computes its share
of every global batch, with MirroredStrategy's exact step. Trains a few
steps on the digits in examples/data and prints where the variables live
and the loss, once. torch has no shared copy (one device per process):
the script says so and exits.

    KERAS_BACKEND=tensorflow python examples/central_storage.py
    KERAS_BACKEND=jax python examples/central_storage.py
"""

import gzip
import os
import pathlib
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402

import keras_dist  # noqa: E402  (before the backend starts computing)

DATA = pathlib.Path(__file__).parent / "data" / "digits.csv.gz"

if keras.backend.backend() not in ("jax", "tensorflow"):
    print(
        f"skipped: CentralStorageStrategy runs on TensorFlow and JAX, not "
        f"{keras.backend.backend()} (use MirroredStrategy there)"
    )
    sys.exit(0)
keras_dist.simulate_cpu_devices(4)


def main():
    """Trains a small classifier and prints the loss per epoch."""
    with gzip.open(DATA, "rt") as f:
        table = np.loadtxt(f, delimiter=",", dtype="float32")
    x, y = table[:512, :64] / 16.0, table[:512, 64].astype("int32")

    strategy = keras_dist.CentralStorageStrategy()
    strategy.print(
        f"variables on {strategy.parameter_device}, "
        f"{strategy.num_replicas_in_sync} replicas compute"
    )
    keras.utils.set_random_seed(0)
    with strategy.scope():
        model = keras.Sequential(
            [
                keras.Input((64,)),
                keras.layers.Dense(32, activation="relu"),
                keras.layers.BatchNormalization(),
                keras.layers.Dense(10, activation="softmax"),
            ]
        )
        model.compile(
            optimizer=keras.optimizers.Adam(1e-2),
            loss="sparse_categorical_crossentropy",
            metrics=["accuracy"],
        )
    # 128 is the global batch: each of the 4 replicas computes 32 samples.
    history = model.fit(x, y, batch_size=128, epochs=3, verbose=0)
    losses = ", ".join(f"{v:.4f}" for v in history.history["loss"])
    strategy.print(f"CentralStorageStrategy: losses per epoch {losses}")


if __name__ == "__main__":
    main()

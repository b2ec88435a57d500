"""ModelParallel: a model's kernels split over a 2 x 2 DeviceMesh.

Lays the Dense kernels out with a LayoutMap over a ("batch", "model")
mesh of 4 devices: each batch is split over "batch", each kernel's output
dimension over "model". Trains a few steps, then prints
``strategy.describe(model)`` (every layout and bytes per device) once.
JAX: 4 simulated CPU devices; torch: the strategy starts 4 processes (one
per device) by re-running this script. TensorFlow has no layouts: the
script says so and exits.

    KERAS_BACKEND=jax python examples/model_parallel.py
    KERAS_BACKEND=torch python examples/model_parallel.py
"""

import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402

import keras_dist  # noqa: E402  (before the backend starts computing)

if keras.backend.backend() not in ("jax", "torch"):
    print(
        f"skipped: ModelParallel runs on JAX and torch, not "
        f"{keras.backend.backend()} (set KERAS_BACKEND=jax or torch)"
    )
    sys.exit(0)
keras_dist.simulate_cpu_devices(4)  # CPU: 4 devices (torch: 4 processes)


def main():
    """Lays the model out, describes it, trains and prints the loss."""
    rng = np.random.default_rng(0)  # the same data on every process
    x = rng.normal(size=(256, 32)).astype("float32")
    y = (np.tanh(x @ rng.normal(size=(32, 8)))).astype("float32")

    mesh = keras_dist.DeviceMesh((2, 2), ("batch", "model"))
    layout_map = keras_dist.LayoutMap(mesh)
    layout_map[".*dense.*/kernel"] = (None, "model")  # split the outputs
    layout_map[".*dense.*/bias"] = ("model",)
    strategy = keras_dist.ModelParallel(layout_map, batch_dim_name="batch")

    keras.utils.set_random_seed(0)
    with strategy.scope():
        model = keras.Sequential(
            [
                keras.Input((32,)),
                keras.layers.Dense(64, activation="tanh"),
                keras.layers.Dense(8),
            ]
        )
        model.compile(optimizer=keras.optimizers.Adam(1e-2), loss="mse")
    history = model.fit(x, y, batch_size=64, epochs=3, verbose=0)
    # After the first step: the optimizer's slots and metrics exist too.
    strategy.describe(model)  # prints on the chief only
    losses = ", ".join(f"{v:.4f}" for v in history.history["loss"])
    strategy.print(f"ModelParallel 2x2: losses per epoch {losses}")


if __name__ == "__main__":
    main()

"""ShardedDataParallel (ZeRO-3 / FSDP style) over every device.

Every variable of at least ``min_size`` elements (and its optimizer
slots) is split over the devices along its largest divisible dimension;
each of N devices holds about 1/N of the state MirroredStrategy would
hold, and the results equal one device's. Trains a few steps, then
prints the split variables and the bytes one device holds, once.
JAX: 4 simulated CPU devices; torch: the strategy starts 2 processes (one
per device; each a whole Python, so 2 keep the example quick) by
re-running this script. TensorFlow has no layouts: the script says so
and exits.

    KERAS_BACKEND=jax python examples/sharded_data_parallel.py
    KERAS_BACKEND=torch python examples/sharded_data_parallel.py
"""

import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402

import keras_dist  # noqa: E402  (before the backend starts computing)

if keras.backend.backend() not in ("jax", "torch"):
    print(
        f"skipped: ShardedDataParallel runs on JAX and torch, not "
        f"{keras.backend.backend()} (set KERAS_BACKEND=jax or torch)"
    )
    sys.exit(0)
# CPU: simulated devices (torch: processes).
keras_dist.simulate_cpu_devices(4 if keras.backend.backend() == "jax" else 2)


def main():
    """Trains under ShardedDataParallel and prints what was split."""
    rng = np.random.default_rng(0)  # the same data on every process
    x = rng.normal(size=(256, 32)).astype("float32")
    y = (np.tanh(x @ rng.normal(size=(32, 8)))).astype("float32")

    strategy = keras_dist.ShardedDataParallel(min_size=256)
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
    rows = strategy.describe(model, print_fn=None)  # the rows, no table
    sharded = [r["path"] for r in rows if any(r["layout"])]
    held = sum(r["bytes_per_device"] for r in rows)
    whole = sum(4 * int(np.prod(r["shape"])) for r in rows)  # float32
    strategy.print(f"sharded: {sharded}")
    strategy.print(f"bytes per device: {held} of {whole}")
    losses = ", ".join(f"{v:.4f}" for v in history.history["loss"])
    strategy.print(f"ShardedDataParallel: losses per epoch {losses}")


if __name__ == "__main__":
    main()

"""Train a small CNN on handwritten digits with MirroredStrategy.

The same file runs under KERAS_BACKEND=jax, tensorflow and torch. With no
GPU it simulates 4 CPU devices (KERAS_DIST_CPU_DEVICES, default 4), so
MirroredStrategy really splits every batch across 4 replicas (on torch: 4
gloo processes, started by the strategy re-running this script).

    python examples/train_digits.py [--epochs 8] [--batch-size 128] [--seed 0]

Seeded (``keras.utils.set_random_seed``): the same command prints the same
numbers on every run with the same backend and device count.
"""

import argparse
import gzip
import os
import pathlib

os.environ.setdefault("KERAS_DIST_CPU_DEVICES", "4")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402

import keras_dist  # noqa: E402  (before the backend starts computing)

DATA = pathlib.Path(__file__).parent / "data" / "digits.csv.gz"


def load_digits():
    """Returns (x, y): 1,797 images of shape (8, 8, 1) in [0, 1], labels."""
    with gzip.open(DATA, "rt") as f:
        table = np.loadtxt(f, delimiter=",", dtype="float32")
    x = (table[:, :64] / 16.0).reshape(-1, 8, 8, 1)
    y = table[:, 64].astype("int32")
    return x, y


def build_model():
    """A small CNN: Conv2D, BatchNormalization, Dense."""
    return keras.Sequential(
        [
            keras.Input((8, 8, 1)),
            keras.layers.Conv2D(32, 3, padding="same", activation="relu"),
            keras.layers.BatchNormalization(momentum=0.9),
            keras.layers.Conv2D(32, 3, activation="relu"),
            keras.layers.Flatten(),
            keras.layers.Dropout(0.2),
            keras.layers.Dense(64, activation="relu"),
            keras.layers.Dense(10, activation="softmax"),
        ]
    )


def main():
    """Trains, evaluates on a held-out split and prints the results."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=8)
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    # Python, NumPy and the backend: initial weights, dropout, shuffling.
    keras.utils.set_random_seed(args.seed)

    x, y = load_digits()
    order = np.random.default_rng(0).permutation(len(x))
    x, y = x[order], y[order]
    x_train, y_train, x_test, y_test = x[:1500], y[:1500], x[1500:], y[1500:]

    strategy = keras_dist.MirroredStrategy()
    # strategy.print prints on the chief only: on torch this script runs
    # once per device, and a plain print would appear once per process.
    strategy.print(
        f"backend={keras.backend.backend()} "
        f"replicas={strategy.num_replicas_in_sync} "
        f"devices={list(strategy.devices)}"
    )
    with strategy.scope():
        model = build_model()
        model.compile(
            optimizer=keras.optimizers.Adam(3e-3),
            loss="sparse_categorical_crossentropy",
            metrics=["accuracy"],
        )
    # batch_size is the global batch: each replica gets 1/N of it.
    model.fit(
        x_train,
        y_train,
        batch_size=args.batch_size,
        epochs=args.epochs,
        verbose=2,
    )
    loss, accuracy = model.evaluate(x_test, y_test, verbose=0)
    strategy.print(f"test loss={loss:.4f} test accuracy={accuracy:.4f}")


if __name__ == "__main__":
    main()

"""Preemptible training: stop it any time, start it again, same result.

Trains the digits CNN with MirroredStrategy and
`keras_dist.callbacks.BackupAndRestore`. Interrupt it with Ctrl-C (SIGINT)
or ``kill <pid>`` (SIGTERM, what Kubernetes, cloud VMs and SLURM send):
every replica stops after the same step, the state is saved to
``--backup-dir`` and the program exits with code 75
(`keras_dist.callbacks.PREEMPTION_EXIT_CODE`). Run the same command again:
it resumes at the exact step, and ends with the same weights as a run that
was never interrupted. A second Ctrl-C stops at once (the last periodic
checkpoint, every ``--save-freq`` steps, is kept).

    python examples/preemptible.py [--epochs 6] [--backup-dir /tmp/digits]

A loop that restarts the job until it finishes (what a scheduler's
requeue does)::

    until python examples/preemptible.py; do
        [ $? -eq 75 ] || exit 1   # a real failure: stop
    done

The same file runs under KERAS_BACKEND=jax, tensorflow and torch (4
simulated CPU devices without a GPU; on torch, 4 processes).
"""

import argparse
import gzip
import os
import pathlib
import signal

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
    """A small CNN with BatchNormalization and Dropout."""
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


class Slow(keras.callbacks.Callback):
    """Sleeps after each step so that there is time to interrupt."""

    _keras_dist_all_ranks = True

    def __init__(self, seconds):
        super().__init__()
        self.seconds = seconds

    def on_train_batch_end(self, batch, logs=None):
        if self.seconds:
            import time

            time.sleep(self.seconds)


def main():
    """Trains (resuming from the backup if there is one), then evaluates."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=6)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--backup-dir", default="/tmp/keras_dist_digits")
    parser.add_argument("--save-freq", type=int, default=20)
    parser.add_argument("--sleep", type=float, default=0.05)
    parser.add_argument("--weights-out", default=None)
    args = parser.parse_args()
    # Same seed on every (re)start: initial weights, dropout and shuffling
    # are drawn as in an uninterrupted run; the backup restores the rest.
    keras.utils.set_random_seed(args.seed)

    x, y = load_digits()
    order = np.random.default_rng(0).permutation(len(x))
    x, y = x[order], y[order]
    x_train, y_train, x_test, y_test = x[:1500], y[:1500], x[1500:], y[1500:]

    strategy = keras_dist.MirroredStrategy()
    with strategy.scope():
        model = build_model()
        model.compile(
            optimizer=keras.optimizers.Adam(3e-3),
            loss="sparse_categorical_crossentropy",
            metrics=["accuracy"],
        )
    backup = keras_dist.callbacks.BackupAndRestore(
        args.backup_dir,
        save_freq=args.save_freq,
        # Ctrl-C too: the first saves and exits, a second stops at once.
        preemption_signals=(signal.SIGTERM, signal.SIGINT),
    )
    model.fit(
        x_train,
        y_train,
        batch_size=args.batch_size,
        epochs=args.epochs,
        shuffle=True,
        verbose=2,  # the progress lines come from the chief only
        callbacks=[backup, Slow(args.sleep)],
    )
    loss, accuracy = model.evaluate(x_test, y_test, verbose=0)
    strategy.print(f"resumed from: {backup.restored_from}")
    strategy.print(f"test accuracy={accuracy:.4f} loss={loss:.4f}")
    if args.weights_out:
        save_arrays(args.weights_out, model)


@keras_dist.on_chief
def save_arrays(path, model):
    """Writes the model's weights as a NumPy archive, on the chief only (no
    collective inside: the other processes do not call it)."""
    arrays = [keras.ops.convert_to_numpy(w) for w in model.weights]
    np.savez(path, *arrays)


if __name__ == "__main__":
    main()

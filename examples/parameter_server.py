"""ParameterServerStrategy: a recommender with row-sharded embeddings.

A user table and an item table (`keras_dist.layers.ShardedEmbedding`)
have their rows split over 2 ps tasks; 2 worker tasks run the training
steps asynchronously, scheduled by the chief (this script). Each step
gathers and updates only the rows it looks up. Trains a few steps on
seeded synthetic ratings and prints where the table shards live and the
loss, once (on the chief); the steps run asynchronously, so the losses
vary a little from run to run. TensorFlow only: JAX and torch have no
parameter-server engine (row-shard the table under ModelParallel there);
the script says so and exits.

    KERAS_BACKEND=tensorflow python examples/parameter_server.py

Started without TF_CONFIG, the script starts the whole job on this host
itself (2 ps, 2 workers, the chief: 5 processes) with keras-dist's
launcher, the same as running:

    KERAS_BACKEND=tensorflow keras-dist launch --ps 2 --workers 2 \\
        examples/parameter_server.py

On several hosts, start it on every task with its TF_CONFIG instead
(guides/parameter_server.md, "Launching").
"""

import os
import subprocess
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

if "TF_CONFIG" not in os.environ and os.environ.get(
    "KERAS_BACKEND", "tensorflow"
) in ("tensorflow", ""):
    # Not a task of a job yet: start the job (every task runs this file).
    launch = [sys.executable, "-m", "keras_dist.cli", "launch"]
    sys.exit(
        subprocess.call(launch + ["--ps", "2", "--workers", "2", __file__])
    )

import keras  # noqa: E402
import numpy as np  # noqa: E402

import keras_dist  # noqa: E402

if keras.backend.backend() != "tensorflow":
    print(
        f"skipped: ParameterServerStrategy runs on TensorFlow, not "
        f"{keras.backend.backend()} (set KERAS_BACKEND=tensorflow)"
    )
    sys.exit(0)

USERS, ITEMS, DIM = 50, 40, 8


def build_model():
    """Dot product of a user's and an item's embedding, as a probability."""
    user = keras.Input((), dtype="int32", name="user")
    item = keras.Input((), dtype="int32", name="item")
    init = keras.initializers.RandomNormal(stddev=0.3, seed=0)
    u = keras_dist.layers.ShardedEmbedding(
        USERS, DIM, embeddings_initializer=init, name="users"
    )(user)
    v = keras_dist.layers.ShardedEmbedding(
        ITEMS, DIM, embeddings_initializer=init, name="items"
    )(item)
    score = keras.layers.Dot(axes=1)([u, v])
    out = keras.layers.Activation("sigmoid")(score)
    return keras.Model({"user": user, "item": item}, out)


def main():
    """Chief: builds, trains and prints; ps and worker tasks serve."""
    # On a ps or worker task this starts the server and never returns.
    strategy = keras_dist.ParameterServerStrategy()

    rng = np.random.default_rng(0)
    taste = rng.normal(size=(USERS, 3))
    kind = rng.normal(size=(ITEMS, 3))
    users = rng.integers(0, USERS, 1024).astype("int32")
    items = rng.integers(0, ITEMS, 1024).astype("int32")
    liked = (np.sum(taste[users] * kind[items], 1) > 0).astype("float32")

    keras.utils.set_random_seed(0)
    with strategy.scope():
        model = build_model()
        model.compile(
            optimizer=keras.optimizers.Adagrad(0.5),
            loss="binary_crossentropy",
            metrics=["accuracy"],
        )
    for v in model.weights:  # e.g. /job:ps/replica:0/task:1/device:CPU:0
        task = v.value.device.split("/task:")[1].split("/")[0]
        strategy.print(f"{v.path} {tuple(v.shape)} on ps task {task}")
    x = {"user": users, "item": items}
    history = model.fit(x, liked, batch_size=64, epochs=3, verbose=0)
    losses = ", ".join(f"{v:.4f}" for v in history.history["loss"])
    strategy.print(f"ParameterServerStrategy: losses per epoch {losses}")


if __name__ == "__main__":
    main()

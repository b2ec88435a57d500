"""A custom torch-autograd training loop under `MirroredStrategy` (torch).

Mirrors what `fit` does on each rank: take this rank's part of every global
batch (`strategy.distribute_dataset`), run the model forward, weight the
local mean loss by ``n_local / n_global``, backpropagate with torch
autograd, sum the gradients over ranks with `torch.distributed`, and apply
them with the Keras optimizer. The script then trains the same model with
`fit` and prints how far the two results are apart.

Run: ``KERAS_BACKEND=torch python examples/custom_loop_torch.py [out.json]``
(it starts one process per device; 2 CPU processes here).
"""

import json
import os
import sys

import keras
import numpy as np

import keras_dist

if keras.backend.backend() != "torch":
    raise SystemExit(
        "Run with KERAS_BACKEND=torch (JAX and TensorFlow: "
        "examples/custom_loop.py)."
    )
keras_dist.simulate_cpu_devices(2)
strategy = keras_dist.MirroredStrategy()  # starts rank 1 by re-running this

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

EPOCHS, BATCH = 4, 16
rng = np.random.default_rng(0)
x = rng.normal(size=(80, 6)).astype("float32")
y = (x @ rng.normal(size=(6, 1))).astype("float32")


def build():
    """The same model and optimizer on every rank and in both runs."""
    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [
            keras.Input((6,)),
            keras.layers.Dense(16, activation="tanh"),
            keras.layers.Dense(1),
        ]
    )
    return model, keras.optimizers.SGD(0.05, momentum=0.9)


def train_custom_loop():
    """Trains with torch autograd; returns the weights."""
    with strategy.scope():
        model, optimizer = build()
        optimizer.build(model.trainable_variables)
    loss_fn = keras.losses.MeanSquaredError()
    batches = [
        (x[i : i + BATCH], y[i : i + BATCH]) for i in range(0, len(x), BATCH)
    ]
    for _ in range(EPOCHS):
        for xb, yb in strategy.distribute_dataset(batches):
            n_local = torch.tensor([float(xb.shape[0])])
            n_global = n_local.clone()
            dist.all_reduce(n_global)
            model.zero_grad()
            y_pred = model(xb, training=True)
            if xb.shape[0] > 0:
                # Local mean times this rank's share: summed over ranks it is
                # the mean over the global batch.
                loss = loss_fn(yb, y_pred) * (n_local / n_global)[0]
            else:
                loss = y_pred.sum() * 0.0  # an empty shard: zero gradients
            loss.backward()
            weights = model.trainable_weights
            grads = [v.value.grad for v in weights]
            for g in grads:
                dist.all_reduce(g)  # sum of the ranks' weighted gradients
            with torch.no_grad():
                optimizer.apply(grads, weights)
    return model.get_weights()


def train_fit():
    """Trains the same model with `model.fit`; returns the weights."""
    with strategy.scope():
        model, optimizer = build()
        model.compile(optimizer=optimizer, loss="mse")
    model.fit(x, y, batch_size=BATCH, epochs=EPOCHS, shuffle=False, verbose=0)
    return model.get_weights()


if __name__ == "__main__":
    custom, fitted = train_custom_loop(), train_fit()
    initial = build()[0].get_weights()
    moved = max(float(np.abs(a - b).max()) for a, b in zip(fitted, initial))
    worst = max(
        float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-12))
        for a, b in zip(custom, fitted)
    )
    rank = int(os.environ.get("RANK", 0))
    print(f"rank {rank}: max relative difference custom loop vs fit: {worst}")
    if len(sys.argv) > 1:
        with open(f"{sys.argv[1]}.r{rank}.json", "w") as f:
            json.dump({"difference": worst, "moved": moved}, f)

"""Train the same model with 2 workers on any backend.

    KERAS_BACKEND=torch keras-dist launch --nproc-per-node 2 \
        examples/multi_worker.py --out /tmp/mw

Each worker runs this script; `MultiWorkerMirroredStrategy` reads where it
stands from the launcher's variables. Workers seed differently on purpose:
the chief's initial weights are broadcast. `--out DIR` makes the chief save
its final weights, logs and predictions there (`weights.npz`,
`history.json`, `predictions.npy`).
`--strategy model_parallel --mesh 2,2` lays the Dense layers out over a
("batch", "model") mesh spanning every worker's devices instead;
`--strategy sharded` shards every variable over the workers (ZeRO-3).
"""

import argparse
import json
import os

import keras
import numpy as np

import keras_dist

parser = argparse.ArgumentParser()
parser.add_argument("--epochs", type=int, default=3)
parser.add_argument("--batch-size", type=int, default=32)
parser.add_argument("--out", default=None)
parser.add_argument(
    "--dropout", type=float, default=0.0, help="a Dropout layer's rate"
)
parser.add_argument("--init", default=None, help="initial weights (.npz)")
parser.add_argument(
    "--shuffle",
    action="store_true",
    help="shuffle every epoch (every worker draws the chief's order)",
)
parser.add_argument(
    "--strategy",
    default="multi_worker",
    choices=["multi_worker", "model_parallel", "sharded"],
)
parser.add_argument("--mesh", default="2,2", help="batch,model axis sizes")
parser.add_argument(
    "--checkpoint", default=None, help="save a keras_dist checkpoint there"
)
args = parser.parse_args()

if args.strategy == "model_parallel":
    shape = tuple(int(s) for s in args.mesh.split(","))
    mesh = keras_dist.DeviceMesh(shape, ("batch", "model"))
    layout_map = keras_dist.LayoutMap(mesh)
    layout_map[".*dense.*/kernel"] = (None, "model")
    layout_map[".*dense.*/bias"] = ("model",)
    strategy = keras_dist.ModelParallel(layout_map, batch_dim_name="batch")
elif args.strategy == "sharded":
    strategy = keras_dist.ShardedDataParallel(min_size=16)
else:
    strategy = keras_dist.MultiWorkerMirroredStrategy()
keras.utils.set_random_seed(1234 + strategy.worker_index)

rng = np.random.default_rng(0)  # the same data on every worker
x = rng.normal(size=(200, 8)).astype("float32")
y = (x[:, :2].sum(axis=1) > 0).astype("int32")

with strategy.scope():
    layers = [keras.Input((8,)), keras.layers.Dense(16, activation="tanh")]
    if args.dropout:  # seeded: every worker draws one device's masks
        layers.append(keras.layers.Dropout(args.dropout, seed=7))
    model = keras.Sequential([*layers, keras.layers.Dense(2)])
    if args.init:
        init = np.load(args.init)
        model.set_weights([init[k] for k in init.files])
    model.compile(
        optimizer=keras.optimizers.SGD(0.1),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
    )
callbacks = []
if args.out:  # written by the chief only, on every backend and strategy
    callbacks.append(
        keras.callbacks.ModelCheckpoint(
            os.path.join(args.out, "epoch.weights.h5"), save_weights_only=True
        )
    )
history = model.fit(
    x,
    y,
    batch_size=args.batch_size,
    epochs=args.epochs,
    shuffle=args.shuffle,
    verbose=2,  # only the chief prints
    callbacks=callbacks,
)
loss, accuracy = model.evaluate(x, y, batch_size=50, verbose=0)
# Every worker gets every row, in the input's order.
predictions = model.predict(x, batch_size=64, verbose=0)
# Every worker reads the weights: a variable sharded over workers is
# gathered from all of them (a collective).
weights = model.get_weights()
if args.out:  # every worker calls save: the chief writes the file
    model.save_weights(os.path.join(args.out, "final.weights.h5"))
if args.checkpoint:  # every worker writes its own shards, the chief commits
    keras_dist.checkpoint.save(model, args.checkpoint, async_save=True)
    keras_dist.checkpoint.wait()
strategy.print(
    f"workers={strategy.num_workers} "
    f"replicas={strategy.num_replicas_in_sync} "
    f"loss={loss:.4f} accuracy={accuracy:.4f}"
)


@keras_dist.on_chief
def write_results(folder):
    """The chief's files (no collective inside: only the chief runs it)."""
    os.makedirs(folder, exist_ok=True)
    np.savez(os.path.join(folder, "weights.npz"), *weights)
    np.save(os.path.join(folder, "predictions.npy"), predictions)
    with open(os.path.join(folder, "history.json"), "w") as f:
        json.dump({"history": history.history, "evaluate": [loss, accuracy]}, f)


if args.out:
    write_results(args.out)

"""Scenarios of tests/test_parameter_server.py, each run in a process of
its own (a process that joins a parameter-server cluster stays connected to
it): prints one JSON line of measured figures."""

import json
import os
import sys


def _launched_task():
    """A ps or worker task that `keras-dist launch --ps` started for the
    `launched` scenario: its pid on disk (the chief kills tasks by pid),
    then TensorFlow's server, with TensorFlow only (as `local_cluster`'s
    tasks: importing Keras too doubles a task's start on a busy host)."""
    config = json.loads(os.environ["TF_CONFIG"])
    task = config["task"]
    name = f"{task['type']}{task['index']}.pid"
    with open(os.path.join(sys.argv[2], name), "w") as f:
        f.write(str(os.getpid()))
    import tensorflow as tf

    server = tf.distribute.Server(
        tf.train.ClusterSpec(config["cluster"]),
        job_name=task["type"],
        task_index=int(task["index"]),
        protocol="grpc",
        start=True,
    )
    server.join()


if __name__ == "__main__" and sys.argv[1:2] == ["launched"]:
    _TASK = json.loads(os.environ.get("TF_CONFIG", "{}")).get("task", {})
    if _TASK.get("type") in ("ps", "worker"):
        _launched_task()

os.environ["KERAS_BACKEND"] = "tensorflow"

import keras  # noqa: E402
import numpy as np  # noqa: E402

import keras_dist  # noqa: E402
from keras_dist._src.cluster import parameter_server as ps  # noqa: E402

N, BATCH = 64, 16


def data():
    rng = np.random.RandomState(0)
    x = rng.rand(N, 4).astype("float32")
    y = (x @ np.arange(1, 5, dtype="float32")[:, None]).astype("float32")
    return x, y


def build(metrics=("mae",)):
    keras.utils.set_random_seed(1)
    model = keras.Sequential(
        [
            keras.Input((4,)),
            keras.layers.Dense(8, activation="relu"),
            keras.layers.Dense(1),
        ]
    )
    model.compile(
        optimizer=keras.optimizers.SGD(0.05), loss="mse", metrics=list(metrics)
    )
    return model


def _confusion():
    """Four metrics that Keras updates with ``assign(v + increment)``;
    every prediction lands in exactly one of them."""
    return [
        cls(thresholds=0.0)
        for cls in (
            keras.metrics.TruePositives,
            keras.metrics.FalsePositives,
            keras.metrics.TrueNegatives,
            keras.metrics.FalseNegatives,
        )
    ]


def max_rel(a, b):
    return max(
        float(np.max(np.abs(u - v)) / max(np.max(np.abs(v)), 1e-12))
        for u, v in zip(a, b)
    )


def ps_device(variable):
    from keras_dist._src.keras_glue.internals import variable_value

    return variable_value(variable).device.split("/device")[0]


def one_worker():
    x, y = data()
    strategy = keras_dist.ParameterServerStrategy(ps.in_process_cluster(1, 2))
    with strategy.scope():
        model = build()
    reference = build()
    reference.set_weights(model.get_weights())
    history = model.fit(
        x, y, batch_size=BATCH, epochs=3, shuffle=False, verbose=0
    )
    expected = reference.fit(
        x, y, batch_size=BATCH, epochs=3, shuffle=False, verbose=0
    )
    out = {
        "weights_rel": max_rel(model.get_weights(), reference.get_weights()),
        "loss": history.history["loss"],
        "loss_expected": expected.history["loss"],
        "iterations": int(model.optimizer.iterations.numpy()),
        "evaluate": model.evaluate(x, y, batch_size=10, verbose=0),
        "evaluate_expected": reference.evaluate(x, y, batch_size=10, verbose=0),
        "predict_rel": max_rel(
            [model.predict(x, batch_size=10)],
            [reference.predict(x, batch_size=10, verbose=0)],
        ),
    }
    # class_weight and validation_split (the last quarter held out), as
    # Keras's own fit does them: 0/1 labels, class 1 weighing 3; batches of
    # 10, so each epoch ends with a partial batch (of 8).
    labels = (x.sum(axis=1, keepdims=True) > 2).astype("float32")
    with strategy.scope():
        weighted = build()
    reference = build()
    reference.set_weights(weighted.get_weights())
    kwargs = dict(
        batch_size=10,
        epochs=2,
        shuffle=False,
        class_weight={0: 1.0, 1: 3.0},
        validation_split=0.25,
        verbose=0,
    )
    history = weighted.fit(x, labels, **kwargs)
    expected = reference.fit(x, labels, **kwargs)
    out["weighted"] = {
        "weights_rel": max_rel(weighted.get_weights(), reference.get_weights()),
        "iterations": int(weighted.optimizer.iterations.numpy()),
        **{k: history.history[k] for k in ("loss", "val_loss")},
        **{f"{k}_expected": expected.history[k] for k in ("loss", "val_loss")},
    }
    return out


def two_workers():
    import tensorflow as tf

    x, y = data()
    cluster = ps.in_process_cluster(2, 2)
    strategy = keras_dist.ParameterServerStrategy(cluster)
    out = {"repr": repr(strategy)}
    confusion = _confusion()
    with strategy.scope():
        model = build(metrics=["mae", *confusion])
    steps = 100
    model.fit(
        x, y, batch_size=BATCH, epochs=1, steps_per_epoch=steps, verbose=0
    )
    counts = {
        v.path: float(v.numpy())
        for v in model.metrics_variables
        if v.path.endswith("count")
    }
    out["confusion_total"] = sum(float(m.result()) for m in confusion)
    out.update(
        iterations=int(model.optimizer.iterations.numpy()),
        scheduled=steps,
        counts=counts,
        samples=steps * BATCH,
    )

    # A dataset function and a tf.data dataset, two epochs each.
    def dataset_fn():
        return tf.data.Dataset.from_tensor_slices((x, y)).repeat().batch(8)

    model.fit(dataset_fn, epochs=2, steps_per_epoch=10, verbose=0)
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(BATCH)
    history = model.fit(dataset, epochs=2, verbose=0)
    out["iterations_after"] = int(model.optimizer.iterations.numpy())
    out["history_epochs"] = len(history.history["loss"])

    # Each worker reads its own part of the input: sample i goes to
    # worker i % 2, from NumPy, from a tf.data dataset (batch i to worker
    # i % 2) and from a dataset function sharding by its InputContext.
    seen_model = _seen_model(strategy)
    ids = np.arange(N, dtype="float32")[:, None]

    def sharded_fn(context):
        return (
            tf.data.Dataset.from_tensor_slices((ids, ids))
            .shard(context.num_input_pipelines, context.input_pipeline_id)
            .repeat()
            .batch(8)
        )

    def owner(i, name):
        return (i // 8) % 2 if name == "dataset" else i % 2

    parts = {}
    for name, fit in {
        "numpy": lambda: seen_model.fit(ids, ids, batch_size=8, verbose=0),
        "dataset": lambda: seen_model.fit(
            tf.data.Dataset.from_tensor_slices((ids, ids)).batch(8),
            verbose=0,
        ),
        "function": lambda: seen_model.fit(
            sharded_fn, steps_per_epoch=8, verbose=0
        ),
    }.items():
        before = seen_model.seen.numpy()
        fit()
        seen = seen_model.seen.numpy() - before
        parts[name] = {
            "per_worker": seen.sum(axis=1).tolist(),
            # samples read by another worker than their own (a batched
            # tf.data dataset is sharded by batches: of 8 samples)
            "foreign": float(
                sum(seen[1 - owner(i, name), i] for i in range(N))
            ),
            "count": float(seen_model.metrics_variables[1].numpy()),
        }
    out["parts"] = parts

    # A train_step override runs as written (here: counting its calls in
    # a variable of its own, exact too).
    class Counting(keras.Sequential):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.calls = self.add_weight(
                shape=(), initializer="zeros", trainable=False, name="calls"
            )

        def train_step(self, data):
            self.calls.assign_add(1.0)
            return super().train_step(data)

    with strategy.scope():
        counting = Counting(
            [keras.Input((4,)), keras.layers.Dense(1)], name="counting"
        )
        counting.compile(optimizer="sgd", loss="mse")
    counting.fit(
        x, y, batch_size=BATCH, epochs=1, steps_per_epoch=40, verbose=0
    )
    out["override_calls"] = float(counting.calls.numpy())
    # steps_per_execution: 4 steps per closure, 10 steps (4 + 4 + 2).
    with strategy.scope():
        chunked = build()
        chunked.compile(optimizer="sgd", loss="mse", steps_per_execution=4)
    chunked.fit(x, y, batch_size=BATCH, epochs=1, steps_per_epoch=10, verbose=0)
    out["chunked"] = {
        "iterations": int(chunked.optimizer.iterations.numpy()),
        "count": float(chunked.metrics_variables[1].numpy()),
    }

    class Batches(keras.utils.PyDataset):
        def __len__(self):
            return 4

        def __getitem__(self, index):
            part = slice(index * BATCH, (index + 1) * BATCH)
            return x[part], y[part]

    errors = {}
    for name, call in {
        "endless": lambda: model.fit(dataset.repeat(), epochs=1, verbose=0),
        "function": lambda: model.fit(dataset_fn, epochs=1, verbose=0),
        "pydataset": lambda: model.fit(Batches(), epochs=1, verbose=0),
        "generator": lambda: model.fit(
            (b for b in [(x[:BATCH], y[:BATCH])]), epochs=1, verbose=0
        ),
        "predict_generator": lambda: model.predict(
            (b for b in [x[:BATCH]]), verbose=0
        ),
        "split_dataset": lambda: model.fit(
            dataset, validation_split=0.25, verbose=0
        ),
        "step_backup": lambda: model.fit(
            dataset,
            verbose=0,
            callbacks=[keras_dist.callbacks.BackupAndRestore("/nonexistent")],
        ),
    }.items():
        try:
            call()
            errors[name] = None
        except (ValueError, NotImplementedError) as error:
            errors[name] = str(error)
    # evaluate on the chief takes a PyDataset
    out["evaluate_pydataset"] = model.evaluate(Batches(), verbose=0)
    out["evaluate_pydataset_expected"] = model.evaluate(
        x, y, batch_size=BATCH, verbose=0
    )
    out["errors"] = errors
    # evaluate/predict on the chief equal plain Keras on the same weights.
    reference = build(metrics=["mae", *_confusion()])
    reference.set_weights(model.get_weights())
    out["evaluate"] = model.evaluate(x, y, batch_size=10, verbose=0)
    out["evaluate_expected"] = reference.evaluate(
        x, y, batch_size=10, verbose=0
    )
    # ShardedEmbedding: one variable per ps task, sparse gradients.
    with strategy.scope():
        embed = keras.Sequential(
            [
                keras.Input((3,), dtype="int32"),
                keras_dist.layers.ShardedEmbedding(
                    10,
                    4,
                    name="table",
                    embeddings_initializer=keras.initializers.RandomUniform(
                        seed=7
                    ),
                ),
                keras.layers.Flatten(),
                keras.layers.Dense(1),
            ]
        )
        embed.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    table = embed.get_layer("table")
    ids = np.random.RandomState(1).randint(0, 7, size=(64, 3)).astype("int32")
    before = [np.array(s.numpy()) for s in table.trainable_weights]
    # One device's table from the same initializer: the shards are its rows.
    plain = keras.layers.Embedding(
        10, 4, embeddings_initializer=keras.initializers.RandomUniform(seed=7)
    )
    plain.build((None, 3))
    init_equal = bool(
        np.array_equal(np.concatenate(before), plain.embeddings.numpy())
    )
    with tf.GradientTape() as tape:
        loss = tf.reduce_mean(embed(ids[:8]) ** 2)
    grads = tape.gradient(loss, table.trainable_weights)
    embed.fit(
        ids,
        ids[:, :1].astype("float32"),
        batch_size=8,
        epochs=1,
        steps_per_epoch=10,
        verbose=0,
    )
    after = [np.array(s.numpy()) for s in table.trainable_weights]
    out["table"] = {
        "shards": [tuple(s.shape) for s in table.trainable_weights],
        "devices": [ps_device(s) for s in table.trainable_weights],
        "gradients": [type(g).__name__ for g in grads],
        # rows 7..9 are never looked up: they stay as initialized
        "unused_rows_same": bool(np.array_equal(after[1][-1:], before[1][-1:])),
        "used_rows_moved": bool(not np.array_equal(after[0], before[0])),
        "iterations": int(embed.optimizer.iterations.numpy()),
        "init_equal": init_equal,
        "lookup_rel": max_rel(
            [embed.layers[0](ids[:4]).numpy()],
            [np.concatenate(after)[ids[:4]]],
        ),
    }
    partitioner = tf.distribute.experimental.partitioners.FixedShardsPartitioner
    sharded = keras_dist.ParameterServerStrategy(
        cluster, variable_partitioner=partitioner(2)
    )
    with sharded.scope():
        embed = keras.Sequential(
            [
                keras.Input((3,), dtype="int32"),
                keras.layers.Embedding(64, 4),
                keras.layers.Flatten(),
                keras.layers.Dense(1),
            ]
        )
        try:
            embed.compile(optimizer="sgd", loss="mse")
            out["embedding_error"] = None
        except keras_dist.KerasDistError as error:
            out["embedding_error"] = str(error)
    return out


def _seen_model(strategy):
    """A model whose train_step counts, per worker, the samples it reads
    (feature 0 is the sample's index) in an (workers, N) variable."""
    import tensorflow as tf

    from keras_dist._src.keras_glue.internals import variable_value

    class Seen(keras.Sequential):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.seen = self.add_weight(
                shape=(2, N), initializer="zeros", trainable=False, name="seen"
            )

        def train_step(self, data):
            index = tf.cast(data[0][:, 0], "int32")
            worker = tf.distribute.coordinator
            worker = tf.cast(
                worker.experimental_get_current_worker_index(), "int32"
            )
            where = tf.stack([tf.fill(tf.shape(index), worker), index], axis=1)
            # one atomic scatter-add on the ps
            variable_value(self.seen).scatter_nd_add(
                where, tf.ones(tf.shape(index), "float32")
            )
            return super().train_step(data)

    with strategy.scope():
        model = Seen([keras.Input((1,)), keras.layers.Dense(1)], name="seen")
        model.compile(optimizer=keras.optimizers.SGD(0.0), loss="mse")
    return model


def killed_worker():
    import signal
    import threading
    import time

    x, y = data()
    with ps.local_cluster(num_workers=2, num_ps=1) as (cluster, tasks):
        strategy = keras_dist.ParameterServerStrategy(cluster)
        with strategy.scope():
            model = build()
        victim = tasks[("worker", 1)]
        model.fit(
            x, y, batch_size=BATCH, epochs=1, steps_per_epoch=20, verbose=0
        )  # traced, both workers up

        class Kill(keras.callbacks.Callback):
            def on_epoch_begin(self, epoch, logs=None):
                if epoch == 1:
                    threading.Timer(
                        0.5, lambda: victim.send_signal(signal.SIGKILL)
                    ).start()

        start = time.monotonic()
        history = model.fit(
            x,
            y,
            batch_size=BATCH,
            epochs=3,
            steps_per_epoch=200,
            verbose=0,
            callbacks=[Kill()],
        )
        victim.wait()
        out = {
            "epochs": len(history.history["loss"]),
            "iterations": int(model.optimizer.iterations.numpy()),
            "scheduled": 20 + 3 * 200,
            "victim_returncode": victim.returncode,
            "seconds": time.monotonic() - start,
        }
        # A lost ps task ends fit with keras_dist's clear error.
        lost = tasks[("ps", 0)]
        lost.send_signal(signal.SIGKILL)
        lost.wait()
        try:
            model.fit(
                x, y, batch_size=BATCH, epochs=1, steps_per_epoch=50, verbose=0
            )
            ps_error = None
        except keras_dist.KerasDistError as error:
            ps_error = str(error)
        out["ps_error"] = ps_error
        return out


def same_script():
    """Worker and ps tasks started by hand with TF_CONFIG, running the
    chief's own script: `ParameterServerStrategy()` serves there."""
    import subprocess

    x, y = data()
    cluster = {
        "chief": [f"127.0.0.1:{ps.free_port()}"],
        "worker": [f"127.0.0.1:{ps.free_port()}"],
        "ps": [f"127.0.0.1:{ps.free_port()}"],
    }
    code = "import keras_dist; keras_dist.ParameterServerStrategy()"
    tasks = []
    try:
        for kind in ("ps", "worker"):
            config = {"cluster": cluster, "task": {"type": kind, "index": 0}}
            env = dict(os.environ, TF_CONFIG=json.dumps(config))
            tasks.append(
                subprocess.Popen(
                    [sys.executable, "-c", code],
                    env=env,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.DEVNULL,
                    text=True,
                )
            )
        ready = []
        for task in tasks:
            for line in task.stdout:
                if line.startswith(ps.READY_LINE):
                    ready.append(line.strip())
                    break
        strategy = keras_dist.ParameterServerStrategy(cluster)
        with strategy.scope():
            model = build()
        model.fit(
            x, y, batch_size=BATCH, epochs=1, steps_per_epoch=8, verbose=0
        )
        return {
            "ready": ready,
            "iterations": int(model.optimizer.iterations.numpy()),
            "alive": [task.poll() is None for task in tasks],
        }
    finally:
        for task in tasks:
            task.kill()
            task.wait()


def launched():
    """The chief of a `keras-dist launch --ps 1 --workers 2 --max-restarts
    2` job (argv: the job's directory). In the first run worker 1 is
    killed as epoch 1 begins (started again by the launcher) and ps 0 as
    epoch 2 begins (the launcher restarts the job); Keras's
    BackupAndRestore has saved epochs 0 and 1 by then, and the second run
    resumes at epoch 2."""
    strategy = keras_dist.ParameterServerStrategy()  # TF_CONFIG: the chief
    print("STRATEGY " + repr(strategy), flush=True)
    first = os.environ.get("KERAS_DIST_RESTART_COUNT", "0") == "0"
    return _fit_with_backup(strategy, sys.argv[2], kill=first)


def _fit_with_backup(strategy, directory, kill):
    import signal
    import time

    x, y = data()
    with strategy.scope():
        model = build()

    def kill_task(name):
        with open(os.path.join(directory, name + ".pid")) as f:
            os.kill(int(f.read()), signal.SIGKILL)

    class Faults(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            if kill and epoch == 1:
                kill_task("worker1")
            if kill and epoch == 2:
                kill_task("ps0")
                time.sleep(60)  # the launcher stops the job meanwhile

    backup = keras.callbacks.BackupAndRestore(os.path.join(directory, "backup"))
    history = model.fit(
        x,
        y,
        batch_size=BATCH,
        epochs=4,
        steps_per_epoch=20,
        callbacks=[backup, Faults()],
        verbose=0,
    )
    return {
        "epochs": history.epoch,
        "iterations": int(model.optimizer.iterations.numpy()),
        "backup_left": os.path.exists(os.path.join(directory, "backup")),
    }


if __name__ == "__main__":
    result = {
        "launched": launched,
        "one_worker": one_worker,
        "two_workers": two_workers,
        "killed_worker": killed_worker,
        "same_script": same_script,
    }[sys.argv[1]]()
    print("RESULT " + json.dumps(result), flush=True)
    os._exit(0)  # in-process servers never stop on their own

"""MultiWorkerMirroredStrategy with 2 real worker processes on localhost,
started by ``keras-dist launch`` (python -m keras_dist.launch), against
plain Keras on one device from the same initial weights."""

import contextlib
import json
import os
import re
import subprocess
import sys
import time

import keras
import numpy as np
import pytest

from tests.utils import max_relative_difference

BACKEND = keras.backend.backend()
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLE = os.path.join(ROOT, "examples", "multi_worker.py")

pytestmark = [pytest.mark.multi_process, pytest.mark.slow]


def _build(dropout=0.0):
    layers = [keras.Input((8,)), keras.layers.Dense(16, activation="tanh")]
    if dropout:  # as in examples/multi_worker.py
        layers.append(keras.layers.Dropout(dropout, seed=7))
    return keras.Sequential([*layers, keras.layers.Dense(2)])


def _data():
    rng = np.random.default_rng(0)  # as in examples/multi_worker.py
    x = rng.normal(size=(200, 8)).astype("float32")
    y = (x[:, :2].sum(axis=1) > 0).astype("int32")
    return x, y


def _launch(args, tmp_path, timeout=300):
    env = dict(os.environ, KERAS_BACKEND=BACKEND, OMP_NUM_THREADS="1")
    env.pop("KERAS_DIST_CPU_DEVICES", None)
    env.pop("XLA_FLAGS", None)
    start = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "keras_dist.launch", *map(str, args)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    return proc, time.monotonic() - start


def _failure(proc) -> str:
    """A failed job's story: every rank's first error line (the first to
    fail may be far from the end of the output), then the output's tail."""
    errors = [
        line
        for line in proc.stdout.splitlines()
        if re.match(r"\[rank \d+\] [\w.]*(Error|Exception|Exit)\b", line)
    ]
    return (
        "\n".join(errors[:10])
        + "\n...\n"
        + (proc.stdout[-3000:] + proc.stderr[-3000:])
    )


@pytest.mark.parametrize(
    "devices_per_worker", [1] if BACKEND == "torch" else [1, 2]
)
def test_two_workers_equal_one_device(tmp_path, devices_per_worker):
    # 200 samples / 30: the last batch (20) does not divide by 4 replicas.
    # With 2 devices a worker, batches of 50 (all full, parts of 13 and
    # 12) and Dropout: each replica must hold its own place's part (its
    # masks are one device's rows there), on TF's native rebatching too.
    # With 1 device a worker, Keras's default shuffle=True: the workers seed
    # differently (1234 + rank), and each must draw the chief's order. On
    # TF they drew their own (Keras shuffles with TF's seeds there), so an
    # epoch used some samples twice and others never.
    batch_size, dropout = (30, 0.0) if devices_per_worker == 1 else (50, 0.3)
    shuffle = devices_per_worker == 1
    keras.utils.set_random_seed(7)
    model = _build(dropout)
    np.savez(tmp_path / "init.npz", *model.get_weights())
    model.compile(
        optimizer=keras.optimizers.SGD(0.1),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
    )
    x, y = _data()
    keras.utils.set_random_seed(1234)  # the chief's seed in the example
    history = model.fit(
        x, y, batch_size=batch_size, epochs=3, shuffle=shuffle, verbose=0
    )
    expected_eval = model.evaluate(x, y, batch_size=50, verbose=0)
    expected_predictions = model.predict(x, batch_size=64, verbose=0)

    args = ["--nproc-per-node", 2]
    if devices_per_worker > 1:
        args += ["--cpu-devices-per-process", devices_per_worker]
    args += [EXAMPLE, "--init", tmp_path / "init.npz"]
    args += ["--batch-size", batch_size, "--dropout", dropout]
    args += ["--out", tmp_path / "out"] + (["--shuffle"] if shuffle else [])
    proc, _ = _launch(args, tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    replicas = 2 * devices_per_worker
    assert f"workers=2 replicas={replicas}" in proc.stdout
    # Only the chief prints progress.
    assert "[rank 0] Epoch 1/3" in proc.stdout
    assert "[rank 1] Epoch" not in proc.stdout
    saved = np.load(tmp_path / "out" / "weights.npz")
    weights = [saved[k] for k in saved.files]
    difference = max_relative_difference(model.get_weights(), weights)
    print(f"{BACKEND} 2x{devices_per_worker}: max relative {difference:.2e}")
    assert difference <= 1e-5
    logs = json.loads((tmp_path / "out" / "history.json").read_text())
    np.testing.assert_allclose(
        logs["history"]["loss"], history.history["loss"], rtol=1e-5
    )
    np.testing.assert_allclose(logs["evaluate"], expected_eval, rtol=1e-5)
    # Every row, in order (64 over 4 replicas: Keras's TF predict put them
    # back in tf.distribute's order, not keras_dist's).
    predictions = np.load(tmp_path / "out" / "predictions.npy")
    np.testing.assert_allclose(
        predictions, expected_predictions, rtol=1e-5, atol=1e-6
    )


@pytest.mark.skipif(BACKEND != "jax", reason="torch: tests/torch; TF: refused")
@pytest.mark.parametrize("strategy", ["model_parallel", "sharded"])
def test_mesh_across_two_workers_equals_one_device(tmp_path, strategy):
    """A 2x2 ("batch", "model") mesh over 2 workers x 2 devices, and
    ZeRO-3 over all 4, train like one device."""
    keras.utils.set_random_seed(7)
    model = _build()
    np.savez(tmp_path / "init.npz", *model.get_weights())
    model.compile(
        optimizer=keras.optimizers.SGD(0.1),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
    )
    x, y = _data()
    history = model.fit(x, y, batch_size=30, epochs=2, shuffle=False, verbose=0)
    args = ["--nproc-per-node", 2, "--cpu-devices-per-process", 2, EXAMPLE]
    args += ["--strategy", strategy, "--epochs", 2, "--batch-size", 30]
    args += ["--init", tmp_path / "init.npz", "--out", tmp_path / "out"]
    if strategy == "model_parallel":
        args += ["--checkpoint", tmp_path / "ckpt"]
    proc, _ = _launch(args, tmp_path)
    assert proc.returncode == 0, _failure(proc)
    replicas = 2 if strategy == "model_parallel" else 4
    assert f"workers=2 replicas={replicas}" in proc.stdout
    saved = np.load(tmp_path / "out" / "weights.npz")
    weights = [saved[k] for k in saved.files]
    difference = max_relative_difference(model.get_weights(), weights)
    print(f"{BACKEND} {strategy} 2 workers: max relative {difference:.2e}")
    assert difference <= 1e-5
    # Saving reads variables split across workers (a collective): the
    # ModelCheckpoint callback and a save_weights on every worker work, and
    # the chief's files load into a one-device model.
    for name in ("epoch.weights.h5", "final.weights.h5"):
        restored = _build()
        restored.load_weights(tmp_path / "out" / name)
        assert max_relative_difference(weights, restored.get_weights()) == 0
    assert not list(tmp_path.glob("**/keras_dist_discard_*"))
    logs = json.loads((tmp_path / "out" / "history.json").read_text())
    np.testing.assert_allclose(
        logs["history"]["loss"], history.history["loss"], rtol=1e-5
    )
    if strategy == "model_parallel":
        _check_sharded_checkpoint(tmp_path / "ckpt", weights)


def _check_sharded_checkpoint(root, weights):
    """The 2-worker 2x2 checkpoint: one shard file per process, each with
    only its half of every split variable (no gathered copy), restoring
    into Mirrored and one device with identical weights."""
    import keras_dist
    from keras_dist._src.checkpoint import format as fmt

    (path,) = root.glob("ckpt-*")
    files = ["shards-00000.npz", "shards-00001.npz"]
    assert sorted(os.listdir(path)) == ["COMMIT", "metadata.json", *files]
    metadata = fmt.read_metadata(path)
    assert metadata["processes"] == 2
    split = {name: 0 for name in files}
    for entry in metadata["arrays"]:
        if "model" not in str(entry.get("layout")):
            continue
        total = int(np.prod(entry["shape"]))
        for name in files:
            held = sum(
                int(np.prod(p["shape"]))
                for p in entry["pieces"]
                if p["file"] == name
            )
            assert held == total // 2, (entry["key"], name, held)
            split[name] += held * 4
    assert all(split.values()), metadata["arrays"]
    sizes = {name: os.path.getsize(path / name) for name in files}
    print(f"shard files {sizes} bytes; split variables in each {split}")
    for strategy in (keras_dist.MirroredStrategy(), None):
        keras.backend.clear_session()
        with strategy.scope() if strategy else contextlib.nullcontext():
            model = _build()
            model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
        keras_dist.checkpoint.restore(model, root)
        assert max_relative_difference(weights, model.get_weights()) == 0


KILLED = """
import os, signal, sys
import keras, numpy as np
import keras_dist

strategy = keras_dist.MultiWorkerMirroredStrategy()


class Die(keras.callbacks.Callback):
    def on_train_batch_end(self, batch, logs=None):
        if strategy.worker_index == 1 and batch == 2:
            os.kill(os.getpid(), signal.SIGKILL)


with strategy.scope():
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
    model.compile("sgd", "mse")
x = np.zeros((64, 4), "float32")
model.fit(x, x[:, :1], batch_size=4, epochs=50, verbose=0, callbacks=[Die()])
print("TRAINING DONE", flush=True)
"""


@pytest.mark.parametrize("how", ["SIGKILL", "SIGTERM", "raise", "exit"])
def test_killed_worker_stops_the_job(tmp_path, how):
    # SIGTERM without BackupAndRestore has its default action: JAX's and
    # TensorFlow's distributed services swallowed it (training went on to
    # the end). An exception or `sys.exit(3)` ends its worker at once: on
    # JAX the worker waited in the shutdown barrier until the timeout, and
    # the job ended under rank 0's name with code 1.
    script = tmp_path / "killed.py"
    kill = "os.kill(os.getpid(), signal.SIGKILL)"
    script.write_text(
        KILLED.replace(
            kill,
            {
                "SIGKILL": kill,
                "SIGTERM": "os.kill(os.getpid(), signal.SIGTERM)",
                "raise": "raise RuntimeError('boom on rank 1')",
                "exit": "sys.exit(3)",
            }[how],
        )
    )
    # With a 400 s liveness timeout, an ending well before it shows that the
    # launcher stopped the job on the kill, not a timeout.
    os.environ["KERAS_DIST_TIMEOUT"] = "400"
    try:
        proc, seconds = _launch(["--nproc-per-node", 2, script], tmp_path)
    finally:
        del os.environ["KERAS_DIST_TIMEOUT"]
    assert proc.returncode != 0
    assert "TRAINING DONE" not in proc.stdout
    if how == "raise":
        assert proc.returncode == 1
        assert "RuntimeError: boom on rank 1" in proc.stdout + proc.stderr
        # The launcher names the rank that raised (torch named rank 0,
        # which another rank's failure had stopped).
        assert "worker rank 1 exited with code 1" in proc.stderr
    elif how == "exit":
        assert proc.returncode == 3
        assert "worker rank 1 exited with code 3" in proc.stderr
    else:
        assert f"worker rank 1 was killed by {how}" in proc.stderr
    assert seconds < 200


CHIEF_SAVES = """
import os, sys, time
import keras, numpy as np, tensorflow as tf
import keras_dist

strategy = keras_dist.MultiWorkerMirroredStrategy()
# With a learning rate of 0 an epoch's mean loss is the whole data's loss
# only if the epoch's global batches hold every sample once.
rng = np.random.default_rng(0)  # as _shuffled_data()
arrays = (rng.normal(size=(96, 4)).astype("float32"),
          rng.normal(size=(96, 1)).astype("float32"))
# The tutorials' dataset: a shuffle without any seed.
unseeded = tf.data.Dataset.from_tensor_slices(arrays).shuffle(96).batch(16)
keras.utils.set_random_seed(strategy.worker_index)  # seeds differ
seeded_apart = tf.data.Dataset.from_tensor_slices(arrays).shuffle(96)
seeded_apart = seeded_apart.batch(16)
with strategy.scope():
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
    model.compile("sgd", "mse")
x = np.arange(32, dtype="float32").reshape(8, 4) / 32
model.fit(x, x[:, :1], batch_size=4, epochs=1, verbose=0)
with strategy.scope():
    still = keras.Sequential(
        [keras.Input((4,)), keras.layers.Dense(1, kernel_initializer="ones")]
    )
    still.compile(keras.optimizers.SGD(0.0), "mse")
history = still.fit(
    unseeded, epochs=2, validation_data=seeded_apart, verbose=0
)
print("SHUFFLED", *history.history["loss"], *history.history["val_loss"],
      flush=True)
if strategy.is_chief:  # torch's `rank == 0` idiom
    model.save(os.path.join(sys.argv[1], "chief.keras"))
loss = model.evaluate(x, x[:, :1], batch_size=4, verbose=0)
if not strategy.is_chief:  # the chief writes, and may exit, first
    time.sleep(2)
model.save_weights(os.path.join(sys.argv[1], "all.weights.h5"))  # every one
print(f"EVALUATED {loss:.6f}", flush=True)
"""


def _shuffled_data():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(96, 4)).astype("float32")
    return x, rng.normal(size=(96, 1)).astype("float32")


def test_saving_on_the_chief_alone_lets_the_job_go_on(tmp_path):
    # A save on the chief alone exchanges nothing (its outcome goes to the
    # job's key-value store), so the workers' next collectives still pair.
    # The last save: the chief writes and ends its program while the other
    # worker has yet to read the outcome from the store the chief's process
    # hosts (TF's coordination service, torch's rendezvous store); that
    # worker failed when the chief's process, and the store, went first.
    script = tmp_path / "chief_saves.py"
    script.write_text(CHIEF_SAVES)
    os.environ["KERAS_DIST_TIMEOUT"] = "60"
    try:
        proc, _ = _launch(["--nproc-per-node", 2, script, tmp_path], tmp_path)
    finally:
        del os.environ["KERAS_DIST_TIMEOUT"]
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    losses = {
        line.split("EVALUATED ")[1]
        for line in proc.stdout.splitlines()
        if "EVALUATED" in line
    }
    assert len(losses) == 1  # both workers, one value
    assert proc.stdout.count("EVALUATED") == 2
    assert keras.saving.load_model(tmp_path / "chief.keras") is not None
    assert (tmp_path / "all.weights.h5").is_file()
    # Every worker drew its own order of the unseeded shuffle (on every
    # backend) and an epoch used some samples twice and others never
    # (epoch losses 5.88 and 6.77 against 6.04 measured on JAX).
    reference = keras.Sequential(
        [keras.Input((4,)), keras.layers.Dense(1, kernel_initializer="ones")]
    )
    reference.compile("sgd", "mse")
    expected = reference.evaluate(*_shuffled_data(), verbose=0)
    shuffled = [
        line.split("SHUFFLED ")[1].split()
        for line in proc.stdout.splitlines()
        if "SHUFFLED" in line
    ]
    assert len(shuffled) == 2  # both workers
    assert all(len(values) == 4 for values in shuffled)  # loss, val_loss
    for epochs in shuffled:
        np.testing.assert_allclose(np.float64(epochs), expected, rtol=1e-5)


CHIEF_ONLY = """
import keras, numpy as np
import keras_dist

strategy = keras_dist.MultiWorkerMirroredStrategy()
x = np.ones((64, 4), "float32")
if keras.backend.backend() == "tensorflow":
    # A metric object made outside the scope: each worker's own variable.
    outside = keras.metrics.AUC(name="auc_outside")
    with strategy.scope():
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
        model.compile("sgd", "mse", metrics=[outside])
    try:
        model.fit(x, x[:, :1], batch_size=16, verbose=0)
    except keras_dist.VariablesOutsideScopeError as error:
        print("OUTSIDE_METRIC", "auc_outside" in str(error), flush=True)
else:
    # JAX and torch: a metric object made outside the scope still counts
    # every worker's samples (predictions are the rows' sums; lr 0).
    outside = keras.metrics.MeanAbsoluteError(name="mae_outside")
    with strategy.scope():
        ones = keras.layers.Dense(1, kernel_initializer="ones")
        model = keras.Sequential([keras.Input((4,)), ones])
        model.compile(keras.optimizers.SGD(0.0), "mse", metrics=[outside])
    rows = np.arange(256, dtype="float32").reshape(64, 4) / 64
    history = model.fit(rows, np.zeros((64, 1), "float32"), batch_size=16,
                        verbose=0)
    print("OUTSIDE_METRIC", repr(history.history["mae_outside"][0]), flush=True)
    # A strategy refused for its arguments keeps the job: the next one
    # (below) works. It used to leave the job, and no strategy could be
    # made again in the program.
    try:
        keras_dist.ModelParallel(keras_dist.LayoutMap(
            keras_dist.DeviceMesh((3, 1), ("batch", "model"))))
    except keras_dist.LayoutError as error:
        print("REFUSED", "needs 3" in str(error), flush=True)
    # A layer made on one worker alone shifts its layer names, which the
    # layout keys match: refused on every worker, not a hang.
    mesh = keras_dist.DeviceMesh(
        (1, strategy.num_replicas_in_sync), ("batch", "model"))
    layouts = keras_dist.LayoutMap(mesh)
    layouts[".*/dense/kernel"] = (None, "model")
    layouts[".*/dense_1/kernel"] = ("model", None)
    keras.backend.clear_session()
    if not strategy.is_chief:
        keras.layers.Dense(1)
    try:
        with keras_dist.ModelParallel(layouts, "batch").scope():
            shifted = keras.Sequential([keras.Input((4,)),
                                        keras.layers.Dense(4),
                                        keras.layers.Dense(4)])
            shifted.compile("sgd", "mse")
        shifted.fit(x, x, batch_size=16, verbose=0)
        print("SHIFTED None", flush=True)
    except keras_dist.LayoutError as error:
        print("SHIFTED", "differ between processes" in str(error), flush=True)
with strategy.scope():
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
    model.compile("sgd", "mse")
model.fit(x, x[:, :1], batch_size=16, verbose=0)


class ChiefStops(keras.callbacks.Callback):
    # Decides on the chief alone, as a time budget read from one clock.
    def __init__(self, batch=None, epoch=None):
        super().__init__()
        self.batch, self.epoch = batch, epoch

    def on_train_batch_end(self, batch, logs=None):
        if batch == self.batch:
            self.model.stop_training = True

    def on_epoch_end(self, epoch, logs=None):
        if epoch == self.epoch:
            self.model.stop_training = True


class Batches(keras.callbacks.Callback):
    def on_train_begin(self, logs=None):
        self.seen = 0

    def on_train_batch_begin(self, batch, logs=None):
        self.seen += 1


# stop_training set on the chief alone: every worker stops with it, in the
# same batch (only the chief runs a batch callback) or after the same epoch.
for chief_stops in (ChiefStops(batch=1), ChiefStops(epoch=1)):
    seen = Batches()
    history = model.fit(x, x[:, :1], batch_size=16, epochs=4, verbose=0,
                        callbacks=[seen] + [chief_stops] * strategy.is_chief)
    print("STOPPED", len(history.history["loss"]), seen.seen, flush=True)
if strategy.is_chief:  # torch's `rank == 0` idiom, for a collective call
    model.evaluate(x, x[:, :1], verbose=0)
"""


def test_a_call_on_the_chief_alone_fails_at_once(tmp_path):
    # evaluate on the chief alone waited in its first collective for a
    # worker that had ended its program: on JAX for ever (that worker is
    # alive in JAX's shutdown barrier; the job ran past 300 s with a 60 s
    # timeout), on TF and torch until a transport error that blamed a crash.
    script = tmp_path / "chief_only.py"
    script.write_text(CHIEF_ONLY)
    os.environ["KERAS_DIST_TIMEOUT"] = "400"
    try:
        proc, seconds = _launch(["--nproc-per-node", 2, script], tmp_path)
    finally:
        del os.environ["KERAS_DIST_TIMEOUT"]
    assert proc.returncode == 1, _failure(proc)
    assert (
        "Rank 0 called `evaluate` after rank 1 had finished the program"
        in proc.stdout
    ), _failure(proc)
    assert seconds < 200
    # 64 samples in batches of 16: 4 steps an epoch. The first fit stops
    # after its 2nd step (1 epoch), the second after 2 epochs (8 steps).
    for rank in (0, 1):
        stops = [
            line.split("STOPPED ")[1]
            for line in proc.stdout.splitlines()
            if line.startswith(f"[rank {rank}] STOPPED ")
        ]
        assert stops == ["1 2", "2 8"], _failure(proc)
    if BACKEND == "tensorflow":  # its counts would be each worker's own
        for rank in (0, 1):
            assert f"[rank {rank}] OUTSIDE_METRIC True" in proc.stdout
    else:  # a worker counting its own part alone would read 6.97 or 8.97
        rows = np.arange(256, dtype="float64").reshape(64, 4) / 64
        expected = np.abs(rows.sum(axis=1)).mean()  # 7.96875
        for rank in (0, 1):
            line = f"[rank {rank}] OUTSIDE_METRIC "
            found = [x for x in proc.stdout.splitlines() if x.startswith(line)]
            assert len(found) == 1, _failure(proc)
            value = float(found[0].split(line)[1])
            np.testing.assert_allclose(value, expected, rtol=1e-6)
            assert f"[rank {rank}] REFUSED True" in proc.stdout, _failure(proc)
            assert f"[rank {rank}] SHIFTED True" in proc.stdout, _failure(proc)


HUNG = KILLED.replace(
    "os.kill(os.getpid(), signal.SIGKILL)", "import time; time.sleep(3600)"
)


def test_hung_worker_stops_the_job(tmp_path):
    script = tmp_path / "hung.py"
    script.write_text(HUNG)
    env_timeout = {"KERAS_DIST_TIMEOUT": "30"}
    os.environ.update(env_timeout)
    try:
        proc, seconds = _launch(["--nproc-per-node", 2, script], tmp_path)
    finally:
        del os.environ["KERAS_DIST_TIMEOUT"]
    assert proc.returncode != 0
    assert "TRAINING DONE" not in proc.stdout
    assert "stopping the other workers" in proc.stderr
    # The hung worker's peers gave up after the liveness timeout (30 s),
    # not the 3600 s the worker sleeps.
    assert seconds < 240


def _run_tf_config_workers(script, args, envs, timeout=300):
    """Starts one process of `script` per entry of `envs` (extra variables),
    each with its own TF_CONFIG on free localhost ports, as a user starts
    workers by hand; returns the processes and their outputs."""
    from keras_dist._src.cluster.launcher import free_port

    workers = [f"127.0.0.1:{free_port()}" for _ in envs]
    procs = []
    for index, extra in enumerate(envs):
        env = dict(os.environ, OMP_NUM_THREADS="1")
        env.pop("KERAS_DIST_CPU_DEVICES", None)
        env.update(extra)
        env["TF_CONFIG"] = json.dumps(
            {
                "cluster": {"worker": workers},
                "task": {"type": "worker", "index": index},
            }
        )
        procs.append(
            subprocess.Popen(
                [sys.executable, str(script), *map(str, args)],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
        )
    try:
        outputs = [p.communicate(timeout=timeout)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    return procs, outputs


TUTORIAL = """
import json, os, sys
import numpy as np
import tensorflow as tf
import keras
import keras_dist

tf_config = json.loads(os.environ["TF_CONFIG"])
num_workers = len(tf_config["cluster"]["worker"])
strategy = keras_dist.MultiWorkerMirroredStrategy()
keras.utils.set_random_seed(strategy.worker_index)  # seeds differ
global_batch_size = 8 * num_workers
rng = np.random.default_rng(0)
x = rng.normal(size=(96, 6)).astype("float32")
y = rng.integers(0, 3, size=(96,))
dataset = tf.data.Dataset.from_tensor_slices((x, y)).repeat()
dataset = dataset.batch(global_batch_size)
with strategy.scope():
    model = keras.Sequential([
        keras.Input((6,)),
        keras.layers.Dense(8, activation="tanh"),
        keras.layers.Dense(3),
    ])
    init = np.load(sys.argv[1])
    model.set_weights([init[k] for k in init.files])
    model.compile(
        optimizer=keras.optimizers.SGD(0.1),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
    )
model.fit(dataset, epochs=2, steps_per_epoch=5, verbose=0)
np.savez(sys.argv[2] + f".{strategy.worker_index}.npz", *model.get_weights())
"""


@pytest.mark.skipif(BACKEND != "tensorflow", reason="TF_CONFIG tutorial")
def test_keras_multi_worker_tutorial_shape(tmp_path):
    """Workers started by hand, each with its own TF_CONFIG, as in the
    official Keras multi-worker tutorial (which fails with stock Keras 3:
    keras-team/keras#20585)."""
    import tensorflow as tf

    keras.utils.set_random_seed(3)
    model = keras.Sequential(
        [
            keras.Input((6,)),
            keras.layers.Dense(8, activation="tanh"),
            keras.layers.Dense(3),
        ]
    )
    np.savez(tmp_path / "init.npz", *model.get_weights())
    model.compile(
        optimizer=keras.optimizers.SGD(0.1),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    rng = np.random.default_rng(0)
    x = rng.normal(size=(96, 6)).astype("float32")
    y = rng.integers(0, 3, size=(96,))
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).repeat().batch(16)
    model.fit(dataset, epochs=2, steps_per_epoch=5, verbose=0)

    script = tmp_path / "tutorial.py"
    script.write_text(TUTORIAL)
    args = [tmp_path / "init.npz", tmp_path / "out"]
    procs, outputs = _run_tf_config_workers(script, args, [{}, {}])
    for p, out in zip(procs, outputs):
        assert p.returncode == 0, out[-3000:]
    for index in range(2):
        saved = np.load(tmp_path / f"out.{index}.npz")
        weights = [saved[k] for k in saved.files]
        assert max_relative_difference(model.get_weights(), weights) <= 1e-5


POLICIES = """
import json, os, sys
import numpy as np
import tensorflow as tf
import keras
import keras_dist

init_path, out, data_dir = sys.argv[1:4]
strategy = keras_dist.MultiWorkerMirroredStrategy()
rank = strategy.worker_index
files = sorted(os.path.join(data_dir, f) for f in os.listdir(data_dir))


def parse(line):
    v = tf.strings.to_number(tf.strings.split(line, ","))
    return v[:6], v[6:7]


for policy in ("off", "file"):
    strategy.extended.input_options = keras_dist.InputOptions(policy)
    with strategy.scope():
        model = keras.Sequential([keras.Input((6,)),
                                  keras.layers.Dense(8, activation="tanh"),
                                  keras.layers.Dense(1)])
        init = np.load(init_path)
        model.set_weights([init[k] for k in init.files])
        # Groups of 3 steps (Keras 3.16 stacks them on JAX), the last
        # group partial; the reference runs one step a call.
        model.compile(keras.optimizers.SGD(0.05, momentum=0.9), "mse",
                      metrics=["mae"], steps_per_execution=3)
    if policy == "off":
        local = np.load(os.path.join(data_dir, "..", f"off{rank}.npz"))
        kw = dict(x=local["x"], y=local["y"], batch_size=16)
    else:
        names = tf.data.Dataset.from_tensor_slices(files)
        kw = dict(x=names.interleave(tf.data.TextLineDataset, cycle_length=1)
                  .map(parse).batch(8))
    history = model.fit(epochs=3, verbose=0, shuffle=False, **kw)
    evaluation = model.evaluate(verbose=0, **kw)
    if strategy.is_chief:
        np.savez(f"{out}.{policy}.npz", *model.get_weights())
        with open(f"{out}.{policy}.json", "w") as f:
            json.dump({"history": history.history, "evaluate": evaluation}, f)
"""


def _global_batches(parts, local):
    """Step k's global batch: each worker's k-th local batch, worker order."""
    steps = max(-(-len(y) // local) for _, y in parts)
    return [
        tuple(
            np.concatenate([p[i][k * local : (k + 1) * local] for p in parts])
            for i in (0, 1)
        )
        for k in range(steps)
    ]


def _policy_shares(tmp_path, data_dir):
    """Each worker's share under OFF (arrays of 50 and 23 samples, batched
    with 8 of the global 16) and FILE (files of 9, 20, 14 and 6 rows split
    by file, batched with 4 of the dataset's 8)."""
    rng = np.random.default_rng(5)
    off = []
    for rank, count in enumerate((50, 23)):
        x = rng.normal(size=(count, 6)).astype("float32")
        y = x[:, :3].sum(1, keepdims=True) - x[:, 4:5]
        np.savez(tmp_path / f"off{rank}.npz", x=x, y=y)
        off.append((x, y))
    rows = []
    for i, count in enumerate((9, 20, 14, 6)):
        values = rng.normal(size=(count, 7)).round(3).astype("float32")
        values[:, 6] = values[:, :3].sum(1) - values[:, 4]
        lines = [",".join(f"{v:.3f}" for v in row) for row in values]
        (data_dir / f"part{i}.csv").write_text("\n".join(lines) + "\n")
        rows.append(values)
    files = [np.concatenate(rows[r::2]) for r in (0, 1)]  # auto_shard's split
    files = [(p[:, :6], p[:, 6:7]) for p in files]
    return {"off": (off, 8), "file": (files, 4)}


@pytest.mark.skipif(BACKEND == "torch", reason="tests/torch has torch's")
def test_file_and_off_policies_between_workers(tmp_path):
    """Workers with shares of different sizes train as one device does on
    the global batches the shares make, step by step (JAX and TF gather
    every worker's local batch; torch's own test is in tests/torch), with
    `steps_per_execution=3` and a partial group at each epoch's end."""
    data_dir = tmp_path / "data"
    data_dir.mkdir()
    shares = _policy_shares(tmp_path, data_dir)
    keras.utils.set_random_seed(11)
    model = keras.Sequential(
        [
            keras.Input((6,)),
            keras.layers.Dense(8, activation="tanh"),
            keras.layers.Dense(1),
        ]
    )
    np.savez(tmp_path / "init.npz", *model.get_weights())
    init = model.get_weights()

    script = tmp_path / "policies.py"
    script.write_text(POLICIES)
    out = tmp_path / "two"
    args = ["--nproc-per-node", 2, script, tmp_path / "init.npz", out]
    proc, _ = _launch([*args, data_dir], tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    for policy, (parts, local) in shares.items():
        model.set_weights(init)
        model.compile(
            keras.optimizers.SGD(0.05, momentum=0.9), "mse", metrics=["mae"]
        )
        batches = _Batches(_global_batches(parts, local))
        history = model.fit(batches, epochs=3, verbose=0, shuffle=False)
        expected = model.evaluate(batches, verbose=0)
        saved = np.load(f"{out}.{policy}.npz")
        weights = [saved[k] for k in saved.files]
        difference = max_relative_difference(model.get_weights(), weights)
        print(f"{BACKEND} {policy}: max relative {difference:.2e}")
        assert difference <= 1e-5, policy
        logs = json.loads(open(f"{out}.{policy}.json").read())
        for key, values in history.history.items():
            np.testing.assert_allclose(logs["history"][key], values, rtol=1e-5)
        np.testing.assert_allclose(logs["evaluate"], expected, rtol=1e-5)


class _Batches(keras.utils.PyDataset):
    def __init__(self, batches):
        super().__init__()
        self.batches = batches

    @property
    def num_batches(self):
        return len(self.batches)

    def __getitem__(self, i):
        return self.batches[i]


@pytest.mark.skipif(BACKEND != "tensorflow", reason="TF_CONFIG workers")
def test_workers_with_different_device_counts_are_refused(tmp_path):
    """tf.distribute counts this worker's devices times the worker count:
    workers with 2 and 1 simulated CPUs would disagree on the replicas."""
    script = tmp_path / "counts.py"
    script.write_text(
        "import keras_dist\nkeras_dist.MultiWorkerMirroredStrategy()\n"
    )
    procs, outputs = _run_tf_config_workers(
        script, [], [{"KERAS_DIST_CPU_DEVICES": str(n)} for n in (2, 1)]
    )
    for p, out in zip(procs, outputs):
        assert p.returncode != 0, out[-3000:]
        assert "the workers have [2, 1]" in out, out[-3000:]

"""Real multi-process tests of the torch backend (gloo on localhost).

Each test writes a training script to ``tmp_path`` and runs it with
``python script.py``: the strategy itself starts the other ranks; the
per-rank BatchNormalization and deferred-metrics scripts run in the shared
job of ``tests/torch/conftest.py`` instead. Runs only under
``KERAS_BACKEND=torch``.
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

keras = pytest.importorskip("keras")
if keras.backend.backend() != "torch":
    pytest.skip("needs KERAS_BACKEND=torch", allow_module_level=True)

from keras_dist._src.cluster import launcher, supervision  # noqa: E402
from keras_dist._src.core.shards import shard_bounds  # noqa: E402
from tests.utils import (  # noqa: E402
    MALLOC_PROBE,
    max_relative_difference,
    npz_max_relative_difference,
    register_torch_part,
    run_torch_script,
)

PRELUDE = """
import json, os, signal, sys
import numpy as np
import keras_dist, keras
"""

#: The parity model and data: run by the script and, for the one-device
#: reference, by plain Keras in the test process.
MODEL = """
rng = np.random.default_rng(0)
x = rng.normal(size=(83, 8, 8, 3)).astype("float32")
y = rng.integers(0, 4, size=(83,))


def build():
    inp = keras.Input((8, 8, 3))
    h = keras.layers.Conv2D(4, 3, padding="same", use_bias=False)(inp)
    h = keras.layers.BatchNormalization()(h)
    h = keras.layers.Activation("relu")(h)
    # Through keras_dist's channels-last path on the ranks, Keras's here.
    h = keras.layers.MaxPooling2D(2, strides=1)(h)
    h = keras.layers.Flatten()(h)
    h = keras.layers.Dense(16, activation="relu")(h)
    return keras.Model(inp, keras.layers.Dense(4)(h))


def compile_and_fit(model, out, rank):
    model.compile(
        optimizer=keras.optimizers.SGD(0.05, momentum=0.9),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
    )
    csv = keras.callbacks.CSVLogger(f"{out}.log{rank}.csv")
    # 83 samples / 16 = 6 steps per epoch (last one holds 3 samples: fewer
    # than 4 ranks, so one shard is empty); 4 epochs = 24 steps.
    history = model.fit(x, y, batch_size=16, epochs=4, shuffle=False,
                        verbose=2, callbacks=[csv])
    evaluation = model.evaluate(x, y, batch_size=3, verbose=0,
                                return_dict=True)
    prediction = model.predict(x, batch_size=3, verbose=0)
    np.savez(f"{out}.r{rank}.npz", *model.get_weights())
    np.save(f"{out}.pred{rank}.npy", prediction)
    with open(f"{out}.r{rank}.json", "w") as f:
        json.dump({"history": history.history, "evaluate": evaluation}, f)
"""

TRAIN = (
    MODEL
    + """
n, out = int(sys.argv[1]), sys.argv[2]
strategy = keras_dist.MirroredStrategy(devices=[f"cpu:{i}" for i in range(n)])
rank = int(os.environ.get("RANK", 0))
keras.utils.set_random_seed(100 + rank)   # ranks seeded differently
init_path = os.path.join(os.path.dirname(out), "init.npz")
with strategy.scope():
    model = build()
    lazy = keras.layers.Dense(3)
# Made in the scope (`lazy` in `run`'s): the chief's initial values.
strategy.run(lambda: lazy(np.ones((2, 5), "float32")))
np.savez(f"{out}.built{rank}.npz", *model.get_weights(), *lazy.get_weights())
with strategy.scope():
    if rank == 0:    # only the chief loads: the others must get a broadcast
        init = np.load(init_path)
        model.set_weights([init[f"arr_{i}"] for i in range(len(init.files))])
    compile_and_fit(model, out, rank)
"""
)

FAIL = """
mode, n = sys.argv[1], int(sys.argv[2])
strategy = keras_dist.MirroredStrategy(devices=[f"cpu:{i}" for i in range(n)])
rank = int(os.environ.get("RANK", 0))  # unset on rank 0 (the launcher)
with open(os.path.join(os.path.dirname(__file__), f"pid{rank}"), "w") as f:
    f.write(str(os.getpid()))


class Fail(keras.callbacks.Callback):
    def on_train_batch_begin(self, batch, logs=None):
        if rank == 1 and batch == 3:
            if mode == "raise":
                raise ValueError("boom at step 3")
            os.kill(os.getpid(), signal.SIGKILL)


with strategy.scope():
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
    model.compile("sgd", "mse")
model.fit(np.ones((64, 4)), np.ones((64,)), batch_size=4, epochs=100,
          verbose=0, callbacks=[Fail()])
"""


def _run(tmp_path, body, args, timeout=400, devices=None, env=None):
    env = dict(env or {})
    if devices:
        env["KERAS_DIST_CPU_DEVICES"] = str(devices)
    source = PRELUDE + textwrap.dedent(body)
    return run_torch_script(tmp_path, source, args, timeout, env)


# -- unit tests (no processes) -------------------------------------------------
def test_shard_bounds_match_array_split():
    for count in (0, 1, 3, 7, 16, 83):
        for world in (1, 2, 3, 4):
            expected = np.array_split(np.arange(count), world)
            for rank in range(world):
                start, stop = shard_bounds(count, rank, world)
                np.testing.assert_array_equal(
                    np.arange(count)[start:stop], expected[rank]
                )


def test_launcher_helpers():
    port = launcher.free_port()
    assert 0 < port < 65536
    env = launcher.child_env(2, 4, port)
    assert env["RANK"] == "2" and env["WORLD_SIZE"] == "4"
    assert env["MASTER_ADDR"] == "127.0.0.1"
    assert env["MASTER_PORT"] == str(port)
    assert supervision.describe_exit(-9) == "was killed by SIGKILL"
    with pytest.raises(RuntimeError, match="torchrun"):
        launcher.relaunch_command()  # pytest cannot be re-run


# -- real processes ------------------------------------------------------------
@pytest.mark.multi_process
@pytest.mark.slow
def test_parity_with_one_device(tmp_path, monkeypatch):
    # The reference: plain Keras on one device, in this process, from the
    # initial weights the ranks' chief loads.
    monkeypatch.chdir(tmp_path)
    plain = {"np": np, "json": json, "keras": keras}
    exec(textwrap.dedent(MODEL), plain)
    keras.utils.set_random_seed(100)
    model = plain["build"]()
    np.savez(tmp_path / "init.npz", *model.get_weights())
    plain["compile_and_fit"](model, str(tmp_path / "one"), 0)
    reference = np.load(tmp_path / "one.r0.npz")
    ref_logs = json.loads((tmp_path / "one.r0.json").read_text())
    ref_pred = np.load(tmp_path / "one.pred0.npy")
    differences = {}
    # 4 ranks (the last batch of 3 leaves one rank's part empty); 2 ranks
    # are test_torch_parity_fast.py's.
    n = 4
    proc, _ = _run(tmp_path, TRAIN, [n, tmp_path / f"n{n}"], devices=n)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.count("Epoch 1/4") == 1  # only rank 0 prints
    for rank in range(n):
        weights = np.load(tmp_path / f"n{n}.r{rank}.npz")
        diff = npz_max_relative_difference(reference, weights)
        differences[(n, rank)] = diff
        assert diff <= 1e-5, (n, rank, diff)
        logs = json.loads((tmp_path / f"n{n}.r{rank}.json").read_text())
        for key, values in ref_logs["history"].items():
            np.testing.assert_allclose(logs["history"][key], values, rtol=1e-5)
        for key, value in ref_logs["evaluate"].items():
            np.testing.assert_allclose(logs["evaluate"][key], value, rtol=1e-5)
        prediction = np.load(tmp_path / f"n{n}.pred{rank}.npy")
        assert prediction.shape == ref_pred.shape
        np.testing.assert_allclose(prediction, ref_pred, atol=1e-5)
        csv = tmp_path / f"n{n}.log{rank}.csv"
        assert csv.exists() == (rank == 0), csv
    for name in ("r", "built"):
        first = np.load(tmp_path / f"n{n}.{name}0.npz")
        for rank in range(1, n):
            other = np.load(tmp_path / f"n{n}.{name}{rank}.npz")
            assert npz_max_relative_difference(first, other) == 0.0, name
    print("max relative weight difference:", differences)


def _check_failure(tmp_path, mode, n):
    # A liveness timeout of 400 s: a rank that hung until it instead of
    # failing fast would take more than 400 s; start-up alone took 65 s on
    # a loaded 2-core machine, so 240 s leaves room for a busy CI.
    proc, elapsed = _run(
        tmp_path,
        FAIL,
        [mode, n],
        devices=n,
        timeout=480,
        env={"KERAS_DIST_TIMEOUT": "400"},
    )
    assert proc.returncode != 0
    assert elapsed < 240, elapsed
    assert "rank 1" in proc.stderr, proc.stderr[-3000:]
    if mode == "raise":
        assert "boom at step 3" in proc.stderr
    else:
        assert "SIGKILL" in proc.stderr
    time.sleep(2)
    for rank in range(n):
        pid = int((tmp_path / f"pid{rank}").read_text())
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            continue
        with open(f"/proc/{pid}/stat") as f:  # a zombie is gone too
            assert f.read().split()[2] == "Z", f"rank {rank} left running"


@pytest.mark.multi_process
@pytest.mark.slow
def test_failures_stop_every_rank(tmp_path):
    _check_failure(tmp_path, "raise", 4)
    _check_failure(tmp_path, "kill", 2)


PER_RANK_BN = """
out = sys.argv[1]
strategy = keras_dist.MirroredStrategy(
    devices=["cpu:0", "cpu:1"], sync_batch_norm=False)
rank = int(os.environ.get("RANK", 0))  # unset on rank 0 (the launcher)
keras.utils.set_random_seed(7 + rank)
rng = np.random.default_rng(0)
x = rng.normal(size=(64, 8, 8, 1)).astype("float32")
x[32:] = 3 * x[32:] + 1   # the two shards differ: their statistics too
y = rng.integers(0, 3, size=(64,))
with strategy.scope():
    inp = keras.Input((8, 8, 1))
    conv = keras.layers.Conv2D(4, 3, activation="tanh")
    bn = keras.layers.BatchNormalization(momentum=0.0)
    h = keras.layers.Flatten()(bn(conv(inp)))
    model = keras.Model(inp, keras.layers.Dense(3)(h))
    model.compile("sgd", keras.losses.SparseCategoricalCrossentropy(
        from_logits=True))
features = keras.ops.convert_to_numpy(conv(x))  # rank 0's weights, broadcast
shards = np.array_split(features, 2)
expected = np.mean([s.var(axis=(0, 1, 2)) for s in shards], axis=0)
# The step's reference: plain Keras (a clone outside the scope, the same
# weights) on each shard with its own BatchNorm moments, the gradients
# averaged, one SGD step (learning rate 0.01).
import torch
reference = keras.models.clone_model(model)
reference.set_weights(model.get_weights())
loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
grads = []
for xs, ys in zip(np.array_split(x, 2), np.array_split(y, 2)):
    loss = loss_fn(ys, reference(xs, training=True))
    grads.append(torch.autograd.grad(
        loss, [v.value for v in reference.trainable_weights]))
stepped = [keras.ops.convert_to_numpy(v) - 0.01 * np.mean(
    [keras.ops.convert_to_numpy(g[i]) for g in grads], axis=0)
    for i, v in enumerate(reference.trainable_weights)]
model.fit(x, y, batch_size=64, epochs=1, shuffle=False, verbose=0)
with open(f"{out}.r{rank}.json", "w") as f:
    json.dump({"expected": expected.tolist(),
               "global": features.var(axis=(0, 1, 2)).tolist(),
               "moving": np.asarray(bn.moving_variance).tolist(),
               "stepped": [w.tolist() for w in stepped],
               "weights": [keras.ops.convert_to_numpy(v).tolist()
                           for v in model.trainable_weights]}, f)
"""


PER_RANK_BN_PART = register_torch_part("per_rank_bn", PRELUDE + PER_RANK_BN)


@pytest.mark.multi_process
@pytest.mark.slow
@pytest.mark.torch_part(PER_RANK_BN_PART)
def test_per_rank_batch_norm_statistics(torch_parts):
    out = torch_parts.output(PER_RANK_BN_PART)
    results = [
        json.loads(pathlib.Path(f"{out}.r{rank}.json").read_text())
        for rank in range(2)
    ]
    for result in results:
        np.testing.assert_allclose(
            result["moving"], result["expected"], rtol=1e-4
        )
        assert not np.allclose(result["moving"], result["global"], rtol=1e-3)
        # The step: each rank's own moments, gradients averaged (DDP).
        for got, want in zip(result["weights"], result["stepped"]):
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    assert results[0]["moving"] == results[1]["moving"]
    assert results[0]["weights"] == results[1]["weights"]


#: mixed_float16 with a loss scale (2**18) under which one device's
#: float16 gradients hold at batch 16 but overflow at batch 8 (measured):
#: each rank's half batch must overflow only where one device's does.
MIXED_MODEL = """
def mixed_model():
    keras.utils.set_random_seed(4)
    model = keras.Sequential([
        keras.Input((6,)), keras.layers.Dense(8, activation="relu"),
        keras.layers.Dense(4),
        keras.layers.Activation("softmax", dtype="float32")])
    model.compile(keras.optimizers.LossScaleOptimizer(
        keras.optimizers.SGD(0.1), initial_scale=262144.0),
        "sparse_categorical_crossentropy")
    return model


mx = np.random.default_rng(1).normal(size=(32, 6)).astype("float32")
my = np.random.default_rng(2).integers(0, 4, 32)
"""

MIXED = """
out = sys.argv[1]
strategy = keras_dist.MirroredStrategy(devices=["cpu:0", "cpu:1"])
keras.mixed_precision.set_global_policy("mixed_float16")
try:
    with strategy.scope():
        model = mixed_model()
    init = [w.tolist() for w in model.get_weights()]
    model.fit(mx, my, batch_size=16, epochs=2, shuffle=False, verbose=0)
    optimizer = model.optimizer
    result = {"init": init,
              "weights": [w.tolist() for w in model.get_weights()],
              "scale": float(optimizer.dynamic_scale),
              "steps": int(optimizer.inner_optimizer.iterations)}
finally:
    keras.mixed_precision.set_global_policy("float32")
with open(f"{out}.r{strategy.worker_index}.json", "w") as f:
    json.dump(result, f)
"""

MIXED_PART = register_torch_part("mixed", PRELUDE + MIXED_MODEL + MIXED)


@pytest.mark.multi_process
@pytest.mark.slow
@pytest.mark.torch_part(MIXED_PART)
def test_mixed_float16_loss_scale_as_one_device(torch_parts):
    got = json.loads(
        pathlib.Path(f"{torch_parts.output(MIXED_PART)}.r0.json").read_text()
    )
    namespace = {"keras": keras, "np": np}
    exec(MIXED_MODEL, namespace)
    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        model = namespace["mixed_model"]()
        model.set_weights([np.asarray(w, "float32") for w in got["init"]])
        model.fit(
            namespace["mx"], namespace["my"], batch_size=16, epochs=2,
            shuffle=False, verbose=0,
        )  # fmt: skip
        optimizer = model.optimizer
        # One device skips no step and keeps its scale: so must the ranks.
        assert int(optimizer.inner_optimizer.iterations) == 4
        assert got["steps"] == 4 and got["scale"] == 262144.0, got
        want = model.get_weights()
    finally:
        keras.mixed_precision.set_global_policy("float32")
    have = [np.asarray(w, "float32") for w in got["weights"]]
    assert max_relative_difference(want, have) <= 1e-3


CPU_ALLOCATOR = """
out = sys.argv[1]
strategy = keras_dist.MirroredStrategy(devices=["cpu:0", "cpu:1"])
with open(f"{out}.r{strategy.worker_index}.json", "w") as f:
    json.dump({"faults": faults_per_round()}, f)
"""

CPU_ALLOCATOR_PART = register_torch_part(
    "cpu_allocator", PRELUDE + MALLOC_PROBE + CPU_ALLOCATOR
)


@pytest.mark.multi_process
@pytest.mark.slow
@pytest.mark.torch_part(CPU_ALLOCATOR_PART)
def test_cpu_ranks_keep_freed_memory(torch_parts):
    # Every rank of the job (the one the script runs in and the one it
    # starts) keeps what it frees: glibc as it comes faults the 12,288
    # pages of the probe's blocks in again every round
    # (tests/test_cluster.py's probe shows both).
    out = torch_parts.output(CPU_ALLOCATOR_PART)
    for rank in range(2):
        faults = json.loads(pathlib.Path(f"{out}.r{rank}.json").read_text())
        assert faults["faults"] < 100, (rank, faults)


@pytest.mark.multi_process
@pytest.mark.slow
def test_clean_exit_while_watchdog_polls(tmp_path):
    # Polling every 0.5 ms keeps the watchdog thread inside a TCPStore call
    # most of the time. Without the exit handler that joins it, the
    # interpreter's finalization ended that thread inside the binding and
    # a rank aborted ("terminate called without an active exception") in 4
    # of 4 runs; it is the exit-time flake once seen in CI.
    body = """
    strategy = keras_dist.MirroredStrategy(devices=["cpu:0", "cpu:1"])
    with strategy.scope():
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
        model.compile("sgd", "mse")
    model.fit(np.ones((32, 4)), np.ones((32,)), batch_size=8, verbose=0)
    """
    proc, _ = _run(
        tmp_path,
        body,
        [],
        timeout=300,
        env={"KERAS_DIST_POLL_SECONDS": "0.0005"},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "terminate called" not in proc.stderr


DEFERRED_METRICS = """
from keras_dist._src.backends.torch import metrics_sync as torch_steps

out = sys.argv[1]
strategy = keras_dist.MirroredStrategy(devices=["cpu:0", "cpu:1"])
rank = int(os.environ.get("RANK", 0))  # unset on rank 0 (the launcher)
syncs = []
original = torch_steps.all_reduce_metric_deltas


def counted(*args):
    syncs.append(1)
    return original(*args)


torch_steps.all_reduce_metric_deltas = counted
rng = np.random.default_rng(0)
x = rng.normal(size=(60, 5)).astype("float32")
y = (x @ rng.normal(size=(5, 1))).astype("float32")


class Seen(keras.callbacks.Callback):
    def __init__(self):
        super().__init__()
        self.losses = []

    def on_train_batch_end(self, batch, logs=None):
        self.losses.append(logs["loss"])


def train(deferred):
    with strategy.scope():
        keras.utils.set_random_seed(0)
        model = keras.Sequential([keras.Input((5,)), keras.layers.Dense(1)])
        model.compile("sgd", "mse", metrics=["mae"])
    seen = Seen()
    syncs.clear()
    # 60 samples / 8 = 8 steps per epoch, the last one uneven.
    history = model.fit(
        x, y, batch_size=8, epochs=3, shuffle=False,
        validation_data=(x[:20], y[:20]),
        verbose=0 if deferred else 2, callbacks=[] if deferred else [seen])
    evaluation = model.evaluate(x, y, batch_size=8, verbose=0,
                                return_dict=True)
    return {"history": history.history, "evaluate": evaluation,
            "syncs": len(syncs), "seen": seen.losses}


with open(f"{out}.r{rank}.json", "w") as f:
    json.dump({"deferred": train(True), "per_step": train(False)}, f)
"""


DEFERRED_PART = register_torch_part(
    "deferred_metrics", PRELUDE + DEFERRED_METRICS
)


@pytest.mark.multi_process
@pytest.mark.slow
@pytest.mark.torch_part(DEFERRED_PART)
def test_metric_sync_deferred_until_read(torch_parts):
    out = torch_parts.output(DEFERRED_PART)
    ranks = [
        json.loads(pathlib.Path(f"{out}.r{r}.json").read_text()) for r in (0, 1)
    ]
    deferred, per_step = ranks[0]["deferred"], ranks[0]["per_step"]
    # Nothing reads per-step values: one all-reduce per epoch (training and
    # validation) and one for `evaluate`, instead of one per step.
    assert deferred["syncs"] == 3 * 2 + 1
    assert per_step["syncs"] >= 3 * 8
    for key in ("history", "evaluate"):
        for name, values in per_step[key].items():
            np.testing.assert_allclose(
                deferred[key][name], values, rtol=1e-6, err_msg=name
            )
    # Every rank holds the same values, per step too.
    for mode in ("deferred", "per_step"):
        for key in ("history", "evaluate", "seen"):
            assert ranks[1][mode][key] == ranks[0][mode][key], (mode, key)
    assert len(per_step["seen"]) == 3 * 8


JOIN = """
out = sys.argv[1]
strategy = keras_dist.MirroredStrategy(devices=["cpu:0", "cpu:1"])
from keras_dist._src.backends.torch import job as torch_job

rank = strategy.worker_index   # read from the launcher's variables
keras.utils.set_random_seed(rank)   # the broadcast makes the ranks agree
with strategy.scope():
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
    model.compile("sgd", "mse")
rng = np.random.default_rng(0)
model.fit(rng.normal(size=(40, 4)), rng.normal(size=(40,)), batch_size=8,
          verbose=0)
with open(f"{out}.r{rank}.json", "w") as f:
    json.dump({"replicas": strategy.num_replicas_in_sync,
               "launched": len(torch_job._job.children),
               "weights": [w.tolist() for w in model.get_weights()]}, f)
# Every rank saves, the chief writes; it may end its program before rank 1
# reads the outcome from the store that rank 0's process may host (rank 1
# sleeps for sys.argv[2] s, longer than rank 0 takes to exit).
if rank and len(sys.argv) > 2:
    import time; time.sleep(float(sys.argv[2]))
model.save_weights(f"{out}.weights.h5")
"""

#: The same script in the processes of `torch.multiprocessing.spawn`, with
#: the process group started by the program (rank 0 hosts its store).
SPAWN = """
import os, socket, sys


def main(rank, port, out):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                      RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2")
    import torch.distributed as dist
    dist.init_process_group("gloo", rank=rank, world_size=2)
    sys.argv = [sys.argv[0], out, "4"]
    with open(os.path.join(os.path.dirname(__file__), "join.py")) as f:
        exec(f.read(), {"__name__": "__main__"})


if __name__ == "__main__":
    import torch.multiprocessing as mp
    probe = socket.socket()
    probe.bind(("127.0.0.1", 0))
    port = probe.getsockname()[1]
    probe.close()
    mp.spawn(main, args=(port, sys.argv[1]), nprocs=2)
"""


def _check_joined(tmp_path, prefix):
    results = [
        json.loads((tmp_path / f"{prefix}.r{r}.json").read_text())
        for r in (0, 1)
    ]
    assert not list(tmp_path.glob(f"{prefix}.r2.json"))
    for result in results:
        assert result["replicas"] == 2
        assert result["launched"] == 0  # joined: started no process
    assert results[0]["weights"] == results[1]["weights"]
    assert (tmp_path / f"{prefix}.weights.h5").is_file()


@pytest.mark.multi_process
@pytest.mark.slow
def test_joins_torchrun_slurm_and_spawned_jobs(tmp_path):
    script = tmp_path / "join.py"
    script.write_text(PRELUDE + textwrap.dedent(JOIN))
    (tmp_path / "spawn.py").write_text(SPAWN)
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")
        and not k.startswith(("MASTER_", "SLURM_", "TORCHELASTIC_"))
    }
    env.update(KERAS_BACKEND="torch", OMP_NUM_THREADS="1")
    torchrun = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone",
         "--nproc_per_node=2", str(script), str(tmp_path / "torchrun")],
        env=env, capture_output=True, text=True, timeout=400,
    )  # fmt: skip
    assert torchrun.returncode == 0, torchrun.stderr[-3000:]
    _check_joined(tmp_path, "torchrun")
    # Two tasks of an srun step, as SLURM starts them (with a free port).
    slurm = {
        "SLURM_JOB_ID": "4242",
        "SLURM_STEP_NODELIST": "127.0.0.1",
        "SLURM_NTASKS": "2",
        "MASTER_PORT": str(launcher.free_port()),
    }
    logs = [open(tmp_path / f"slurm{r}.log", "w+") for r in (0, 1)]
    tasks = [
        subprocess.Popen(
            [sys.executable, str(script), str(tmp_path / "slurm"), "4"],
            env=dict(env, SLURM_PROCID=str(r), SLURM_LOCALID=str(r), **slurm),
            stdout=logs[r],
            stderr=subprocess.STDOUT,
        )
        for r in (0, 1)
    ]
    for task, log in zip(tasks, logs):
        task.wait(timeout=400)
        log.seek(0)
        assert task.returncode == 0, log.read()[-3000:]
        log.close()
    _check_joined(tmp_path, "slurm")
    # A process group the program starts, under torch.multiprocessing.spawn:
    # rank 1's last read of the store failed once rank 0 had exited.
    spawned = subprocess.run(
        [sys.executable, str(tmp_path / "spawn.py"), str(tmp_path / "spawn")],
        env=env, capture_output=True, text=True, timeout=400,
    )  # fmt: skip
    assert spawned.returncode == 0, spawned.stderr[-3000:]
    _check_joined(tmp_path, "spawn")


def test_which_calls_read_metric_values_every_step(tmp_path):
    from keras_dist._src.backends.torch.metrics_sync import reads_batch_logs

    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    callback_list = keras.callbacks.CallbackList

    class BatchHook(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            pass

    def fit_progress():
        return [keras.callbacks.History(), keras.callbacks.ProgbarLogger()]

    epoch_only = [
        keras.callbacks.CSVLogger(str(tmp_path / "log.csv")),
        keras.callbacks.EarlyStopping(),
    ]
    cases = [
        ("fit", {"verbose": 0}, False),
        ("fit", {"verbose": 2}, False),
        ("fit", {}, True),  # "auto": a progress bar updated every step
        ("fit", {"verbose": 0, "callbacks": [BatchHook()]}, True),
        ("fit", {"verbose": 0, "callbacks": epoch_only}, False),
        # fit's validation: fit's progress bar ignores evaluation steps.
        (
            "evaluate",
            {
                "callbacks": callback_list(fit_progress()),
                "_use_cached_eval_dataset": True,
            },
            False,
        ),
        ("evaluate", {"callbacks": callback_list(fit_progress())}, True),
        ("evaluate", {"verbose": 0}, False),
        ("predict", {"verbose": 0}, True),
    ]
    for name, kwargs, expected in cases:
        method = getattr(model, name)
        assert reads_batch_logs(name, method, (), kwargs) is expected, (
            name,
            kwargs,
        )


@pytest.mark.slow  # one fresh process importing torch and Keras: ~7 s
def test_script_from_stdin_fails_at_once_with_what_to_do(tmp_path):
    # It hung 120 s and ended in a raw DistStoreError: the relaunched ranks
    # read an exhausted stdin and never joined.
    script = "import keras_dist\nkeras_dist.MirroredStrategy()\n"
    env = {k: v for k, v in os.environ.items() if k != "KERAS_DIST_NO_LAUNCH"}
    env.update(KERAS_BACKEND="torch", KERAS_DIST_CPU_DEVICES="2")
    start = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-"],
        input=script,
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=100,  # a hang guard; the error comes after the imports
    )
    seconds = time.monotonic() - start
    assert proc.returncode == 1, proc.stderr[-3000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith(
        "RuntimeError: keras_dist would start one process per device by "
        "re-running this program, but it was read from standard input"
    ), proc.stderr[-3000:]
    assert "DistStoreError" not in proc.stderr
    assert seconds < 60, f"took {seconds:.0f} s"


#: Output from the chief only, on 2 ranks: each rank writes what on_chief
#: returned; the marks are counted in the job's output.
CHIEF_OUTPUT = """
out = sys.argv[1]
rank = int(os.environ.get("RANK", "0"))
strategy = keras_dist.MirroredStrategy(["cpu:0", "cpu:1"])
keras_dist.print("MARK-PRINT")
strategy.print("MARK-STRATEGY-PRINT")


@keras_dist.on_chief
def chief_value():
    return 42


with strategy.scope():
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
    model.compile(optimizer="sgd", loss="mse")
x = np.ones((12, 3), "float32")  # the same on every rank
model.fit(x, x[:, :1], batch_size=6, epochs=1, verbose=0)
rows = strategy.describe(model)
with open(os.path.join(out, f"r{rank}.json"), "w") as f:
    json.dump({"value": chief_value(), "rows": len(rows)}, f)
"""

CHIEF_OUTPUT_PART = register_torch_part("chief_output", PRELUDE + CHIEF_OUTPUT)


@pytest.mark.multi_process
@pytest.mark.slow
@pytest.mark.torch_part(CHIEF_OUTPUT_PART)
def test_print_describe_and_the_start_line_come_once(torch_parts):
    # Every print appeared once per rank (the describe table twice).
    out = torch_parts.output(CHIEF_OUTPUT_PART)
    results = [
        json.loads((out / f"r{rank}.json").read_text()) for rank in range(2)
    ]
    assert [r["value"] for r in results] == [42, None]
    assert results[0]["rows"] == results[1]["rows"] > 0  # data everywhere
    output = torch_parts.proc.stdout
    assert output.count("MARK-PRINT\n") == 1
    assert output.count("MARK-STRATEGY-PRINT\n") == 1
    assert output.count("mesh: every variable is whole on each of") == 1
    assert output.count("total bytes per device:") == 1
    assert (
        torch_parts.proc.stderr.count(
            "keras_dist: MirroredStrategy on torch: 2 replicas, 2 processes "
            "x 1 device (cpu:0 cpu:1), no mesh (every variable whole on each "
            "replica); fit: per-replica batch 3 (global 6)\n"
        )
        == 1
    )

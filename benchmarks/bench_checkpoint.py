"""Checkpoint save, asynchronous-save stall and restore times.

A dense model of about 50 M parameters (``--width``), trained with Adam,
so a checkpoint holds ~150 M float32 values (variables, two Adam slots):
~0.6 GB. Measured, each ``--repeats`` times:

* ``sync_save``: `CheckpointManager.save` with ``async_save=False`` (copy
  to host, write, fsync, checksum, rename), the time the caller waits;
* ``async_blocked``: the same with ``async_save=True``: the time the
  training thread is blocked (the copy to host memory);
* ``async_write``: the background write of that save, from start to end;
* ``step`` and ``step_during_write``: the training step time alone and
  while the background write runs (the write, at a lower CPU priority,
  still competes for memory bandwidth and, on a small machine, for cores);
  ``slowdown_during_write`` is their ratio minus one;
* ``restore``: `CheckpointManager.restore` (verify the SHA-256, load,
  assign).

The stall of an asynchronous save is ``async_blocked``, the time the
training thread waits; the target is ``async_blocked <= 0.10 * sync_save``.
Run::

    KERAS_BACKEND=jax python benchmarks/bench_checkpoint.py \\
        [--dir /tmp/bench_ckpt] [--repeats 3] [--width 4096]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time

import keras
import numpy as np

from keras_dist.checkpoint import CheckpointManager


def build(width: int):
    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [
            keras.Input((width // 2,)),
            keras.layers.Dense(width, activation="relu"),
            keras.layers.Dense(width, activation="relu"),
            keras.layers.Dense(width, activation="relu"),
            keras.layers.Dense(width // 2),
        ]
    )
    model.compile(optimizer="adam", loss="mse")
    return model


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dir", default=None)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--width", type=int, default=4096)
    parser.add_argument("--batch", type=int, default=8)
    args = parser.parse_args()
    root = args.dir or tempfile.mkdtemp(prefix="bench_ckpt_")
    shutil.rmtree(root, ignore_errors=True)

    model = build(args.width)
    x = (
        np.random.default_rng(0)
        .normal(size=(args.batch, args.width // 2))
        .astype("float32")
    )
    y = x.copy()
    model.train_on_batch(x, y)  # compile and create the optimizer's slots
    params = model.count_params()
    values = params + sum(
        int(np.prod(v.shape)) for v in model.optimizer.variables
    )

    def step():
        start = time.perf_counter()
        model.train_on_batch(x, y)
        keras.ops.convert_to_numpy(model.trainable_variables[0][0, 0])
        return time.perf_counter() - start

    results = {
        k: []
        for k in (
            "sync_save",
            "async_blocked",
            "async_write",
            "step",
            "step_during_write",
            "slowdown_during_write",
            "restore",
        )
    }
    sync = CheckpointManager(os.path.join(root, "sync"), keep=1)
    asyn = CheckpointManager(
        os.path.join(root, "async"), keep=1, async_save=True
    )
    for repeat in range(args.repeats):
        step_base = statistics.median(step() for _ in range(5))
        start = time.perf_counter()
        sync.save(model, repeat)
        results["sync_save"].append(time.perf_counter() - start)

        asyn.save(model, repeat)
        blocked = asyn.last_save_seconds
        during = []
        while asyn.in_flight:
            during.append(step())
        asyn.wait()
        results["async_blocked"].append(blocked)
        results["async_write"].append(asyn.last_write_seconds)
        results["step"].append(step_base)
        slow = statistics.median(during) if during else step_base
        results["step_during_write"].append(slow)
        results["slowdown_during_write"].append(slow / step_base - 1.0)

        start = time.perf_counter()
        sync.restore(model)
        results["restore"].append(time.perf_counter() - start)

    size = sum(
        os.path.getsize(os.path.join(dirpath, name))
        for dirpath, _, names in os.walk(os.path.join(root, "sync"))
        for name in names
    )
    print(
        f"backend={keras.backend.backend()} parameters={params / 1e6:.1f}M "
        f"checkpoint_values={values / 1e6:.1f}M size={size / 1e9:.2f}GB "
        f"dir={root}"
    )
    for name, samples in results.items():
        unit = "" if name.startswith("slowdown") else " s"
        print(
            f"{name:>21}: median {statistics.median(samples):7.3f}{unit}  "
            f"(min {min(samples):.3f}, max {max(samples):.3f})"
        )
    ratio = statistics.median(results["async_blocked"]) / statistics.median(
        results["sync_save"]
    )
    print(f"stall (async_blocked) / sync_save = {ratio:.3f} (target <= 0.10)")
    shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()

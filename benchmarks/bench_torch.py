"""Step time of keras_dist on torch (2 gloo processes) against baselines.

Compares, on the same Conv2D + BatchNormalization + Dense model and data:

* ``keras_dist``: `MirroredStrategy` over 2 CPU processes (gloo), global
  batch ``2 * B``;
* ``keras``: Keras on torch in one process with batch ``B`` (the same
  per-process batch): the target is keras_dist / keras <= 1.10;
* ``keras_x2``: two of those one-process Keras fits at the same time, so
  that both cores are busy as they are with keras_dist's two ranks: on a
  2-core machine the one-process baseline has a core to spare, which the
  two ranks do not;
* ``ddp``: a hand-written PyTorch loop with `DistributedDataParallel` over
  2 gloo processes, batch ``B`` per process (torch's `SyncBatchNorm` only
  runs on GPUs, so on a CPU this baseline uses per-process BatchNorm and
  does less communication than keras_dist).

Every process uses one thread (``OMP_NUM_THREADS=1``). Run::

    KERAS_BACKEND=torch [BENCH_BATCH=64] [BENCH_SYNC_BN=0] \
        python benchmarks/bench_torch.py [--steps 40]

``BENCH_SYNC_BN=0`` gives keras_dist per-process BatchNormalization, like
the DDP baseline.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import time

import numpy as np

BATCH = int(os.environ.get("BENCH_BATCH", "64"))
WARMUP = 5


def _data(samples):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(samples, 32, 32, 3)).astype("float32")
    y = rng.integers(0, 10, size=(samples,))
    return x, y


def _keras_model():
    import keras

    inp = keras.Input((32, 32, 3))
    h = inp
    for filters in (16, 32):
        h = keras.layers.Conv2D(filters, 3, padding="same", use_bias=False)(h)
        h = keras.layers.BatchNormalization()(h)
        h = keras.layers.Activation("relu")(h)
    h = keras.layers.Flatten()(h)
    h = keras.layers.Dense(64, activation="relu")(h)
    return keras.Model(inp, keras.layers.Dense(10)(h))


def _time_keras_fit(model, x, y, batch, steps):
    import keras

    model.compile(
        optimizer=keras.optimizers.SGD(0.01),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )

    def fit(steps_per_epoch):
        model.fit(
            x,
            y,
            batch_size=batch,
            epochs=1,
            steps_per_epoch=steps_per_epoch,
            shuffle=False,
            verbose=0,
        )

    fit(WARMUP)
    start = time.perf_counter()
    fit(steps)
    return (time.perf_counter() - start) / steps


def run_keras(steps):
    """Keras on torch, one process, batch `BATCH`."""
    x, y = _data(BATCH * (steps + WARMUP))
    return _time_keras_fit(_keras_model(), x, y, BATCH, steps)


def run_keras_dist(steps):
    """keras_dist MirroredStrategy over 2 gloo processes."""
    import keras_dist

    strategy = keras_dist.MirroredStrategy(
        devices=["cpu:0", "cpu:1"],
        sync_batch_norm=os.environ.get("BENCH_SYNC_BN", "1") == "1",
    )
    x, y = _data(2 * BATCH * (steps + WARMUP))
    with strategy.scope():
        model = _keras_model()
        seconds = _time_keras_fit(model, x, y, 2 * BATCH, steps)
    if int(os.environ.get("RANK", "0")) != 0:
        return None
    return seconds


def run_ddp(steps):
    """Hand-written torch DDP over 2 gloo processes."""
    import torch
    import torch.distributed as dist
    from torch import nn

    from keras_dist._src import launch

    if launch.env_rank() is None:
        port = launch.free_port()
        children = launch.start_workers(2, port)
        os.environ.update(
            RANK="0",
            WORLD_SIZE="2",
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
        )
    else:
        children = {}
    rank = int(os.environ["RANK"])
    dist.init_process_group("gloo", rank=rank, world_size=2)
    model = nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1, bias=False),
        nn.BatchNorm2d(16),
        nn.ReLU(),
        nn.Conv2d(16, 32, 3, padding=1, bias=False),
        nn.BatchNorm2d(32),
        nn.ReLU(),
        nn.Flatten(),
        nn.Linear(32 * 32 * 32, 64),
        nn.ReLU(),
        nn.Linear(64, 10),
    )
    if torch.cuda.is_available():  # SyncBatchNorm is GPU-only in torch.
        model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
    ddp = nn.parallel.DistributedDataParallel(model)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.01)
    loss_fn = nn.CrossEntropyLoss()
    x, y = _data(2 * BATCH * (steps + WARMUP))
    x = torch.as_tensor(x).permute(0, 3, 1, 2).contiguous()
    y = torch.as_tensor(y)

    def step(i):
        lo = (2 * i + rank) * BATCH
        optimizer.zero_grad()
        loss = loss_fn(ddp(x[lo : lo + BATCH]), y[lo : lo + BATCH])
        loss.backward()
        optimizer.step()

    for i in range(WARMUP):
        step(i)
    dist.barrier()
    start = time.perf_counter()
    for i in range(WARMUP, WARMUP + steps):
        step(i)
    dist.barrier()
    seconds = (time.perf_counter() - start) / steps
    dist.destroy_process_group()
    for proc in children.values():
        proc.wait()
    return seconds if rank == 0 else None


MODES = {"keras": run_keras, "keras_dist": run_keras_dist, "ddp": run_ddp}


def _start(mode, steps):
    env = dict(os.environ, KERAS_BACKEND="torch", OMP_NUM_THREADS="1")
    return subprocess.Popen(
        [sys.executable, __file__, "--mode", mode, "--steps", str(steps)],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _result(mode, proc):
    stdout, stderr = proc.communicate(timeout=900)
    match = re.search(r"STEP_SECONDS ([0-9.e-]+)", stdout)
    if proc.returncode != 0 or not match:
        raise RuntimeError(f"{mode} failed:\n{stderr[-3000:]}")
    return float(match.group(1))


def _measure(mode, steps):
    """Step seconds of `mode`; ``keras_x2`` runs two one-process Keras fits
    at once (mean of the two): the same per-process batch with both cores
    busy, as keras_dist's two ranks keep them."""
    if mode == "keras_x2":
        procs = [_start("keras", steps) for _ in range(2)]
        return sum(_result("keras", p) for p in procs) / 2
    return _result(mode, _start(mode, steps))


def main():
    """Runs each mode in its own processes and prints the ratios."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--mode", choices=sorted(MODES))
    parser.add_argument("--steps", type=int, default=40)
    args = parser.parse_args()
    if args.mode:
        seconds = MODES[args.mode](args.steps)
        if seconds is not None:
            print(f"STEP_SECONDS {seconds:.6f}", flush=True)
        return
    modes = [*MODES, "keras_x2"]
    times = {mode: _measure(mode, args.steps) for mode in modes}
    for mode, seconds in times.items():
        print(f"{mode:>11}: {1000 * seconds:8.2f} ms/step")
    print(
        f"keras_dist / keras (1 process, same per-process batch): "
        f"{times['keras_dist'] / times['keras']:.3f} (target <= 1.10)"
    )
    print(
        f"keras_dist / keras_x2 (2 independent 1-process fits at once): "
        f"{times['keras_dist'] / times['keras_x2']:.3f}"
    )
    print(
        f"keras_dist / hand-written torch DDP (2 processes): "
        f"{times['keras_dist'] / times['ddp']:.3f}"
    )


if __name__ == "__main__":
    main()

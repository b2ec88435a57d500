"""Step time of keras_dist on torch (2 gloo processes) against baselines.

Compares, on the same model and data:

* ``keras_dist``: `MirroredStrategy` over 2 CPU processes (gloo), global
  batch ``2 * B``;
* ``keras``: Keras on torch in one process with batch ``B`` (the same
  per-process batch): the target is keras_dist / keras <= 1.10;
* ``keras_tuned``: the same with glibc's malloc tuned as keras_dist tunes
  its CPU ranks (``KERAS_DIST_CPU_ALLOCATOR``, `cluster/allocator.py`):
  keras_dist / keras_tuned leaves the allocator out of the comparison;
* ``keras_dist_untuned``: keras_dist with ``KERAS_DIST_CPU_ALLOCATOR=none``
  (malloc as it comes, as before that setting existed);
* ``keras_x2``: two of those one-process Keras fits at the same time, so
  that both cores are busy as they are with keras_dist's two ranks;
* ``keras_upstream`` (Keras 3.16 and later, not in the default modes):
  Keras's own ``keras.distribution.DataParallel`` on 2 gloo processes
  (Keras wraps the model in DDP), ``B`` rows a process a step from a torch
  DataLoader; the target is keras_dist / keras_upstream <= 1.0;
  ``keras_upstream_tuned``: the same with malloc tuned as keras_dist's
  ranks;
* ``torch``: a plain PyTorch loop in one process, batch ``B``;
* ``ddp``: the same loop with `DistributedDataParallel` over 2 gloo
  processes, batch ``B`` per process (torch's `SyncBatchNorm` only runs on
  GPUs, so on a CPU this baseline uses per-process BatchNorm and does less
  communication than keras_dist). ``ddp / torch`` is what the gradient
  all-reduce costs torch itself: the floor for ``keras_dist / keras``.
  Its ranks get the same core binding as keras_dist's
  (``KERAS_DIST_CPU_BINDING``, default none). ``ddp_tuned``: the same
  with malloc tuned as keras_dist's ranks.

Two models (``BENCH_MODEL``): ``dense`` (default) is two 3x3 convolutions,
BatchNormalization, then Flatten and Dense(64): 2.1 M parameters, an 8 MB
gradient per step, so gloo's all-reduce dominates. ``pooled`` is three
convolutions with max and global-average pooling: 29 k parameters
(a 0.12 MB gradient), compute-bound like most convolutional networks.

Every process uses one thread (``OMP_NUM_THREADS=1``). Run::

    KERAS_BACKEND=torch [BENCH_MODEL=pooled] [BENCH_BATCH=64] \\
        [BENCH_SYNC_BN=0] python benchmarks/bench_torch.py \\
        [--steps 40] [--repeats 3] [--modes keras,keras_dist]

Besides wall time, each mode reports its CPU time per step (this
process's, every thread of it: for keras_dist and DDP rank 0's): on a
loaded machine the work a step does is steadier than its wall time, and
wall minus CPU is time spent waiting (for the other rank, for gloo); and
its minor page faults per step (memory the allocator gave back to the
kernel and touched again).

``BENCH_SYNC_BN=0`` gives keras_dist per-process BatchNormalization, like
the DDP baseline.

``BENCH_WHOLE=1`` times whole ``fit`` calls as a user meets them (the
Keras modes: ``keras``, ``keras_tuned``, ``keras_dist``,
``keras_upstream``): the epoch's iterator, a validation pass over a
quarter as many batches and a ``keras.callbacks.ModelCheckpoint`` saving
the weights at the epoch's end; the figure is the whole call's wall time
over its training steps.

``BENCH_DEVICE=gpu`` runs every mode on the GPUs instead: one rank per GPU
for ``keras_dist`` (`MultiWorkerMirroredStrategy`, NCCL, global batch
``GPUs * B``) and ``ddp`` (NCCL, torch's `SyncBatchNorm`); ``keras`` and
``torch`` on the first GPU. On a one-GPU machine the ratios are what
keras_dist's step (DDP, its BatchNorm and metric collectives, over a
one-rank NCCL group) costs over Keras's own, and DDP's over torch's.
"""

from __future__ import annotations

import argparse
import os
import re
import resource
import subprocess
import sys
import time

import numpy as np

BATCH = int(os.environ.get("BENCH_BATCH", "64"))
MODEL = os.environ.get("BENCH_MODEL", "dense")
WARMUP = 5
GPU = os.environ.get("BENCH_DEVICE", "cpu") == "gpu"
WHOLE = os.environ.get("BENCH_WHOLE", "0") == "1"


def _data(samples):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(samples, 32, 32, 3)).astype("float32")
    y = rng.integers(0, 10, size=(samples,))
    return x, y


def _keras_model():
    import keras

    layers = keras.layers
    inp = keras.Input((32, 32, 3))
    h = inp
    filters = (16, 32) if MODEL == "dense" else (32, 32, 64)
    for i, f in enumerate(filters):
        if MODEL == "pooled" and i == 2:
            h = layers.MaxPooling2D(2)(h)
        h = layers.Conv2D(f, 3, padding="same", use_bias=False)(h)
        h = layers.BatchNormalization()(h)
        h = layers.Activation("relu")(h)
    if MODEL == "dense":
        h = layers.Flatten()(h)
        h = layers.Dense(64, activation="relu")(h)
    else:
        h = layers.GlobalAveragePooling2D()(h)
    return keras.Model(inp, layers.Dense(10)(h))


def _torch_model():
    """The same architecture as `_keras_model`, in plain torch."""
    from torch import nn

    def block(cin, cout):
        return [
            nn.Conv2d(cin, cout, 3, padding=1, bias=False),
            nn.BatchNorm2d(cout),
            nn.ReLU(),
        ]

    if MODEL == "dense":
        return nn.Sequential(
            *block(3, 16),
            *block(16, 32),
            nn.Flatten(),
            nn.Linear(32 * 32 * 32, 64),
            nn.ReLU(),
            nn.Linear(64, 10),
        )
    return nn.Sequential(
        *block(3, 32),
        *block(32, 32),
        nn.MaxPool2d(2),
        *block(32, 64),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(64, 10),
    )


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
            **_whole_fit_extras(
                steps_per_epoch, batch, lambda n: (x[:n], y[:n])
            ),
        )

    fit(WARMUP)
    clock = _Clock()
    fit(steps)
    return clock.per_step(steps)


def _whole_fit_extras(steps, batch, validation_rows):
    """With ``BENCH_WHOLE=1``, `fit`'s validation data (a quarter as many
    batches of `batch` as `steps`: ``validation_rows(n)``) and a checkpoint
    of the weights at the epoch's end; else nothing."""
    if not WHOLE:
        return {}
    import tempfile

    import keras

    path = os.path.join(tempfile.mkdtemp(), "bench.weights.h5")
    n = batch * max(1, steps // 4)
    return {
        "validation_data": validation_rows(n),
        "callbacks": [
            keras.callbacks.ModelCheckpoint(path, save_weights_only=True)
        ],
    }


def _faults():
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def _gpus() -> int:
    import torch

    return torch.cuda.device_count()


def _synchronize():
    """Waits for the GPU's queued work (nothing on CPU)."""
    if GPU:
        import torch

        torch.cuda.synchronize()


class _Clock:
    """Wall time, CPU time and minor page faults from its creation."""

    def __init__(self):
        _synchronize()
        self.wall, self.cpu = time.perf_counter(), time.process_time()
        self.faults = _faults()

    def per_step(self, steps):
        """``(wall s, CPU s, faults)`` per step since the creation."""
        _synchronize()
        return (
            (time.perf_counter() - self.wall) / steps,
            (time.process_time() - self.cpu) / steps,
            (_faults() - self.faults) / steps,
        )


def run_keras(steps):
    """Keras on torch, one process, batch `BATCH`."""
    x, y = _data(BATCH * (steps + WARMUP))
    return _time_keras_fit(_keras_model(), x, y, BATCH, steps)


def _tuned_malloc(run):
    """`run` with glibc's malloc tuned as keras_dist tunes its CPU ranks
    (a DDP mode's other rank reruns this mode and tunes itself)."""

    def tuned(steps):
        from keras_dist._src.cluster import allocator

        if not allocator.tune_allocator():
            raise RuntimeError("glibc's malloc could not be tuned here")
        return run(steps)

    return tuned


def run_keras_dist_untuned(steps):
    """`run_keras_dist` with ``KERAS_DIST_CPU_ALLOCATOR=none``."""
    os.environ["KERAS_DIST_CPU_ALLOCATOR"] = "none"  # rank 1 inherits it
    return run_keras_dist(steps)


def run_keras_dist(steps):
    """keras_dist MirroredStrategy over 2 gloo processes (one NCCL rank per
    GPU with ``BENCH_DEVICE=gpu``)."""
    import keras_dist

    sync = os.environ.get("BENCH_SYNC_BN", "1") == "1"
    if GPU:  # one rank per GPU, even where there is only one
        strategy = keras_dist.MultiWorkerMirroredStrategy(sync_batch_norm=sync)
    else:
        strategy = keras_dist.MirroredStrategy(
            devices=["cpu:0", "cpu:1"], sync_batch_norm=sync
        )
    world = strategy.num_replicas_in_sync
    x, y = _data(world * BATCH * (steps + WARMUP))
    with strategy.scope():
        model = _keras_model()
        seconds = _time_keras_fit(model, x, y, world * BATCH, steps)
    if int(os.environ.get("RANK", "0")) != 0:
        return None
    return seconds


def _time_torch_loop(module, parameters, rank, world, steps, sync=None):
    """Wall and CPU seconds per step of a plain torch loop, batch `BATCH`
    per process."""
    import torch
    from torch import nn

    optimizer = torch.optim.SGD(parameters, lr=0.01)
    loss_fn = nn.CrossEntropyLoss()
    x, y = _data(world * BATCH * (steps + WARMUP))
    device = torch.device("cuda") if GPU else torch.device("cpu")
    x = torch.as_tensor(x).permute(0, 3, 1, 2).contiguous().to(device)
    y = torch.as_tensor(y).to(device)

    def step(i):
        lo = (world * i + rank) * BATCH
        optimizer.zero_grad()
        loss = loss_fn(module(x[lo : lo + BATCH]), y[lo : lo + BATCH])
        loss.backward()
        optimizer.step()

    for i in range(WARMUP):
        step(i)
    if sync:
        sync()
    clock = _Clock()
    for i in range(WARMUP, WARMUP + steps):
        step(i)
    if sync:
        sync()
    return clock.per_step(steps)


def run_torch(steps):
    """Plain torch in one process, batch `BATCH`: DDP's own anchor."""
    model = _torch_model().to("cuda" if GPU else "cpu")
    return _time_torch_loop(model, model.parameters(), 0, 1, steps)


def _join_job(world):
    """Starts ranks 1.. of a `world`-process job running this mode (rank 0
    is this process), unless a launcher already did; returns the started
    children ``{rank: Popen}``."""
    from keras_dist._src.cluster import detect_environment, launcher

    if detect_environment().is_distributed:
        return {}
    port = launcher.free_port()
    children = launcher.start_workers(world, port)
    os.environ.update(
        RANK="0",
        WORLD_SIZE=str(world),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    return children


def run_ddp(steps):
    """Hand-written torch DDP over 2 gloo processes (NCCL, one per GPU,
    with ``BENCH_DEVICE=gpu``)."""
    import torch
    import torch.distributed as dist
    from torch import nn

    from keras_dist._src.cluster import launcher

    world = _gpus() if GPU else 2
    children = _join_job(world)
    rank = int(os.environ["RANK"])
    if GPU:
        torch.cuda.set_device(rank)
        dist.init_process_group("nccl", rank=rank, world_size=world)
        # SyncBatchNorm (GPU-only in torch): the statistics keras_dist uses.
        model = nn.SyncBatchNorm.convert_sync_batchnorm(_torch_model().cuda())
        ddp = nn.parallel.DistributedDataParallel(model, device_ids=[rank])
    else:
        # The same core binding as keras_dist's ranks
        # (KERAS_DIST_CPU_BINDING).
        launcher.bind_to_cores(rank, 2)
        dist.init_process_group("gloo", rank=rank, world_size=2)
        ddp = nn.parallel.DistributedDataParallel(_torch_model())
    seconds = _time_torch_loop(
        ddp, ddp.parameters(), rank, world, steps, sync=dist.barrier
    )
    dist.destroy_process_group()
    for proc in children.values():
        proc.wait()
    return seconds if rank == 0 else None


def run_keras_upstream(steps):
    """Keras's own torch data parallelism (Keras 3.16 and later):
    ``keras.distribution.DataParallel`` over 2 gloo processes, each fitting
    its own ``BATCH`` rows a step from a torch DataLoader (Keras wraps the
    model in DDP)."""
    import keras
    import torch

    from keras_dist._src.cluster import launcher

    if tuple(int(p) for p in keras.__version__.split(".")[:2]) < (3, 16):
        raise SystemExit(
            f"keras_upstream needs Keras 3.16's torch distribution; this is "
            f"Keras {keras.__version__} (requirements/keras-next.txt)"
        )
    world = 2
    children = _join_job(world)
    rank = int(os.environ["RANK"])
    launcher.bind_to_cores(rank, 2)
    keras.distribution.initialize()
    distribution = keras.distribution.DataParallel(
        devices=keras.distribution.list_devices()
    )
    distribution.auto_shard_dataset = False  # each rank reads its own rows
    keras.distribution.set_distribution(distribution)
    x, y = _data(world * BATCH * (steps + WARMUP))
    x, y = x[rank::world], y[rank::world]  # this process's rows
    loader = torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(torch.as_tensor(x), torch.as_tensor(y)),
        batch_size=BATCH,
        shuffle=False,
    )
    model = _keras_model()
    model.compile(
        optimizer=keras.optimizers.SGD(0.01),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )

    def validation_rows(n):  # this process's own rows, as in training
        return torch.utils.data.DataLoader(
            torch.utils.data.TensorDataset(
                torch.as_tensor(x[:n]), torch.as_tensor(y[:n])
            ),
            batch_size=BATCH,
        )

    def fit(steps):
        model.fit(
            loader,
            epochs=1,
            steps_per_epoch=steps,
            verbose=0,
            **_whole_fit_extras(steps, BATCH, validation_rows),
        )

    fit(WARMUP)
    torch.distributed.barrier()
    clock = _Clock()
    fit(steps)
    torch.distributed.barrier()
    seconds = clock.per_step(steps)
    torch.distributed.destroy_process_group()
    for proc in children.values():
        proc.wait()
    return seconds if rank == 0 else None


MODES = {
    "keras": run_keras,
    "keras_upstream": run_keras_upstream,
    "keras_upstream_tuned": _tuned_malloc(run_keras_upstream),
    "keras_tuned": _tuned_malloc(run_keras),
    "keras_dist": run_keras_dist,
    "keras_dist_untuned": run_keras_dist_untuned,
    "torch": run_torch,
    "ddp": run_ddp,
    "ddp_tuned": _tuned_malloc(run_ddp),
}


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
    match = re.search(
        r"STEP_SECONDS ([0-9.e-]+) CPU ([0-9.e-]+) FAULTS ([0-9.e-]+)", stdout
    )
    if proc.returncode != 0 or not match:
        raise RuntimeError(f"{mode} failed:\n{stderr[-3000:]}")
    return tuple(float(match.group(i)) for i in (1, 2, 3))


def _measure(mode, steps):
    """``(wall s, CPU s, faults)`` per step of `mode`; ``keras_x2`` runs two
    one-process Keras fits at once (mean of the two): the same per-process
    batch with both cores busy, as keras_dist's two ranks keep them."""
    if mode == "keras_x2":
        procs = [_start("keras", steps) for _ in range(2)]
        results = [_result("keras", p) for p in procs]
        return tuple(float(np.mean(r)) for r in zip(*results))
    return _result(mode, _start(mode, steps))


def _ratio_line(runs, a, b, note, what):
    """``a / b`` from per-repeat values: ratio of medians, and the median
    and quartiles of the per-repeat ratios."""
    paired = np.array(runs[a]) / np.array(runs[b])
    q1, q2, q3 = np.percentile(paired, [25, 50, 75])
    ratio = np.median(runs[a]) / np.median(runs[b])
    return (
        f"{what} {a} / {b}: {ratio:.3f} (per-repeat median {q2:.3f}, "
        f"quartiles {q1:.3f}..{q3:.3f}) {note}"
    )


def main():
    """Runs each mode in its own processes and prints the ratios."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--mode", choices=sorted(MODES))
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--modes",
        default=",".join([m for m in MODES if "upstream" not in m])
        + ",keras_x2",
        help="comma-separated modes to run (default: all but "
        "keras_upstream, which needs Keras 3.16)",
    )
    args = parser.parse_args()
    if args.mode:
        seconds = MODES[args.mode](args.steps)
        if seconds is not None:
            wall, cpu, faults = seconds
            print(
                f"STEP_SECONDS {wall:.6f} CPU {cpu:.6f} FAULTS {faults:.1f}",
                flush=True,
            )
        return
    modes = args.modes.split(",")
    unknown = set(modes) - {*MODES, "keras_x2"}
    if unknown:
        parser.error(f"unknown modes {sorted(unknown)}")
    walls = {mode: [] for mode in modes}
    cpus = {mode: [] for mode in modes}
    faults = {mode: [] for mode in modes}
    for _ in range(args.repeats):  # interleaved, so drift hits every mode
        for mode in modes:
            wall, cpu, fault = _measure(mode, args.steps)
            walls[mode].append(wall)
            cpus[mode].append(cpu)
            faults[mode].append(fault)
    print(f"median of {args.repeats} interleaved runs, model {MODEL!r}:")
    for mode in modes:
        print(
            f"{mode:>18}: {1000 * np.median(walls[mode]):8.2f} ms/step, "
            f"CPU {1000 * np.median(cpus[mode]):8.2f} ms/step, "
            f"{np.median(faults[mode]):8.0f} page faults/step"
        )
    ratios = [
        ("keras_dist", "keras", "(target <= 1.10)"),
        ("keras_dist", "keras_tuned", "(the same allocator)"),
        ("keras_dist_untuned", "keras", "(before the allocator setting)"),
        ("keras_dist", "keras_x2", ""),
        ("keras_dist", "keras_upstream", "(Keras 3.16's own DataParallel)"),
        ("keras_dist", "keras_upstream_tuned", "(the same allocator)"),
        ("keras_dist", "ddp", ""),
        ("keras_dist", "ddp_tuned", "(the same allocator)"),
        ("ddp", "torch", "(what gloo costs torch itself)"),
    ]
    for a, b, note in ratios:
        if a in walls and b in walls:
            print(_ratio_line(walls, a, b, note, "wall"))
            print(_ratio_line(cpus, a, b, "", " CPU"))


if __name__ == "__main__":
    main()

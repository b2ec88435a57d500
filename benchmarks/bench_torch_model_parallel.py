"""Layouts on torch: keras_dist against plain PyTorch DTensor, step time.

The same MLP (``width``-``width``-``width``-16, tanh, Adam, MSE) trains in
each mode, every mode in its own processes, modes interleaved over
``--repeats`` runs (so that machine drift hits all alike):

* ``torch``: a plain PyTorch loop in one process, batch ``B``;
* ``keras``: Keras on torch in one process, batch ``B``. ``keras / torch``
  is Keras's own single-process overhead: the target for the ratios below;
* ``kd_mp``: `keras_dist.ModelParallel` on a (1, 2) ("batch", "model")
  mesh over 2 gloo processes, the first kernel split by columns and the
  second by rows (Megatron style), global batch ``B``;
* ``dt_mp``: the same layout in plain torch: `parallelize_module` with
  `ColwiseParallel` / `RowwiseParallel` on a 2-process device mesh, the
  same batch ``B`` on both ranks;
* ``kd_sdp``: `keras_dist.ShardedDataParallel` over 2 processes, ``B`` per
  process (global batch ``2 B``);
* ``fsdp``: torch's `fully_shard` (FSDP2) over 2 processes, ``B`` per
  process.

Targets (issue #15 item 8): ``kd_mp / dt_mp`` and ``kd_sdp / fsdp`` no
larger than ``keras / torch``. Every process uses one thread.

``--model dense`` or ``--model pooled`` trains `bench_torch.py`'s
convolutional model of that name instead (convolutions with
BatchNormalization, SGD, cross-entropy; 32x32x3 inputs) in the modes
``torch``, ``keras``, ``kd_sdp`` and ``fsdp``. keras_dist's BatchNorm is
synchronised over the global batch; FSDP's ``BatchNorm2d`` normalises each
process's part (as DDP's on CPUs, where ``SyncBatchNorm`` does not run).
``--model lm`` trains a small transformer classifier in those modes
(``Embedding(1000, 64)`` of 32 ids, one attention block of 4 heads with
a 128-wide feed-forward, LayerNorms, mean over the sequence, 4 classes;
SGD, cross-entropy).

Run::

    KERAS_BACKEND=torch python benchmarks/bench_torch_model_parallel.py \\
        [--steps 30] [--repeats 3] [--width 512] [--batch 64] \\
        [--model mlp|dense|pooled|lm]
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import time

import numpy as np

WARMUP = 5


OTHER_MODES = ("torch", "keras", "kd_sdp", "fsdp")  # conv models, lm
VOCAB, SEQUENCE, WIDTH, CLASSES = 1000, 32, 64, 4  # lm


def _conv(args):
    """`bench_torch.py` with its model set to `args.model`, or None for the
    MLP and the transformer."""
    if args.model in ("mlp", "lm"):
        return None
    os.environ["BENCH_MODEL"] = args.model
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import bench_torch

    return bench_torch


def _data(samples, args):
    conv = _conv(args)
    if conv is not None:
        return conv._data(samples)
    rng = np.random.default_rng(0)
    if args.model == "lm":
        x = rng.integers(0, VOCAB, (samples, SEQUENCE)).astype("int32")
        return x, rng.integers(0, CLASSES, (samples,))
    x = rng.normal(size=(samples, args.width)).astype("float32")
    y = rng.normal(size=(samples, 16)).astype("float32")
    return x, y


def _keras_model(args):
    import keras

    keras.utils.set_random_seed(0)
    conv = _conv(args)
    if conv is not None:
        return conv._keras_model()
    if args.model == "lm":
        layers = keras.layers
        ids = keras.Input((SEQUENCE,), dtype="int32")
        h = layers.Embedding(VOCAB, WIDTH)(ids)
        a = layers.MultiHeadAttention(4, WIDTH // 4)(h, h)
        h = layers.LayerNormalization(epsilon=1e-5)(h + a)
        f = layers.Dense(2 * WIDTH, activation="gelu")(h)
        h = layers.LayerNormalization(epsilon=1e-5)(h + layers.Dense(WIDTH)(f))
        h = layers.GlobalAveragePooling1D()(h)
        return keras.Model(ids, layers.Dense(CLASSES)(h))
    width = args.width
    return keras.Sequential(
        [
            keras.Input((width,)),
            keras.layers.Dense(width, activation="tanh", name="up"),
            keras.layers.Dense(width, activation="tanh", name="mid"),
            keras.layers.Dense(16, name="down"),
        ]
    )


def _torch_model(args):
    import torch
    from torch import nn

    torch.manual_seed(0)
    conv = _conv(args)
    if conv is not None:
        return conv._torch_model()
    if args.model == "lm":
        return _torch_lm()
    width = args.width

    class MLP(nn.Module):
        def __init__(self):
            super().__init__()
            self.up = nn.Linear(width, width)
            self.mid = nn.Linear(width, width)
            self.down = nn.Linear(width, 16)

        def forward(self, x):
            x = torch.tanh(self.up(x))
            x = torch.tanh(self.mid(x))
            return self.down(x)

    return MLP()


def _torch_lm():
    """`_keras_model`'s transformer in plain torch."""
    import torch
    from torch import nn

    class LM(nn.Module):
        def __init__(self):
            super().__init__()
            self.embedding = nn.Embedding(VOCAB, WIDTH)
            self.attention = nn.MultiheadAttention(WIDTH, 4, batch_first=True)
            self.norm1 = nn.LayerNorm(WIDTH)
            self.up = nn.Linear(WIDTH, 2 * WIDTH)
            self.down = nn.Linear(2 * WIDTH, WIDTH)
            self.norm2 = nn.LayerNorm(WIDTH)
            self.head = nn.Linear(WIDTH, CLASSES)

        def forward(self, ids):
            h = self.embedding(ids)
            a, _ = self.attention(h, h, h, need_weights=False)
            h = self.norm1(h + a)
            f = self.down(nn.functional.gelu(self.up(h)))
            h = self.norm2(h + f)
            return self.head(torch.mean(h, 1))

    return LM()


def _join(world):
    """Starts ranks 1.. of a `world`-process job (rank 0 is this one)."""
    from keras_dist._src.cluster import detect_environment, launcher

    if world < 2 or detect_environment().is_distributed:
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


def _time_keras(model, x, y, batch, steps, args):
    import keras

    if args.model == "mlp":
        model.compile(optimizer=keras.optimizers.Adam(1e-3), loss="mse")
    else:
        model.compile(
            optimizer=keras.optimizers.SGD(0.01),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        )

    def fit(n):
        model.fit(
            x,
            y,
            batch_size=batch,
            epochs=1,
            steps_per_epoch=n,
            shuffle=False,
            verbose=0,
        )

    fit(WARMUP)
    start = time.perf_counter()
    fit(steps)
    return (time.perf_counter() - start) / steps


def _time_torch(module, x, y, batch, steps, args, rank=0, world=1, sync=None):
    import torch

    x, y = torch.as_tensor(x), torch.as_tensor(y)
    if args.model == "mlp":
        optimizer = torch.optim.Adam(module.parameters(), lr=1e-3)

        def loss_of(outputs, targets):
            return torch.mean((outputs - targets) ** 2)
    else:
        if args.model != "lm":  # bench_torch.py's loop: N, C, H, W images
            x = x.permute(0, 3, 1, 2).contiguous()
        optimizer = torch.optim.SGD(module.parameters(), lr=0.01)
        loss_of = torch.nn.functional.cross_entropy

    def step(i):
        lo = (world * i + rank) * batch
        optimizer.zero_grad()
        loss = loss_of(module(x[lo : lo + batch]), y[lo : lo + batch])
        loss.backward()
        optimizer.step()

    for i in range(WARMUP):
        step(i)
    if sync:
        sync()
    start = time.perf_counter()
    for i in range(WARMUP, WARMUP + steps):
        step(i)
    if sync:
        sync()
    return (time.perf_counter() - start) / steps


def run_torch(args):
    """Plain torch, one process."""
    x, y = _data(args.batch * (args.steps + WARMUP), args)
    return _time_torch(_torch_model(args), x, y, args.batch, args.steps, args)


def run_keras(args):
    """Keras on torch, one process."""
    x, y = _data(args.batch * (args.steps + WARMUP), args)
    return _time_keras(_keras_model(args), x, y, args.batch, args.steps, args)


def run_kd_mp(args):
    """keras_dist ModelParallel (1, 2) over 2 processes."""
    import keras_dist

    children = _join(2)
    mesh = keras_dist.DeviceMesh((1, 2), ("batch", "model"))
    layouts = keras_dist.LayoutMap(mesh)
    layouts[".*up/kernel"] = (None, "model")
    layouts[".*up/bias"] = ("model",)
    layouts[".*mid/kernel"] = ("model", None)
    strategy = keras_dist.ModelParallel(layouts, "batch")
    x, y = _data(args.batch * (args.steps + WARMUP), args)
    with strategy.scope():
        model = _keras_model(args)
        seconds = _time_keras(model, x, y, args.batch, args.steps, args)
    return _finish(children, seconds)


def run_kd_sdp(args):
    """keras_dist ShardedDataParallel over 2 processes."""
    import keras_dist

    children = _join(2)
    strategy = keras_dist.ShardedDataParallel()
    x, y = _data(2 * args.batch * (args.steps + WARMUP), args)
    with strategy.scope():
        model = _keras_model(args)
        seconds = _time_keras(model, x, y, 2 * args.batch, args.steps, args)
    return _finish(children, seconds)


def run_dt_mp(args):
    """Plain torch tensor parallel (DTensor) over 2 processes."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    children = _join(2)
    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (2,))
    model = parallelize_module(
        _torch_model(args),
        mesh,
        {"up": ColwiseParallel(), "mid": RowwiseParallel()},
    )
    x, y = _data(args.batch * (args.steps + WARMUP), args)
    # Model parallel: both ranks compute on the same batch.
    seconds = _time_torch(
        model, x, y, args.batch, args.steps, args, sync=dist.barrier
    )
    dist.destroy_process_group()
    return _finish(children, seconds)


def run_fsdp(args):
    """Plain torch FSDP2 (`fully_shard`) over 2 processes."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    children = _join(2)
    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (2,))
    model = _torch_model(args)
    for layer in model.children():
        if any(True for _ in layer.parameters()):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    rank = dist.get_rank()
    x, y = _data(2 * args.batch * (args.steps + WARMUP), args)
    seconds = _time_torch(
        model, x, y, args.batch, args.steps, args, rank, 2, sync=dist.barrier
    )
    dist.destroy_process_group()
    return _finish(children, seconds)


def _finish(children, seconds):
    for proc in children.values():
        proc.wait()
    return seconds if int(os.environ.get("RANK", "0")) == 0 else None


MODES = {
    "torch": run_torch,
    "keras": run_keras,
    "kd_mp": run_kd_mp,
    "dt_mp": run_dt_mp,
    "kd_sdp": run_kd_sdp,
    "fsdp": run_fsdp,
}


def _measure(mode, args):
    env = dict(os.environ, KERAS_BACKEND="torch", OMP_NUM_THREADS="1")
    command = [sys.executable, __file__, "--mode", mode]
    for flag in ("steps", "width", "batch", "model"):
        command += [f"--{flag}", str(getattr(args, flag))]
    proc = subprocess.run(
        command, env=env, capture_output=True, text=True, timeout=900
    )
    match = re.search(r"STEP_SECONDS ([0-9.e-]+)", proc.stdout)
    if proc.returncode != 0 or not match:
        raise RuntimeError(f"{mode} failed:\n{proc.stderr[-3000:]}")
    return float(match.group(1))


def main():
    """Runs every mode `--repeats` times, interleaved; prints the ratios."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mode", choices=sorted(MODES))
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument(
        "--model",
        choices=("mlp", "dense", "pooled", "lm"),
        default="mlp",
        help="the MLP, bench_torch.py's convolutional models, or a small "
        "transformer",
    )
    args = parser.parse_args()
    if args.mode:
        seconds = MODES[args.mode](args)
        if seconds is not None:
            print(f"STEP_SECONDS {seconds:.6f}", flush=True)
        return
    modes = list(MODES) if args.model == "mlp" else list(OTHER_MODES)
    runs = {mode: [] for mode in modes}
    for _ in range(args.repeats):
        for mode in modes:
            runs[mode].append(_measure(mode, args))
    what = f"MLP width {args.width}" if args.model == "mlp" else args.model
    print(
        f"median of {args.repeats} interleaved runs, {what}, "
        f"batch {args.batch}:"
    )
    for mode, values in runs.items():
        print(f"{mode:>7}: {1000 * np.median(values):8.2f} ms/step")
    for a, b, note in [
        ("keras", "torch", "(Keras's own overhead: the target)"),
        ("kd_mp", "dt_mp", ""),
        ("kd_sdp", "fsdp", ""),
    ]:
        if a not in runs:
            continue
        ratios = np.array(runs[a]) / np.array(runs[b])
        print(
            f"{a} / {b}: {np.median(runs[a]) / np.median(runs[b]):.3f} "
            f"(per-repeat median {np.median(ratios):.3f}, "
            f"range {ratios.min():.3f}..{ratios.max():.3f}) {note}"
        )


if __name__ == "__main__":
    main()

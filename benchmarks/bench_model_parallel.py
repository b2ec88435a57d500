"""Layouts over a mesh on JAX: keras_dist against Keras's own, and memory.

Side by side in one process on N simulated CPU devices (default 4), the
same MLP trains under:

(a) ``keras``: `keras.distribution.ModelParallel` on a (2, N/2)
    ("batch", "model") mesh with a `keras.distribution.LayoutMap` — the
    anchor;
(b) ``model_parallel``: `keras_dist.ModelParallel` given that same Keras
    layout map;
(c) ``mirrored``: `keras_dist.MirroredStrategy` on the N devices;
(d) ``zero3``: `keras_dist.ShardedDataParallel` over the N devices.

The configurations take turns (a, b, c, d, a, b, ...) for ``--repeats``
timed ``fit`` calls after one warm-up each; a callback times each epoch
from the start of batch ``--skip`` to its end, and the table shows the
median and quartiles of the per-repeat mean step time, plus the ratio
(b)/(a) (target <= 1.0). Then, for (b), (c) and (d), the bytes of model and
optimizer state that device 0 holds, read from the arrays' shards, against
the ideal (params + optimizer state) / N.

Example::

    python benchmarks/bench_model_parallel.py --repeats 8
"""

from __future__ import annotations

import argparse
import os
import statistics
import time


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=8)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--skip", type=int, default=3)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--batch", type=int, default=64)
    args = parser.parse_args()

    os.environ["KERAS_BACKEND"] = "jax"
    os.environ["KERAS_DIST_CPU_DEVICES"] = str(args.devices)
    import jax
    import keras
    import numpy as np

    import keras_dist

    n = args.devices
    model_axis = n // 2
    width = args.width

    def build():
        keras.utils.set_random_seed(0)
        return keras.Sequential(
            [
                keras.Input((width,)),
                keras.layers.Dense(width, activation="tanh", name="up"),
                keras.layers.Dense(width, activation="tanh", name="mid"),
                keras.layers.Dense(16, name="down"),
            ]
        )

    def compile_model(model):
        model.compile(optimizer=keras.optimizers.Adam(1e-3), loss="mse")

    keras_mesh = keras.distribution.DeviceMesh(
        (2, model_axis),
        ["batch", "model"],
        devices=[f"cpu:{i}" for i in range(n)],
    )
    keras_map = keras.distribution.LayoutMap(keras_mesh)
    keras_map[".*up/kernel"] = (None, "model")
    keras_map[".*up/bias"] = ("model",)
    keras_map[".*mid/kernel"] = ("model", None)
    keras_map[".*down/kernel"] = (None, None)

    rng = np.random.default_rng(0)
    samples = args.batch * args.steps
    x = rng.normal(size=(samples, width)).astype("float32")
    y = rng.normal(size=(samples, 16)).astype("float32")

    models = {}
    anchor = keras.distribution.ModelParallel(
        layout_map=keras_map, batch_dim_name="batch"
    )
    with anchor.scope():
        models["keras"] = build()
        compile_model(models["keras"])
    strategies = {
        "model_parallel": keras_dist.ModelParallel(keras_map, "batch"),
        "mirrored": keras_dist.MirroredStrategy(),
        "zero3": keras_dist.ShardedDataParallel(),
    }
    for name, strategy in strategies.items():
        with strategy.scope():
            models[name] = build()
            compile_model(models[name])

    class Timer(keras.callbacks.Callback):
        def on_train_batch_begin(self, batch, logs=None):
            if batch == args.skip:
                self.start = time.perf_counter()

        def on_train_end(self, logs=None):
            jax.block_until_ready(self.model.trainable_variables[0].value)
            steps = args.steps - args.skip
            self.ms = (time.perf_counter() - self.start) * 1e3 / steps

    def fit(name):
        timer = Timer()
        if name == "keras":
            with anchor.scope():
                models[name].fit(
                    x, y, batch_size=args.batch, epochs=1, verbose=0,
                    shuffle=False, callbacks=[timer],
                )  # fmt: skip
        else:
            models[name].fit(
                x, y, batch_size=args.batch, epochs=1, verbose=0,
                shuffle=False, callbacks=[timer],
            )  # fmt: skip
        return timer.ms

    names = list(models)
    for name in names:
        fit(name)  # warm-up: compilation
    times = {name: [] for name in names}
    for _ in range(args.repeats):
        for name in names:
            times[name].append(fit(name))

    print(
        f"JAX, {n} simulated CPU devices, MLP width {width}, "
        f"batch {args.batch}, {args.repeats} interleaved repeats"
    )
    print(f"{'configuration':<16} {'median ms/step':>15} {'quartiles':>18}")
    for name in names:
        q = statistics.quantiles(times[name], n=4)
        print(
            f"{name:<16} {statistics.median(times[name]):>15.3f} "
            f"{q[0]:>8.3f}-{q[2]:<8.3f}"
        )
    ratios = [b / a for a, b in zip(times["keras"], times["model_parallel"])]
    print(
        "model_parallel / keras.distribution.ModelParallel: median "
        f"{statistics.median(ratios):.3f} (per-repeat ratios; target <= 1.0)"
    )

    def device0_bytes(model):
        device = jax.devices()[0]
        total = 0
        for v in model.variables + model.optimizer.variables:
            for shard in v.value.addressable_shards:
                if shard.device == device:
                    total += shard.data.nbytes
        return total

    full = sum(
        int(np.prod(v.shape)) * 4
        for v in models["mirrored"].variables
        + models["mirrored"].optimizer.variables
    )
    print(
        f"\nstate (params + Adam slots): {full} bytes; ideal / {n}: {full // n}"
    )
    print(f"{'configuration':<16} {'bytes on device 0':>18} {'x ideal':>8}")
    for name in ("mirrored", "model_parallel", "zero3"):
        got = device0_bytes(models[name])
        print(f"{name:<16} {got:>18} {got / (full / n):>8.2f}")


if __name__ == "__main__":
    main()

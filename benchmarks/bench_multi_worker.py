"""2 workers × 1 device against 1 worker × 2 devices and one device.

Runs the same MLP at the same global batch three ways, interleaved, each in
fresh processes, and prints the median time per step and the ratios:

* ``one``: plain Keras on one device (no keras_dist);
* ``mirrored``: `MirroredStrategy` over 2 devices in one worker (2
  simulated CPU devices on JAX/TF; 2 processes on torch);
* ``multi_worker``: `MultiWorkerMirroredStrategy`, 2 workers × 1 device,
  started by ``python -m keras_dist.launch --nproc-per-node 2``.

    KERAS_BACKEND=jax python benchmarks/bench_multi_worker.py --repeats 3

Time per step is measured inside the training script (the chief's `fit` of
`--steps` steps after a warm-up epoch), so process start and compilation
are excluded.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
import textwrap

SCRIPT = """
import os, sys, time
import numpy as np
mode, steps, batch = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
import keras
import keras_dist

if mode == "one":
    strategy = None
elif mode == "mirrored":
    strategy = keras_dist.MirroredStrategy(devices=["cpu:0", "cpu:1"])
else:
    strategy = keras_dist.MultiWorkerMirroredStrategy()
chief = strategy is None or strategy.is_chief
rng = np.random.default_rng(0)
x = rng.normal(size=(batch * steps, 256)).astype("float32")
y = rng.integers(0, 10, size=(batch * steps,))


def build():
    model = keras.Sequential([
        keras.Input((256,)),
        keras.layers.Dense(512, activation="relu"),
        keras.layers.Dense(512, activation="relu"),
        keras.layers.Dense(10),
    ])
    model.compile(
        optimizer="adam",
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    return model


if strategy is None:
    model = build()
else:
    with strategy.scope():
        model = build()
model.fit(x[: batch * 3], y[: batch * 3], batch_size=batch, verbose=0)
start = time.perf_counter()
model.fit(x, y, batch_size=batch, epochs=1, verbose=0, shuffle=False)
seconds = time.perf_counter() - start
if chief:
    print(f"STEP_MS={1000 * seconds / steps:.3f}", flush=True)
"""


def run(mode, steps, batch, directory):
    """Runs one configuration; returns milliseconds per step."""
    script = os.path.join(directory, "bench_mw_script.py")
    with open(script, "w") as f:
        f.write(textwrap.dedent(SCRIPT))
    env = dict(os.environ)
    env.pop("KERAS_DIST_CPU_DEVICES", None)
    backend = env.get("KERAS_BACKEND", "jax")
    args = [script, mode, str(steps), str(batch)]
    if mode == "multi_worker":
        command = [sys.executable, "-m", "keras_dist.launch"]
        command += ["--nproc-per-node", "2", *args]
    else:
        command = [sys.executable, *args]
        if mode == "mirrored" and backend != "torch":
            env["KERAS_DIST_CPU_DEVICES"] = "2"
    out = subprocess.run(
        command, env=env, capture_output=True, text=True, timeout=900
    )
    match = re.search(r"STEP_MS=([0-9.]+)", out.stdout)
    if out.returncode != 0 or not match:
        raise RuntimeError(f"{mode} failed:\n{out.stdout}\n{out.stderr}")
    return float(match.group(1))


def main(argv=None):
    """Runs the three configurations interleaved and prints the ratios."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--batch", type=int, default=256)
    args = parser.parse_args(argv)
    modes = ("one", "mirrored", "multi_worker")
    times = {m: [] for m in modes}
    with tempfile.TemporaryDirectory() as directory:
        for _ in range(args.repeats):
            for mode in modes:
                times[mode].append(run(mode, args.steps, args.batch, directory))
    median = {m: statistics.median(v) for m, v in times.items()}
    backend = os.environ.get("KERAS_BACKEND", "jax")
    print(f"backend={backend} global batch={args.batch} steps={args.steps}")
    for mode in modes:
        runs = ", ".join(f"{t:.1f}" for t in times[mode])
        print(f"  {mode:13s} {median[mode]:8.2f} ms/step  ({runs})")
    one, mirrored = median["one"], median["mirrored"]
    multi = median["multi_worker"]
    print(f"  multi_worker / one      = {multi / one:.3f}")
    print(f"  multi_worker / mirrored = {multi / mirrored:.3f}")
    print(f"  mirrored / one          = {mirrored / one:.3f}")


if __name__ == "__main__":
    main()

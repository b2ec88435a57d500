"""Where a training step's time goes: a per-phase profile of `fit`.

Wraps the functions each phase of a step runs through (input, forward,
loss, backward, collectives, optimizer, metric updates, callbacks, host
waits, the step glue around them) with wall-clock timers and reports, per
configuration, milliseconds per step and the share of the step. A phase's
time is *exclusive*: a phase called inside another (a collective inside
backward) is subtracted from the outer one, so the phases add up to the
step. "unattributed" is the rest of the loop (Keras's own fit loop, Python
between the wrapped calls).

Configurations, side by side in the same run as the ratio benchmarks:

* ``--backend torch``: plain Keras on torch in one process (batch ``B``)
  and keras_dist `MirroredStrategy` over 2 gloo processes (global batch
  ``2 B``, rank 0 reported), the model of ``bench_torch.py``
  (``BENCH_MODEL=dense|pooled``);
* ``--backend jax`` / ``tensorflow``: plain Keras, keras_dist
  `MirroredStrategy` x4 and the anchor (`keras.distribution.DataParallel` /
  `tf.distribute.MirroredStrategy` x4) on 4 simulated CPU devices, the MLP of
  ``bench_fit.py``.

On JAX and TensorFlow a step's device work runs inside one compiled call:
there "dispatch" (JAX, asynchronous) or "compiled step" (TF, synchronous)
holds forward, backward, all-reduce and update together, and a JAX host
"wait" is the time the host blocks for the devices. The wrappers cost about
a microsecond per call; compare configurations, not absolute figures.

Run::

    python benchmarks/profile_step.py --backend torch [--steps 30]
    python benchmarks/profile_step.py --backend jax
"""

from __future__ import annotations

import argparse
import functools
import os
import subprocess
import sys
import threading
import time
from collections import defaultdict

HERE = os.path.dirname(os.path.abspath(__file__))


class PhaseTimer:
    """Exclusive wall-clock time per phase label, across threads."""

    def __init__(self):
        self.seconds = defaultdict(float)
        self.calls = defaultdict(int)
        self.active = False
        self._local = threading.local()
        self._undo = []

    def _stack(self):
        stack = getattr(self._local, "stack", None)
        if stack is None:
            stack = self._local.stack = []
        return stack

    def _enter(self):
        self._stack().append(0.0)
        return time.perf_counter()

    def _exit(self, label, start):
        elapsed = time.perf_counter() - start
        stack = self._stack()
        inner = stack.pop()
        if self.active:
            self.seconds[label] += elapsed - inner
            self.calls[label] += 1
        if stack:
            stack[-1] += elapsed

    def timed(self, function, label):
        """`function` wrapped so that its calls count for `label`."""

        @functools.wraps(function)
        def call(*args, **kwargs):
            start = self._enter()
            try:
                return function(*args, **kwargs)
            finally:
                self._exit(label, start)

        return call

    def patch(self, owner, name, label, generator=False):
        """Replaces ``owner.name`` (a class, module or instance attribute)
        with a timed wrapper; `generator`: time each item it yields."""
        original = owner.__dict__[name] if isinstance(owner, type) else None
        function = getattr(owner, name)
        if generator:
            wrapped = self._timed_generator(function, label)
        else:
            wrapped = self.timed(function, label)
        if isinstance(original, (staticmethod, classmethod)):
            wrapped = type(original)(self.timed(original.__func__, label))
        setattr(owner, name, wrapped)
        self._undo.append((owner, name, original, function))

    def _timed_generator(self, function, label):
        timer = self

        @functools.wraps(function)
        def call(*args, **kwargs):
            iterator = iter(function(*args, **kwargs))
            while True:
                start = timer._enter()
                try:
                    item = next(iterator)
                except StopIteration:
                    return
                finally:
                    timer._exit(label, start)
                yield item

        return call

    def restore(self):
        """Undoes every patch."""
        for owner, name, original, function in reversed(self._undo):
            if original is not None:
                setattr(owner, name, original)
            else:
                setattr(owner, name, function)
        self._undo = []


def _patch_common(timer, keras):
    from keras.src.callbacks.callback_list import CallbackList
    from keras.src.optimizers.base_optimizer import BaseOptimizer
    from keras.src.trainers.epoch_iterator import EpochIterator
    from keras.src.trainers.trainer import Trainer

    timer.patch(CallbackList, "on_train_batch_begin", "callbacks")
    timer.patch(CallbackList, "on_train_batch_end", "callbacks")
    timer.patch(EpochIterator, "_enumerate_iterator", "input", generator=True)
    timer.patch(Trainer, "compute_loss", "loss")
    timer.patch(Trainer, "compute_metrics", "metric updates")
    timer.patch(BaseOptimizer, "apply", "optimizer update")


def _patch_backend(timer, backend):
    if backend == "torch":
        import torch
        import torch.distributed as dist
        from keras.src.models.functional import Functional

        timer.patch(Functional, "call", "forward")
        timer.patch(torch.Tensor, "backward", "backward (DDP's all-reduce)")
        for name in ("all_reduce", "all_gather", "broadcast", "barrier"):
            timer.patch(dist, name, f"keras_dist's {name}")
    elif backend == "jax":
        import jax

        timer.patch(jax, "block_until_ready", "host wait for devices")
        timer.patch(jax, "device_put", "input to devices")
        from keras.src.backend.jax import distribution_lib

        timer.patch(
            distribution_lib, "distribute_data_input", "input to devices"
        )


def _wrap_train_function(timer, model, label):
    """Times every call of the model's train function as `label`."""
    make = model.make_train_function

    def make_timed(force=False):
        make(force)  # Keras's torch trainer returns None
        function = model.train_function
        if getattr(function, "_profiled", False):
            return function
        timed = timer.timed(function, label)
        timed._profiled = True
        model.train_function = timed
        return timed

    model.make_train_function = make_timed
    model.train_function = None


def profile_fit(keras, model, x, y, batch, steps, backend, label):
    """Profiles `steps` steps of ``model.fit`` after a warm-up fit.

    Returns:
        ``(ms per step, {phase: ms per step})``.
    """
    timer = PhaseTimer()
    _patch_common(timer, keras)
    _patch_backend(timer, backend)
    glue_label = {
        "jax": "dispatch (compiled step)",
        "tensorflow": "compiled step",
    }.get(backend, f"step glue ({label})")
    _wrap_train_function(timer, model, glue_label)

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

    try:
        fit(5)
        timer.active = True
        start = time.perf_counter()
        fit(steps)
        total = time.perf_counter() - start
        timer.active = False
    finally:
        timer.restore()
    phases = {}
    for label, seconds in timer.seconds.items():
        if label.startswith("keras_dist's "):  # collectives: calls too
            label = f"{label} ({timer.calls[label] / steps:g} per step)"
        phases[label] = 1e3 * seconds / steps
    step_ms = 1e3 * total / steps
    phases["unattributed"] = step_ms - sum(phases.values())
    return step_ms, phases


def print_table(results):
    """One column per configuration: ms per step and % of the step."""
    names = list(results)
    phases = []
    for _, table in results.values():
        phases += [p for p in table if p not in phases]
    width = max(len(p) for p in phases + ["step"]) + 2
    head = "".join(f"{n:>22}" for n in names)
    print(f"{'phase':<{width}}{head}")
    for phase in phases:
        cells = ""
        for name in names:
            step, table = results[name]
            ms = table.get(phase)
            cells += (
                f"{ms:11.2f} ({100 * ms / step:4.1f}%)  "
                if ms is not None
                else f"{'-':>22}"
            )
        print(f"{phase:<{width}}{cells}")
    print(
        f"{'step':<{width}}"
        + "".join(f"{results[n][0]:11.2f} ms{'':>8}" for n in names)
    )


# -- torch ---------------------------------------------------------------------
def _torch_run(mode, steps):
    sys.path.insert(0, HERE)
    import bench_torch
    import keras

    batch = bench_torch.BATCH
    if mode == "keras":
        x, y = bench_torch._data(batch * (steps + 5))
        model = bench_torch._keras_model()
        model.compile(
            optimizer=keras.optimizers.SGD(0.01),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        )
        return profile_fit(keras, model, x, y, batch, steps, "torch", "Keras")
    import keras_dist

    strategy = keras_dist.MirroredStrategy(
        devices=["cpu:0", "cpu:1"],
        sync_batch_norm=os.environ.get("BENCH_SYNC_BN", "1") == "1",
    )
    x, y = bench_torch._data(2 * batch * (steps + 5))
    with strategy.scope():
        model = bench_torch._keras_model()
        model.compile(
            optimizer=keras.optimizers.SGD(0.01),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        )
        result = profile_fit(
            keras, model, x, y, 2 * batch, steps, "torch", "keras_dist"
        )
    if int(os.environ.get("RANK", "0")) != 0:
        return None
    return result


def _run_child(mode, steps):
    env = dict(os.environ, KERAS_BACKEND="torch", OMP_NUM_THREADS="1")
    proc = subprocess.run(
        [sys.executable, __file__, "--child", mode, "--steps", str(steps)],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    for line in proc.stdout.splitlines():
        if line.startswith("PROFILE "):
            return eval(line[len("PROFILE ") :])  # noqa: S307 - our output
    raise RuntimeError(f"{mode} failed:\n{proc.stderr[-3000:]}")


# -- JAX and TensorFlow -------------------------------------------------------
def _in_process(backend, steps):
    os.environ["KERAS_BACKEND"] = backend
    os.environ["KERAS_DIST_CPU_DEVICES"] = "4"
    sys.path.insert(0, HERE)
    import bench_fit
    import keras

    import keras_dist

    args = bench_fit.parse_args(["--samples", "8192"])
    x, y = bench_fit._make_data(args)
    results = {}
    for config in bench_fit._setup_configs(keras, args, backend):
        with config.context():
            results[config.name] = profile_fit(
                keras,
                config.model,
                x,
                y,
                args.batch_size,
                steps,
                backend,
                config.name,
            )
    del keras_dist
    return results


def main():
    """Profiles one backend and prints the per-phase table."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--backend", choices=("torch", "jax", "tensorflow"), required=False
    )
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        result = _torch_run(args.child, args.steps)
        if result is not None:
            print("PROFILE", repr(result), flush=True)
        return
    backend = args.backend or os.environ.get("KERAS_BACKEND", "jax")
    if backend == "torch":
        results = {
            "Keras, 1 process": _run_child("keras", args.steps),
            "keras_dist, 2 ranks": _run_child("keras_dist", args.steps),
        }
    else:
        results = _in_process(backend, args.steps)
    print(f"{backend}: ms per step by phase ({args.steps} steps)")
    print_table(results)


if __name__ == "__main__":
    main()

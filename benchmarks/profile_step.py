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
  (``BENCH_MODEL=dense|pooled``); with ``--device-type gpu`` Keras on the
  first GPU and keras_dist `MultiWorkerMirroredStrategy` as one NCCL rank
  per GPU (as ``BENCH_DEVICE=gpu bench_torch.py``). A GPU runs
  asynchronously: there a phase's time is the host's (the Python and the
  kernel launches), which is what a step of these models costs on a GPU;
  the step's total waits for the GPU;
* ``--backend jax`` / ``tensorflow``: plain Keras, keras_dist
  `MirroredStrategy` x4 and the anchor (`keras.distribution.DataParallel` /
  `tf.distribute.MirroredStrategy` x4) on 4 simulated CPU devices, the MLP of
  ``bench_fit.py``.

On JAX and TensorFlow a step's device work runs inside one compiled call:
there "dispatch" (JAX, asynchronous) or "compiled step" (TF, synchronous)
holds forward, backward, all-reduce and update together, and a JAX host
"wait" is the time the host blocks for the devices. The wrappers cost about
a microsecond per call; compare configurations, not absolute figures.

``--by-package`` adds, per configuration, a second timed fit under
cProfile and its own (exclusive) Python time per step summed by package:
where a Python-bound step's host time goes (``keras_dist``, ``keras``,
``torch``'s Python, and C functions called from Python). A tensor
operator (``a * b``) is no call cProfile sees: its time counts for the
function that applies it (on a CPU, compute; on a GPU, a launch).

Run::

    python benchmarks/profile_step.py --backend torch [--steps 30]
    python benchmarks/profile_step.py --backend torch --device-type gpu
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


def _synchronize(backend):
    """Waits for a GPU's queued torch work (nothing elsewhere)."""
    if backend == "torch":
        import torch

        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.synchronize()


def _package_of(filename):
    """The top-level package a profiled function belongs to."""
    if filename.startswith("~") or filename.startswith("<"):
        return "C functions (called from Python)"
    for package in ("keras_dist", "keras", "torch", "jax", "tensorflow"):
        if f"/{package}/" in filename:
            return package
    return "other Python"


def python_by_package(run, steps):
    """Own (exclusive) Python time per step of `run()` under cProfile,
    summed by package: ``{package: ms per step}``."""
    import cProfile
    import pstats

    profile = cProfile.Profile()
    profile.enable()
    run()
    profile.disable()
    totals = defaultdict(float)
    for (filename, _, _), row in pstats.Stats(profile).stats.items():
        totals[_package_of(filename)] += row[2]  # tottime
    return {k: 1e3 * v / steps for k, v in totals.items()}


def profile_fit(
    keras, model, x, y, batch, steps, backend, label, by_package=False
):
    """Profiles `steps` steps of ``model.fit`` after a warm-up fit.

    Returns:
        ``(ms per step, {phase: ms per step})``; with `by_package` also
        ``{package: ms of own Python per step}`` from a second fit under
        cProfile.
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
        _synchronize(backend)
        timer.active = True
        start = time.perf_counter()
        fit(steps)
        _synchronize(backend)
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
    if by_package:
        return step_ms, phases, python_by_package(lambda: fit(steps), steps)
    return step_ms, phases


def print_table(results):
    """One column per configuration: ms per step and % of the step."""
    names = list(results)
    phases = []
    for result in results.values():
        phases += [p for p in result[1] if p not in phases]
    width = max(len(p) for p in phases + ["step"]) + 2
    column = max(24, *(len(n) + 2 for n in names))
    head = "".join(f"{n:>{column}}" for n in names)
    print(f"{'phase':<{width}}{head}")
    for phase in phases:
        cells = ""
        for name in names:
            step, table = results[name][:2]
            ms = table.get(phase)
            cells += (
                f"{f'{ms:.2f} ({100 * ms / step:4.1f}%)':>{column}}"
                if ms is not None
                else f"{'-':>{column}}"
            )
        print(f"{phase:<{width}}{cells}")
    print(
        f"{'step':<{width}}"
        + "".join(f"{f'{results[n][0]:.2f} ms':>{column}}" for n in names)
    )
    packages = [r[2] for r in results.values() if len(r) > 2]
    if not packages:
        return
    print("own Python time under cProfile, ms per step, by package:")
    kinds = sorted({k for table in packages for k in table})
    print(f"{'package':<{width}}{head}")
    for kind in kinds:
        cells = "".join(
            f"{results[n][2].get(kind, 0.0):>{column}.2f}" for n in names
        )
        print(f"{kind:<{width}}{cells}")


# -- torch ---------------------------------------------------------------------
def _torch_run(mode, steps, by_package):
    sys.path.insert(0, HERE)
    import bench_torch
    import keras

    batch = bench_torch.BATCH
    # A run under cProfile needs data for its own fit too.
    fits = 2 if by_package else 1
    if mode == "keras":
        x, y = bench_torch._data(batch * (fits * steps + 5))
        model = bench_torch._keras_model()
        model.compile(
            optimizer=keras.optimizers.SGD(0.01),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        )
        return profile_fit(
            keras, model, x, y, batch, steps, "torch", "Keras", by_package
        )
    import keras_dist

    sync = os.environ.get("BENCH_SYNC_BN", "1") == "1"
    if bench_torch.GPU:  # one NCCL rank per GPU, even where there is one
        strategy = keras_dist.MultiWorkerMirroredStrategy(sync_batch_norm=sync)
    else:
        strategy = keras_dist.MirroredStrategy(
            devices=["cpu:0", "cpu:1"], sync_batch_norm=sync
        )
    world = strategy.num_replicas_in_sync
    x, y = bench_torch._data(world * batch * (fits * steps + 5))
    with strategy.scope():
        model = bench_torch._keras_model()
        model.compile(
            optimizer=keras.optimizers.SGD(0.01),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        )
        result = profile_fit(
            keras,
            model,
            x,
            y,
            world * batch,
            steps,
            "torch",
            "keras_dist",
            by_package,
        )
    if int(os.environ.get("RANK", "0")) != 0:
        return None
    return result


def _run_child(mode, steps, device_type, by_package):
    env = dict(os.environ, KERAS_BACKEND="torch", OMP_NUM_THREADS="1")
    env["BENCH_DEVICE"] = device_type
    extra = ["--by-package"] if by_package else []
    proc = subprocess.run(
        [
            sys.executable,
            __file__,
            "--child",
            mode,
            "--steps",
            str(steps),
            *extra,
        ],
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
def _in_process(backend, steps, by_package):
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
                by_package,
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
    parser.add_argument(
        "--device-type",
        choices=("cpu", "gpu"),
        default="cpu",
        help="torch: run on the GPUs (one NCCL rank per GPU)",
    )
    parser.add_argument(
        "--by-package",
        action="store_true",
        help="also each configuration's own Python time by package",
    )
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        result = _torch_run(args.child, args.steps, args.by_package)
        if result is not None:
            print("PROFILE", repr(result), flush=True)
        return
    backend = args.backend or os.environ.get("KERAS_BACKEND", "jax")
    if backend == "torch":
        gpu = args.device_type == "gpu"
        run = functools.partial(
            _run_child,
            steps=args.steps,
            device_type=args.device_type,
            by_package=args.by_package,
        )
        results = {
            "Keras, 1 process": run("keras"),
            ("keras_dist, 1 rank/GPU" if gpu else "keras_dist, 2 ranks"): run(
                "keras_dist"
            ),
        }
    else:
        if args.device_type != "cpu":
            parser.error("--device-type gpu is for --backend torch")
        results = _in_process(backend, args.steps, args.by_package)
    print(f"{backend}: ms per step by phase ({args.steps} steps)")
    print_table(results)


if __name__ == "__main__":
    main()

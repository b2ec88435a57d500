"""Steady-state step time of `model.fit`: keras_dist against its anchors.

For one Keras backend per process (``KERAS_BACKEND``, or ``--backend``),
trains the same model on the same data under four configurations, side by
side in one process:

(a) ``native``: plain Keras on one device, no keras_dist at all;
(b) ``one_device``: ``keras_dist.OneDeviceStrategy("cpu:0")``;
(c) ``mirrored``: ``keras_dist.MirroredStrategy`` on N devices;
(d) ``anchor``: the backend's own data parallelism on the same N devices:
    ``keras.distribution.DataParallel`` on JAX,
    ``tf.distribute.MirroredStrategy`` on TensorFlow.

Each configuration gets a warm-up ``fit`` of one epoch; then the
configurations take turns (a, b, c, d, a, b, c, d, ...) for ``--repeats``
timed ``fit`` calls each, so that machine noise hits all of them alike. A
callback times each epoch from the start of batch ``--skip`` (the first
batches of an epoch pay for creating the data iterator) to the start of the
last batch on TensorFlow, whose steps run synchronously, or to the end of
the epoch on JAX, whose steps are dispatched asynchronously; one epoch so
gives the mean steady-state step time. A repeat's value is the mean over its
epochs, and the table shows the median over repeats.

``--diagnose`` (JAX) adds (e) ``unbounded``: keras_dist's MirroredStrategy
with its bound on steps in flight on CPU devices removed (unbounded
dispatch, as ``DataParallel`` and as keras_dist on GPUs and TPUs). It is a
diagnostic, not a configuration to ship: unbounded dispatch can deadlock
XLA's CPU collectives under load (``tests/test_jax_stress.py``); (e)/(d)
says what the bound costs a step.

``--whole`` times entire ``fit`` calls instead, as a user meets them:
each epoch with its iterator's creation, a validation pass over held-out
data (a quarter of the training set's size) and a
``keras.callbacks.ModelCheckpoint`` saving the weights at every epoch's
end; the table then gives milliseconds per epoch (the whole ``fit`` call's
wall time over its epochs).

``--steps-per-execution N`` compiles every configuration with Keras's
``steps_per_execution=N`` (use it with ``--whole``: Keras calls per-batch
callbacks once a group of steps).

``--backend all`` runs this script once per backend (jax, tensorflow) in a
subprocess with a clean environment and prints all results together.

Example::

    python benchmarks/bench_fit.py --backend all --json /tmp/bench.json
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time

BACKENDS = ("jax", "tensorflow")
CONFIGS = ("native", "one_device", "mirrored", "anchor")
LABELS = {
    "native": "(a) native Keras, 1 device",
    "one_device": "(b) keras_dist.OneDeviceStrategy",
    "mirrored": "(c) keras_dist.MirroredStrategy",
    "anchor": "(d) anchor",
    "unbounded": "(e) (c), dispatch unbounded",
}
ANCHORS = {
    "jax": "keras.distribution.DataParallel",
    "tensorflow": "tf.distribute.MirroredStrategy",
}
TARGETS = {"b/a": 1.03, "c/d": 1.0}
# Environment variables that would leak one run's backend or device setup
# into the next; `--backend all` removes them before starting each child.
_LEAKY_ENV = (
    "KERAS_BACKEND",
    "KERAS_DIST_CPU_DEVICES",
    "XLA_FLAGS",
    "JAX_NUM_CPU_DEVICES",
    "JAX_PLATFORMS",
)


def parse_args(argv=None) -> argparse.Namespace:
    """Parses the command line; `--quick` shrinks the defaults."""
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--backend",
        choices=BACKENDS + ("all",),
        default=None,
        help="backend to run (default: $KERAS_BACKEND); 'all' runs each "
        "backend in its own clean subprocess",
    )
    parser.add_argument(
        "--devices",
        type=int,
        default=4,
        help="number of simulated CPU devices for (c) and (d) (default 4)",
    )
    parser.add_argument(
        "--device-type",
        choices=("cpu", "gpu"),
        default="cpu",
        help="train on CPU devices (simulated; default) or on the first "
        "--devices GPUs (all four configurations)",
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="smoke run of about a minute for both backends",
    )
    parser.add_argument("--samples", type=int, help="data set size")
    parser.add_argument("--features", type=int, default=64)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--classes", type=int, default=10)
    parser.add_argument(
        "--batch-size", type=int, default=256, help="global batch size"
    )
    parser.add_argument(
        "--epochs", type=int, help="timed epochs per fit call (per repeat)"
    )
    parser.add_argument(
        "--repeats", type=int, help="timed fit calls per configuration"
    )
    parser.add_argument(
        "--skip",
        type=int,
        default=3,
        help="first batches of each epoch left out of the timing",
    )
    parser.add_argument(
        "--diagnose",
        action="store_true",
        help="JAX: also time (e), keras_dist's MirroredStrategy without its "
        "bound on steps in flight on CPU devices (what the bound costs)",
    )
    parser.add_argument(
        "--whole",
        action="store_true",
        help="time whole fit calls (iterator, validation, a checkpoint "
        "every epoch) in ms per epoch, not steady-state steps",
    )
    parser.add_argument(
        "--steps-per-execution",
        type=int,
        default=1,
        help="Keras's steps_per_execution for every configuration (with "
        "--whole: per-batch callbacks see groups, not steps)",
    )
    parser.add_argument("--json", metavar="PATH", help="write results here")
    args = parser.parse_args(argv)
    if args.samples is None:
        args.samples = 4096 if args.quick else 8192
    if args.epochs is None:
        args.epochs = 1 if args.quick else 2
    if args.repeats is None:
        args.repeats = 5 if args.quick else 16
    if args.samples % args.batch_size:
        parser.error(
            f"--samples ({args.samples}) must be divisible by --batch-size "
            f"({args.batch_size}): keras.distribution.DataParallel fails on "
            "a partial last batch."
        )
    if args.batch_size % args.devices:
        parser.error("--batch-size must be divisible by --devices.")
    if args.samples // args.batch_size < args.skip + 2:
        parser.error("an epoch needs at least --skip + 2 batches.")
    return args


# -- one backend, in this process ---------------------------------------------
def _make_data(args):
    import numpy as np

    rng = np.random.default_rng(0)
    x = rng.standard_normal((args.samples, args.features)).astype("float32")
    y = rng.integers(0, args.classes, size=(args.samples,)).astype("int32")
    return x, y


def build_model(keras, args):
    """The benchmark model: a small MLP, no BatchNormalization.

    Built and compiled in the caller's current scope (strategy or
    distribution), with a fixed seed so every configuration starts from the
    same weights.
    """
    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [
            keras.Input((args.features,)),
            keras.layers.Dense(args.hidden, activation="relu"),
            keras.layers.Dense(args.hidden, activation="relu"),
            keras.layers.Dense(args.classes),
        ],
        name="mlp",
    )
    model.compile(
        optimizer="adam",
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
        steps_per_execution=args.steps_per_execution,
    )
    return model


def _model_description(args) -> str:
    return (
        f"MLP {args.features}-{args.hidden}-{args.hidden}-{args.classes} "
        "(Dense+ReLU, no BatchNormalization), adam, sparse CE + accuracy; "
        f"{args.samples} samples, global batch {args.batch_size} "
        f"({args.samples // args.batch_size} steps/epoch)"
    )


def _step_timer(keras, skip, synchronous):
    """Returns a callback that records steady-state ms/step per epoch.

    The clock starts when batch `skip` begins. With `synchronous` steps
    (TensorFlow: a call of the compiled step returns finished results) it
    stops when the epoch's last batch begins, which leaves out the
    end-of-epoch work (metric results, iterator teardown). JAX dispatches
    steps asynchronously, so there the clock stops at the end of the epoch,
    the first point where Keras has waited for the last step's results.
    """

    class StepTimer(keras.callbacks.Callback):
        # Only *_begin/epoch hooks: overriding on_train_batch_end would turn
        # off Keras's asynchronous callback dispatch and change the timing.

        def __init__(self):
            super().__init__()
            self.epoch_ms = []
            self._start = None
            self._last = None

        def on_epoch_begin(self, epoch, logs=None):
            self._start = None
            self._last = None

        def on_train_batch_begin(self, batch, logs=None):
            now = time.perf_counter()
            if batch == skip:
                self._start = now
            self._last = (batch, now)

        def on_epoch_end(self, epoch, logs=None):
            # Keras has flushed its pending batch callbacks, which read the
            # last step's logs, so every step of the epoch has finished.
            end = time.perf_counter()
            if self._start is None:
                return
            last, last_begin = self._last
            if synchronous:
                steps, end = last - skip, last_begin
            else:
                steps = last - skip + 1
            if steps > 0:
                self.epoch_ms.append((end - self._start) * 1e3 / steps)

    return StepTimer()


class _Config:
    """A model plus the context its build and fit calls run in."""

    def __init__(self, name, model, context):
        self.name = name
        self.model = model
        self.context = context  # callable returning a context manager
        self.repeats_ms = []


def _setup_configs(keras, args, backend):
    import keras_dist

    kind = args.device_type
    devices = [f"{kind}:{i}" for i in range(args.devices)]
    configs = []

    model = build_model(keras, args)
    configs.append(_Config("native", model, contextlib.nullcontext))

    one = keras_dist.OneDeviceStrategy(devices[0])
    with one.scope():
        model = build_model(keras, args)
    configs.append(_Config("one_device", model, contextlib.nullcontext))

    mirrored = keras_dist.MirroredStrategy(devices=devices)
    with mirrored.scope():
        model = build_model(keras, args)
    configs.append(_Config("mirrored", model, contextlib.nullcontext))

    if backend == "jax":
        chosen = keras.distribution.list_devices(kind)[: args.devices]
        data_parallel = keras.distribution.DataParallel(devices=chosen)

        @contextlib.contextmanager
        def anchor_context():
            keras.distribution.set_distribution(data_parallel)
            try:
                yield
            finally:
                keras.distribution.set_distribution(None)

    else:
        import tensorflow as tf

        tf_strategy = tf.distribute.MirroredStrategy(
            devices=[f"/device:{kind.upper()}:{i}" for i in range(args.devices)]
        )
        anchor_context = tf_strategy.scope
    with anchor_context():
        model = build_model(keras, args)
    configs.append(_Config("anchor", model, anchor_context))
    if args.diagnose and backend == "jax":
        unbounded = keras_dist.MirroredStrategy(devices=devices)
        # The engine's bound (None: unbounded dispatch, as on accelerators).
        unbounded.extended.max_in_flight = None
        with unbounded.scope():
            model = build_model(keras, args)
        configs.append(_Config("unbounded", model, contextlib.nullcontext))
    return configs


def _fit(keras, config, x, y, args, epochs):
    if args.whole:
        return _whole_fit(keras, config, x, y, args, epochs)
    synchronous = keras.backend.backend() == "tensorflow"
    timer = _step_timer(keras, args.skip, synchronous)
    gc.collect()  # not during the timed steps, if it can be helped
    with config.context():
        config.model.fit(
            x,
            y,
            batch_size=args.batch_size,
            epochs=epochs,
            shuffle=False,
            verbose=0,
            callbacks=[timer],
        )
    return timer.epoch_ms


def _whole_fit(keras, config, x, y, args, epochs):
    """One whole `fit` (validation, a checkpoint every epoch): returns
    ``[ms per epoch]`` from its wall time."""
    held = len(x) // 4
    rng_x, rng_y = x[::-1][:held], y[::-1][:held]  # reversed: unseen order
    with tempfile.TemporaryDirectory() as tmp:
        checkpoint = keras.callbacks.ModelCheckpoint(
            os.path.join(tmp, f"{config.name}.weights.h5"),
            save_weights_only=True,
        )
        gc.collect()
        with config.context():
            start = time.perf_counter()
            config.model.fit(
                x,
                y,
                batch_size=args.batch_size,
                epochs=epochs,
                shuffle=False,
                verbose=0,
                validation_data=(rng_x, rng_y),
                callbacks=[checkpoint],
            )
            took = time.perf_counter() - start
    return [took * 1e3 / epochs]


def _versions(backend) -> dict:
    import keras

    versions = {"python": platform.python_version(), "keras": keras.__version__}
    if backend == "jax":
        import jax

        versions["jax"] = jax.__version__
    else:
        import tensorflow as tf

        versions["tensorflow"] = tf.__version__
    return versions


def run_backend(args) -> dict:
    """Runs the benchmark for the backend of this process; returns results.

    Sets ``KERAS_BACKEND`` (from ``--backend``) and
    ``KERAS_DIST_CPU_DEVICES`` before importing Keras, so it must run before
    Keras or keras_dist is imported.
    """
    if args.backend:
        os.environ["KERAS_BACKEND"] = args.backend
    os.environ["KERAS_DIST_CPU_DEVICES"] = str(args.devices)
    import keras

    import keras_dist  # noqa: F401  (simulates the CPU devices at import)

    backend = keras.backend.backend()
    if backend not in BACKENDS:
        raise SystemExit(f"bench_fit supports {BACKENDS}, not {backend!r}.")
    print(f"[{backend}] {_model_description(args)}", flush=True)
    print(
        f"[{backend}] {args.devices} {args.device_type} devices; "
        f"{args.repeats} repeats x {args.epochs} epochs, skipping "
        f"{args.skip} batches per epoch",
        flush=True,
    )
    x, y = _make_data(args)
    started = time.perf_counter()
    configs = _setup_configs(keras, args, backend)
    for config in configs:
        warm = time.perf_counter()
        _fit(keras, config, x, y, args, epochs=1)
        print(
            f"[{backend}] warm-up {config.name}: "
            f"{time.perf_counter() - warm:.1f}s",
            flush=True,
        )
    for repeat in range(args.repeats):
        for config in configs:  # interleaved: a, b, c, d, a, b, c, d, ...
            epoch_ms = _fit(keras, config, x, y, args, args.epochs)
            config.repeats_ms.append(statistics.fmean(epoch_ms))
        line = "  ".join(f"{c.name}={c.repeats_ms[-1]:.3f}" for c in configs)
        unit = "ms/epoch" if args.whole else "ms/step"
        print(f"[{backend}] repeat {repeat + 1}: {line} {unit}", flush=True)

    results = {}
    for config in configs:
        results[config.name] = {
            "label": LABELS[config.name],
            "median_ms": statistics.median(config.repeats_ms),
            "min_ms": min(config.repeats_ms),
            "max_ms": max(config.repeats_ms),
            "repeats_ms": config.repeats_ms,
        }
    med = {name: r["median_ms"] for name, r in results.items()}
    per_repeat = {c.name: c.repeats_ms for c in configs}
    pairs = {"b/a": ("one_device", "native"), "c/d": ("mirrored", "anchor")}
    if "unbounded" in med:
        pairs["e/d"] = ("unbounded", "anchor")

    def paired(num, den):
        pairs = zip(per_repeat[num], per_repeat[den], strict=True)
        ratios = [n / d for n, d in pairs]
        if len(ratios) < 2:
            return {"median": ratios[0], "q1": ratios[0], "q3": ratios[0]}
        q1, median, q3 = statistics.quantiles(ratios, n=4)
        return {"median": median, "q1": q1, "q3": q3}

    return {
        "backend": backend,
        "anchor": ANCHORS[backend],
        "devices": args.devices,
        "model": _model_description(args),
        "batch_norm": False,
        "samples": args.samples,
        "batch_size": args.batch_size,
        "steps_per_execution": args.steps_per_execution,
        "epochs_per_repeat": args.epochs,
        "repeats": args.repeats,
        "skip": args.skip,
        "unit": "ms/epoch (whole fit)" if args.whole else "ms/step",
        "results": results,
        "ratios": {key: med[n] / med[d] for key, (n, d) in pairs.items()},
        # Median over repeats of the ratio within each repeat: the two
        # configurations of a pair ran back to back, so this cancels slow
        # drifts in machine load better than the ratio of medians.
        "paired_ratios": {key: paired(n, d) for key, (n, d) in pairs.items()},
        "targets": dict(TARGETS),
        "seconds": time.perf_counter() - started,
        "versions": _versions(backend),
    }


# -- every backend, one subprocess each ---------------------------------------
def child_env(backend: str, devices: int) -> dict:
    """A clean environment for one backend's child process."""
    env = {k: v for k, v in os.environ.items() if k not in _LEAKY_ENV}
    env["KERAS_BACKEND"] = backend
    env["KERAS_DIST_CPU_DEVICES"] = str(devices)
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    return env


def _child_argv(args, backend: str, json_path: str) -> list:
    argv = [sys.executable, os.path.abspath(__file__), "--backend", backend]
    for flag in (
        "devices",
        "device_type",
        "samples",
        "features",
        "hidden",
        "classes",
        "batch_size",
        "epochs",
        "repeats",
        "skip",
        "steps_per_execution",
    ):
        argv += [f"--{flag.replace('_', '-')}", str(getattr(args, flag))]
    if args.diagnose:
        argv.append("--diagnose")
    if args.whole:
        argv.append("--whole")
    return argv + ["--json", json_path]


def run_all(args) -> dict:
    """Runs every backend in its own subprocess and collects the results."""
    runs = {}
    with tempfile.TemporaryDirectory() as tmp:
        for backend in BACKENDS:
            path = os.path.join(tmp, f"{backend}.json")
            command = _child_argv(args, backend, path)
            env = child_env(backend, args.devices)
            code = subprocess.run(command, env=env, check=False).returncode
            if code != 0 or not os.path.exists(path):
                runs[backend] = {"backend": backend, "error": f"exit {code}"}
                continue
            with open(path) as f:
                runs[backend] = json.load(f)["runs"][backend]
    return runs


# -- output -------------------------------------------------------------------
def format_table(runs: dict) -> str:
    """Formats the results of one or more backends as a text table."""
    units = {run.get("unit", "ms/step") for run in runs.values()}
    unit = "ms/epoch" if "ms/epoch (whole fit)" in units else "ms/step"
    lines = [
        f"{'backend':<11} {'config':<40} {'median ' + unit:>14} "
        f"{'min..max':>16}"
    ]
    for backend, run in runs.items():
        if "error" in run:
            lines.append(f"{backend:<11} FAILED ({run['error']})")
            continue
        for name in CONFIGS + ("unbounded",):
            if name not in run["results"]:
                continue
            r = run["results"][name]
            label = r["label"]
            if name == "anchor":
                label = f"(d) {run['anchor']}"
            if name in ("mirrored", "anchor", "unbounded"):
                label += f" x{run['devices']}"
            spread = f"{r['min_ms']:.3f}..{r['max_ms']:.3f}"
            lines.append(
                f"{backend:<11} {label:<40} {r['median_ms']:>14.3f} "
                f"{spread:>16}"
            )
        for key, value in run["ratios"].items():
            target = run["targets"].get(key)
            if target is None:
                verdict = "diagnostic, no target"
            else:
                verdict = "target <= {:.2f}: {}".format(
                    target, "ok" if value <= target else "ABOVE TARGET"
                )
            paired = run["paired_ratios"][key]
            lines.append(
                f"{backend:<11} ratio ({key[0]})/({key[2]}) = {value:.3f} "
                f"({verdict})"
            )
            lines.append(
                f"{'':<11}   per-repeat ratios: median {paired['median']:.3f}"
                f", quartiles {paired['q1']:.3f}..{paired['q3']:.3f}"
            )
    return "\n".join(lines)


def main(argv=None) -> int:
    """Command-line entry point."""
    args = parse_args(argv)
    started = time.perf_counter()
    if args.backend == "all":
        runs = run_all(args)
    else:
        run = run_backend(args)
        runs = {run["backend"]: run}
    print()
    print("Model: " + _model_description(args))
    where = (
        "are simulated and share them"
        if args.device_type == "cpu"
        else f"are GPUs (the first {args.devices})"
    )
    cores = os.cpu_count()
    print(f"Machine: {cores} CPU cores; the {args.devices} devices {where}.")
    print(format_table(runs))
    print(f"Total: {time.perf_counter() - started:.0f}s")
    if args.json:
        report = {
            "command": " ".join([os.path.basename(sys.executable)] + sys.argv),
            "cpu_count": os.cpu_count(),
            "platform": platform.platform(),
            "runs": runs,
        }
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    failed = [b for b, r in runs.items() if "error" in r]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

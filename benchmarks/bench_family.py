"""Step time of CentralStorage and ParameterServer: keras_dist against anchors.

Issue #18 item 5: each strategy of the tf.distribute family gets the same
side-by-side benchmark as Mirrored (`bench_fit.py`) and ModelParallel
(`bench_model_parallel.py`). Two families, each on the backends where
keras_dist offers it:

``central_storage`` (in one process; ``bench_fit.py``'s MLP, data and
global batch, on ``--devices`` simulated CPU devices, 2 by default):

* TensorFlow: ``keras_dist.CentralStorageStrategy(devices=cpu:0..N-1)``
  against ``tf.distribute.experimental.CentralStorageStrategy`` with the
  same compute devices and parameter device (``/cpu:0``, the choice of
  both for several devices), the model built and compiled in its scope and
  trained by Keras's own ``fit`` (which works there for a model without
  BatchNormalization; keras_dist's also handles BatchNormalization).
* JAX: ``keras_dist.CentralStorageStrategy`` keeps the replicated state in
  host memory (``pinned_host``) between steps and computes on the devices
  (see ``keras_dist/_src/backends/jax/central_storage.py``). Keras has no
  host-memory strategy of its own; the stock path that computes the same
  step on the same devices is ``keras.distribution.DataParallel`` (state
  replicated in device memory), so that is the anchor, and the ratio is
  the price of keeping the state off the devices (on CPU devices, a copy
  between memory kinds per step).
* torch: keras_dist's CentralStorage raises (use MirroredStrategy): no row.

``parameter_server`` (TensorFlow only; JAX and torch raise): a chief (this
process) and ``--workers`` worker tasks plus ``--ps`` ps tasks, each a
subprocess running a ``tf.distribute.Server`` on a free loopback port
(``--in-process`` starts the servers in this process instead, quicker but
sharing its threads). Stock Keras 3 ``fit`` does not run under
``tf.distribute.ParameterServerStrategy`` at all (it asks for
``ClusterCoordinator.create_per_worker_dataset``; the script records the
error it raises), so the anchor is TensorFlow's documented custom loop
around Keras's own ``train_step``: the model built in the TF strategy's
scope, a per-worker dataset from ``create_per_worker_dataset``, one
``tf.function`` step scheduled ``--steps`` times with
``ClusterCoordinator.schedule`` and one ``join`` per epoch. keras_dist's
``ParameterServerStrategy`` runs ``model.fit`` with ``steps_per_epoch``
on the same dataset function. Both use the same TensorFlow strategy and
coordinator (``strategy.coordinator`` and its ``.strategy``: one chief
connects to a cluster once), so their variables live on the same ps tasks.
An epoch is timed from its first scheduled step to its join and the read of
its metrics, divided by its steps (the anchor computes Keras's stock
metrics and counters, which lose updates under concurrent workers; see
guides/parameter_server.md). ``--diagnose`` adds two variants of the
anchor, each with one thing keras_dist does differently: atomic
``assign_add`` (exact counters) and its closure (a ``tf.range`` loop over
a step count, for ``steps_per_execution``).

Each configuration gets a warm-up epoch; then the configurations take
turns for ``--repeats`` timed calls each (interleaved, so machine noise
hits all alike). The table shows the median ms per step over repeats, and
the ratio ours / anchor: the ratio of medians and the median and quartiles
of the per-repeat ratios.

Example::

    python benchmarks/bench_family.py --json /tmp/family.json  # 6 min, loaded
    python benchmarks/bench_family.py --family parameter_server --quick
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import gc
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_fit  # noqa: E402  (the shared model, data and step timer)

#: (family, backend) runs of `--family all`, each in its own subprocess.
RUNS = (
    ("central_storage", "tensorflow"),
    ("central_storage", "jax"),
    ("parameter_server", "tensorflow"),
)
ANCHORS = {
    ("central_storage", "tensorflow"): (
        "tf.distribute.experimental.CentralStorageStrategy + Keras fit"
    ),
    ("central_storage", "jax"): "keras.distribution.DataParallel + Keras fit",
    ("parameter_server", "tensorflow"): (
        "tf.distribute.ParameterServerStrategy + ClusterCoordinator "
        "scheduling Keras's train_step"
    ),
}
#: Why a family has no run on a backend (keras_dist raises there).
NOT_OFFERED = {
    ("central_storage", "torch"): "keras_dist raises: use MirroredStrategy",
    ("parameter_server", "jax"): "keras_dist raises: use ModelParallel",
    ("parameter_server", "torch"): "keras_dist raises: use ModelParallel",
}


def parse_args(argv=None) -> argparse.Namespace:
    """Parses the command line; `--quick` shrinks the defaults."""
    parser = argparse.ArgumentParser(description=__doc__.partition("\n")[0])
    parser.add_argument(
        "--family",
        choices=("central_storage", "parameter_server", "all"),
        default="all",
    )
    parser.add_argument(
        "--backend",
        choices=("jax", "tensorflow"),
        default=None,
        help="with one --family: the backend (default: every one offered)",
    )
    parser.add_argument("--quick", action="store_true", help="a smoke run")
    parser.add_argument(
        "--devices",
        type=int,
        default=2,
        help="CentralStorage: simulated CPU compute devices (default 2)",
    )
    parser.add_argument("--samples", type=int, default=8192)
    parser.add_argument("--features", type=int, default=64)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--classes", type=int, default=10)
    parser.add_argument(
        "--batch-size",
        type=int,
        default=256,
        help="CentralStorage: the global batch; ParameterServer: each "
        "worker's batch (there is no global batch under PS)",
    )
    parser.add_argument("--epochs", type=int, help="timed epochs per repeat")
    parser.add_argument("--repeats", type=int, help="timed calls per config")
    parser.add_argument(
        "--skip",
        type=int,
        default=3,
        help="CentralStorage: first batches of an epoch left out",
    )
    parser.add_argument(
        "--steps", type=int, help="ParameterServer: steps per epoch"
    )
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--ps", type=int, default=1)
    parser.add_argument(
        "--diagnose",
        action="store_true",
        help="ParameterServer: also time the anchor with keras_dist's "
        "atomic updates, and with keras_dist's tf.range closure",
    )
    parser.add_argument(
        "--in-process",
        action="store_true",
        help="ParameterServer: servers in this process, not subprocesses",
    )
    parser.add_argument("--json", metavar="PATH", help="write results here")
    args = parser.parse_args(argv)
    if args.epochs is None:
        args.epochs = 1
    if args.repeats is None:
        args.repeats = 3 if args.quick else 8
    if args.steps is None:
        args.steps = 20 if args.quick else 40
    if args.quick:
        args.samples = min(args.samples, 4096)
    if args.samples % args.batch_size or args.batch_size % args.devices:
        parser.error(
            "--samples must be divisible by --batch-size, and --batch-size "
            "by --devices (DataParallel fails on a partial last batch)."
        )
    if args.samples // args.batch_size < args.skip + 2:
        parser.error("an epoch needs at least --skip + 2 batches.")
    return args


def _stats(values) -> dict:
    """Median and quartiles of `values` (one value: all three equal)."""
    if len(values) < 2:
        return {"median": values[0], "q1": values[0], "q3": values[0]}
    q1, median, q3 = statistics.quantiles(values, n=4)
    return {"median": median, "q1": q1, "q3": q3}


def _summary(ours_ms, anchor_ms) -> dict:
    """The figures of one (family, backend) run from per-repeat ms/step."""
    ratios = [o / a for o, a in zip(ours_ms, anchor_ms, strict=True)]
    return {
        "ours_ms": ours_ms,
        "anchor_ms": anchor_ms,
        "ours": _stats(ours_ms),
        "anchor": _stats(anchor_ms),
        "ratio_of_medians": statistics.median(ours_ms)
        / statistics.median(anchor_ms),
        "paired_ratio": _stats(ratios),
    }


def _interleave(configs, run_one, repeats, label):
    """Warms each config up, then times them in turn; returns ms lists."""
    for name, config in configs.items():
        started = time.perf_counter()
        run_one(config, warm=True)
        print(
            f"[{label}] warm-up {name}: {time.perf_counter() - started:.1f}s",
            flush=True,
        )
    timed = {name: [] for name in configs}
    calls = {name: [] for name in configs}  # seconds of each whole call
    for repeat in range(repeats):
        for name, config in configs.items():
            gc.collect()  # not during the timed steps, if it can be helped
            started = time.perf_counter()
            timed[name].append(run_one(config, warm=False))
            calls[name].append(time.perf_counter() - started)
        line = "  ".join(
            f"{n}={v[-1]:.3f} ms/step ({calls[n][-1]:.1f}s)"
            for n, v in timed.items()
        )
        print(f"[{label}] repeat {repeat + 1}: {line}", flush=True)
    timed["call_s"] = {n: statistics.median(v) for n, v in calls.items()}
    return timed


# -- CentralStorage -----------------------------------------------------------
def run_central_storage(args, keras, backend) -> dict:
    """keras_dist's CentralStorage against the backend's anchor (module
    doc), in this process."""
    import keras_dist

    x, y = bench_fit._make_data(args)
    devices = [f"cpu:{i}" for i in range(args.devices)]
    strategy = keras_dist.CentralStorageStrategy(devices=devices)
    with strategy.scope():
        ours = bench_fit.build_model(keras, args)
    if backend == "tensorflow":
        import tensorflow as tf

        tf_strategy = tf.distribute.experimental.CentralStorageStrategy(
            compute_devices=[f"/device:CPU:{i}" for i in range(args.devices)],
            parameter_device="/cpu:0",
        )
        anchor_context = tf_strategy.scope
        where = {"ours": strategy.parameter_device, "anchor": "/cpu:0"}
    else:
        cpus = keras.distribution.list_devices("cpu")[: args.devices]
        data_parallel = keras.distribution.DataParallel(devices=cpus)
        anchor_context = data_parallel.scope  # set, then the previous one
        where = {"ours": strategy.parameter_device, "anchor": "device"}
    with anchor_context():
        anchor = bench_fit.build_model(keras, args)
    configs = {
        "ours": bench_fit._Config("ours", ours, contextlib.nullcontext),
        "anchor": bench_fit._Config("anchor", anchor, anchor_context),
    }

    def run_one(config, warm):
        epoch_ms = bench_fit._fit(
            keras, config, x, y, args, 1 if warm else args.epochs
        )
        return statistics.fmean(epoch_ms)

    label = f"central_storage/{backend}"
    timed = _interleave(configs, run_one, args.repeats, label)
    if backend == "jax":  # where the state was between steps
        kernel = ours.trainable_variables[0].value
        where["ours_after_fit"] = kernel.sharding.memory_kind
    return {
        **_summary(timed["ours"], timed["anchor"]),
        "call_s": timed["call_s"],
        "state_lives": where,
        "devices": args.devices,
        "model": bench_fit._model_description(args),
    }


# -- ParameterServer ----------------------------------------------------------
def _epoch_timer(keras, steps, out):
    """A callback that appends each epoch's ms per step to `out`: from
    the epoch's start to keras_dist's single batch-end call, which comes
    after the epoch's join and the read of its metrics."""

    class EpochTimer(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            self._start = time.perf_counter()

        def on_train_batch_end(self, batch, logs=None):
            elapsed = time.perf_counter() - self._start
            out.append(elapsed * 1e3 / steps)

    return EpochTimer()


def _stock_fit_error(keras, tf_strategy, dataset_fn, args):
    """What stock Keras's `fit` says under TF's ParameterServerStrategy."""
    with tf_strategy.scope():
        model = bench_fit.build_model(keras, args)
    try:
        keras.Model.fit(
            model, dataset_fn(), steps_per_epoch=2, epochs=1, verbose=0
        )
    except Exception as error:  # noqa: BLE001 - recorded, not raised
        return f"{type(error).__name__}: {str(error).splitlines()[0][:200]}"
    return None


def _coordinator_loop(
    keras, args, coordinator, x, y, atomic=False, range_loop=False
):
    """The anchor: a model built in TF's strategy scope and a function
    that times epochs of Keras's `train_step` scheduled one step per
    closure. `atomic` gives its variables keras_dist's atomic updates;
    `range_loop` schedules keras_dist's closure instead (a ``tf.range``
    loop over a step count), to tell what each costs.

    Returns:
        ``(model, run)``: ``run(iterator, warm)`` returns ms per step.
    """
    import numpy as np
    import tensorflow as tf

    tf_strategy = coordinator.strategy
    batch = args.batch_size
    with tf_strategy.scope():
        model = bench_fit.build_model(keras, args)
        # Keras builds its optimizer and metrics in the first step, which
        # a worker cannot do (variables live on the ps tasks): build them
        # on the chief, as TF's PS guide does.
        model.optimizer.build(model.trainable_variables)
        model.compute_metrics(x[:batch], y[:batch], model(x[:batch]))
        model.reset_metrics()
    if atomic:
        from keras_dist._src.keras_glue.parameter_server import (
            make_updates_atomic,
        )

        make_updates_atomic(
            model.variables
            + model.metrics_variables
            + model.optimizer.variables
        )

    @tf.function
    def one_step(iterator):
        tf_strategy.run(model.train_step, args=(next(iterator),))

    @tf.function
    def range_steps(iterator, steps):
        for _ in tf.range(steps):
            tf_strategy.run(model.train_step, args=(next(iterator),))

    def schedule(iterator):
        if range_loop:
            one = tf.constant(1, "int32")
            coordinator.schedule(range_steps, args=(iterator, one))
        else:
            coordinator.schedule(one_step, args=(iterator,))

    def run(iterator, warm):
        epoch_ms = []
        for _ in range(1 if warm else args.epochs):
            model.reset_metrics()
            start = time.perf_counter()
            for _ in range(args.steps):
                schedule(iterator)
            coordinator.join()
            logs = model.get_metrics_result()
            {k: float(np.asarray(v)) for k, v in logs.items()}
            epoch_ms.append((time.perf_counter() - start) * 1e3 / args.steps)
        return statistics.fmean(epoch_ms)

    return model, run


def run_parameter_server(args, keras) -> dict:
    """keras_dist's ParameterServer fit against TF's coordinator loop
    around Keras's train_step (module doc), this process as the chief."""
    import tensorflow as tf

    import keras_dist
    from keras_dist._src.cluster import parameter_server as ps

    x, y = bench_fit._make_data(args)
    batch = args.batch_size

    def dataset_fn():
        data = tf.data.Dataset.from_tensor_slices((x, y))
        return data.repeat().batch(batch, drop_remainder=True)

    if args.in_process:
        cluster = ps.in_process_cluster(args.workers, args.ps)
        cluster_context = contextlib.nullcontext((cluster, {}))
    else:
        cluster_context = ps.local_cluster(args.workers, args.ps)
    with cluster_context as (cluster, _):
        strategy = keras_dist.ParameterServerStrategy(cluster)
        coordinator = strategy.coordinator
        tf_strategy = coordinator.strategy
        with strategy.scope():
            ours = bench_fit.build_model(keras, args)
        per_worker = coordinator.create_per_worker_dataset(dataset_fn)
        iterator = iter(per_worker)
        anchors = {"anchor": _coordinator_loop(keras, args, coordinator, x, y)}
        if args.diagnose:  # the anchor, each with one of keras_dist's ways
            anchors["anchor+atomic"] = _coordinator_loop(
                keras, args, coordinator, x, y, atomic=True
            )
            anchors["anchor+range_loop"] = _coordinator_loop(
                keras, args, coordinator, x, y, range_loop=True
            )

        def run_ours(warm):
            epoch_ms = []
            ours.fit(
                dataset_fn,
                epochs=1 if warm else args.epochs,
                steps_per_epoch=args.steps,
                verbose=0,
                callbacks=[_epoch_timer(keras, args.steps, epoch_ms)],
            )
            return statistics.fmean(epoch_ms)

        configs = {"ours": run_ours}
        for name, (_, run) in anchors.items():
            configs[name] = functools.partial(run, iterator)
        timed = _interleave(
            configs,
            lambda run, warm: run(warm=warm),
            args.repeats,
            "parameter_server/tensorflow",
        )
        counters = {
            "ours_iterations": int(ours.optimizer.iterations.numpy()),
            "anchor_iterations": int(
                anchors["anchor"][0].optimizer.iterations.numpy()
            ),
            "scheduled_each": args.steps * (1 + args.repeats * args.epochs),
        }
        stock_fit = _stock_fit_error(keras, tf_strategy, dataset_fn, args)
    return {
        **_summary(timed["ours"], timed["anchor"]),
        "workers": args.workers,
        "ps": args.ps,
        "in_process": bool(args.in_process),
        "steps_per_epoch": args.steps,
        "counters": counters,
        "stock_keras_fit": stock_fit,
        "call_s": timed["call_s"],
        "diagnosis": {
            name: _stats(ms) for name, ms in timed.items() if "+" in name
        },
        "model": bench_fit._model_description(args).split(";")[0]
        + f"; each worker's batch {batch}",
    }


def run_one_backend(args) -> dict:
    """Runs `args.family` on `args.backend` in this process; must run
    before Keras is imported (it sets the backend and devices)."""
    os.environ["KERAS_BACKEND"] = args.backend
    if args.family == "central_storage":
        os.environ["KERAS_DIST_CPU_DEVICES"] = str(args.devices)
    else:
        os.environ.pop("KERAS_DIST_CPU_DEVICES", None)
        os.environ.pop("TF_CONFIG", None)
    import keras

    import keras_dist  # noqa: F401  (simulates the CPU devices at import)

    backend = keras.backend.backend()
    started = time.perf_counter()
    if args.family == "central_storage":
        result = run_central_storage(args, keras, backend)
    else:
        result = run_parameter_server(args, keras)
    result.update(
        family=args.family,
        backend=backend,
        anchor_name=ANCHORS[(args.family, backend)],
        repeats=args.repeats,
        epochs_per_repeat=args.epochs,
        seconds=time.perf_counter() - started,
        versions={
            "python": platform.python_version(),
            "keras": keras.__version__,
            backend: __import__(backend).__version__,
        },
    )
    return result


def run_children(args, runs) -> list:
    """Runs each (family, backend) in a clean subprocess; returns results."""
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for family, backend in runs:
            path = os.path.join(tmp, f"{family}-{backend}.json")
            argv = [sys.executable, os.path.abspath(__file__)]
            argv += ["--family", family, "--backend", backend, "--json", path]
            for flag, value in sorted(vars(args).items()):
                option = f"--{flag.replace('_', '-')}"
                if isinstance(value, bool):  # --quick is applied already
                    argv += [option] if value and flag != "quick" else []
                elif isinstance(value, int):
                    argv += [option, str(value)]
            env = bench_fit.child_env(backend, args.devices)
            env.pop("TF_CONFIG", None)
            code = subprocess.run(argv, env=env, check=False).returncode
            if code != 0 or not os.path.exists(path):
                results.append(
                    {"family": family, "backend": backend, "error": code}
                )
                continue
            with open(path) as f:
                results.append(json.load(f)["runs"][0])
    return results


def format_table(results, not_offered=True) -> str:
    """The results as a text table (`not_offered`: with a line for each
    family and backend that has no run)."""
    lines = [
        f"{'family':<17} {'backend':<11} {'ours ms':>8} {'anchor ms':>10} "
        f"{'ratio':>6}  per-repeat ratio median (quartiles)"
    ]
    for r in results:
        head = f"{r['family']:<17} {r['backend']:<11}"
        if "error" in r:
            lines.append(f"{head} FAILED (exit {r['error']})")
            continue
        p = r["paired_ratio"]
        lines.append(
            f"{head} {r['ours']['median']:>8.3f} {r['anchor']['median']:>10.3f}"
            f" {r['ratio_of_medians']:>6.3f}  {p['median']:.3f} "
            f"({p['q1']:.3f}..{p['q3']:.3f})"
        )
        lines.append(f"{'':<17} anchor: {r['anchor_name']}")
    for (family, backend), why in NOT_OFFERED.items() if not_offered else ():
        lines.append(f"{family:<17} {backend:<11} no run: {why}")
    return "\n".join(lines)


def main(argv=None) -> int:
    """Command-line entry point."""
    args = parse_args(argv)
    started = time.perf_counter()
    single = args.family != "all" and args.backend
    if single:
        results = [run_one_backend(args)]
    else:
        runs = [
            (f, b)
            for f, b in RUNS
            if args.family in ("all", f) and args.backend in (None, b)
        ]
        results = run_children(args, runs)
    print()
    print(
        f"Machine: {os.cpu_count()} CPU cores; load average "
        + ", ".join(f"{v:.2f}" for v in os.getloadavg())
        + " (1, 5, 15 min) at the end"
    )
    print(format_table(results, not_offered=not single))
    for r in results:
        if r.get("family") == "parameter_server" and "error" not in r:
            print(f"stock Keras fit under TF's PS: {r['stock_keras_fit']}")
            print(f"counters: {r['counters']}")
            for name, figures in r["diagnosis"].items():
                print(
                    f"diagnosis {name}: {figures['median']:.3f} ms/step "
                    f"({figures['q1']:.3f}..{figures['q3']:.3f})"
                )
        if "call_s" in r:
            calls = ", ".join(f"{n} {v:.1f}" for n, v in r["call_s"].items())
            print(f"{r['family']}/{r['backend']} s per timed call: {calls}")
        if r.get("state_lives"):
            print(f"{r['family']}/{r['backend']} state: {r['state_lives']}")
    print(f"Total: {time.perf_counter() - started:.0f}s")
    if args.json:  # what ran, where, and every figure
        command = [os.path.basename(sys.executable)] + sys.argv
        machine = dict(cpu_count=os.cpu_count(), platform=platform.platform())
        machine["loadavg"] = os.getloadavg()
        with open(args.json, "w") as f:
            json.dump(
                dict(command=" ".join(command), runs=results, **machine),
                f,
                indent=2,
            )
    return 1 if any("error" in r for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())

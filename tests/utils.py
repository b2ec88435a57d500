"""Shared helpers: the parity model, its data, weight comparison, and
running a script in its own (torch multi-process) Python."""

import os
import pathlib
import subprocess
import sys
import textwrap
import time

import keras
import numpy as np

#: The repository's root (on PYTHONPATH of scripts that import `tests`).
ROOT = pathlib.Path(__file__).resolve().parents[1]


def build_model(seed=0, dropout=0.0, bn_momentum=0.99):
    """Dense + Conv2D + BatchNormalization (+ Dropout) classifier."""
    keras.utils.set_random_seed(seed)
    inputs = keras.Input((8, 8, 1))
    h = keras.layers.Conv2D(4, 3, activation="tanh")(inputs)
    h = keras.layers.BatchNormalization(momentum=bn_momentum)(h)
    h = keras.layers.Flatten()(h)
    h = keras.layers.Dropout(dropout)(h)
    h = keras.layers.Dense(16, activation="tanh")(h)
    outputs = keras.layers.Dense(3, activation="softmax")(h)
    return keras.Model(inputs, outputs)


class TiedEmbedding(keras.layers.Embedding):
    """A lookup whose table also scores vectors (``reverse=True``), as
    KerasHub's `ReversibleEmbedding` ties a language model's output."""

    def call(self, inputs, reverse=False):
        if reverse:
            table = keras.ops.transpose(self.embeddings)
            return keras.ops.matmul(inputs, table)
        return super().call(inputs)

    def compute_output_spec(self, inputs, reverse=False):
        if reverse:
            shape = (*inputs.shape[:-1], self.input_dim)
            return keras.KerasTensor(shape, inputs.dtype)
        return super().compute_output_spec(inputs)


def build_tied_model(seed=0):
    """KerasHub's language-model shape in small: ids -> tied table ->
    Dense -> scores against the table, averaged over the sequence."""
    keras.utils.set_random_seed(seed)
    ids = keras.Input((8,), dtype="int32")
    table = TiedEmbedding(64, 16, name="table")
    h = keras.layers.Dense(16, activation="tanh", name="proj")(table(ids))
    scores = table(h, reverse=True)
    return keras.Model(ids, keras.layers.GlobalAveragePooling1D()(scores))


class HalfUsed(keras.layers.Layer):
    """Two 8x8 weights, of which the call uses only the first."""

    def build(self, input_shape):
        self.used = self.add_weight((8, 8), name="used")
        self.unused = self.add_weight((8, 8), name="unused")

    def call(self, inputs):
        return keras.ops.matmul(inputs, self.used)


def build_half_used_model(seed=0):
    """8 features -> `HalfUsed` -> Dense(1): a variable with no
    gradient."""
    keras.utils.set_random_seed(seed)
    inputs = keras.Input((8,))
    h = HalfUsed(name="half")(inputs)
    return keras.Model(inputs, keras.layers.Dense(1, name="out")(h))


def compiled_model(strategy=None, build=None, **build_kwargs):
    """Builds (with `build`, default `build_model`) and compiles a model,
    inside `strategy.scope()` when a strategy is given, else in plain
    Keras on one device."""
    build = build or build_model
    if strategy is None:
        model = build(**build_kwargs)
        compile_model(model)
        return model
    with strategy.scope():
        model = build(**build_kwargs)
        compile_model(model)
    return model


def make_data(n=90, seed=0):
    """Images, integer labels and positive sample weights."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, 8, 8, 1)).astype("float32")
    y = rng.integers(0, 3, n)
    sw = rng.uniform(0.5, 2.0, n).astype("float32")
    return x, y, sw


def compile_model(model):
    """Compiles with SGD so that parity errors are not hidden by Adam."""
    model.compile(
        optimizer=keras.optimizers.SGD(0.05, momentum=0.9),
        loss="sparse_categorical_crossentropy",
        metrics=["accuracy", keras.metrics.SparseCategoricalCrossentropy()],
    )


def max_relative_difference(weights_a, weights_b):
    """max over tensors of max|a - b| / max|a|."""
    worst = 0.0
    for a, b in zip(weights_a, weights_b, strict=True):
        a, b = np.asarray(a, "float64"), np.asarray(b, "float64")
        worst = max(
            worst, np.max(np.abs(a - b)) / max(np.max(np.abs(a)), 1e-12)
        )
    return worst


def npz_max_relative_difference(a, b):
    """`max_relative_difference` of two loaded ``.npz`` weight files."""
    return max_relative_difference(
        [a[key] for key in a.files], [b[key] for key in a.files]
    )


def run_torch_script(
    directory, source, args=(), timeout=400, env=None, name="script.py"
):
    """Writes `source` to ``directory/name`` and runs it under torch.

    The script starts its own ranks (it is not run under pytest), with one
    thread per process; `env` adds to the environment.

    Returns:
        ``(CompletedProcess, seconds)``.
    """
    script = directory / name
    script.write_text(textwrap.dedent(source))
    env = dict(
        os.environ, KERAS_BACKEND="torch", OMP_NUM_THREADS="1", **(env or {})
    )
    start = time.monotonic()
    proc = subprocess.run(
        [sys.executable, str(script), *map(str, args)],
        cwd=directory,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    return proc, time.monotonic() - start


# -- torch scripts sharing one job --------------------------------------------
#: name -> source of a torch script that may share its job's processes with
#: others (`register_torch_part`; run by the ``torch_parts`` fixture).
TORCH_PARTS: dict[str, str] = {}

_PARTS_DRIVER = """
import os, sys
here = os.path.dirname(os.path.abspath(__file__))
for name in sys.argv[1:]:
    path = os.path.join(here, name + ".py")
    out = os.path.join(here, name)
    os.makedirs(out, exist_ok=True)
    sys.argv = [path, out]
    with open(path) as f:
        code = compile(f.read(), path, "exec")
    exec(code, {"__name__": "__main__", "__file__": path})
    rank = os.environ.get("RANK", "0")
    open(os.path.join(out, f"done.r{rank}"), "w").close()
"""


def register_torch_part(name, source):
    """Registers a torch script (`source`, dedented) that reads its output
    directory from ``sys.argv[1]`` and whose strategy runs on
    ``["cpu:0", "cpu:1"]``; a test marked ``torch_part(name)`` reads what
    it wrote through the ``torch_parts`` fixture. Returns `name`."""
    if name in TORCH_PARTS:
        raise ValueError(f"torch part {name!r} registered twice")
    TORCH_PARTS[name] = textwrap.dedent(source)
    return name


def run_torch_parts(directory, names, timeout=600):
    """Runs the registered scripts `names` one after another in the
    processes of one 2-rank torch job, so that the ranks' start (importing
    torch and Keras: about 7 s a process here) and exit are paid once.

    Each part writes to ``directory/<name>/`` and, once it has ended on a
    rank, ``done.r<rank>`` there. A part that raises ends the job (as its own
    job would end); the parts after it do not run.

    Returns:
        ``(CompletedProcess, seconds)`` of the job.
    """
    for name in names:
        (directory / f"{name}.py").write_text(TORCH_PARTS[name])
    env = {"KERAS_DIST_CPU_DEVICES": "2"}
    return run_torch_script(
        directory, _PARTS_DRIVER, names, timeout, env, name="parts.py"
    )


class TorchParts:
    """What the shared job of the ``torch_parts`` fixture left."""

    def __init__(self, directory, proc, seconds):
        self.directory = directory
        self.proc = proc
        self.seconds = seconds

    def output(self, name, ranks=(0, 1)):
        """The directory part `name` wrote to, once it ended on `ranks`;
        fails the test with the job's output when it did not."""
        import pytest

        out = self.directory / name
        missing = [r for r in ranks if not (out / f"done.r{r}").exists()]
        if missing:
            pytest.fail(
                f"torch part {name!r} did not end on rank(s) {missing}: the "
                f"shared job exited {self.proc.returncode} after "
                f"{self.seconds:.0f} s:\n"
                + self.proc.stdout[-3000:]
                + self.proc.stderr[-3000:]
            )
        return out


# -- glibc's malloc in a CPU rank ----------------------------------------------
#: Source of ``faults_per_round()``: the minor page faults of one round of
#: three 16 MiB blocks allocated, written and freed (`bytearray`, through
#: malloc), after a first round. glibc as it comes gives the 48 MiB free at
#: the top of its heap back to the kernel and faults the 12,288 pages in
#: again every round; with `keras_dist._src.cluster.allocator`'s tuning,
#: none.
MALLOC_PROBE = """
import resource


def faults_per_round():
    def round_():
        blocks = [bytearray(16 << 20) for _ in range(3)]
        for block in blocks:
            block[::4096] = b"x" * len(block[::4096])

    round_()
    start = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(5):
        round_()
    return (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - start) / 5
"""

"""Real-GPU paths, against plain Keras on the same GPU: skipped on a machine
without one (CI), run by ``tools/gpu_check.sh`` where there is one.

Each test prints ``GPU-FIGURE name value`` lines (run pytest with ``-s``)
so that a GPU run reports what it measured, not only that it passed.

* every backend: the default strategy's devices are the GPUs, its variables
  live there, and `fit` equals plain Keras; ``OneDeviceStrategy("cpu:0")``
  on a GPU host trains on the CPU;
* torch: ``MultiWorkerMirroredStrategy`` forms a real NCCL process group
  (DDP, synchronised BatchNorm and metrics over NCCL) and equals plain
  Keras; its checkpoint restores on a CPU-only process; ``ModelParallel``
  on a process group of the user's runs DTensor over a CUDA mesh (or, on a
  torch too old for DTensor's layer rules, is refused with the reason);
  more ranks than GPUs is a clear error, not NCCL's;
* JAX: dispatch is unbounded on GPUs (no per-step host wait);
  ``ModelParallel`` over the GPUs equals plain Keras.
"""

import json
import os
import subprocess
import sys
import textwrap

import keras
import numpy as np
import pytest

import keras_dist
from tests.utils import (
    ROOT,
    build_model,
    compile_model,
    make_data,
    max_relative_difference,
)

BACKEND = keras.backend.backend()
# The CPU tests' parity bound. Measured on an H200 (torch 2.11, JAX 0.11):
# 0 in one process, 3.2e-6 through a one-rank NCCL job.
TOLERANCE = 1e-5
N, BATCH, EPOCHS = 83, 16, 3


def _gpu_count() -> int:
    if BACKEND == "torch":
        import torch

        return torch.cuda.device_count()
    if BACKEND == "jax":
        import jax

        try:
            return len(jax.devices("gpu"))
        except RuntimeError:
            return 0
    import tensorflow as tf

    return len(tf.config.list_physical_devices("GPU"))


GPUS = _gpu_count()
pytestmark = pytest.mark.skipif(GPUS == 0, reason="needs a GPU")
torch_only = pytest.mark.skipif(BACKEND != "torch", reason="torch's paths")
jax_only = pytest.mark.skipif(BACKEND != "jax", reason="JAX's paths")


def figure(name, value):
    """Prints one measured figure for the run's log."""
    print(f"GPU-FIGURE {BACKEND} {name} {value}", flush=True)


def _device_of(variable) -> str:
    value = variable.value
    if BACKEND == "torch":
        return value.device.type
    if BACKEND == "jax":
        return next(iter(value.devices())).platform
    return value.device.lower()


def _train(model):
    """The tests' fit: `N` samples, batches of `BATCH`, `EPOCHS` epochs."""
    x, y, sw = make_data(N)
    return model.fit(
        x, y, sample_weight=sw, batch_size=BATCH, epochs=EPOCHS,
        shuffle=False, verbose=0,
    )  # fmt: skip


def _reference(initial):
    """Plain Keras (no keras_dist) on its default device, the GPU."""
    model = build_model()
    model.set_weights(initial)
    compile_model(model)
    assert "cpu" not in _device_of(model.variables[0])
    history = _train(model)
    return model.get_weights(), history.history


@pytest.fixture(scope="module")
def initial():
    return build_model(seed=7).get_weights()


@pytest.mark.skipif(
    BACKEND == "torch" and GPUS > 1, reason="torch starts a process per GPU"
)
def test_default_strategy_trains_on_the_gpus_like_plain_keras(initial):
    strategy = keras_dist.MirroredStrategy()
    assert all(d.startswith("gpu:") for d in strategy.devices)
    assert strategy.num_replicas_in_sync == GPUS
    with strategy.scope():
        model = build_model()
        model.set_weights(initial)
        compile_model(model)
    assert all("gpu" in _device_of(v) or "cuda" in _device_of(v)
               for v in model.variables)  # fmt: skip
    history = _train(model)
    weights, reference_history = _reference(initial)
    worst = max_relative_difference(weights, model.get_weights())
    figure("mirrored_vs_keras_max_rel", f"{worst:.3g}")
    assert worst <= TOLERANCE
    np.testing.assert_allclose(
        history.history["loss"], reference_history["loss"], rtol=1e-5
    )


def test_one_device_cpu_on_a_gpu_host_trains_on_the_cpu(initial):
    strategy = keras_dist.OneDeviceStrategy("cpu:0")
    with strategy.scope():
        model = build_model()
        model.set_weights(initial)
        compile_model(model)
    assert {_device_of(v) for v in model.variables} <= {"cpu", "cpu:0"}, {
        _device_of(v) for v in model.variables
    }
    x, y, sw = make_data(32)
    before = model.get_weights()
    model.fit(x, y, sample_weight=sw, batch_size=BATCH, verbose=0)
    assert {_device_of(v) for v in model.variables} <= {"cpu", "cpu:0"}
    assert max_relative_difference(before, model.get_weights()) > 0


# -- JAX ----------------------------------------------------------------------
@jax_only
def test_jax_dispatch_is_unbounded_on_gpus():
    import jax

    from keras_dist._src.backends.jax.engine import steps_in_flight

    assert steps_in_flight(jax.devices("gpu")) is None
    strategy = keras_dist.ShardedDataParallel()  # the SPMD engine, any count
    assert strategy.extended.max_in_flight is None


@jax_only
def test_jax_model_parallel_over_the_gpus_matches_plain_keras(initial):
    mesh = keras_dist.DeviceMesh((1, GPUS), ("batch", "model"))
    layouts = keras_dist.LayoutMap(mesh)
    # Rows split: 144 and 16 inputs divide over 1, 2, 4 or 8 GPUs.
    layouts[".*dense.*/kernel"] = ("model", None)
    strategy = keras_dist.ModelParallel(layouts, "batch")
    with strategy.scope():
        model = build_model()
        model.set_weights(initial)
        compile_model(model)
    _train(model)
    weights, _ = _reference(initial)
    worst = max_relative_difference(weights, model.get_weights())
    figure("model_parallel_vs_keras_max_rel", f"{worst:.3g}")
    assert worst <= TOLERANCE


# -- torch --------------------------------------------------------------------
NCCL_SCRIPT = """
import json, sys
import numpy as np
import torch.distributed as dist
import keras, keras_dist
from tests.utils import build_model, compile_model, make_data

initial = np.load("initial.npz")
strategy = keras_dist.MultiWorkerMirroredStrategy()
with strategy.scope():
    model = build_model()
    model.set_weights([initial[k] for k in initial.files])
    compile_model(model)
x, y, sw = make_data({n})
history = model.fit(x, y, sample_weight=sw, batch_size={batch},
                    epochs={epochs}, shuffle=False, verbose=0)
keras_dist.checkpoint.save(model, "ckpt", step=1)
np.savez("weights.npz", *model.get_weights())
with open("out.json", "w") as f:
    json.dump({{"backend": dist.get_backend(), "world": dist.get_world_size(),
               "device": str(model.variables[0].value.device),
               "loss": history.history["loss"]}}, f)
"""

RESTORE_SCRIPT = """
import numpy as np, torch
import keras, keras_dist
from tests.utils import build_model, compile_model
assert not torch.cuda.is_available()
model = build_model(seed=3)
compile_model(model)
keras_dist.checkpoint.restore(model, "ckpt")
np.savez("restored.npz", *model.get_weights())
print("restored on", model.variables[0].value.device)
"""

DTENSOR_SCRIPT = """
import json, os
import numpy as np
import torch, torch.distributed as dist
import keras, keras_dist
from keras_dist._src.cluster.launcher import free_port
from tests.utils import build_model, compile_model, make_data

dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{{free_port()}}",
                        rank=0, world_size=1)
torch.cuda.set_device(0)
initial = np.load("initial.npz")
mesh = keras_dist.DeviceMesh((1, 1), ("batch", "model"), ["gpu:0"])
layouts = keras_dist.LayoutMap(mesh)
layouts[".*dense.*/kernel"] = (None, "model")
strategy = keras_dist.ModelParallel(layouts, "batch")
with strategy.scope():
    model = build_model()
    model.set_weights([initial[k] for k in initial.files])
    compile_model(model)
x, y, sw = make_data({n})
model.fit(x, y, sample_weight=sw, batch_size={batch}, epochs={epochs},
          shuffle=False, verbose=0)
np.savez("weights.npz", *model.get_weights())
kernel = [v for v in model.variables if v.path.endswith("kernel")][-1]
with open("out.json", "w") as f:
    json.dump({{"engine": type(strategy.extended).__name__,
               "value": type(kernel.value).__name__,
               "device": str(getattr(kernel.value, "device", "?"))}}, f)
dist.destroy_process_group()
"""


def _run(directory, source, env=None, args=("script.py",), timeout=300):
    """Runs `source` (as ``script.py``), or ``python *args``, under torch
    in `directory` with this checkout importable."""
    (directory / "script.py").write_text(textwrap.dedent(source))
    path = os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])
    return subprocess.run(
        [sys.executable, *args],
        cwd=directory,
        env=dict(os.environ, KERAS_BACKEND="torch", PYTHONPATH=path,
                 **(env or {})),
        capture_output=True, text=True, timeout=timeout,
    )  # fmt: skip


@torch_only
def test_torch_nccl_job_matches_plain_keras_and_restores_on_cpu(
    tmp_path, initial
):
    np.savez(tmp_path / "initial.npz", *initial)
    proc = _run(tmp_path, NCCL_SCRIPT.format(n=N, batch=BATCH, epochs=EPOCHS))
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads((tmp_path / "out.json").read_text())
    assert out["backend"] == "nccl" and out["world"] == GPUS, out
    assert out["device"].startswith("cuda"), out
    got = np.load(tmp_path / "weights.npz")
    weights, history = _reference(initial)
    worst = max_relative_difference(weights, [got[k] for k in got.files])
    figure("nccl_job_vs_keras_max_rel", f"{worst:.3g}")
    assert worst <= TOLERANCE
    np.testing.assert_allclose(out["loss"], history["loss"], rtol=1e-5)
    # The checkpoint a GPU job wrote restores where there is no GPU.
    proc = _run(tmp_path, RESTORE_SCRIPT, env={"CUDA_VISIBLE_DEVICES": ""})
    assert proc.returncode == 0, proc.stderr[-3000:]
    restored = np.load(tmp_path / "restored.npz")
    for key in got.files:
        np.testing.assert_array_equal(restored[key], got[key])


@torch_only
def test_torch_model_parallel_runs_dtensor_on_a_cuda_mesh(tmp_path, initial):
    if GPUS != 1:
        pytest.skip("a one-rank mesh: written for one GPU")
    import torch

    from keras_dist._src.backends.torch.sharded import dtensor_runs_on

    np.savez(tmp_path / "initial.npz", *initial)
    proc = _run(
        tmp_path, DTENSOR_SCRIPT.format(n=N, batch=BATCH, epochs=EPOCHS)
    )
    if not dtensor_runs_on(torch.__version__):
        # Refused when the strategy is made, not by a layer mid-step.
        figure("dtensor_refused_torch", torch.__version__)
        assert proc.returncode != 0
        assert "or newer; this is torch" in proc.stderr, proc.stderr[-3000:]
        return
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads((tmp_path / "out.json").read_text())
    figure("dtensor_engine", f"{out['engine']}:{out['value']}:{out['device']}")
    assert out["engine"] == "DTensorEngine", out
    got = np.load(tmp_path / "weights.npz")
    weights, _ = _reference(initial)
    worst = max_relative_difference(weights, [got[k] for k in got.files])
    figure("dtensor_vs_keras_max_rel", f"{worst:.3g}")
    assert worst <= TOLERANCE


@torch_only
def test_torch_more_ranks_than_gpus_is_a_clear_error(tmp_path):
    source = """
    import keras, keras_dist
    strategy = keras_dist.MultiWorkerMirroredStrategy()
    """
    (tmp_path / "train.py").write_text(textwrap.dedent(source))
    proc = _run(
        tmp_path,
        "",
        args=("-m", "keras_dist.cli", "launch", "--nproc-per-node",
              str(GPUS + 1), "train.py"),
        timeout=180,
    )  # fmt: skip
    assert proc.returncode != 0
    output = proc.stdout + proc.stderr
    assert "NCCL needs a GPU of its own" in output, output[-3000:]
    assert f"--nproc-per-node {GPUS}" in output

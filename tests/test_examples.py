"""Each example of examples/ for one strategy runs under the test run's
backend (issue #48: an example per strategy, in CI's smoke tests).

Every example is its own process, started from a clean environment (no
simulated devices of the test run), and must exit 0 printing its final
line once. train_digits.py, the custom loops, multi_worker.py and
preemptible.py have their own tests (test_guides.py, test_custom_loop.py,
test_multi_worker.py, test_checkpoint_process.py).
"""

import os
import subprocess
import sys

import keras
import pytest

from tests.utils import ROOT

BACKEND = keras.backend.backend()

# (script, backends it runs on, the line it ends with)
EXAMPLES = [
    ("model_parallel.py", ("jax", "torch"), "ModelParallel 2x2: losses"),
    (
        "sharded_data_parallel.py",
        ("jax", "torch"),
        "ShardedDataParallel: losses",
    ),
    (
        "central_storage.py",
        ("jax", "tensorflow"),
        "CentralStorageStrategy: losses",
    ),
    (
        "parameter_server.py",
        ("tensorflow",),
        "[chief] ParameterServerStrategy: losses",
    ),
    # keras-hub is not installed in CI: the script then says so, exit 0.
    ("keras_hub_backbone.py", ("jax", "torch"), None),
]


def _env():
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("KERAS_DIST_CPU_DEVICES", "XLA_FLAGS", "TF_CONFIG")
    }
    env["KERAS_BACKEND"] = BACKEND
    env["PYTHONPATH"] = os.pathsep.join(
        [str(ROOT), env.get("PYTHONPATH", "")]
    ).rstrip(os.pathsep)
    return env


@pytest.mark.slow
@pytest.mark.multi_process
@pytest.mark.parametrize(
    "script, backends, line", EXAMPLES, ids=[e[0] for e in EXAMPLES]
)
def test_example_runs(script, backends, line):
    if BACKEND not in backends:
        pytest.skip(f"{script} does not run on {BACKEND}")
    out = subprocess.run(
        [sys.executable, str(ROOT / "examples" / script)],
        capture_output=True,
        text=True,
        env=_env(),
        timeout=600,
    )
    log = f"{out.stdout[-3000:]}\n{out.stderr[-3000:]}"
    assert out.returncode == 0, log
    if line is None:  # keras_hub_backbone.py
        expected = (
            "GemmaCausalLM 2x2: losses"
            if "skipped: pip install keras-hub" not in out.stdout
            else "skipped: pip install keras-hub"
        )
        assert out.stdout.count(expected) == 1, log
    else:
        assert out.stdout.count(line) == 1, log  # printed once


@pytest.mark.parametrize("script", [e[0] for e in EXAMPLES])
def test_example_says_how_to_run_it(script):
    """The docstring names the command, with KERAS_BACKEND."""
    text = (ROOT / "examples" / script).read_text()
    assert text.startswith('"""')
    assert "KERAS_BACKEND=" in text and f"examples/{script}" in text

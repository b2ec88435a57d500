"""The custom training loop example gives the weights `fit` gives."""

import os
import re
import subprocess
import sys

import keras
import pytest

from tests.utils import ROOT


@pytest.mark.slow
@pytest.mark.skipif(
    keras.backend.backend() not in ("jax", "tensorflow"),
    reason="torch has examples/custom_loop_torch.py, tested in tests/torch",
)
def test_custom_loop_equals_fit():
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("KERAS_DIST_CPU_DEVICES", "XLA_FLAGS")
    }
    out = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "custom_loop.py")],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.count("epoch") == 3
    match = re.search(r"custom loop vs fit: ([0-9.e+-]+)", out.stdout)
    assert match, out.stdout
    assert float(match[1]) <= 1e-5

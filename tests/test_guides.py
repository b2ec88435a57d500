"""The guides' Python blocks run, in order, as one script."""

import os
import re
import subprocess
import sys

import keras
import pytest

from tests.utils import ROOT


def _run_guide(tmp_path, name, min_blocks=1):
    """Runs a guide's Python blocks, in order, as one script in a clean
    process (no simulated devices of the test run)."""
    text = (ROOT / "guides" / name).read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, flags=re.S)
    assert len(blocks) >= min_blocks
    script = tmp_path / "guide.py"
    script.write_text("\n".join(blocks))
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("KERAS_DIST_CPU_DEVICES", "XLA_FLAGS")
    }
    out = subprocess.run(
        [sys.executable, str(script)],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
        cwd=tmp_path,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return out


@pytest.mark.slow
@pytest.mark.skipif(
    keras.backend.backend() not in ("jax", "tensorflow"),
    reason="the guide's single-process blocks",
)
def test_distributed_training_guide_runs(tmp_path):
    out = _run_guide(tmp_path, "distributed_training.md", min_blocks=5)
    assert "['cpu:0', 'cpu:1', 'cpu:2', 'cpu:3']" in out.stdout
    assert "(100, 3)" in out.stdout
    assert "refused:" in out.stdout


@pytest.mark.slow
@pytest.mark.skipif(
    keras.backend.backend() != "jax", reason="one backend runs the guide"
)
def test_model_parallel_guide_runs(tmp_path):
    out = _run_guide(tmp_path, "model_parallel.md")
    assert "(None, 'model')" in out.stdout  # describe's table
    assert "sharded: [" in out.stdout and "dense" in out.stdout


@pytest.mark.slow
def test_main_example_trains(tmp_path):
    """The README's example trains on every backend (4 devices)."""
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("KERAS_DIST_CPU_DEVICES", "XLA_FLAGS")
    }
    out = subprocess.run(
        [
            sys.executable,
            str(ROOT / "examples" / "train_digits.py"),
            "--epochs",
            "4",
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.count("replicas=4") == 1  # printed by the chief only
    accuracy = float(re.search(r"test accuracy=([\d.]+)", out.stdout)[1])
    assert accuracy > 0.9


def _readme_section(title):
    text = (ROOT / "README.md").read_text()
    return text.split(f"## {title}\n", 1)[1].split("\n## ", 1)[0]


def test_readme_quick_start_is_two_commands():
    """One command runs the example, one installs and runs every test."""
    blocks = re.findall(
        r"```bash\n(.*?)```", _readme_section("Quick start"), re.S
    )
    assert len(blocks) == 2
    assert all(b.strip() and "\n" not in b.strip() for b in blocks), blocks
    assert "examples/train_digits.py" in blocks[0]
    assert blocks[1].strip() == "bash tools/test_all.sh"


def test_readme_extras_exist():
    tomllib = pytest.importorskip("tomllib")
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]
    named = set(re.findall(r'\.\[([\w-]+)\]"', _readme_section("Install")))
    assert {"jax", "tensorflow", "torch", "all"} <= named
    assert named <= set(extras), named - set(extras)

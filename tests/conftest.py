"""Test set-up: simulated devices before the backend starts, hygiene checks.

The Keras backend is chosen by ``KERAS_BACKEND`` for the whole run (CI runs
the suite once per backend). JAX and TensorFlow tests get 4 simulated CPU
devices, requested here before either backend starts.
"""

import gc
import os
import threading
import time

import pytest

if os.environ.get("KERAS_BACKEND", "tensorflow") in ("jax", "tensorflow"):
    os.environ.setdefault("KERAS_DIST_CPU_DEVICES", "4")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
if os.environ.get("KERAS_BACKEND") == "jax" and not os.environ.get(
    "JAX_COMPILATION_CACHE_DIR"
):
    # One persistent compilation cache for the run, this process and the
    # scripts the tests start: the same model compiled again (a plain
    # reference, a resumed run, a second worker) loads its executable
    # instead of compiling it (the same executable: results are
    # unchanged). Parity + checkpoint tests: 132 s -> 109 s from cold.
    import atexit
    import shutil
    import tempfile

    _cache = tempfile.mkdtemp(prefix="keras_dist_jax_cache_")
    atexit.register(shutil.rmtree, _cache, ignore_errors=True)
    os.environ.update(
        JAX_COMPILATION_CACHE_DIR=_cache,
        JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
        JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0",
    )

import keras  # noqa: E402

import keras_dist  # noqa: E402,F401  (applies KERAS_DIST_CPU_DEVICES)

try:  # TensorFlow sets environment variables when first imported (Keras
    # data adapters import it lazily); import it now so no test "leaks" them.
    import tensorflow  # noqa: E402,F401
except ImportError:  # pragma: no cover
    pass

if keras.backend.backend() in ("jax", "tensorflow"):
    # Start the backend (and its one-off helper threads) before any test.
    keras_dist.list_devices()

BACKEND = keras.backend.backend()


@pytest.fixture(autouse=True)
def _no_leaks(monkeypatch):
    """Fails a test that leaks environment variables or threads."""
    env_before = dict(os.environ)
    threads_before = {t.ident for t in threading.enumerate()}
    yield
    monkeypatch.undo()  # what a test set through monkeypatch is no leak
    changed = {
        k
        for k in set(env_before) | set(os.environ)
        if env_before.get(k) != os.environ.get(k) and k != "PYTEST_CURRENT_TEST"
    }
    assert not changed, f"test leaked environment variables: {changed}"
    new = [
        t
        for t in threading.enumerate()
        if t.ident not in threads_before and not t.daemon
    ]
    if new:
        # Keras's CallbackList never shuts its ThreadPoolExecutor down when
        # `fit` raises; the idle worker ends once the executor is collected.
        # (Only then: with TensorFlow loaded a collection costs ~0.6 s.)
        gc.collect()
    deadline = time.monotonic() + 2.0
    leaked = []
    for t in new:
        t.join(max(0.0, deadline - time.monotonic()))
        if t.is_alive():
            leaked.append(t)
    assert not leaked, f"test leaked threads: {leaked}"

"""TensorFlow on TPUs: tf.distribute's TPUStrategy, reached once.

`connect` resolves the TPU (`TPUClusterResolver`: this VM's with
``tpu=None`` or "local", else a name or ``grpc://`` address), connects to
its cluster and initializes the TPU system; any failure on the way (no TPU
here, an unknown name, an unreachable address, a TensorFlow without TPU
support) becomes one `TPUNotFoundError` that says what was tried. The
engine runs Keras's own TensorFlow steps under tf.distribute's
`TPUStrategy` (XLA-compiled per replica; Keras divides each replica's loss
by the replica count, which equals one device's loss when every global
batch divides evenly: use ``drop_remainder`` batches or a batch size the
dataset size divides).
"""

from __future__ import annotations

import os
import threading

import tensorflow as tf

from keras_dist._src.backends.tensorflow.strategy_engine import (
    StrategyEngine,
)
from keras_dist._src.errors import TPUNotFoundError

_RESOLVED = {}


def connect_tpu(tpu=None):
    """`TPUStrategy`'s connection on TensorFlow: connects to `tpu`
    (`connect`).

    Returns:
        ``(None, devices)``: this process's TPU devices.
    """
    from keras_dist._src.backends.tensorflow.devices import list_devices

    connect(tpu)
    return None, list_devices("tpu")


def connect(tpu=None):
    """Resolves `tpu`, connects to it and initializes its TPU system (once
    per address); returns the `TPUClusterResolver`.

    Raises:
        TPUNotFoundError: for every failure to reach a TPU.
    """
    key = tpu or "local"
    if key in _RESOLVED:
        return _RESOLVED[key]
    what = f"TPUClusterResolver(tpu={key!r})"
    timeout = _timeout()
    outcome = {}

    def reach():
        try:
            outcome["resolver"] = _reach(key)
        except BaseException as error:  # IndexError, ValueError, ...
            outcome["error"] = error

    thread = None
    if key == "local":  # this VM's TPU: in this thread
        reach()
    else:
        # A remote address that nothing answers makes TensorFlow wait
        # forever: give up after the timeout.
        thread = threading.Thread(target=reach, name="keras_dist-tpu")
        thread.daemon = True
        thread.start()
        thread.join(timeout)
    error = outcome.get("error")
    if thread is not None and thread.is_alive():
        error = TimeoutError(
            f"no answer within {timeout:g} s (KERAS_DIST_TPU_TIMEOUT)"
        )
    if error is not None:
        raise TPUNotFoundError(
            f"TPUStrategy could not reach a TPU ({what}: "
            f"{type(error).__name__}: {error}). On a Cloud TPU VM leave "
            "tpu=None; elsewhere pass the TPU's name or its grpc://host:8470 "
            "address, and install a TensorFlow with TPU support "
            "(tensorflow-tpu). Without a TPU, use "
            "keras_dist.MirroredStrategy(), or KERAS_BACKEND=jax with "
            "jax[tpu] on a TPU VM."
        ) from error
    resolver = outcome["resolver"]
    _RESOLVED[key] = resolver
    return resolver


def _reach(key):
    resolver = tf.distribute.cluster_resolver.TPUClusterResolver(tpu=key)
    if key != "local":
        tf.config.experimental_connect_to_cluster(resolver)
    tf.tpu.experimental.initialize_tpu_system(resolver)
    if not tf.config.list_logical_devices("TPU"):
        raise RuntimeError("no TPU devices after initialization")
    return resolver


def _timeout() -> float:
    """Seconds to wait for a TPU (``KERAS_DIST_TPU_TIMEOUT``, 300)."""
    value = os.environ.get("KERAS_DIST_TPU_TIMEOUT", "300")
    try:
        return max(0.1, float(value))
    except ValueError:
        raise TPUNotFoundError(
            f"KERAS_DIST_TPU_TIMEOUT must be a number of seconds; got "
            f"{value!r}."
        ) from None


class TPUEngine(StrategyEngine):
    """Keras's own TF steps under tf.distribute's `TPUStrategy` (the
    engine contract is `StrategyEngine`'s, on TPU-mirrored variables)."""

    def __init__(self, resolver, devices):
        super().__init__(devices, tf.distribute.TPUStrategy(resolver))


def create_engine(plan, runtime, input_options):
    """The engine of a `TPUPlan` on TensorFlow.

    Raises:
        TPUNotFoundError: when no TPU can be reached.
        UnsupportedBackendError: for a mesh shape or layout map (layouts
            over a mesh are JAX's).
    """
    del runtime, input_options
    if plan.layout_map is not None or (
        plan.mesh_shape is not None and len(plan.mesh_shape) > 1
    ):
        from keras_dist._src.errors import UnsupportedBackendError

        raise UnsupportedBackendError(
            "TPUStrategy on TensorFlow is data parallel only (tf.distribute's "
            "TPUStrategy); a multi-axis mesh_shape or a layout_map needs "
            "KERAS_BACKEND=jax."
        )
    return TPUEngine(connect(plan.tpu), plan.devices)

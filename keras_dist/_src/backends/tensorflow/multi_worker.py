"""TensorFlow over several processes: tf.distribute's
MultiWorkerMirroredStrategy with keras_dist's exact step.

Each worker runs the same program with a ``TF_CONFIG`` (set by ``keras-dist
launch``, by hand, or converted from the job's environment when it lists
every worker's address). tf.distribute's collective ops all-reduce the
gradients over every device of every worker; its coordination service
gives the Runtime its key-value store and barrier. Variables take the
chief's initial values (tf.distribute broadcasts them from worker 0). The
step and the exact input splitting are the single-host engine's; each
global batch is split over all replicas of all workers.

Without a GPU, tf.distribute gives each worker one CPU replica, whatever
its logical CPUs. keras_dist's strategy lists the simulated CPU devices
instead (`keras_dist.simulate_cpu_devices`, ``KERAS_DIST_CPU_DEVICES``,
``keras-dist launch --cpu-devices-per-process``), through a subclass of
tf.distribute's `CollectiveAllReduceExtended`, so that 2 workers with 2
simulated CPUs each train 4 replicas. Every worker needs the same count.
"""

from __future__ import annotations

import contextlib
import json
import random

import numpy as np
import tensorflow as tf

from keras_dist._src.backends.tensorflow.inputs import (
    distribute_global_batches,
)
from keras_dist._src.backends.tensorflow.mirrored import MirroredEngine
from keras_dist._src.cluster.environments import ClusterConfigError
from keras_dist._src.cluster.supervision import liveness_timeout
from keras_dist._src.core import policies
from keras_dist._src.core.lockstep import GatheredAdapter
from keras_dist._src.core.rng import replicate_chief_generators
from keras_dist._src.errors import VariablesOutsideScopeError
from keras_dist._src.framework_glue import tensorflow_private


def _cluster_resolver(environment):
    """A TFConfigClusterResolver for `environment` (from its TF_CONFIG)."""
    if not environment.worker_addresses:
        raise ClusterConfigError(
            "TensorFlow's multi-worker strategy needs every worker's address "
            f"(found only the {environment.source} variables). Start the "
            "workers with `keras-dist launch`, or set TF_CONFIG on each "
            "worker (see guides/multi_worker.md)."
        )
    config = {
        "cluster": {"worker": list(environment.worker_addresses)},
        "task": {"type": "worker", "index": environment.rank},
    }
    return tf.distribute.cluster_resolver.SimpleClusterResolver(
        tf.train.ClusterSpec(config["cluster"]),
        task_type="worker",
        task_id=environment.rank,
        rpc_layer="grpc",
    ), json.dumps(config)


_created = 0


def _reduce(self, reduce_op, value, axis):
    """`Strategy.reduce` that takes ``axis=0`` of per-replica scalars as no
    axis. Keras's TF trainer reduces the logs of a multi-worker step with
    ``reduce("MEAN", logs, axis=0)`` (keras-team/keras#20585: it fails on
    the scalar logs); keras_dist's logs are equal on every replica, so
    their mean is the value itself."""
    base = tf.distribute.MultiWorkerMirroredStrategy.reduce
    if axis is not None:
        parts = self.experimental_local_results(value)
        if parts and getattr(parts[0], "shape", None) is not None:
            if parts[0].shape.rank == 0:
                axis = None
    return base(self, reduce_op, value, axis=axis)


def simulated_cpu_count() -> int:
    """The logical CPU devices this process was split into (1 if none).

    Counted from the logical device configuration: once a multi-worker
    job has started, TensorFlow's logical device list holds every worker's
    devices.
    """
    cpus = tf.config.list_physical_devices("CPU")
    if not cpus:
        return 1
    configuration = tf.config.get_logical_device_configuration(cpus[0])
    return len(configuration) if configuration else 1


class _CollectiveExtended(
    tensorflow_private.collective_all_reduce_extended_class()
):
    """tf.distribute's multi-worker implementation, with a replica on each
    simulated CPU device of a worker without GPUs (tf.distribute's own
    rule is one CPU replica per worker). GPUs and TPUs are left as
    tf.distribute finds them."""

    def _initialize_local_devices(self, cluster_resolver, worker_device):
        devices, kind = super()._initialize_local_devices(
            cluster_resolver, worker_device
        )
        if kind == "CPU":
            devices = tuple(
                f"{worker_device}/device:CPU:{i}"
                for i in range(simulated_cpu_count())
            )
        return devices, kind


def _init(self, cluster_resolver=None, communication_options=None):
    """`MultiWorkerMirroredStrategy.__init__` with `_CollectiveExtended`."""
    options = communication_options
    if options is None:
        options = tf.distribute.experimental.CommunicationOptions()
    tf.distribute.Strategy.__init__(
        self,
        _CollectiveExtended(
            self,
            cluster_resolver=cluster_resolver,
            communication_options=options,
        ),
    )


def new_strategy(environment):
    """A MultiWorkerMirroredStrategy of keras_dist's for `environment`."""
    global _created
    _created += 1
    resolver, _ = _cluster_resolver(environment)
    cls = type(
        "MultiWorkerMirroredStrategy",
        (tf.distribute.MultiWorkerMirroredStrategy,),
        {
            "__init__": _init,
            "_keras_dist": True,
            "_native_distribute": (
                tf.distribute.MultiWorkerMirroredStrategy
            ).experimental_distribute_dataset,
            "experimental_distribute_dataset": distribute_global_batches,
            "reduce": _reduce,
        },
    )
    options = tf.distribute.experimental.CommunicationOptions(
        timeout_seconds=liveness_timeout()
    )
    return cls(cluster_resolver=resolver, communication_options=options)


class MultiWorkerEngine(MirroredEngine):
    """`MirroredEngine` over a tf.distribute MultiWorkerMirroredStrategy."""

    def __init__(self, devices, sync_batch_norm: bool, runtime, options):
        # No MirroredStrategy of its own: the multi-worker one replaces it,
        # created by the runtime (tf.distribute must configure its
        # collective ops before TensorFlow initialises, before devices are
        # listed).
        super().__init__(devices, sync_batch_norm, runtime.tf_strategy)
        self.input_options = options
        self.runtime = runtime
        _check_same_device_count(self.tf_strategy, runtime)

    def check_metric_variables(self, model) -> None:
        """Raises if a metric of `model` was created outside the scope: its
        variable would be this worker's own, counting its samples only.

        Raises:
            VariablesOutsideScopeError: naming the metric and the fix.
        """
        outside = self.first_outside_scope(model.metrics_variables)
        if outside is not None:
            raise VariablesOutsideScopeError(
                f"Metric variable {outside.path!r} was created outside "
                "strategy.scope(): under MultiWorkerMirroredStrategy it would "
                "be each worker's own, counting that worker's samples only "
                "(its values would differ between workers and from one "
                "device). Create the metric objects (`keras.metrics.AUC()` "
                "and the like) inside `with strategy.scope():`, or pass "
                "metrics by name."
            )

    @contextlib.contextmanager
    def call_scope(self):
        """fit/evaluate/predict start from the chief's random state on every
        worker (`tf_seed_state`), then run in the strategy's scope."""
        replicate_chief_generators(
            self.runtime, get_extra=tf_seed_state, set_extra=set_tf_seed_state
        )
        with self.tf_strategy.scope():
            yield

    def prepare_call(self, name, method, args, kwargs):
        """FILE/OFF input: each worker reads its share (`core.policies`)
        and `GatheredAdapter` assembles the global batches through the
        coordination service (a channel of its own per input, since
        tf.data iterates it on its own threads)."""

        def wrap(inner, what):
            channel = self.runtime.channel("input")
            return GatheredAdapter(inner, what, channel, channel.all_gather)

        return policies.prepare_worker_call(
            self, name, method, args, kwargs, wrap
        )


def tf_seed_state() -> np.ndarray:
    """TensorFlow's global seed and the generator its unseeded random ops
    draw their op seeds from, as int64s (with Python's and NumPy's states
    these are what a worker's shuffles depend on).

    Keras shuffles NumPy input on this backend with ``tf.random.shuffle``
    in its tf.data pipeline; workers with different (or no) seeds drew
    different permutations, so their global batches differed and an epoch
    used some samples twice and others not at all. A process without a
    global seed gets one drawn here at random (its random ops stay as
    random as before), so that the chief has a state to hand on.
    """
    if tensorflow_private.eager_global_seed() is None:
        tf.random.set_seed(random.SystemRandom().randrange(2**31))
    rng = tensorflow_private.eager_op_seed_generator()
    version, keys, gauss = rng.getstate()
    gauss_bits = np.array([gauss or 0.0], np.float64).view(np.int64)
    seed = int(tensorflow_private.eager_global_seed())
    head = [seed, version, int(gauss is not None)]
    return np.concatenate([np.asarray(head, np.int64), gauss_bits, keys])


def set_tf_seed_state(vector: np.ndarray) -> None:
    """Sets TensorFlow's global seed and op-seed generator from
    `tf_seed_state`'s vector."""
    seed, version, has_gauss = (int(v) for v in vector[:3])
    gauss = float(vector[3:4].view(np.float64)[0]) if has_gauss else None
    if tensorflow_private.eager_global_seed() != seed:
        # Also clears TensorFlow's kernel caches, which restarts the
        # reshuffling of datasets made before: only when it changes.
        tf.random.set_seed(seed)
    tensorflow_private.eager_op_seed_generator().setstate(
        (version, tuple(int(v) for v in vector[4:]), gauss)
    )


def _check_same_device_count(strategy, runtime):
    """Raises on every worker unless all workers have as many replicas
    (tf.distribute counts this worker's devices times the worker count)."""
    counts = runtime.all_gather(len(strategy.extended.worker_devices))
    if len(set(counts)) > 1:
        raise ClusterConfigError(
            "Every TensorFlow worker needs the same number of devices; "
            f"the workers have {counts} (in rank order). Give each worker "
            "as many GPUs, or the same simulated CPU count "
            "(KERAS_DIST_CPU_DEVICES or keras-dist launch "
            "--cpu-devices-per-process)."
        )

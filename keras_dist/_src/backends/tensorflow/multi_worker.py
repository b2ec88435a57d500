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
"""

from __future__ import annotations

import json

import tensorflow as tf

from keras_dist._src.backends.tensorflow.data_parallel import MirroredEngine
from keras_dist._src.backends.tensorflow.inputs import (
    distribute_global_batches,
)
from keras_dist._src.cluster.environments import ClusterConfigError
from keras_dist._src.cluster.supervision import liveness_timeout
from keras_dist._src.core import policies
from keras_dist._src.core.lockstep import GatheredAdapter


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


def new_strategy(environment):
    """A MultiWorkerMirroredStrategy of keras_dist's for `environment`."""
    global _created
    _created += 1
    resolver, _ = _cluster_resolver(environment)
    cls = type(
        "MultiWorkerMirroredStrategy",
        (tf.distribute.MultiWorkerMirroredStrategy,),
        {
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

    def __init__(self, devices, sync_batch_norm: bool, runtime, policy):
        # No MirroredStrategy of its own: the multi-worker one replaces it.
        self.shard_policy = policy
        self.devices = tuple(devices)
        self.sync_batch_norm = sync_batch_norm
        self.runtime = runtime
        # Created by the runtime: tf.distribute must configure its collective
        # ops before TensorFlow initialises (before devices are listed).
        self.tf_strategy = runtime.tf_strategy
        self._warned = False

    def prepare_call(self, name, method, args, kwargs):
        """FILE/OFF input: each worker reads its share (`core.policies`)
        and `GatheredAdapter` assembles the global batches through the
        coordination service (a channel of its own per input, since
        tf.data iterates it on its own threads)."""

        def wrap(inner, what):
            channel = self.runtime.channel("input")
            return GatheredAdapter(inner, what, channel, channel.all_gather)

        return policies.prepare_arguments(
            name,
            method,
            args,
            kwargs,
            self.shard_policy,
            self.runtime.rank,
            self.runtime.world_size,
            wrap,
        )

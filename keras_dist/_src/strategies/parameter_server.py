"""`ParameterServerStrategy`: asynchronous training with variables on
parameter-server tasks (TensorFlow)."""

from __future__ import annotations

from keras_dist._src import backends as backend_lib
from keras_dist._src.cluster.environments import (
    ClusterConfigError,
    TaskSpec,
    read_task_spec,
)
from keras_dist._src.cluster.parameter_server import serve
from keras_dist._src.plan import ParameterServerPlan, Topology
from keras_dist._src.strategy import Strategy


class ParameterServerStrategy(Strategy):
    """Asynchronous data parallelism with variables on ps tasks.

    The cluster has one chief (this script: it builds the model and calls
    `fit`), worker tasks that run training steps, and ps tasks that hold
    the variables (split over them round-robin, and large ones sharded by
    `variable_partitioner`). Each worker runs Keras's own `train_step` on
    its own batches and updates the variables on the ps tasks as soon as it
    is done, without waiting for the others: with several workers the
    result is not that of one device (steps read weights that others are
    updating). Counters and metrics stay exact (see
    ``guides/parameter_server.md``).

    On a worker or ps task (``TF_CONFIG``'s task type), creating the
    strategy starts that task's server and never returns (`serve`): the
    same script can run on every task.

    TensorFlow only: other backends raise `UnsupportedBackendError`.

    Args:
        cluster_resolver: the cluster: a dict ``{"chief": [...], "worker":
            [...], "ps": [...]}`` of addresses, a `TaskSpec`, or a
            tf.distribute cluster resolver; read from ``TF_CONFIG`` when
            None.
        variable_partitioner: a tf.distribute partitioner (e.g.
            ``tf.distribute.experimental.partitioners.MinSizePartitioner``)
            that shards large variables over the ps tasks, or None.

    Raises:
        ClusterConfigError: when there is no cluster, or it lacks ps or
            worker tasks.
        UnsupportedBackendError: on the JAX and torch backends.
    """

    # The chief is one process: its runtime is local.
    topology = Topology.MIRRORED

    def __init__(self, cluster_resolver=None, variable_partitioner=None):
        # The backend's clear error, before any runtime starts.
        backend_lib.refuse_unsupported(ParameterServerPlan)
        task = _task_from(cluster_resolver)
        if task.task_type in ("worker", "ps"):
            serve(task)  # blocks: this task serves the chief until killed
        if task.task_type == "evaluator":
            raise ClusterConfigError(
                "This is TF_CONFIG's 'evaluator' task, which is not part of "
                "the parameter-server cluster: do not create a "
                "ParameterServerStrategy here. Build the model without a "
                "strategy and evaluate the checkpoints the chief writes "
                "(e.g. with keras.callbacks.ModelCheckpoint on the chief)."
            )
        cluster = task.cluster
        if not cluster.get("ps") or not cluster.get("worker"):
            raise ClusterConfigError(
                "ParameterServerStrategy needs a cluster with 'worker' and "
                "'ps' tasks (and this process as its 'chief'); got "
                f"{ {k: len(v) for k, v in cluster.items()} }. Set TF_CONFIG "
                "on every task, or pass cluster_resolver={'chief': [...], "
                "'worker': [...], 'ps': [...]} (see "
                "guides/parameter_server.md)."
            )
        self._cluster = cluster
        self._variable_partitioner = variable_partitioner
        super().__init__(None)

    def _make_plan(self, devices):
        return ParameterServerPlan(
            topology=self.topology,
            devices=tuple(devices),
            cluster=self._cluster,
            variable_partitioner=self._variable_partitioner,
        )

    @property
    def coordinator(self):
        """The `tf.distribute.coordinator.ClusterCoordinator` of the job."""
        return self._engine.coordinator

    @property
    def num_workers(self) -> int:
        """Number of worker tasks (the chief and ps tasks not counted)."""
        return len(self._cluster["worker"])

    @property
    def num_ps(self) -> int:
        """Number of ps tasks."""
        return len(self._cluster["ps"])

    def __repr__(self):
        return (
            f"ParameterServerStrategy(workers={self.num_workers}, "
            f"ps={self.num_ps})"
        )


def _task_from(resolver) -> TaskSpec:
    if resolver is None:
        task = read_task_spec()
        if task.task_type is None:
            raise ClusterConfigError(
                "ParameterServerStrategy found no cluster: TF_CONFIG is not "
                "set. Set TF_CONFIG on every task, or pass cluster_resolver="
                "{'chief': [...], 'worker': [...], 'ps': [...]}."
            )
        return task
    if isinstance(resolver, TaskSpec):
        return resolver
    if isinstance(resolver, dict):
        return TaskSpec("chief", 0, {k: list(v) for k, v in resolver.items()})
    if hasattr(resolver, "cluster_spec") and hasattr(resolver, "task_type"):
        spec = resolver.cluster_spec().as_dict()
        cluster = {
            k: list(v.values()) if isinstance(v, dict) else list(v)
            for k, v in spec.items()
        }
        return TaskSpec(
            resolver.task_type or "chief", int(resolver.task_id or 0), cluster
        )
    raise TypeError(
        "cluster_resolver must be a dict of task addresses, a TaskSpec or "
        f"a tf.distribute cluster resolver; got {type(resolver).__name__}."
    )

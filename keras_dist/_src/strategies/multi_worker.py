"""`MultiWorkerMirroredStrategy`: synchronous data parallelism over hosts."""

from __future__ import annotations

from keras_dist._src.cluster.environments import environment_from
from keras_dist._src.options import InputOptions
from keras_dist._src.plan import Topology
from keras_dist._src.strategy import Strategy


class MultiWorkerMirroredStrategy(Strategy):
    """Synchronous data parallelism over every device of every worker.

    The same script runs on each worker (started by ``keras-dist launch``,
    torchrun, SLURM's ``srun``, ``mpirun``, or by hand with ``TF_CONFIG``).
    Variables are mirrored on every device of every worker (the chief's
    initial values are broadcast, so workers need not seed alike), each
    global batch is split across all replicas and gradients are all-reduced
    by the backend's own engine: `jax.distributed` on JAX,
    `torch.distributed` on torch. With no cluster settings it is a
    one-worker strategy over the local devices, as in tf.distribute.

    Args:
        cluster_resolver: where this process stands in the job: a
            `keras_dist.ClusterEnvironment` (or a tf.distribute cluster
            resolver); read from the launcher's variables when None.
        sync_batch_norm: global-batch BatchNormalization statistics
            (default) or per-replica ones.
        input_options: an `InputOptions`: how input is sharded between
            workers.

    Raises:
        ClusterConfigError: when the launcher's variables are incomplete or
            contradict each other.
    """

    topology = Topology.MULTI_WORKER

    def __init__(
        self,
        cluster_resolver=None,
        sync_batch_norm: bool = True,
        input_options: InputOptions | None = None,
    ):
        environment = environment_from(cluster_resolver)
        self._many_devices_meant = True  # warn when one replica is found
        # None: the backend's default devices, listed once this process has
        # joined the job (on torch, where a process drives one device, the
        # backend picks this process's by its local rank).
        super().__init__(
            None,
            sync_batch_norm=sync_batch_norm,
            input_options=input_options,
            environment=environment,
        )

    def __repr__(self):
        return (
            f"MultiWorkerMirroredStrategy(worker={self.worker_index}/"
            f"{self.num_workers}, replicas={self.num_replicas_in_sync})"
        )

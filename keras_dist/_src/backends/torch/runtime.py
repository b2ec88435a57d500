"""The `Runtime` of a torch job: host-value collectives over gloo and
the rendezvous store (`TorchRuntime`), and which runtime a strategy gets
(`create_runtime`). Joining or starting the job is `job.py`.
"""

from __future__ import annotations

import datetime

import numpy as np
import torch
import torch.distributed as dist

from keras_dist._src.backends.torch.job import (
    Job,
    collective_timeout,
    shutdown_job,
    start_job,
)
from keras_dist._src.cluster.environments import detect_environment
from keras_dist._src.runtime import HostRuntime, LocalRuntime, membership


class TorchRuntime(HostRuntime):
    """Host-value collectives of a torch job, over a gloo process group.

    Host values travel on CPU tensors through their own gloo group (also
    when training uses NCCL), so they never queue behind, or interleave
    with, the training step's collectives.
    """

    def __init__(self, job: Job):
        super().__init__(job.environment)
        self.job = job
        # At most the liveness timeout for a hung rank, as the job's group
        # (a new group's default is 30 minutes).
        self._group = dist.new_group(
            backend="gloo", timeout=collective_timeout()
        )
        self._store = None  # a client of the rendezvous store, when used

    @property
    def has_key_values(self) -> bool:
        """Whether the job's rendezvous store is reachable (the job was
        started with a coordinator address)."""
        if self._store is None:
            self._store = self.job._client()
        return self._store is not None

    def publish(self, key: str, text: str) -> None:
        """Sets `key` in the rendezvous store."""
        if not self.has_key_values:
            super().publish(key, text)
        self._store.set(key, text.encode())

    def wait_for(self, key: str, seconds: float) -> str | None:
        """Waits for `key` in the rendezvous store."""
        if not self.has_key_values:
            return super().wait_for(key, seconds)
        try:
            self._store.wait([key], datetime.timedelta(seconds=seconds))
        except (RuntimeError, dist.DistError):  # the wait timed out
            return None
        return self._store.get(key).decode()

    def _barrier(self) -> None:
        dist.barrier(group=self._group)

    def _broadcast(self, flat: np.ndarray, root: int) -> np.ndarray:
        tensor = torch.from_numpy(np.ascontiguousarray(flat))
        dist.broadcast(tensor, src=root, group=self._group)
        return tensor.numpy()

    def _all_reduce(self, flat: np.ndarray, op: str) -> np.ndarray:
        tensor = torch.from_numpy(np.ascontiguousarray(flat))
        reduce_op = {
            "sum": dist.ReduceOp.SUM,
            "max": dist.ReduceOp.MAX,
            "min": dist.ReduceOp.MIN,
        }[op]
        dist.all_reduce(tensor, op=reduce_op, group=self._group)
        return tensor.numpy()

    def _all_gather(self, flat: np.ndarray) -> list[np.ndarray]:
        tensor = torch.from_numpy(np.ascontiguousarray(flat))
        parts = [torch.empty_like(tensor) for _ in range(self.world_size)]
        dist.all_gather(parts, tensor, group=self._group)
        return [p.numpy() for p in parts]

    def shutdown(self) -> None:
        """Stops the watchdog and leaves the process group (at exit)."""
        shutdown_job()


def joins_job() -> bool:
    """Whether this process is (or will be) one rank of a launched job."""
    return dist.is_initialized() or detect_environment().is_distributed


def create_runtime(kind, devices, environment=None):
    """The runtime of a `kind` strategy over `devices`.

    One process per device: `runtime.membership` decides whether this
    process trains alone (`LocalRuntime`) or joins (or starts) the job and
    gets a `TorchRuntime`.
    """
    if devices is None:
        from keras_dist._src.backends.torch.devices import default_devices

        devices = default_devices()
    kinds = {d.split(":")[0] for d in devices}
    if len(kinds) != 1 or kinds - {"cpu", "gpu"}:
        tpu = (
            " TPUs are trained with TPUStrategy on the JAX or TensorFlow "
            "backend (KERAS_BACKEND=jax)."
            if "tpu" in kinds
            else ""
        )
        raise ValueError(
            f"The torch backend runs one process per device, all of one "
            f"type (all 'gpu' or all 'cpu'); got {list(devices)}.{tpu}"
        )
    member = membership(
        kind,
        devices,
        environment,
        process_per_device=True,
        in_job=joins_job,
    )
    if not member.job:
        return LocalRuntime()
    return TorchRuntime(start_job(devices, member.environment))

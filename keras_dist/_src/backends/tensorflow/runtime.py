"""The TensorFlow Runtime: one process, or many through TF's coordination
service.

A mirrored strategy drives every local device from this one process
(`LocalRuntime`). Workers of a multi-worker strategy share the coordination
service that `tf.distribute.MultiWorkerMirroredStrategy` starts (the one its
own `PreemptionCheckpointHandler` uses): host values go through its
key-value store and `barrier` is its barrier.
"""

from __future__ import annotations

import atexit
import base64
import itertools

import numpy as np

from keras_dist._src.cluster import supervision
from keras_dist._src.cluster.supervision import liveness_timeout
from keras_dist._src.errors import KerasDistError
from keras_dist._src.framework_glue import tensorflow_private
from keras_dist._src.runtime import HostRuntime, LocalRuntime, membership


def _context():
    return tensorflow_private.eager_context()


class _StoreRuntime(HostRuntime):
    """Host-value collectives through the coordination service's store.

    Every process makes the same collectives in the same order, so the
    n-th one uses keys numbered n (under this runtime's `prefix`). A
    process's keys are deleted once every process is known to have read
    them (after the next gather or barrier).
    """

    def __init__(self, environment, prefix: str = "keras_dist"):
        super().__init__(environment)
        self._prefix = prefix
        self._sequence = itertools.count()
        self._stale: list[str] = []
        self._channels = itertools.count()

    def channel(self, name: str) -> _StoreRuntime:
        """An independent runtime of the same processes, with keys of its
        own: collectives made from another thread (an input pipeline's)
        never interleave with this one's. Every process must open its
        channels in the same order."""
        number = next(self._channels)
        return _StoreRuntime(self.environment, f"{self._prefix}/{name}{number}")

    @property
    def has_key_values(self) -> bool:
        """The coordination service's store is this runtime's medium."""
        return True

    def publish(self, key: str, text: str) -> None:
        """Sets `key` in the coordination service's store."""
        _context().set_config_key_value(key, text)

    def wait_for(self, key: str, seconds: float) -> str | None:
        """Waits for `key` in the coordination service's store."""
        try:
            return _context().get_config_key_value(
                key, timeout_in_ms=int(seconds * 1000)
            )
        except Exception:  # noqa: BLE001 - TF raises its own error types
            return None

    def _key(self, sequence: int, rank: int) -> str:
        return f"{self._prefix}/{sequence}/{rank}"

    def _put(self, key: str, flat: np.ndarray) -> None:
        payload = (
            flat.dtype.str + ":" + base64.b64encode(flat.tobytes()).decode()
        )
        _context().set_config_key_value(key, payload)

    def _get(self, key: str) -> np.ndarray:
        # A hung worker (alive, so the coordination service's heartbeats
        # never end the wait) fails the wait after the liveness timeout.
        seconds = liveness_timeout()
        try:
            payload = _context().get_config_key_value(
                key, timeout_in_ms=seconds * 1000
            )
        except Exception as error:  # noqa: BLE001 - TF's own error types
            raise KerasDistError(
                f"Worker {self.rank} waited {seconds} s (KERAS_DIST_TIMEOUT) "
                f"for another worker in a collective of keras_dist ({key}), "
                "and it did not come: that worker is hung, has failed or "
                "is making another call. Raise KERAS_DIST_TIMEOUT if a "
                "worker may legitimately take longer."
            ) from error
        dtype, _, data = payload.partition(":")
        return np.frombuffer(base64.b64decode(data), np.dtype(dtype)).copy()

    def _forget_stale(self, keep: list[str]) -> None:
        for key in self._stale:
            try:
                _context().delete_config_key_value(key)
            except Exception:  # noqa: BLE001 - best effort clean-up
                pass
        self._stale = keep

    def _barrier(self) -> None:
        sequence = next(self._sequence)
        _context().wait_at_barrier(
            f"{self._prefix}/barrier/{sequence}", liveness_timeout() * 1000
        )
        self._forget_stale([])

    def _broadcast(self, flat: np.ndarray, root: int) -> np.ndarray:
        sequence = next(self._sequence)
        key = self._key(sequence, root)
        if self.rank == root:
            self._put(key, flat)
            self._stale.append(key)
            return flat
        return self._get(key)

    def _all_gather(self, flat: np.ndarray) -> list[np.ndarray]:
        sequence = next(self._sequence)
        mine = self._key(sequence, self.rank)
        self._put(mine, flat)
        parts = [
            flat if r == self.rank else self._get(self._key(sequence, r))
            for r in range(self.world_size)
        ]
        # Everyone has now published this round, so has read the last one.
        self._forget_stale([mine])
        return parts

    def _all_reduce(self, flat: np.ndarray, op: str) -> np.ndarray:
        stacked = np.stack(self._all_gather(flat))
        return {"sum": np.sum, "max": np.max, "min": np.min}[op](
            stacked, axis=0
        )


class TfRuntime(_StoreRuntime):
    """The Runtime of a TensorFlow multi-worker job: joins it by creating
    tf.distribute's MultiWorkerMirroredStrategy (`tf_strategy`)."""

    def __init__(self, environment):
        super().__init__(environment)
        from keras_dist._src.backends.tensorflow.multi_worker import (
            new_strategy,
        )

        # Joins the job: starts this worker's server and the coordination
        # service, before TensorFlow lists its devices.
        self.tf_strategy = new_strategy(environment)
        supervision.keep_sigterm_fatal()
        # The chief's process hosts the coordination service: registered
        # after TensorFlow's own exit handlers, so this one runs first.
        supervision.track_exit_requests()
        atexit.register(self._leave)

    def _leave(self) -> None:
        supervision.leave_job(
            self.rank,
            self.world_size,
            self.publish,
            lambda key, seconds: self.wait_for(key, seconds) is not None,
        )


def create_runtime(kind, devices, environment=None):
    """The runtime of a `kind` strategy (the multi-worker engine creates the
    tf.distribute strategy that starts the coordination service)."""
    supervision.watch_launcher()
    member = membership(
        kind, devices or (), environment, process_per_device=False
    )
    if not member.job:
        return LocalRuntime(member.environment)
    return TfRuntime(member.environment)

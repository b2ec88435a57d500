"""The JAX Runtime: one process, or many through `jax.distributed`.

A mirrored strategy drives every local device from this one process
(`LocalRuntime`). A multi-worker strategy joins the job with
`jax.distributed.initialize` (its coordination service; gloo collectives on
CPU) and moves host values with `jax.experimental.multihost_utils`, whose
collectives run on the devices of every process.
"""

from __future__ import annotations

import atexit
import inspect
import os
import sys
import time

import jax
import numpy as np

from keras_dist._src.cluster import binding, supervision
from keras_dist._src.cluster.environments import (
    ClusterEnvironment,
)
from keras_dist._src.cluster.supervision import liveness_timeout
from keras_dist._src.errors import KerasDistError
from keras_dist._src.framework_glue import jax_private
from keras_dist._src.runtime import HostRuntime, LocalRuntime, membership


class JaxRuntime(HostRuntime):
    """Host-value collectives between the processes of a JAX job."""

    def _barrier(self) -> None:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices("keras_dist")

    # JAX computes in 32 bits unless x64 is enabled: move the bytes of
    # 64-bit values as uint32 pairs, exactly, and reduce on the host.
    def _broadcast(self, flat: np.ndarray, root: int) -> np.ndarray:
        from jax.experimental import multihost_utils

        words = flat.view(np.uint32)
        out = multihost_utils.broadcast_one_to_all(
            words, is_source=self.rank == root
        )
        return np.asarray(out, np.uint32).view(flat.dtype)

    def _all_gather(self, flat: np.ndarray) -> list[np.ndarray]:
        from jax.experimental import multihost_utils

        words = flat.view(np.uint32)
        out = np.asarray(multihost_utils.process_allgather(words), np.uint32)
        out = out.reshape(self.world_size, -1)
        return [row.view(flat.dtype) for row in out]

    def _all_reduce(self, flat: np.ndarray, op: str) -> np.ndarray:
        stacked = np.stack(self._all_gather(flat))
        return {"sum": np.sum, "max": np.max, "min": np.min}[op](
            stacked, axis=0
        )

    def shutdown(self) -> None:
        """Leaves the job (`jax.distributed.shutdown`)."""
        global _left
        _left = True
        jax.distributed.shutdown()

    @staticmethod
    def _client():
        return jax_private.distributed_client()

    @property
    def has_key_values(self) -> bool:
        """Whether `jax.distributed`'s coordination service is joined."""
        return self._client() is not None

    def publish(self, key: str, text: str) -> None:
        """Sets `key` in the coordination service's key-value store."""
        self._client().key_value_set(key, text)

    def wait_for(self, key: str, seconds: float) -> str | None:
        """Waits for `key` in the coordination service's store."""
        try:
            return self._client().blocking_key_value_get(
                key, int(seconds * 1000)
            )
        except Exception:  # noqa: BLE001 - JAX raises its runtime's error type
            return None


# Set once this process has left its job (`JaxRuntime.shutdown`).
_left = False


def _initialize(environment: ClusterEnvironment) -> None:
    """Joins the JAX job (once), before JAX's backends start."""
    if jax_private.distributed_client() is not None:
        return  # already initialised (by the user or an earlier strategy)
    if _left:
        raise supervision.rejoin_error("jax.distributed")
    from keras_dist._src.backends.jax.devices import backends_initialized

    if backends_initialized():
        raise KerasDistError(
            "A multi-worker strategy on JAX must be created before JAX "
            "starts computing (jax.distributed.initialize has to run first). "
            "Create the strategy at the top of the program, right after "
            "`import keras_dist`."
        )
    gloo = jax.config.jax_platforms in (None, "", "cpu") or (
        "cpu" in str(jax.config.jax_platforms)
    )
    if gloo:
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    host = binding.bind_host(environment)
    timeout = liveness_timeout()
    options = {
        "initialization_timeout": max(timeout, 300),
        "heartbeat_timeout_seconds": timeout,
        # Where rank 0's coordination service listens (JAX's default is
        # every interface, "[::]:port"): loopback for a one-host job.
        "coordinator_bind_address": binding.format_address(
            host, environment.coordinator_port
        ),
    }
    accepted = inspect.signature(jax.distributed.initialize).parameters
    if "coordinator_bind_address" not in accepted:
        supervision.log(
            "this JAX release's jax.distributed.initialize takes no "
            "coordinator_bind_address: rank 0's coordination service "
            "listens on every interface. Upgrade JAX to keep a one-host "
            "job on loopback."
        )
    jax.distributed.initialize(
        coordinator_address=environment.coordinator_address,
        num_processes=environment.world_size,
        process_id=environment.rank,
        # Older JAX releases lack some of these.
        **{k: v for k, v in options.items() if k in accepted},
    )
    if gloo and host is not None and binding.is_loopback(host):
        _gloo_on(host)
    supervision.keep_sigterm_fatal()
    _exit_on_uncaught_exception()
    # Before JAX's shutdown barrier (exit handlers run last-in first-out):
    # a call still waiting for this process fails at once.
    client = jax_private.distributed_client()
    atexit.register(
        supervision.leave_job,
        environment.rank,
        environment.world_size,
        client.key_value_set,
    )
    _exit_at_once_on_failing_exit()


def _exit_on_uncaught_exception() -> None:
    """A worker whose program raises leaves the job at once, with exit
    code 1: otherwise JAX's shutdown barrier (at exit) waits for the other
    workers, which wait in a collective for this one, until a timeout
    ends them all (minutes) under another rank's name. The launcher then
    names this worker and stops the others. The traceback is printed
    first; exit handlers do not run. A worker whose collective failed
    because a peer left (gloo's error) waits a few seconds first, so that
    the launcher names the peer that failed, not this one."""
    original = sys.excepthook

    def hook(kind, value, tb):
        try:
            original(kind, value, tb)
            sys.stdout.flush()
            sys.stderr.flush()
            if "Gloo" in str(value):
                time.sleep(_PEER_FAILURE_GRACE)
        finally:
            os._exit(1)

    sys.excepthook = hook


def _exit_at_once_on_failing_exit() -> None:
    """A worker whose program calls ``sys.exit(n)`` with a failing status
    leaves the job at once with that status, as on TensorFlow and torch:
    otherwise JAX's shutdown barrier (its exit handler) held it until the
    liveness timeout while the others waited for it in a collective, and
    the job ended under another rank's name and code. Finally blocks and the
    exit handlers registered after this one have run by then; JAX's
    shutdown does not. ``sys.exit()``, ``sys.exit(0)`` and keras_dist's own
    preemption exit keep the orderly shutdown (as does a ``sys.exit`` in
    another thread, which ends only that thread). Must run after
    ``jax.distributed.initialize`` (exit handlers run last-in first-out)."""
    supervision.track_exit_requests()

    def leave():
        code = supervision.failing_exit_code()
        if code is None or getattr(sys, "last_value", None) is not None:
            return  # an uncaught exception: the excepthook ends the process
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)

    atexit.register(leave)


# Seconds a worker whose collective failed on a peer's exit waits before it
# exits (the launcher stops it sooner).
_PEER_FAILURE_GRACE = 5.0


def _gloo_on(host: str) -> None:
    """Makes the CPU backend's gloo collectives listen on `host`.

    JAX creates them for the address this host's name resolves to (a
    network interface on most machines) and has no setting for it: the CPU
    backend's factory is registered again with gloo bound to `host`, the
    loopback address of a one-host job. Must run before the CPU backend
    starts (right after ``jax.distributed.initialize``).
    """
    try:
        jax_private.register_cpu_backend_with_gloo_on(host)
    except (AttributeError, TypeError) as error:  # another JAX release
        supervision.log(
            f"cannot bind JAX's gloo collectives to {host} ({error}); they "
            "listen on the address this host's name resolves to."
        )


def create_runtime(kind, devices, environment=None):
    """The runtime of a `kind` strategy (`plan.Topology`): this process
    joins the job where `runtime.membership` says so."""
    supervision.watch_launcher()
    member = membership(
        kind, devices or (), environment, process_per_device=False
    )
    if not member.job:
        return LocalRuntime(member.environment)
    _initialize(member.environment)
    return JaxRuntime(member.environment)

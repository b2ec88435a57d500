"""The tasks of a parameter-server cluster: serving, and a local cluster.

Under `ParameterServerStrategy` only the chief runs the training script's
logic; worker and ps tasks run a `tf.distribute.Server` and wait for the
chief's work (`serve`). `local_cluster` starts such tasks as subprocesses
of this host on free loopback ports (tests, trying things out).
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import time

from keras_dist._src.cluster.environments import (
    ClusterConfigError,
    TaskSpec,
    read_task_spec,
)

#: Printed by a serving task once its server listens.
READY_LINE = "keras_dist: server ready"


def serve(task: TaskSpec | None = None, block: bool = True):
    """Runs this process's `tf.distribute.Server` if it is a worker or ps
    task of a parameter-server cluster, and waits for the chief's work.

    Read from ``TF_CONFIG`` when `task` is None. On a chief or evaluator
    task (or without TF_CONFIG) it returns None at once, so the same script
    can call it first on every task.

    Args:
        task: this process's `TaskSpec` (default: read from TF_CONFIG).
        block: wait forever (the usual case: the process ends when it is
            killed or the chief's job is over); False returns the started
            server.

    Returns:
        None on a chief/evaluator task; the server when ``block=False``.

    Raises:
        ClusterConfigError: for a malformed TF_CONFIG.
    """
    task = read_task_spec() if task is None else task
    if task.task_type not in ("worker", "ps"):
        return None
    import tensorflow as tf

    server = tf.distribute.Server(
        tf.train.ClusterSpec(task.cluster),
        job_name=task.task_type,
        task_index=task.task_index,
        protocol="grpc",
        start=True,
    )
    print(
        f"{READY_LINE} ({task.task_type} {task.task_index} at {task.address})",
        flush=True,
    )
    if not block:
        return server
    server.join()
    return server


def free_port() -> int:
    """A free TCP port on the loopback interface."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


# What each task of `local_cluster` runs: `serve`'s server, with TensorFlow
# only (importing Keras too doubles a task's start on a busy host).
_SERVER_SCRIPT = f"""
import json, os
import tensorflow as tf
config = json.loads(os.environ["TF_CONFIG"])
task = config["task"]
server = tf.distribute.Server(
    tf.train.ClusterSpec(config["cluster"]), job_name=task["type"],
    task_index=int(task["index"]), protocol="grpc", start=True)
print({READY_LINE!r}, flush=True)
server.join()
"""


@contextlib.contextmanager
def local_cluster(
    num_workers: int = 2, num_ps: int = 1, timeout: float = 240.0, env=None
):
    """Starts worker and ps tasks on this host; yields the cluster.

    Each task is a subprocess running `serve` on a free loopback port. The
    cluster dict (``chief``, ``worker``, ``ps``) is yielded once every task
    listens; the caller is the chief. The tasks are killed on exit.

    Args:
        num_workers: worker tasks to start.
        num_ps: ps tasks to start.
        timeout: seconds to wait for every task to listen.
        env: extra environment variables for the tasks.

    Yields:
        ``(cluster, processes)``: the cluster dict and a dict mapping
        ``("worker", i)`` / ``("ps", i)`` to each `subprocess.Popen`.

    Raises:
        ClusterConfigError: when a task exits or is not ready in time.
    """
    cluster = {
        "chief": [f"127.0.0.1:{free_port()}"],
        "worker": [f"127.0.0.1:{free_port()}" for _ in range(num_workers)],
        "ps": [f"127.0.0.1:{free_port()}" for _ in range(num_ps)],
    }
    processes = {}
    try:
        for kind in ("ps", "worker"):
            for index in range(len(cluster[kind])):
                task_env = dict(os.environ, **(env or {}))
                task_env["TF_CONFIG"] = json.dumps(
                    {
                        "cluster": cluster,
                        "task": {"type": kind, "index": index},
                    }
                )
                task_env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
                processes[(kind, index)] = subprocess.Popen(
                    [sys.executable, "-c", _SERVER_SCRIPT],
                    env=task_env,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.DEVNULL,
                    text=True,
                )
        deadline = time.monotonic() + timeout
        for (kind, index), process in processes.items():
            while True:
                line = process.stdout.readline()
                if line.startswith(READY_LINE):
                    break
                if not line and process.poll() is not None:
                    raise ClusterConfigError(
                        f"The {kind} task {index} exited with code "
                        f"{process.returncode} before its server listened."
                    )
                if time.monotonic() > deadline:
                    raise ClusterConfigError(
                        f"The {kind} task {index} was not listening after "
                        f"{timeout:.0f} s."
                    )
        yield cluster, processes
    finally:
        for process in processes.values():
            if process.poll() is None:
                process.kill()
        for process in processes.values():
            process.wait()
            if process.stdout:
                process.stdout.close()


def in_process_cluster(num_workers: int = 2, num_ps: int = 1) -> dict:
    """Starts worker and ps servers inside this process; returns the
    cluster dict (``chief``, ``worker``, ``ps``) for the chief (this
    process). Quick to start (no process imports TensorFlow again), but
    its servers live until the process ends and cannot be killed one by
    one: tests of faults use `local_cluster`.
    """
    import tensorflow as tf

    cluster = {
        "chief": [f"127.0.0.1:{free_port()}"],
        "worker": [f"127.0.0.1:{free_port()}" for _ in range(num_workers)],
        "ps": [f"127.0.0.1:{free_port()}" for _ in range(num_ps)],
    }
    spec = tf.train.ClusterSpec(cluster)
    # In-process servers share this process's thread pools: with as few
    # inter-op threads as cores (2 on a small host) they deadlock.
    config = tf.compat.v1.ConfigProto()
    config.inter_op_parallelism_threads = 4 * (num_workers + num_ps) + 4
    servers = []
    for kind in ("worker", "ps"):
        for index in range(len(cluster[kind])):
            servers.append(
                tf.distribute.Server(
                    spec,
                    job_name=kind,
                    task_index=index,
                    protocol="grpc",
                    config=config,
                    start=True,
                )
            )
    _IN_PROCESS_SERVERS.extend(servers)  # kept alive with the process
    return cluster


_IN_PROCESS_SERVERS: list = []

"""The tasks of a parameter-server cluster: serving, and a local cluster.

Under `ParameterServerStrategy` only the chief runs the training script's
logic; worker and ps tasks run a `tf.distribute.Server` and wait for the
chief's work (`serve`). `local_cluster` starts such tasks as subprocesses
of this host on free loopback ports (tests, trying things out), and
`launch_ps` (``keras-dist launch --ps N --workers M``) runs and
supervises a whole job on this host: chief, workers and ps tasks.
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
from keras_dist._src.cluster.launcher import (
    ENV_LAUNCHED,
    run_supervised,
    script_command,
)
from keras_dist._src.cluster.launcher import free_port as host_port
from keras_dist._src.cluster.supervision import (
    describe_exit,
    exit_status,
    log,
    stop_processes,
    watch_processes,
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
        stop_processes(processes.values(), grace=0)
        for process in processes.values():
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


# -- keras-dist launch --ps N --workers M ------------------------------------
#: torchrun's variables: a parameter-server task is not one of N peers.
_PEER_VARIABLES = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
)


def ps_task_environments(
    num_workers: int, num_ps: int, host: str = "127.0.0.1", base=None
) -> list:
    """The tasks of a one-host parameter-server job, without starting any.

    Args:
        num_workers: worker tasks.
        num_ps: ps tasks.
        host: the address every task listens on (loopback by default).
        base: the environment to start from (default: this process's).

    Returns:
        ``[(task_type, index, env), ...]``: the ps tasks, the workers, then
        the chief; each env has ``TF_CONFIG`` (one cluster of free ports on
        `host`, the task's own type and index) and
        ``KERAS_BACKEND=tensorflow``.

    Raises:
        ValueError: for no worker or ps task, or another Keras backend.
    """
    if num_workers < 1 or num_ps < 1:
        raise ValueError(
            "A parameter-server job needs --workers >= 1 and --ps >= 1; got "
            f"--workers {num_workers} --ps {num_ps}."
        )
    base = dict(os.environ if base is None else base)
    backend = base.get("KERAS_BACKEND", "tensorflow")
    if backend != "tensorflow":
        raise ValueError(
            f"keras-dist launch --ps starts a ParameterServerStrategy job, "
            f"which is TensorFlow only, but KERAS_BACKEND={backend}. Unset "
            "it or set KERAS_BACKEND=tensorflow (on JAX or torch, use "
            "--nproc-per-node with ModelParallel)."
        )
    for name in _PEER_VARIABLES:
        base.pop(name, None)
    cluster = {
        "chief": [f"{host}:{host_port(host)}"],
        "worker": [f"{host}:{host_port(host)}" for _ in range(num_workers)],
        "ps": [f"{host}:{host_port(host)}" for _ in range(num_ps)],
    }
    tasks = []
    for kind in ("ps", "worker", "chief"):
        for index in range(len(cluster[kind])):
            env = dict(base)
            env.update(
                KERAS_BACKEND="tensorflow",
                PYTHONUNBUFFERED="1",
                TF_CONFIG=json.dumps(
                    {"cluster": cluster, "task": {"type": kind, "index": index}}
                ),
                **{ENV_LAUNCHED: str(os.getpid())},
            )
            tasks.append((kind, index, env))
    return tasks


def _address(env) -> tuple:
    config = json.loads(env["TF_CONFIG"])
    task = config["task"]
    return _split_address(config["cluster"][task["type"]][task["index"]])


def _listens(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=0.5):
            return True
    except OSError:
        return False


def launch_ps(
    command: list,
    num_workers: int,
    num_ps: int,
    host: str = "127.0.0.1",
    start_timeout: float = 300.0,
    max_restarts: int = 0,
    backoff: float = 1.0,
) -> int:
    """``keras-dist launch --ps N --workers M``: runs a whole
    parameter-server job on this host and supervises it.

    Starts the ps, worker and chief tasks at once (each runs `command`
    with its own ``TF_CONFIG``; `serve` or `ParameterServerStrategy()`
    makes the ps and worker tasks serve, and the chief's strategy waits
    until they listen). Output lines
    are prefixed with the task (``[ps 0]``, ``[worker 1]``, ``[chief]``);
    SIGINT, SIGTERM and SIGUSR1 are forwarded to every task. Then, as
    tf.distribute's semantics require:

    * a worker that dies is tolerated: the chief's coordinator re-runs its
      steps on the other workers (the job ends only when no worker is
      left);
    * a ps task that dies (its variables are lost) ends the job: every
      other task is stopped and the ps task's exit code returned;
    * the chief's exit ends the job with the chief's exit code, stopping
      the ps and worker tasks (which serve until stopped).

    With ``--max-restarts N`` (`max_restarts`), up to N times in all: a
    worker task that dies is started again on its address, and the
    chief's coordinator sends it closures again once it serves; a lost ps
    task restarts the whole job (every task, fresh ports, after
    `backoff` seconds doubled each time), and ``BackupAndRestore`` resumes
    `fit` from the last epoch it saved. Tasks see the job's restart count
    in ``KERAS_DIST_RESTART_COUNT``.

    Args:
        command: the program and its arguments (a ``.py`` script runs with
            this Python).
        num_workers: worker tasks.
        num_ps: ps tasks.
        host: the address the tasks listen on.
        start_timeout: seconds for the ps and worker tasks to listen.
        max_restarts: worker replacements and job restarts allowed.
        backoff: seconds before the first job restart.

    Returns:
        The exit code: the chief's, or the failed task's (128 + the signal
        for a task killed by a signal).
    """
    command = script_command(command)
    budget = {"left": max_restarts, "used": 0}
    for attempt in range(max_restarts + 1):
        base = dict(os.environ, KERAS_DIST_RESTART_COUNT=str(attempt))
        tasks = [
            (
                (kind, index),
                "[chief] " if kind == "chief" else f"[{kind} {index}] ",
                env,
            )
            for kind, index, env in ps_task_environments(
                num_workers, num_ps, host, base
            )
        ]
        addresses = {key: _address(env) for key, _, env in tasks}
        # All at once (the chief waits until the others listen: see
        # wait_until_listening), so that their starts overlap.
        code, lost_ps = run_supervised(
            command,
            tasks,
            lambda procs, start, a=addresses: _supervise_ps(
                procs, a, num_workers, start_timeout, start, budget
            ),
            respawn=True,
        )
        if not lost_ps or budget["left"] < 1:
            return code
        budget["left"] -= 1
        budget["used"] += 1
        delay = min(backoff * 2**attempt, 30.0)
        log(
            f"restarting the whole job (restart {budget['used']} of "
            f"{max_restarts}) in {delay:.1f} s: BackupAndRestore resumes "
            "fit from the last epoch it saved."
        )
        time.sleep(delay)
    return code


def _supervise_ps(
    procs, addresses, num_workers, start_timeout, start, budget
) -> tuple:
    """Watches a parameter-server job (`launch_ps`'s rules); returns its
    exit code and whether a ps task was lost."""
    lost_workers = set()
    waiting = {key for key in procs if key[0] != "chief"}
    deadline = time.monotonic() + start_timeout

    def decide(codes):
        for key in sorted(waiting):
            if _listens(*addresses[key]):
                waiting.discard(key)
        if waiting and time.monotonic() > deadline:
            log(
                f"{sorted(waiting)} did not listen within "
                f"{start_timeout:.0f} s; stopping the job."
            )
            return (1, False)
        chief = codes[("chief", 0)]
        if chief is not None:
            if chief != 0:
                log(
                    f"the chief {describe_exit(chief)}; stopping the ps "
                    "and worker tasks."
                )
            return (exit_status(chief), False)
        # Workers before ps tasks: a worker and a ps task found dead in one
        # poll are both reported (the lost ps task then ends the job).
        for (kind, index), code in sorted(
            codes.items(), key=lambda item: item[0][0] == "ps"
        ):
            if code is None or kind == "chief":
                continue
            if (kind, index) in waiting:
                log(
                    f"the {kind} task {index} {describe_exit(code)} before "
                    "it was seen listening: the job cannot start (see its "
                    "output above; on ps and worker tasks the script must "
                    "serve: "
                    "keras_dist.serve() or keras_dist."
                    "ParameterServerStrategy()). Stopping the job."
                )
                return (exit_status(code) or 1, False)
            if kind == "ps":
                after = (
                    "Restart the job: a BackupAndRestore callback resumes "
                    "fit from the last epoch it saved."
                    if budget["left"] < 1
                    else "Restarting the job (--max-restarts)."
                )
                log(
                    f"ps task {index} {describe_exit(code)}: the variables "
                    "it held are lost, so the job cannot continue "
                    "(tf.distribute ends a parameter-server job that loses "
                    "a ps task). Stopping the chief and the workers. " + after
                )
                return (exit_status(code) or 1, True)
            if budget["left"] > 0:
                budget["left"] -= 1
                budget["used"] += 1
                log(
                    f"worker task {index} {describe_exit(code)}; starting "
                    f"it again (restart {budget['used']} of "
                    f"{budget['used'] + budget['left']}): the chief's "
                    "coordinator sends it steps again once it serves."
                )
                start((kind, index))
                continue
            if index not in lost_workers:
                lost_workers.add(index)
                log(
                    f"worker task {index} {describe_exit(code)}; tolerated: "
                    "the chief re-runs its steps on the other workers "
                    f"({num_workers - len(lost_workers)} of {num_workers} "
                    "left)."
                )
                if len(lost_workers) == num_workers:
                    log(
                        "every worker task is gone, so no step can run; "
                        "stopping the job."
                    )
                    return (exit_status(code) or 1, False)
        return None

    return watch_processes(procs, decide, 0.2)


def wait_until_listening(cluster: dict, timeout: float = 300.0) -> None:
    """Waits until every worker and ps address of `cluster` accepts a TCP
    connection (the chief's first step: tasks may start at the same time).

    Raises:
        ClusterConfigError: naming the tasks still not listening after
            `timeout` seconds.
    """
    pending = [
        (kind, index, address)
        for kind in ("ps", "worker")
        for index, address in enumerate(cluster.get(kind, ()))
    ]
    deadline = time.monotonic() + timeout
    while pending:
        pending = [
            task for task in pending if not _listens(*_split_address(task[2]))
        ]
        if not pending:
            return
        if time.monotonic() > deadline:
            raise ClusterConfigError(
                "ParameterServerStrategy: these tasks did not listen within "
                f"{timeout:.0f} s: "
                + ", ".join(f"{k} {i} at {a}" for k, i, a in pending)
                + ". Start every ps and worker task (keras_dist.serve()) "
                "with the same TF_CONFIG cluster."
            )
        time.sleep(0.2)


def _split_address(address: str) -> tuple:
    host, port = address.rsplit(":", 1)
    return host.strip("[]"), int(port)

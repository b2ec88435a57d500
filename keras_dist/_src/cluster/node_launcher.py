"""``keras-dist launch``: start the workers of this node, like torchrun.

Every worker gets torchrun's variables (``RANK``, ``WORLD_SIZE``,
``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``),
which keras_dist reads on every backend; a TensorFlow job on one node also
gets the ``TF_CONFIG`` tf.distribute needs. Output lines are prefixed with
the rank, SIGINT, SIGTERM and SIGUSR1 are forwarded to every worker, and
the first worker that fails stops the others: the launcher then exits with
that worker's code. Workers that stop for preemption (exit code
`PREEMPTION_EXIT_CODE`, after saving) are not failures: the launcher waits
for the others and exits with that code, so a scheduler can requeue.
Workers die with the launcher, also when it is killed with SIGKILL (the
OOM killer, ``timeout -s KILL``): see `launcher.spawn`.

``--max-restarts N`` starts the node's workers again after a failure, a
kill or a preemption (up to N times), and ``--hang-timeout`` ends a job
whose training stops making progress, with every worker's stack: see
`restarts` and guides/fault_tolerance.md.

With several nodes, ``--max-restarts`` and elastic ``--nnodes MIN:MAX``
restart the whole job on every node from a rendezvous that node 0's
launcher serves on ``--master-addr:--master-port`` (`elastic`).

``--ps N --workers M`` starts a whole parameter-server job on this host
instead (`parameter_server.launch_ps`).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os

from keras_dist._src.cluster import elastic, progress, restarts
from keras_dist._src.cluster.launcher import (
    ENV_LAUNCHED,
    free_port,
    run_supervised,
    script_command,
)


@dataclasses.dataclass
class LaunchConfig:
    """What `launch` starts (the command-line options of ``keras-dist
    launch``)."""

    command: list
    nproc_per_node: int = 1
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int | None = None
    cpu_devices_per_process: int | None = None
    #: ``--ps N``: a parameter-server job (`parameter_server.launch_ps`).
    ps: int = 0
    workers: int | None = None
    #: ``--max-restarts``, ``--restart-backoff``, ``--hang-timeout``,
    #: ``--startup-timeout`` (`restarts.RestartPolicy`).
    max_restarts: int = 0
    restart_backoff: float = 1.0
    hang_timeout: float | None = None
    startup_timeout: float | None = None
    #: ``--nnodes MIN:MAX``: the fewest nodes the job goes on with (None:
    #: `nnodes`, the most).
    min_nodes: int | None = None
    #: ``--rdzv-timeout``: how long a round of a multi-node job with
    #: restarts waits for its nodes.
    rdzv_timeout: float = elastic.DEFAULT_RDZV_TIMEOUT_S

    @property
    def rendezvous(self) -> bool:
        """Whether the nodes meet at node 0's rendezvous (`elastic`): with
        several nodes, restarts or elastic membership."""
        elastic_nodes = self.min_nodes is not None and (
            self.min_nodes < self.nnodes
        )
        return self.nnodes > 1 and (bool(self.max_restarts) or elastic_nodes)

    def policy(self) -> restarts.RestartPolicy:
        """The restart and hang settings, with ``KERAS_DIST_HANG_TIMEOUT``
        and ``KERAS_DIST_STARTUP_TIMEOUT`` where no option gives them.

        Raises:
            ValueError: for a setting that is not a positive number.
        """
        hang = self.hang_timeout
        if hang is None:
            hang = progress.positive_seconds(
                progress.ENV_HANG_TIMEOUT,
                os.environ.get(progress.ENV_HANG_TIMEOUT),
            )
        startup = self.startup_timeout
        if startup is None:
            startup = progress.positive_seconds(
                progress.ENV_STARTUP_TIMEOUT,
                os.environ.get(progress.ENV_STARTUP_TIMEOUT),
            )
        policy = restarts.RestartPolicy(
            self.max_restarts, self.restart_backoff, hang, startup
        )
        policy.check()
        return policy

    def check(self) -> None:
        """Raises ValueError for options that cannot start a job."""
        if not self.command:
            raise ValueError("Give the script to run: keras-dist launch ...")
        if self.nproc_per_node < 1 or self.nnodes < 1:
            raise ValueError("--nproc-per-node and --nnodes must be >= 1.")
        if not 0 <= self.node_rank < self.nnodes:
            raise ValueError(
                f"--node-rank {self.node_rank} is outside 0..{self.nnodes - 1}."
            )
        if self.ps or self.workers is not None:
            if self.ps < 1 or (self.workers or 0) < 1:
                raise ValueError(
                    "A parameter-server job needs both --ps N and "
                    "--workers M (N, M >= 1)."
                )
            if self.nnodes > 1 or self.nproc_per_node > 1:
                raise ValueError(
                    "--ps/--workers start a whole parameter-server job on "
                    "this host; they do not combine with --nnodes or "
                    "--nproc-per-node. On several hosts, start each task "
                    "with its own TF_CONFIG (guides/parameter_server.md)."
                )
        if self.nnodes > 1 and self.master_port is None:
            raise ValueError(
                "--master-port is needed with --nnodes > 1: every node must "
                "use the same port on the master (node 0)."
            )
        if self.min_nodes is not None and not (
            1 <= self.min_nodes <= self.nnodes
        ):
            raise ValueError(
                f"--nnodes {self.min_nodes}:{self.nnodes}: give MIN:MAX "
                "with 1 <= MIN <= MAX."
            )
        if not 0 < self.rdzv_timeout < float("inf"):
            raise ValueError(
                f"--rdzv-timeout {self.rdzv_timeout}: give a positive "
                "number of seconds."
            )
        policy = self.policy()
        if self.ps and policy.startup is not None:
            raise ValueError(
                "--hang-timeout does not watch a --ps job (its workers "
                "run closures, not `fit` steps)."
            )


def worker_environments(
    config: LaunchConfig, base=None, extra=None, tf_addresses=None
) -> list[dict]:
    """The environment of each local worker (without starting any):
    `base` (default: this process's) with `extra` and the job's
    variables; `tf_addresses` (every worker's ``host:port``, in rank
    order) gives TensorFlow's workers a TF_CONFIG on several nodes."""
    base = dict(os.environ if base is None else base)
    base.update(extra or {})
    port = config.master_port or free_port(config.master_addr)
    world = config.nnodes * config.nproc_per_node
    tf_config = None
    backend = base.get("KERAS_BACKEND") or _configured_backend()
    if backend == "tensorflow" and tf_addresses:
        tf_config = list(tf_addresses)
    elif backend == "tensorflow" and config.nnodes == 1:
        # tf.distribute's workers each serve on an address of their own.
        addresses = [
            f"{config.master_addr}:{free_port(config.master_addr)}"
            for _ in range(world)
        ]
        tf_config = addresses
    threads = max(1, (os.cpu_count() or 1) // config.nproc_per_node)
    envs = []
    for local in range(config.nproc_per_node):
        rank = config.node_rank * config.nproc_per_node + local
        env = dict(base)
        env.update(
            RANK=str(rank),
            WORLD_SIZE=str(world),
            LOCAL_RANK=str(local),
            LOCAL_WORLD_SIZE=str(config.nproc_per_node),
            MASTER_ADDR=config.master_addr,
            MASTER_PORT=str(port),
            PYTHONUNBUFFERED="1",
            **{ENV_LAUNCHED: str(os.getpid())},
        )
        env.setdefault("OMP_NUM_THREADS", str(threads))
        if config.cpu_devices_per_process:
            env["KERAS_DIST_CPU_DEVICES"] = str(config.cpu_devices_per_process)
        if tf_config is not None:
            env["TF_CONFIG"] = json.dumps(
                {
                    "cluster": {"worker": tf_config},
                    "task": {"type": "worker", "index": rank},
                }
            )
        envs.append(env)
    return envs


def _configured_backend() -> str:
    """The Keras backend workers will use without KERAS_BACKEND: keras.json's
    ``"backend"``, found and read as Keras does, else ``"tensorflow"``
    (Keras's default). Importing Keras to ask it took seconds and started
    TensorFlow in the launcher."""
    home = os.environ.get("KERAS_HOME")
    if not home:
        base = os.path.expanduser("~")
        if not os.access(base, os.W_OK):
            base = "/tmp"
        home = os.path.join(base, ".keras")
    try:
        with open(os.path.expanduser(os.path.join(home, "keras.json"))) as f:
            backend = json.load(f).get("backend")
    except (OSError, ValueError, AttributeError):
        backend = None
    return str(backend or "tensorflow")


def launch(config: LaunchConfig) -> int:
    """Starts this node's workers, supervises them and returns the exit
    code: 0 when all succeed, else the first failure's code (after the
    restarts `config` allows; see `restarts.run`)."""
    config.check()
    if config.ps:
        from keras_dist._src.cluster.parameter_server import launch_ps

        return launch_ps(
            config.command,
            config.workers,
            config.ps,
            config.master_addr,
            max_restarts=config.max_restarts,
            backoff=config.restart_backoff,
        )
    command = script_command(config.command)
    if config.rendezvous:
        return _launch_nodes(config, command)
    ranks = [
        config.node_rank * config.nproc_per_node + local
        for local in range(config.nproc_per_node)
    ]

    def start_attempt(extra_env, supervise):
        # Fresh environments each attempt: new free ports, a fresh
        # rendezvous (the previous workers are all stopped).
        tasks = [
            (int(env["RANK"]), f"[rank {env['RANK']}] ", env)
            for env in worker_environments(config, extra=extra_env)
        ]
        return run_supervised(command, tasks, supervise)

    return restarts.run(start_attempt, config.policy(), ranks)


def _launch_nodes(config: LaunchConfig, command) -> int:
    """`launch` for a multi-node job with restarts or elastic membership:
    rounds of the job from node 0's rendezvous (`elastic.run`)."""

    def local_ranks(node_rank, nnodes):
        del nnodes
        first = node_rank * config.nproc_per_node
        return list(range(first, first + config.nproc_per_node))

    def start_round(node_rank, nnodes, port, addresses, extra_env, supervise):
        this_round = dataclasses.replace(
            config, node_rank=node_rank, nnodes=nnodes, master_port=port
        )
        envs = worker_environments(
            this_round, extra=extra_env, tf_addresses=addresses
        )
        tasks = [(int(e["RANK"]), f"[rank {e['RANK']}] ", e) for e in envs]
        return run_supervised(command, tasks, supervise)

    nodes = elastic.Nodes(
        min_nodes=config.min_nodes or config.nnodes,
        max_nodes=config.nnodes,
        node_rank=config.node_rank,
        addr=config.master_addr,
        port=config.master_port,
        timeout=config.rdzv_timeout,
    )
    return elastic.run(nodes, config.policy(), start_round, local_ranks)


def _nnodes(text: str):
    """``--nnodes N`` or ``MIN:MAX`` -> (MIN or None, MAX)."""
    low, sep, high = text.partition(":")
    try:
        if not sep:
            return None, int(text)
        return int(low), int(high)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"--nnodes {text!r}: give N or MIN:MAX (whole numbers)."
        ) from None


def add_arguments(parser) -> None:
    """Adds ``keras-dist launch``'s options to an argparse parser."""
    parser.add_argument("--nproc-per-node", type=int, default=1)
    parser.add_argument(
        "--nnodes",
        type=_nnodes,
        default=(None, 1),
        metavar="N|MIN:MAX",
        help="nodes in the job; MIN:MAX (elastic): a job that loses nodes "
        "goes on with at least MIN after --rdzv-timeout, restarting from "
        "its checkpoint (needs --master-port, the rendezvous on node 0)",
    )
    parser.add_argument(
        "--rdzv-timeout",
        type=float,
        default=elastic.DEFAULT_RDZV_TIMEOUT_S,
        metavar="SECONDS",
        help="how long each round of a multi-node job with restarts waits "
        "for its nodes (default "
        f"{elastic.DEFAULT_RDZV_TIMEOUT_S:g}): then it goes on with at "
        "least MIN",
    )
    parser.add_argument("--node-rank", type=int, default=0)
    parser.add_argument("--master-addr", default="127.0.0.1")
    parser.add_argument("--master-port", type=int, default=None)
    parser.add_argument(
        "--cpu-devices-per-process",
        type=int,
        default=None,
        help="simulate this many CPU devices in each worker (JAX, TF)",
    )
    parser.add_argument(
        "--ps",
        type=int,
        default=0,
        metavar="N",
        help="start a ParameterServerStrategy job on this host: N ps "
        "tasks, --workers worker tasks and the chief (TensorFlow)",
    )
    parser.add_argument(
        "--workers",
        type=int,
        default=None,
        metavar="M",
        help="worker tasks of a --ps job",
    )
    parser.add_argument(
        "--max-restarts",
        type=int,
        default=0,
        metavar="N",
        help="when a worker fails, is killed, hangs or is preempted, stop "
        "the workers (on every node) and start them all again, up to N "
        "times (default 0); workers see KERAS_DIST_RESTART_COUNT, and "
        "BackupAndRestore resumes at the saved step. Two failures in a "
        "row at the same step stop the restarts (a bug, not a fault). "
        "With --ps: a dead worker task is started again, a lost ps task "
        "restarts the job",
    )
    parser.add_argument(
        "--restart-backoff",
        type=float,
        default=1.0,
        metavar="SECONDS",
        help="wait before the first restart (default 1), doubled at each "
        f"restart, at most {restarts.BACKOFF_CAP_S:g}",
    )
    parser.add_argument(
        "--hang-timeout",
        type=float,
        default=None,
        metavar="SECONDS",
        help="end the job (code 124) when a worker's fit makes no "
        "progress for this long after its first step, with every "
        "worker's Python stack and the rank(s) behind named (default: "
        "KERAS_DIST_HANG_TIMEOUT, else off)",
    )
    parser.add_argument(
        "--startup-timeout",
        type=float,
        default=None,
        metavar="SECONDS",
        help="the same before a worker's first step (compilation); "
        f"default: KERAS_DIST_STARTUP_TIMEOUT, else "
        f"{restarts.STARTUP_FACTOR} hang timeouts, at least "
        f"{restarts.STARTUP_MIN_S:g} s",
    )
    parser.add_argument("script", help="the training script (or program)")
    parser.add_argument(
        "script_args", nargs=argparse.REMAINDER, help="its arguments"
    )


def config_from_args(args) -> LaunchConfig:
    """A `LaunchConfig` from parsed ``keras-dist launch`` arguments."""
    return LaunchConfig(
        command=[args.script, *args.script_args],
        nproc_per_node=args.nproc_per_node,
        nnodes=args.nnodes[1],
        min_nodes=args.nnodes[0],
        rdzv_timeout=getattr(
            args, "rdzv_timeout", elastic.DEFAULT_RDZV_TIMEOUT_S
        ),
        node_rank=args.node_rank,
        master_addr=args.master_addr,
        master_port=args.master_port,
        cpu_devices_per_process=args.cpu_devices_per_process,
        ps=args.ps,
        workers=args.workers,
        max_restarts=getattr(args, "max_restarts", 0),
        restart_backoff=getattr(args, "restart_backoff", 1.0),
        hang_timeout=getattr(args, "hang_timeout", None),
        startup_timeout=getattr(args, "startup_timeout", None),
    )

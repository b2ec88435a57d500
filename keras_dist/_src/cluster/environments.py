"""Where this process stands in a job, read from the launcher's variables.

One `ClusterEnvironment` source per launcher: TF_CONFIG, torchrun /
torchelastic (and keras_dist's own launcher), SLURM's ``srun`` and Open MPI's
``mpirun``. `detect_environment` asks each in turn; a source whose variables
are present but incomplete or contradictory raises `ClusterConfigError`
naming what is missing or conflicting. Reading the environment never writes
it: a backend that needs torchrun's names gets them from
`ClusterEnvironment.torchrun_variables`.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from collections.abc import Mapping

from keras_dist._src.errors import KerasDistError


class ClusterConfigError(KerasDistError, ValueError):
    """The launcher's variables are incomplete or contradict each other."""


@dataclasses.dataclass(frozen=True)
class ClusterEnvironment:
    """This process's place in a job of one or more worker processes.

    Attributes:
        source: which launcher it was read from: ``"local"``, ``"tf_config"``,
            ``"torchelastic"``, ``"slurm"``, ``"mpi"`` or ``"explicit"``.
        rank: this process's index among all processes (worker index).
        world_size: number of processes in the job.
        local_rank: index among the processes of this host.
        local_world_size: number of processes on this host.
        coordinator_host: host of process 0's rendezvous/coordination
            service (None for a one-process job).
        coordinator_port: its port (None for a one-process job).
        worker_addresses: ``"host:port"`` of every worker, in rank order,
            where the launcher says them (TF_CONFIG); else empty.
    """

    source: str = "local"
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    local_world_size: int = 1
    coordinator_host: str | None = None
    coordinator_port: int | None = None
    worker_addresses: tuple[str, ...] = ()

    def __post_init__(self):
        if self.world_size < 1:
            raise ClusterConfigError(
                f"{self.source}: the job has world size {self.world_size}; "
                "it must be at least 1."
            )
        if not 0 <= self.rank < self.world_size:
            raise ClusterConfigError(
                f"{self.source}: rank {self.rank} is outside 0.."
                f"{self.world_size - 1} (world size {self.world_size})."
            )
        if not 0 <= self.local_rank < max(1, self.local_world_size):
            raise ClusterConfigError(
                f"{self.source}: local rank {self.local_rank} is outside "
                f"0..{self.local_world_size - 1}."
            )
        if self.world_size > 1 and not (
            self.coordinator_host and self.coordinator_port
        ):
            raise ClusterConfigError(
                f"{self.source}: a job of {self.world_size} processes needs "
                "the coordinator's address and port (e.g. MASTER_ADDR and "
                "MASTER_PORT)."
            )

    @property
    def is_chief(self) -> bool:
        """Whether this is process 0, the one that prints and writes."""
        return self.rank == 0

    @property
    def is_distributed(self) -> bool:
        """Whether the job has more than one process."""
        return self.world_size > 1

    @property
    def coordinator_address(self) -> str | None:
        """``"host:port"`` of the coordinator, or None."""
        if self.coordinator_host is None:
            return None
        return f"{self.coordinator_host}:{self.coordinator_port}"

    def torchrun_variables(self) -> dict[str, str]:
        """The same place, as torchrun's environment variables."""
        env = {
            "RANK": str(self.rank),
            "WORLD_SIZE": str(self.world_size),
            "LOCAL_RANK": str(self.local_rank),
            "LOCAL_WORLD_SIZE": str(self.local_world_size),
        }
        if self.coordinator_host is not None:
            env["MASTER_ADDR"] = self.coordinator_host
            env["MASTER_PORT"] = str(self.coordinator_port)
        return env


def _int(environ: Mapping[str, str], name: str, source: str) -> int:
    value = environ.get(name, "")
    try:
        return int(value)
    except ValueError:
        raise ClusterConfigError(
            f"{source}: {name}={value!r} is not an integer."
        ) from None


def _missing(environ, names, source, present):
    missing = [n for n in names if not environ.get(n)]
    if missing:
        raise ClusterConfigError(
            f"{source} settings are incomplete: {', '.join(present)} "
            f"{'is' if len(present) == 1 else 'are'} set but "
            f"{', '.join(missing)} {'is' if len(missing) == 1 else 'are'} "
            "not. Set all of them, or none."
        )


def _split_host_port(address: str, source: str) -> tuple[str, int]:
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ClusterConfigError(
            f"{source}: {address!r} is not a 'host:port' address."
        )
    return host.strip("[]"), int(port)


# -- sources -------------------------------------------------------------------
TORCHRUN_VARIABLES = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def from_torchelastic(environ: Mapping[str, str]) -> ClusterEnvironment | None:
    """torchrun / torchelastic / ``keras-dist launch`` (``RANK``,
    ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``)."""
    # MASTER_ADDR/MASTER_PORT alone also serve SLURM and MPI jobs: only
    # RANK or WORLD_SIZE says that torchrun's names describe this process.
    if not (environ.get("RANK") or environ.get("WORLD_SIZE")):
        return None
    present = [n for n in TORCHRUN_VARIABLES if environ.get(n)]
    _missing(environ, TORCHRUN_VARIABLES, "torchrun", present)
    source = "torchelastic"
    world = _int(environ, "WORLD_SIZE", source)
    rank = _int(environ, "RANK", source)
    local = (
        _int(environ, "LOCAL_RANK", source) if environ.get("LOCAL_RANK") else 0
    )
    local_world = (
        _int(environ, "LOCAL_WORLD_SIZE", source)
        if environ.get("LOCAL_WORLD_SIZE")
        else max(local + 1, 1)
    )
    return ClusterEnvironment(
        source=source,
        rank=rank,
        world_size=world,
        local_rank=local,
        local_world_size=local_world,
        coordinator_host=environ["MASTER_ADDR"],
        coordinator_port=_int(environ, "MASTER_PORT", source),
    )


def from_tf_config(environ: Mapping[str, str]) -> ClusterEnvironment | None:
    """``TF_CONFIG`` as tf.distribute reads it: ``{"cluster": {"worker":
    [...], "chief": [...]}, "task": {"type": ..., "index": ...}}``. The
    chief (if listed) is process 0, then the workers in order."""
    text = environ.get("TF_CONFIG", "")
    if not text.strip():
        return None
    source = "TF_CONFIG"
    try:
        config = json.loads(text)
    except json.JSONDecodeError as error:
        raise ClusterConfigError(
            f"TF_CONFIG is not valid JSON ({error}): {text[:200]!r}."
        ) from None
    cluster = config.get("cluster") or {}
    task = config.get("task") or {}
    chiefs = list(cluster.get("chief") or [])
    workers = list(cluster.get("worker") or [])
    if not chiefs and not workers:
        raise ClusterConfigError(
            "TF_CONFIG has no 'cluster' with a 'worker' (or 'chief') list."
        )
    if "type" not in task or "index" not in task:
        raise ClusterConfigError(
            "TF_CONFIG has no 'task' with a 'type' and an 'index', e.g. "
            '{"type": "worker", "index": 0}.'
        )
    kind = task["type"]
    try:
        index = int(task["index"])
    except (TypeError, ValueError):
        raise ClusterConfigError(
            f"TF_CONFIG task index {task['index']!r} is not an integer."
        ) from None
    if kind not in ("chief", "worker"):
        raise ClusterConfigError(
            f"TF_CONFIG task type {kind!r} is not supported by keras_dist's "
            "synchronous strategies; use 'chief' or 'worker'."
        )
    members = chiefs if kind == "chief" else workers
    if not 0 <= index < len(members):
        raise ClusterConfigError(
            f"TF_CONFIG task index {index} is outside the {len(members)} "
            f"'{kind}' addresses listed."
        )
    addresses = tuple(chiefs + workers)
    rank = index if kind == "chief" else len(chiefs) + index
    host, port = _split_host_port(addresses[0], source)
    me = _split_host_port(addresses[rank], source)[0]
    local = [a for a in addresses if _split_host_port(a, source)[0] == me]
    return ClusterEnvironment(
        source="tf_config",
        rank=rank,
        world_size=len(addresses),
        local_rank=local.index(addresses[rank]),
        local_world_size=len(local),
        coordinator_host=host if len(addresses) > 1 else None,
        coordinator_port=port if len(addresses) > 1 else None,
        worker_addresses=addresses,
    )


SLURM_VARIABLES = (
    "SLURM_JOB_ID",
    "SLURM_STEP_NODELIST",
    "SLURM_NTASKS",
    "SLURM_PROCID",
    "SLURM_LOCALID",
)


def first_slurm_host(node_list: str) -> str:
    """First host of a SLURM node list: ``"gpu[003-005,9],cpu1"`` gives
    ``"gpu003"``."""
    head = node_list.split(",", 1)[0]
    if "[" not in head:
        return head
    prefix, _, ranges = node_list.partition("[")
    return prefix + re.split(r"[,\-\]]", ranges, maxsplit=1)[0]


def from_slurm(environ: Mapping[str, str]) -> ClusterEnvironment | None:
    """A task of a multi-task ``srun`` step.

    Only ``srun`` sets ``SLURM_STEP_NODELIST``, so an ``sbatch`` script
    itself (one process in an allocation of many tasks) is not taken for a
    rank. As in ``jax.distributed``'s SLURM support, process 0 runs on the
    step's first node and the port is derived from the job id (in
    61440..65535), unless ``MASTER_ADDR``/``MASTER_PORT`` are set.
    """
    if not environ.get("SLURM_STEP_NODELIST"):
        return None
    present = [n for n in SLURM_VARIABLES if environ.get(n)]
    _missing(environ, SLURM_VARIABLES, "SLURM", present)
    source = "slurm"
    world = _int(environ, "SLURM_NTASKS", source)
    if world < 2:
        return None
    job = _int(environ, "SLURM_JOB_ID", source)
    per_node = environ.get("SLURM_NTASKS_PER_NODE", "").split("(")[0]
    local_world = int(per_node) if per_node.isdigit() else world
    return ClusterEnvironment(
        source=source,
        rank=_int(environ, "SLURM_PROCID", source),
        world_size=world,
        local_rank=_int(environ, "SLURM_LOCALID", source),
        local_world_size=local_world,
        coordinator_host=environ.get("MASTER_ADDR")
        or first_slurm_host(environ["SLURM_STEP_NODELIST"]),
        coordinator_port=_int(environ, "MASTER_PORT", source)
        if environ.get("MASTER_PORT")
        else job % 4096 + 61440,
    )


MPI_VARIABLES = (
    "OMPI_COMM_WORLD_RANK",
    "OMPI_COMM_WORLD_SIZE",
    "OMPI_COMM_WORLD_LOCAL_RANK",
)


def from_mpi(environ: Mapping[str, str]) -> ClusterEnvironment | None:
    """A process started by Open MPI's ``mpirun`` (``OMPI_COMM_WORLD_*``).

    MPI does not say where a rendezvous runs: ``MASTER_ADDR`` and
    ``MASTER_PORT`` (process 0's host and a free port) must be exported to
    every process, e.g. ``mpirun -x MASTER_ADDR=node1 -x MASTER_PORT=29400``.
    """
    present = [n for n in MPI_VARIABLES if environ.get(n)]
    if not present:
        return None
    _missing(environ, MPI_VARIABLES, "Open MPI", present)
    source = "mpi"
    world = _int(environ, "OMPI_COMM_WORLD_SIZE", source)
    if world > 1 and not (
        environ.get("MASTER_ADDR") and environ.get("MASTER_PORT")
    ):
        raise ClusterConfigError(
            "Open MPI started this process (OMPI_COMM_WORLD_SIZE="
            f"{world}) but MASTER_ADDR and MASTER_PORT are not set: export "
            "the first host and a free port to every process, e.g. "
            "`mpirun -x MASTER_ADDR=host0 -x MASTER_PORT=29400 ...`."
        )
    local_world = environ.get("OMPI_COMM_WORLD_LOCAL_SIZE", "")
    return ClusterEnvironment(
        source=source,
        rank=_int(environ, "OMPI_COMM_WORLD_RANK", source),
        world_size=world,
        local_rank=_int(environ, "OMPI_COMM_WORLD_LOCAL_RANK", source),
        local_world_size=int(local_world) if local_world.isdigit() else world,
        coordinator_host=environ.get("MASTER_ADDR") if world > 1 else None,
        coordinator_port=_int(environ, "MASTER_PORT", source)
        if world > 1
        else None,
    )


SOURCES = (from_tf_config, from_torchelastic, from_slurm, from_mpi)


def detect_environment(environ: Mapping[str, str] | None = None):
    """Reads this process's place in the job from the launcher variables.

    Asks TF_CONFIG, torchrun, SLURM and Open MPI in that order and takes the
    first that is set. SLURM and MPI are outer launchers (an ``srun`` task
    per node that runs torchrun, say), so torchrun's variables win over
    theirs. TF_CONFIG and torchrun's variables both describe the worker
    processes themselves: when both are set and disagree on the rank or the
    world size, that is an error (a stale TF_CONFIG, say).

    Args:
        environ: the variables to read; defaults to ``os.environ``.

    Returns:
        A `ClusterEnvironment`; ``source="local"`` (one process) when no
        launcher variables are set.

    Raises:
        ClusterConfigError: naming the missing or conflicting settings.
    """
    environ = os.environ if environ is None else environ
    tf_config = from_tf_config(environ)
    torchrun = from_torchelastic(environ)
    if tf_config and torchrun:
        if (tf_config.rank, tf_config.world_size) != (
            torchrun.rank,
            torchrun.world_size,
        ):
            raise ClusterConfigError(
                f"Launcher settings conflict: TF_CONFIG says rank "
                f"{tf_config.rank} of {tf_config.world_size}, RANK/WORLD_SIZE "
                f"say rank {torchrun.rank} of {torchrun.world_size}. Unset "
                "the stale ones (e.g. a TF_CONFIG left from another job)."
            )
    for env in (tf_config, torchrun):
        if env is not None:
            return env
    for source in (from_slurm, from_mpi):
        env = source(environ)
        if env is not None:
            return env
    return ClusterEnvironment()


# -- parameter-server clusters (ParameterServerStrategy) ---------------------
#: Task types of a parameter-server cluster, as TF_CONFIG names them.
PS_TASK_TYPES = ("chief", "worker", "ps", "evaluator")


@dataclasses.dataclass(frozen=True)
class TaskSpec:
    """This process's task in a parameter-server cluster (from TF_CONFIG).

    Attributes:
        task_type: ``"chief"``, ``"worker"``, ``"ps"`` or ``"evaluator"``;
            None when no TF_CONFIG is set.
        task_index: its index among the tasks of that type.
        cluster: the addresses of every task, by type (``{"chief": [...],
            "worker": [...], "ps": [...]}``; the evaluator is not part of it,
            as in tf.distribute).
    """

    task_type: str | None = None
    task_index: int = 0
    cluster: dict = dataclasses.field(default_factory=dict)

    @property
    def address(self) -> str | None:
        """``"host:port"`` of this task, or None (no TF_CONFIG)."""
        members = self.cluster.get(self.task_type) or []
        return members[self.task_index] if members else None


def read_task_spec(environ: Mapping[str, str] | None = None) -> TaskSpec:
    """Reads this process's task in a parameter-server cluster from
    ``TF_CONFIG`` (all four task types: chief, worker, ps, evaluator).

    Returns:
        A `TaskSpec`; ``task_type=None`` when TF_CONFIG is not set.

    Raises:
        ClusterConfigError: for malformed JSON, an unknown task type or an
            index outside the addresses listed.
    """
    environ = os.environ if environ is None else environ
    text = environ.get("TF_CONFIG", "")
    if not text.strip():
        return TaskSpec()
    try:
        config = json.loads(text)
    except json.JSONDecodeError as error:
        raise ClusterConfigError(
            f"TF_CONFIG is not valid JSON ({error}): {text[:200]!r}."
        ) from None
    cluster = {
        str(k): [str(a) for a in v]
        for k, v in (config.get("cluster") or {}).items()
    }
    unknown = sorted(set(cluster) - set(PS_TASK_TYPES))
    if unknown:
        raise ClusterConfigError(
            f"TF_CONFIG's cluster lists task types {unknown}; a "
            f"parameter-server cluster has {list(PS_TASK_TYPES)}."
        )
    task = config.get("task") or {}
    kind = task.get("type")
    if kind not in PS_TASK_TYPES:
        raise ClusterConfigError(
            f"TF_CONFIG task type {kind!r} is not one of {list(PS_TASK_TYPES)}."
        )
    try:
        index = int(task.get("index", 0))
    except (TypeError, ValueError):
        raise ClusterConfigError(
            f"TF_CONFIG task index {task.get('index')!r} is not an integer."
        ) from None
    members = cluster.get(kind) or []
    if kind != "evaluator" and not 0 <= index < len(members):
        raise ClusterConfigError(
            f"TF_CONFIG task index {index} is outside the {len(members)} "
            f"'{kind}' addresses listed."
        )
    return TaskSpec(task_type=kind, task_index=index, cluster=cluster)


def environment_from(resolver) -> ClusterEnvironment:
    """A `ClusterEnvironment` from ours or a tf.distribute resolver."""
    if resolver is None:
        return detect_environment()
    if isinstance(resolver, ClusterEnvironment):
        return resolver
    if hasattr(resolver, "cluster_spec") and hasattr(resolver, "task_type"):
        import json

        spec = resolver.cluster_spec().as_dict()
        config = {
            "cluster": spec,
            "task": {"type": resolver.task_type, "index": resolver.task_id},
        }
        return detect_environment({"TF_CONFIG": json.dumps(config)})
    raise TypeError(
        "cluster_resolver must be a keras_dist.ClusterEnvironment or a "
        f"tf.distribute cluster resolver; got {type(resolver).__name__}."
    )

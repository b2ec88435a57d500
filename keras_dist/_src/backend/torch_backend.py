"""PyTorch backend: one process per device, `torch.distributed` + DDP.

`MirroredStrategy` on torch runs one process (rank) per device. Run plainly
(``python train.py``), the strategy's constructor starts the other ranks by
re-running the same program (see `keras_dist._src.launch`); started by
torchrun, or with a process group already initialised, it joins instead.
GPUs use NCCL, CPUs gloo.

Every rank iterates the same global batches (Keras's torch trainer, with
identical shuffling); the replicated step takes this rank's contiguous shard
(`numpy.array_split` order), runs forward/backward through
`DistributedDataParallel` (bucketed gradient all-reduce overlapped with the
backward pass), weights the local mean loss by its share of the global batch,
and all-reduces metric state so that logs are exact and equal on all ranks.
See `keras_dist._src.torch.steps`.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import sys
import time

import numpy as np
import torch
import torch.distributed as dist
from keras import tree

from keras_dist._src import launch
from keras_dist._src.devices import ENV_CPU_DEVICES, normalize_device
from keras_dist._src.errors import (
    DevicesAlreadyInitializedError,
    KerasDistError,
)
from keras_dist._src.values import PerReplica, ReduceOp, local_results

NAME = "torch"
ENV_TIMEOUT = "KERAS_DIST_TIMEOUT"
DEFAULT_TIMEOUT_S = 600

_simulated_cpus: int | None = None
_engine_cpus: int | None = None


class RankFailedError(KerasDistError):
    """Another rank of the job failed; this rank stops too."""


# -- devices ------------------------------------------------------------------
def _cpu_count() -> int:
    if _simulated_cpus is not None:
        return _simulated_cpus
    env = os.environ.get(ENV_CPU_DEVICES)
    if env and env.isdigit() and int(env) > 0:
        return int(env)
    return os.cpu_count() or 1


def list_devices(device_type: str | None = None) -> list[str]:
    """Devices torch can run a rank on, as ``"type:index"`` names.

    Every GPU, then one CPU device per core (or the simulated count set with
    `keras_dist.simulate_cpu_devices`): on torch each device is a process,
    so the list is the same on every rank of a host.

    Args:
        device_type: ``"cpu"`` or ``"gpu"`` to filter, or None.
    """
    names = []
    if torch.cuda.is_available():
        names = [f"gpu:{i}" for i in range(torch.cuda.device_count())]
    names += [f"cpu:{i}" for i in range(_cpu_count())]
    if device_type:
        names = [n for n in names if n.startswith(device_type.lower() + ":")]
    return names


def default_devices() -> list[str]:
    """Every GPU; else the simulated CPU devices; else ``["cpu:0"]``."""
    gpus = list_devices("gpu")
    if gpus:
        return gpus
    simulated = _simulated_cpus or os.environ.get(ENV_CPU_DEVICES)
    return list_devices("cpu") if simulated else ["cpu:0"]


def simulate_cpu_devices(count: int) -> None:
    """Makes `list_devices`/`default_devices` report `count` CPU devices.

    On torch each CPU device is one gloo process, so ``MirroredStrategy()``
    then starts `count` processes. The request is exported in the
    environment so that started ranks see the same devices.

    Raises:
        DevicesAlreadyInitializedError: if a strategy already runs with a
            different CPU count.
    """
    global _simulated_cpus
    count = int(count)
    if _engine_cpus is not None and _engine_cpus != count:
        raise DevicesAlreadyInitializedError(
            f"Cannot simulate {count} CPU devices: a keras_dist strategy "
            f"already runs with {_engine_cpus}. Call "
            f"keras_dist.simulate_cpu_devices({count}) (or set "
            f"{ENV_CPU_DEVICES}) before creating the strategy."
        )
    _simulated_cpus = count
    os.environ[ENV_CPU_DEVICES] = str(count)


def _torch_device(device: str) -> torch.device:
    kind, index = device.split(":")
    if kind == "gpu":
        return torch.device("cuda", int(index))
    return torch.device("cpu")


# -- process group ------------------------------------------------------------
class _Job:
    """This process's place in the job: rank, world, store clients."""

    def __init__(self, rank, world_size, local_rank, launched_children):
        self.rank = rank
        self.world_size = world_size
        self.local_rank = local_rank
        self.supervisor = None
        self.watchdog = None
        self.children = launched_children
        self._report_store = None
        self._addr = os.environ.get("MASTER_ADDR")
        self._port = os.environ.get("MASTER_PORT")

    def _client(self):
        if not (self._addr and self._port):
            return None
        return dist.TCPStore(
            self._addr,
            int(self._port),
            is_master=False,
            timeout=datetime.timedelta(seconds=10),
            wait_for_workers=False,
        )

    def report(self, message: str) -> str:
        """Records `message` as the job's failure unless one is recorded.

        Returns:
            The first failure recorded (this one or an earlier one).
        """
        if self._report_store is None:
            self._report_store = self._client()
        if self._report_store is None:
            return message
        first = self._report_store.compare_set(
            launch.ERROR_KEY, "", message.encode()
        )
        return first.decode() if isinstance(first, bytes) else str(first)

    def start_supervisor(self) -> None:
        """Rank 0 of a launched job: starts watching its children."""
        if self.children:
            self.supervisor = launch.Supervisor(
                self.children, report=self.report
            ).start()

    def start_watchdog(self) -> None:
        """Starts watching for failures of other ranks (after rendezvous)."""
        client = self._client()
        if client is None:
            return
        lock_free = {"store": client}

        def check_error():
            store = lock_free["store"]
            if store.check([launch.ERROR_KEY]):
                return store.get(launch.ERROR_KEY).decode()
            return None

        on_stop = None
        if self.supervisor is not None:
            on_stop = lambda reason: self.supervisor.terminate_children()  # noqa: E731
        watch_parent = os.environ.get(launch.ENV_LAUNCHED) is not None
        self.watchdog = launch.Watchdog(
            self.rank, check_error, watch_parent, on_stop
        ).start()

    def mute(self) -> None:
        """Stops watching (at a normal exit, when the store goes away)."""
        if self.watchdog is not None:
            self.watchdog.muted.set()

    def stop_watchdog(self) -> None:
        """Ends the watchdog thread before the interpreter finalizes."""
        if self.watchdog is not None:
            self.watchdog.stop()


_job: _Job | None = None


def _timeout() -> datetime.timedelta:
    seconds = int(os.environ.get(ENV_TIMEOUT, DEFAULT_TIMEOUT_S))
    return datetime.timedelta(seconds=seconds)


def _start_job(devices) -> _Job:
    """Joins or launches the process group for `devices` (once per run)."""
    global _job
    if _job is not None:
        if _job.world_size != len(devices) and len(devices) > 1:
            raise KerasDistError(
                f"This process already belongs to a job of {_job.world_size} "
                f"ranks; a strategy over {len(devices)} devices cannot be "
                "created in it. Create one MirroredStrategy per program."
            )
        return _job
    gpu = devices[0].startswith("gpu")
    if dist.is_initialized():
        rank, world = dist.get_rank(), dist.get_world_size()
        local = int(os.environ.get("LOCAL_RANK", rank))
        _job = _Job(rank, world, local, {})
        return _job
    children = {}
    info = launch.env_rank()
    if info is None:
        world = len(devices)
        port = launch.free_port()
        extra = {}
        if not gpu and "OMP_NUM_THREADS" not in os.environ:
            threads = max(1, (os.cpu_count() or 1) // world)
            extra["OMP_NUM_THREADS"] = str(threads)
            torch.set_num_threads(threads)
        children = launch.start_workers(world, port, extra)
        os.environ.update(
            RANK="0",
            WORLD_SIZE=str(world),
            LOCAL_RANK="0",
            LOCAL_WORLD_SIZE=str(world),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
        )
        info = (0, world, 0)
    rank, world, local = info
    if world > 1 and len(devices) > 1 and world != len(devices):
        launch.log(
            f"rank {rank}: {len(devices)} devices were requested but the job "
            f"has {world} ranks (WORLD_SIZE); using one rank per process."
        )
    _job = _Job(rank, world, local, children)
    _job.start_supervisor()
    if gpu:
        torch.cuda.set_device(local % max(1, torch.cuda.device_count()))
    _install_excepthook(_job)
    dist.init_process_group(
        "nccl" if gpu else "gloo",
        init_method="env://",
        rank=rank,
        world_size=world,
        timeout=_timeout(),
    )
    _job.start_watchdog()
    import atexit

    atexit.register(_shutdown)
    return _job


def _shutdown() -> None:
    if _job is not None:
        _job.stop_watchdog()
        if _job.supervisor is not None:
            # Keep the rendezvous store (hosted here) alive until every
            # child is done; exits non-zero if one of them failed.
            _job.supervisor.wait_at_exit()
        _job.mute()
    if dist.is_initialized():
        with contextlib.suppress(Exception):
            dist.destroy_process_group()


def _install_excepthook(job: _Job) -> None:
    original = sys.excepthook

    def hook(kind, value, tb):
        if not isinstance(value, RankFailedError):
            with contextlib.suppress(Exception):
                job.report(f"rank {job.rank}: {kind.__name__}: {value}")
        job.mute()
        original(kind, value, tb)

    sys.excepthook = hook


# -- engines ------------------------------------------------------------------
class OneDeviceEngine:
    """Keras's own torch step on one device, no process group."""

    is_chief = True

    def __init__(self, device: str):
        self.devices = (device,)
        self._device = _torch_device(device)

    @property
    def num_replicas_in_sync(self) -> int:
        return 1

    def scope(self):
        return contextlib.nullcontext()

    def call_scope(self):
        return contextlib.nullcontext()

    def prepare_call(self, name, method, args, kwargs):
        return args, kwargs

    def attach(self, model) -> None:
        del model

    def run(self, fn, args, kwargs):
        return fn(*args, **kwargs)

    def reduce(self, op, value, axis):
        x = _as_tensor(local_results(value)[0])
        if axis is None:
            return x
        return x.sum(axis) if op is ReduceOp.SUM else x.mean(axis)

    def gather(self, value, axis):
        return _as_tensor(local_results(value)[0])

    def local_results(self, value):
        return local_results(value)

    def distribute_dataset(self, dataset):
        return _DistributedDataset(dataset, 0, 1)


class MirroredEngine:
    """One rank of a DDP job: exact replicated steps over all ranks.

    Args:
        devices: the strategy's devices (one per rank).
        sync_batch_norm: global-batch BatchNormalization statistics.
    """

    def __init__(self, devices, sync_batch_norm: bool):
        global _engine_cpus
        self.devices = tuple(devices)
        self.sync_batch_norm = bool(sync_batch_norm)
        self.job = _start_job(self.devices)
        if self.devices[0].startswith("cpu"):
            _engine_cpus = len(self.devices)
        index = min(self.job.local_rank, len(self.devices) - 1)
        self.device = _torch_device(self.devices[index])
        if self.device.type == "cuda":
            self.device = torch.device("cuda", torch.cuda.current_device())
        # Collectives issued from inside forward/backward (BatchNorm) and
        # for metrics use their own group, so that their order can never
        # interleave with DDP's asynchronous bucket all-reduces.
        self.aux_group = dist.new_group(
            backend="nccl" if self.device.type == "cuda" else "gloo"
        )
        from keras_dist._src.torch.inputs import LocalBatchTracker

        # Set by the input of FILE/OFF policies: the next batch is local.
        self.local_batches = LocalBatchTracker()
        self.input_options = None
        # Per call in progress (innermost last): whether nothing reads the
        # per-step metric values, so their all-reduce can wait until read.
        self._defer_metrics = []

    @property
    def rank(self) -> int:
        """This process's rank."""
        return self.job.rank

    @property
    def world_size(self) -> int:
        """Number of ranks (replicas)."""
        return self.job.world_size

    @property
    def num_replicas_in_sync(self) -> int:
        return self.job.world_size

    @property
    def is_chief(self) -> bool:
        """Whether this is rank 0, the one that prints and writes files."""
        return self.job.rank == 0

    def scope(self):
        return contextlib.nullcontext()

    @contextlib.contextmanager
    def call_scope(self):
        from keras_dist._src.torch import steps

        self._defer_metrics.append(False)
        try:
            self.local_batches.pending = None
            steps.sync_shuffle_seed(self)
            yield
        except BaseException as error:
            self._raise_failure(error)
            raise
        finally:
            self._defer_metrics.pop()

    @property
    def defer_metric_sync(self) -> bool:
        """Whether the call in progress reads metric values only at its end."""
        return bool(self._defer_metrics) and self._defer_metrics[-1]

    def prepare_call(self, name, method, args, kwargs):
        from keras_dist._src.torch import inputs, steps

        if name not in ("fit", "evaluate", "predict"):
            return args, kwargs
        if self._defer_metrics:
            # Decided on the caller's arguments, before rank 0's callbacks
            # are gated: every rank must make the same collectives.
            self._defer_metrics[-1] = not steps.reads_batch_logs(
                name, method, args, kwargs
            )
        args, kwargs = inputs.prepare_arguments(
            self, name, method, args, kwargs
        )
        return steps.gate_call_arguments(self, method, args, kwargs)

    def _raise_failure(self, error) -> None:
        if isinstance(error, RankFailedError):
            return
        supervisor = self.job.supervisor
        if supervisor is not None:
            # A collective that failed because a child died: name the child.
            for _ in range(4):
                for rank, proc in supervisor.children.items():
                    code = proc.poll()
                    if code not in (None, 0):
                        supervisor.fail(
                            f"rank {rank} {launch.describe_exit(code)}"
                        )
                time.sleep(launch.POLL_SECONDS)
        mine = f"rank {self.rank}: {type(error).__name__}: {error}"
        try:
            first = self.job.report(mine)
        except Exception:  # noqa: BLE001 - store gone: rank 0 died.
            first = "rank 0 is gone (its rendezvous store is unreachable)"
        if first != mine:
            self.job.mute()
            raise RankFailedError(
                f"Rank {self.rank} stops because another rank failed: "
                f"{first}. Fix the error of that rank (its traceback is in "
                "its output)."
            ) from error

    def attach(self, model) -> None:
        from keras_dist._src.torch import steps

        steps.check_variables(self, model)
        steps.StepFunctions(self, model).install()

    # -- collectives on per-rank values ---------------------------------------
    def run(self, fn, args, kwargs):
        args = _select_local(args)
        kwargs = _select_local(kwargs)
        return fn(*args, **kwargs)

    def reduce(self, op, value, axis):
        x = _as_tensor(local_results(value)[0]).to(self.device)
        if axis is None:
            total = x.detach().clone().float()
            dist.all_reduce(total, group=self.aux_group)
            if op is ReduceOp.MEAN:
                total = total / self.world_size
            return total
        count = torch.tensor([float(x.shape[axis])], device=self.device)
        total = x.detach().float().sum(axis)
        packed = torch.cat([total.reshape(-1), count])
        dist.all_reduce(packed, group=self.aux_group)
        total = packed[:-1].reshape(total.shape)
        if op is ReduceOp.MEAN:
            total = total / packed[-1].clamp_min(1)
        return total

    def gather(self, value, axis):
        x = _as_tensor(local_results(value)[0]).to(self.device)
        return all_gather_concat(x, axis, self.aux_group, self.world_size)

    def local_results(self, value):
        return local_results(value)

    def distribute_dataset(self, dataset):
        return _DistributedDataset(dataset, self.rank, self.world_size)


def all_gather_concat(x, axis, group, world_size):
    """Concatenates each rank's `x` along `axis` (sizes may differ)."""
    x = torch.movedim(x.detach(), axis, 0).contiguous()
    size = torch.tensor([x.shape[0]], device=x.device)
    sizes = [torch.zeros_like(size) for _ in range(world_size)]
    dist.all_gather(sizes, size, group=group)
    sizes = [int(s) for s in sizes]
    longest = max(sizes)
    padded = x.new_zeros((longest,) + tuple(x.shape[1:]))
    padded[: x.shape[0]] = x
    parts = [torch.empty_like(padded) for _ in range(world_size)]
    dist.all_gather(parts, padded, group=group)
    out = torch.cat([p[:n] for p, n in zip(parts, sizes, strict=True)])
    return torch.movedim(out, 0, axis)


def shard_bounds(count: int, rank: int, world_size: int) -> tuple[int, int]:
    """Start and stop of `rank`'s part of `count` samples.

    Same split as `numpy.array_split`: the first ``count % world_size``
    ranks get one sample more; parts may be empty.
    """
    base, extra = divmod(count, world_size)
    start = rank * base + min(rank, extra)
    return start, start + base + (1 if rank < extra else 0)


def variables_distributed(model) -> bool:
    """Always False: torch variables are local to each rank's process."""
    del model
    return False


def create_engine(devices, sync_batch_norm: bool, input_options):
    """Returns this process's engine; starts or joins the job if needed.

    One device outside a launched job: Keras's own step. Otherwise one rank
    of a torch.distributed job with one process per device (started here by
    re-running the program unless a launcher already started it).
    """
    devices = [normalize_device(d) for d in devices]
    kinds = {d.split(":")[0] for d in devices}
    if len(kinds) != 1 or kinds - {"cpu", "gpu"}:
        raise ValueError(
            f"The torch backend runs one process per device, all of one "
            f"type (all 'gpu' or all 'cpu'); got {devices}."
        )
    joined = launch.env_rank() is not None or dist.is_initialized()
    if len(devices) == 1 and not joined:
        return OneDeviceEngine(devices[0])
    engine = MirroredEngine(devices, sync_batch_norm)
    engine.input_options = input_options
    return engine


# -- helpers ------------------------------------------------------------------
def _as_tensor(x):
    if isinstance(x, torch.Tensor):
        return x
    return torch.as_tensor(np.asarray(x))


def _select_local(structure):
    def pick(x):
        if isinstance(x, PerReplica):
            if len(x) != 1:
                raise ValueError(
                    "On torch each process holds one replica; a per-replica "
                    f"value with {len(x)} parts cannot be used here. Pass "
                    "this process's own part."
                )
            return x.values[0]
        return x

    if not structure:
        return structure
    return tree.map_structure(pick, structure, none_is_leaf=True)


class _DistributedDataset:
    """This rank's shard of each global batch of a dataset."""

    def __init__(self, dataset, rank, world_size):
        self._dataset = dataset
        self._rank = rank
        self._world = world_size

    def __iter__(self):
        from keras_dist._src.data import iterate_numpy_batches, split_batch

        for batch in iterate_numpy_batches(self._dataset):
            part = split_batch(batch, self._world)[self._rank]
            yield tree.map_structure(
                lambda x: None if x is None else torch.as_tensor(x),
                part,
                none_is_leaf=True,
            )

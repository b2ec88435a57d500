"""This process's place in a torch job: joining or starting it.

`start_job` joins the job a launcher (torchrun, SLURM, ``keras-dist
launch``) started, or starts it by re-running the program
(`MirroredStrategy` without a launcher); it initialises the process
group (NCCL on GPU, gloo on CPU), supervises the started children,
watches for failures of other ranks and leaves the job at exit. The
job's `Runtime` is `runtime.TorchRuntime`.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import datetime
import os
import sys
import time

import torch
import torch.distributed as dist

from keras_dist._src.cluster import (
    allocator,
    binding,
    launcher,
    supervision,
)
from keras_dist._src.cluster.environments import (
    ClusterEnvironment,
    detect_environment,
)
from keras_dist._src.devices import check_devices_exist
from keras_dist._src.errors import KerasDistError
from keras_dist._src.keras_glue import internals as glue


class RankFailedError(KerasDistError):
    """Another rank of the job failed; this rank stops too."""


# -- process group ------------------------------------------------------------
class Job:
    """This process's place in the job: rank, world, store clients."""

    def __init__(self, environment: ClusterEnvironment, launched_children):
        self.environment = environment
        self.rank = environment.rank
        self.world_size = environment.world_size
        self.local_rank = environment.local_rank
        self.supervisor = None
        self.watchdog = None
        self.children = launched_children
        self._report_store = None
        self._watch_store = None
        self._addr = environment.coordinator_host
        self._port = environment.coordinator_port

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
            supervision.ERROR_KEY, "", message.encode()
        )
        return first.decode() if isinstance(first, bytes) else str(first)

    def start_supervisor(self) -> None:
        """Rank 0 of a launched job: starts watching its children."""
        if self.children:
            self.supervisor = supervision.Supervisor(
                self.children, report=self.report
            ).start()

    def start_watchdog(self) -> None:
        """Starts watching for failures of other ranks (after rendezvous)."""
        client = self._client()
        if client is None:
            return
        lock_free = {"store": client}
        self._watch_store = client  # reused at exit, once the watch ended

        def check_error():
            store = lock_free["store"]
            if store.check([supervision.ERROR_KEY]):
                return store.get(supervision.ERROR_KEY).decode()
            return None

        on_stop = None
        if self.supervisor is not None:
            on_stop = lambda reason: self.supervisor.terminate_children()  # noqa: E731
        watch_parent = os.environ.get(launcher.ENV_LAUNCHED) is not None
        self.watchdog = supervision.Watchdog(
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

    def leave(self) -> None:
        """At exit: rank 0, which hosts the rendezvous store, waits for
        the other ranks to leave (`supervision.leave_job`), its watchdog
        still running; the others stop theirs and say they left."""
        if self._watch_store is None:
            # A process group the program started: its store, if one is
            # known (MASTER_ADDR and MASTER_PORT), may be rank 0's too.
            try:
                self._watch_store = self._client()
            except Exception:  # noqa: BLE001 - unreachable: nothing to keep
                return
            if self._watch_store is None:
                return
        if self.rank == 0:
            client = self._client()

            def wait_key(key, seconds):
                client.wait([key], datetime.timedelta(seconds=seconds))
                return True

            supervision.leave_job(0, self.world_size, client.set, wait_key)
            self.stop_watchdog()
            return
        self.stop_watchdog()
        supervision.leave_job(
            self.rank, self.world_size, self._watch_store.set, None
        )


_job: Job | None = None
# Set once this process has left its job (`shutdown_job`).
_left = False


def collective_timeout() -> datetime.timedelta:
    """How long a collective of this job's groups waits for a rank: the
    liveness timeout (``KERAS_DIST_TIMEOUT``)."""
    return datetime.timedelta(seconds=supervision.liveness_timeout())


def start_job(devices, environment: ClusterEnvironment | None = None) -> Job:
    """Joins or launches the process group for `devices` (once per run).

    Args:
        devices: the strategy's devices (one per process).
        environment: where this process stands; read from the launcher's
            variables when None. A one-process environment means no
            launcher: the other ranks are started here.
    """
    global _job
    if _job is not None and _left:
        raise supervision.rejoin_error("torch.distributed")
    if _job is not None:
        if _job.world_size != len(devices) and len(devices) > 1:
            raise KerasDistError(
                f"This process already belongs to a job of {_job.world_size} "
                f"ranks; a strategy over {len(devices)} devices cannot be "
                "created in it. Create one MirroredStrategy per program."
            )
        return _job
    gpu = devices[0].startswith("gpu")
    if not gpu:
        launcher.cpu_binding()  # a bad setting fails before ranks start
        # Every CPU rank keeps the memory it frees for its next step
        # (KERAS_DIST_CPU_ALLOCATOR); a bad setting fails here too.
        allocator.tune_allocator()
    if dist.is_initialized():
        rank, world = dist.get_rank(), dist.get_world_size()
        local = int(os.environ.get("LOCAL_RANK", rank))
        env = detect_environment()
        _job = Job(
            dataclasses.replace(
                env,
                rank=rank,
                world_size=world,
                local_rank=min(local, max(env.local_world_size, 1) - 1),
            )
            if env.world_size == world
            else ClusterEnvironment(
                source="process_group",
                rank=rank,
                world_size=world,
                local_rank=local,
                local_world_size=max(local + 1, 1),
                coordinator_host=os.environ.get("MASTER_ADDR", "127.0.0.1"),
                coordinator_port=int(os.environ.get("MASTER_PORT", "0")),
            ),
            {},
        )
        supervision.track_exit_requests()
        atexit.register(_job.leave)
        return _job
    children = {}
    listener = None
    supervision.watch_launcher()
    explicit = environment is not None
    if environment is None:
        environment = detect_environment()
    if not environment.is_distributed:
        # No launcher: this process becomes rank 0 and starts the others by
        # re-running the program (the documented behaviour of
        # `MirroredStrategy` on torch without a launcher).
        # Every rank would find a missing device; rank 0 says so once,
        # before it starts any.
        from keras_dist._src.backends.torch.devices import nameable_devices

        check_devices_exist(devices, nameable_devices())
        world = len(devices)
        # Listen before starting the children: no other process can take
        # the port between choosing it and binding it.
        listener = binding.listen_socket(
            None if binding.bind_all_requested() else binding.LOOPBACK, 0
        )
        port = listener.getsockname()[1]
        extra = {}
        if not gpu and "OMP_NUM_THREADS" not in os.environ:
            threads = max(1, (os.cpu_count() or 1) // world)
            extra["OMP_NUM_THREADS"] = str(threads)
            torch.set_num_threads(threads)
        try:
            children = launcher.start_workers(world, port, extra)
        except BaseException:
            listener.close()
            raise
        environment = ClusterEnvironment(
            source="keras_dist",
            rank=0,
            world_size=world,
            local_rank=0,
            local_world_size=world,
            coordinator_host="127.0.0.1",
            coordinator_port=port,
        )
    rank, world = environment.rank, environment.world_size
    local = environment.local_rank
    if (
        world > 1
        and len(devices) > 1
        and world != len(devices)
        and not (explicit)
    ):
        supervision.log(
            f"rank {rank}: {len(devices)} devices were requested but the job "
            f"has {world} ranks (WORLD_SIZE); using one rank per process."
        )
    _job = Job(environment, children)
    if not gpu and (children or os.environ.get(launcher.ENV_LAUNCHED)):
        # Ranks keras_dist started (their threads sized to a share of the
        # cores) bind to their share as KERAS_DIST_CPU_BINDING asks (off by
        # default). torchrun's or SLURM's keep their launcher's binding.
        launcher.bind_to_cores(local, environment.local_world_size)
    _job.start_supervisor()
    if gpu:
        torch.cuda.set_device(
            gpu_index(
                devices,
                local,
                environment.local_world_size,
                torch.cuda.device_count(),
                started_here=bool(
                    children or os.environ.get(launcher.ENV_LAUNCHED)
                ),
            )
        )
    _install_excepthook(_job)
    supervision.track_exit_requests()
    _init_process_group("nccl" if gpu else "gloo", environment, listener)
    # Keras (3.16+) would wrap every model in DDP now that a process group
    # exists: the models keras_dist does not train stay this process's.
    glue.keep_keras_torch_trainer_local(_owns_process_group)
    _job.start_watchdog()
    atexit.register(shutdown_job)
    return _job


def _owns_process_group() -> bool:
    """Whether the default process group is the one keras_dist started."""
    return _job is not None and dist.is_initialized()


def gpu_index(
    devices, local_rank, local_world_size, visible, started_here=False
) -> int:
    """The CUDA device a GPU rank trains on.

    A strategy that names one GPU per rank of this host (``MirroredStrategy
    (devices=["gpu:2", "gpu:3"])``, or every GPU by default) gives each
    local rank its own device; otherwise (a launcher that shows each rank
    only its own GPU, say) the local rank picks among the visible ones.

    Args:
        devices: the strategy's devices.
        local_rank: this rank's index on its host.
        local_world_size: how many ranks this host runs.
        visible: how many GPUs this process sees.
        started_here: whether keras_dist started this host's ranks (they
            all see the same GPUs then).

    Raises:
        KerasDistError: more ranks on this host than it has GPUs (NCCL runs
            one rank per GPU), or a named GPU this process cannot see.
    """
    if visible < 1:
        raise KerasDistError(
            f"The strategy's devices {list(devices)} are GPUs, but this "
            "process sees none (CUDA_VISIBLE_DEVICES, or torch's CPU build)."
        )
    if started_here and local_world_size > visible:
        raise KerasDistError(
            f"This host runs {local_world_size} ranks but sees {visible} "
            f"GPU(s), and NCCL needs a GPU of its own for each rank. Start "
            f"at most {visible} per host (keras-dist launch --nproc-per-node "
            f"{visible}), or train on CPU ranks: devices=['cpu:0', 'cpu:1', "
            "...] or CUDA_VISIBLE_DEVICES=''."
        )
    if len(devices) == local_world_size:
        index = int(devices[local_rank].split(":")[1])
        if index >= visible:
            raise KerasDistError(
                f"Rank {local_rank} of this host was given "
                f"{devices[local_rank]!r}, but this process sees {visible} "
                f"GPU(s) (cuda:0 to cuda:{visible - 1})."
            )
        return index
    return local_rank % visible


def _init_process_group(backend, environment, listener=None) -> None:
    """Initialises the default process group of `environment`'s job.

    Rank 0 hosts the rendezvous store on the interface `binding.bind_host`
    chooses (loopback for a one-host job), through a socket keras_dist
    binds itself (``TCPStore`` on its own listens on every interface), and
    a one-host job's gloo sockets listen on loopback too. Under torchrun,
    whose agent hosts the store, torch's own ``tcp://`` rendezvous joins
    the agent's store.

    Args:
        backend: ``"gloo"`` or ``"nccl"``.
        environment: the job's `ClusterEnvironment`.
        listener: rank 0's socket, already listening (a relaunched job);
            None to bind the coordinator's port here.
    """
    rank, world = environment.rank, environment.world_size
    agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    if agent_store:
        if listener is not None:
            listener.close()
        dist.init_process_group(
            backend,
            init_method=f"tcp://{environment.coordinator_address}",
            rank=rank,
            world_size=world,
            timeout=collective_timeout(),
        )
        return
    host = binding.bind_host(environment)
    if world > 1 and host is not None and binding.is_loopback(host):
        interface = binding.loopback_interface()
        if interface and "GLOO_SOCKET_IFNAME" not in os.environ:
            # Read by gloo when it creates its device (the default group's
            # and every new_group's); without it gloo listens on the
            # address this host's name resolves to.
            os.environ["GLOO_SOCKET_IFNAME"] = interface
    master = {}
    if rank == 0:
        if listener is None:
            listener = binding.listen_socket(
                host, int(environment.coordinator_port)
            )
        # The store owns the listening socket from here.
        master = dict(
            wait_for_workers=False, master_listen_fd=listener.detach()
        )
    store = dist.TCPStore(
        environment.coordinator_host,
        int(environment.coordinator_port),
        world,
        is_master=rank == 0,
        timeout=collective_timeout(),
        **master,
    )
    dist.init_process_group(
        backend,
        store=store,
        rank=rank,
        world_size=world,
        timeout=collective_timeout(),
    )


def shutdown_job() -> None:
    """Leaves the job (telling the others), stops the watchdog, waits for
    started children and tears the process group down (at exit)."""
    global _left
    _left = True
    if _job is not None:
        _job.leave()
        _job.stop_watchdog()
        if _job.supervisor is not None:
            # Keep the rendezvous store (hosted here) alive until every
            # child is done; exits non-zero if one of them failed.
            _job.supervisor.wait_at_exit()
        _job.mute()
    if dist.is_initialized():
        with contextlib.suppress(Exception):
            dist.destroy_process_group()


def _install_excepthook(job: Job) -> None:
    original = sys.excepthook

    def hook(kind, value, tb):
        if not isinstance(value, RankFailedError):
            with contextlib.suppress(Exception):
                job.report(f"rank {job.rank}: {kind.__name__}: {value}")
        job.mute()
        original(kind, value, tb)
        if isinstance(value, RankFailedError):
            # Stopped by another rank's failure: let that rank exit first,
            # so that the launcher names it (as the watchdog's stop does).
            time.sleep(supervision.PEER_FAILURE_GRACE)

    sys.excepthook = hook

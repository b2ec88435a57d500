"""Starting the worker processes of this host.

Backend-neutral building blocks: pick a free port, build the command that
re-runs the current program, start the other ranks with the environment
variables torch.distributed (``env://``) and most launchers understand, and
run a launcher's tasks with prefixed output and forwarded signals
(`run_supervised`, for ``keras-dist launch`` with or without ``--ps``).
The process that runs the user's script becomes rank 0 and supervises its
children (`keras_dist._src.cluster.supervision`); each child exits when its
parent dies.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading

from keras_dist._src.cluster.supervision import (
    ENV_PARENT_PIPE,
    stop_processes,
)

ENV_LAUNCHED = "KERAS_DIST_LAUNCHED"


ENV_NO_LAUNCH = "KERAS_DIST_NO_LAUNCH"
#: Signals a launcher passes on to every task (SIGUSR1: SLURM's
#: ``--signal``).
FORWARDED_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1)
#: Seconds between SIGTERM and SIGKILL when a launcher stops its tasks.
STOP_GRACE_S = 10.0


ENV_CPU_BINDING = "KERAS_DIST_CPU_BINDING"
_BINDINGS = ("auto", "exclusive", "none")


def core_share(cores, local_rank: int, local_world: int) -> list[int]:
    """The cores of `local_rank` when `cores` are split evenly and
    exclusively among `local_world` ranks (contiguous shares in the order
    of `cores`; left-over cores go to no rank). Empty when there are fewer
    cores than ranks."""
    cores = sorted(cores)
    share = len(cores) // max(local_world, 1)
    if share < 1 or not 0 <= local_rank < local_world:
        return []
    return cores[local_rank * share : (local_rank + 1) * share]


def cpu_binding() -> str:
    """This job's ``KERAS_DIST_CPU_BINDING`` (see `bind_to_cores`).

    Raises:
        ValueError: for a value that is not ``auto``, ``exclusive`` or
            ``none``.
    """
    mode = os.environ.get(ENV_CPU_BINDING, "none").strip().lower() or "none"
    if mode not in _BINDINGS:
        raise ValueError(
            f"{ENV_CPU_BINDING}={mode!r} is not one of {', '.join(_BINDINGS)}:"
            " `auto` binds each CPU rank keras_dist starts to its own cores"
            " when there are enough, `none` leaves them unbound."
        )
    return mode


def bind_to_cores(local_rank: int, local_world: int) -> list[int] | None:
    """Binds this CPU rank (all its threads) to its own share of the cores
    it may run on, as ``torchrun --numa-binding=exclusive`` does for GPU
    ranks, so that ranks do not migrate between cores and evict each
    other's caches. For the torch CPU ranks keras_dist starts, which already
    size their thread pools to that share (``OMP_NUM_THREADS``).

    ``KERAS_DIST_CPU_BINDING``: ``none`` (default: leave the mask as it
    is; binding did not change the 2-rank step ratio measurably on a quiet
    2-core machine, and two bound jobs on one host would share the same
    cores), ``auto`` (bind when every rank gets at least one core of this
    process's affinity mask, else leave it), ``exclusive`` (bind, or fail
    when there are fewer cores than ranks).

    Returns:
        The cores bound to, or None when nothing was changed.

    Raises:
        ValueError: for an unknown setting, or ``exclusive`` with fewer
            cores than local ranks.
    """
    mode = cpu_binding()
    if (
        mode == "none"
        or local_world < 2
        or not hasattr(os, "sched_setaffinity")
    ):
        return None
    cores = os.sched_getaffinity(0)
    share = core_share(cores, local_rank, local_world)
    if not share:
        if mode == "exclusive":
            raise ValueError(
                f"{ENV_CPU_BINDING}=exclusive needs a core per rank, but "
                f"this process may run on {len(cores)} core(s) and the host "
                f"has {local_world} ranks. Start fewer ranks per host or set "
                f"{ENV_CPU_BINDING}=none."
            )
        return None
    # Every thread already running (pools, gloo's, keras_dist's watchers),
    # as ``taskset -a`` does; threads started later inherit the mask.
    try:
        threads = [int(t) for t in os.listdir("/proc/self/task")]
    except OSError:
        threads = [0]
    for thread in threads:
        try:
            os.sched_setaffinity(thread, share)
        except (ProcessLookupError, PermissionError):
            pass  # a thread that just ended, or one that is not ours
    return share


def free_port(host: str = "127.0.0.1") -> int:
    """Returns a TCP port that is free on `host` right now.

    Binds port 0 so that the OS picks; never a fixed port, so that several
    jobs (and parallel tests) on one host do not collide.
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def relaunch_command() -> list[str]:
    """Returns the command line that re-runs the current program.

    Uses ``sys.orig_argv`` (so ``python -m pkg.module args``, ``python -c
    CODE`` and interpreter flags are kept) with ``sys.executable`` as the
    interpreter.

    Raises:
        RuntimeError: when the program cannot be re-run (a program read
            from standard input, an interactive session, a notebook or
            pytest).
    """
    main = sys.modules.get("__main__")
    argv = list(getattr(sys, "orig_argv", None) or [sys.executable] + sys.argv)
    # ``python -c CODE`` re-runs as it was started (its code is in argv);
    # a prompt, ``python -i`` or a program read from stdin cannot.
    from_c = sys.argv[:1] == ["-c"] and "-c" in argv[1:]
    # ``python - < train.py`` (and ``python < train.py``): the children
    # would read an exhausted stdin, run nothing and leave rank 0 waiting
    # for them until the rendezvous timed out.
    from_stdin = not hasattr(sys, "ps1") and (
        sys.argv[:1] == ["-"] or getattr(main, "__file__", None) == "<stdin>"
    )
    interactive = (
        hasattr(sys, "ps1")
        or sys.flags.interactive
        or not (getattr(main, "__file__", None) or from_c)
    )
    script = os.path.basename(sys.argv[0] if sys.argv else "")
    under_pytest = script.startswith(("pytest", "py.test")) or (
        "-m" in argv and argv[argv.index("-m") + 1 :][:1] == ["pytest"]
    )
    if from_stdin and not os.environ.get(ENV_NO_LAUNCH):
        raise RuntimeError(
            "keras_dist would start one process per device by re-running "
            "this program, but it was read from standard input (`python - "
            "< train.py`), which cannot be read again. Save it to a file "
            "and run `python train.py` (keras_dist starts the other "
            "processes), start them yourself with `keras-dist launch "
            "--nproc-per-node N train.py`, or train on one device "
            '(devices=["cpu:0"], or without KERAS_DIST_CPU_DEVICES).'
        )
    if interactive or under_pytest or os.environ.get(ENV_NO_LAUNCH):
        where = "pytest" if under_pytest else "an interactive session"
        if os.environ.get(ENV_NO_LAUNCH):
            where = f"a process with {ENV_NO_LAUNCH} set"
        raise RuntimeError(
            f"keras_dist would start one process per device by re-running "
            f"this program, but it runs in {where} (a prompt or a "
            "notebook), which cannot be re-run. Put the training code in "
            "a script and run it with `python train.py` or `python -c "
            "CODE` (keras_dist starts the other processes), start them "
            "with `keras-dist launch --nproc-per-node N train.py` or "
            "`torchrun --nproc_per_node=N train.py`, or train on one "
            'device (devices=["cpu:0"]).'
        )
    return [sys.executable] + argv[1:]


def child_env(
    rank: int,
    world_size: int,
    port: int,
    extra: dict | None = None,
    host: str = "127.0.0.1",
) -> dict:
    """Returns the environment of the child process of `rank` (the job's
    rendezvous at `host`:`port`)."""
    env = dict(os.environ)
    env.update(
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world_size),
        MASTER_ADDR=host,
        MASTER_PORT=str(port),
        **{ENV_LAUNCHED: str(os.getpid())},
    )
    env.update(extra or {})
    return env


_PR_SET_PDEATHSIG = 1


def _prctl():
    """libc's ``prctl``, resolved in the parent (a forked child must not
    import or load libraries), or None where there is none."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        import ctypes

        return ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None


def _die_with_parent_preexec(prctl, parent: int):
    """A ``preexec_fn`` that gives the child SIGKILL when `parent` dies.

    ``PR_SET_PDEATHSIG`` is kept across ``execve``. When the parent died
    between ``fork`` and ``prctl`` the signal never comes: the child then
    sees another parent and exits at once.
    """

    def preexec():
        prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
        if os.getppid() != parent:
            os._exit(1)

    return preexec


def spawn(command: list[str], env: dict, **popen_kwargs) -> subprocess.Popen:
    """Starts one worker process running `command` in `env`; it dies with
    this process.

    On Linux the child gets SIGKILL when this process dies, however it dies
    (SIGKILL, the OOM killer, ``timeout -s KILL``): ``PR_SET_PDEATHSIG``,
    set in the child before it runs `command`. Elsewhere the child inherits
    the read end of a pipe (named by ``KERAS_DIST_PARENT_PIPE``) whose write
    end only this process holds; keras_dist in the child ends the process
    at the pipe's end of file (`supervision.watch_launcher`).

    The parent-death signal belongs to the thread that starts the child:
    start workers from a thread that lives as long as the job (the main
    thread).

    Args:
        command: the program and its arguments.
        env: the child's environment.
        **popen_kwargs: passed on to `subprocess.Popen` (stdout, text, ...).
    """
    prctl = _prctl()
    if prctl is not None:
        return subprocess.Popen(
            command,
            env=env,
            preexec_fn=_die_with_parent_preexec(prctl, os.getpid()),
            **popen_kwargs,
        )
    read_end, write_end = os.pipe()  # neither is inherited unless passed
    env = dict(env, **{ENV_PARENT_PIPE: str(read_end)})
    try:
        proc = subprocess.Popen(
            command, env=env, pass_fds=(read_end,), **popen_kwargs
        )
    except BaseException:
        os.close(write_end)
        raise
    finally:
        os.close(read_end)
    proc._keras_dist_parent_pipe = write_end  # open as long as we live
    return proc


def start_workers(world_size: int, port: int, extra_env=None) -> dict:
    """Starts ranks 1..world_size-1 re-running this program.

    Returns:
        ``{rank: Popen}`` of the children.
    """
    children = {}
    if world_size < 2:
        return children  # nothing to start: no need to re-run the program
    command = relaunch_command()
    try:
        for rank in range(1, world_size):
            env = child_env(rank, world_size, port, extra_env)
            children[rank] = spawn(command, env)
    except BaseException:
        for proc in children.values():
            proc.kill()
        raise
    return children


def script_command(command: list) -> list:
    """`command` as a launcher runs it: a ``.py`` script runs with this
    Python, unbuffered (so that prefixed output lines come as printed).

    Raises:
        ValueError: for an empty command.
    """
    if not command:
        raise ValueError("Give the script to run: keras-dist launch ...")
    command = list(command)
    if command[0].endswith(".py"):
        command = [sys.executable, "-u"] + command
    return command


def run_supervised(
    command, tasks, supervise, grace=STOP_GRACE_S, respawn=False
) -> int:
    """Runs one process of `command` per task until `supervise` ends the
    job; every process is stopped before this returns.

    Each task's output lines (stdout and stderr) are printed to stdout with
    its prefix. SIGINT, SIGTERM and SIGUSR1 sent to this process are
    forwarded to every live task while they run. Tasks are started with
    `spawn` (they die with this process however it dies), from the calling
    thread. At the end, live tasks get SIGTERM and, `grace` seconds later,
    SIGKILL; the previous signal handlers are restored.

    Args:
        command: the program and its arguments (see `script_command`).
        tasks: ``(key, prefix, env)`` for each process, in start order.
        supervise: called with ``{key: Popen}`` once every task started;
            returns the job's exit code when the job is over.
        grace: seconds between SIGTERM and SIGKILL at the end.
        respawn: also give `supervise` a function ``start(key)`` that
            starts that task again (its process ended), with its
            environment and prefix.

    Returns:
        What `supervise` returned.
    """
    procs, pumps = {}, []

    def forward(signum, frame):
        del frame
        for proc in list(procs.values()):
            if proc.poll() is None:
                proc.send_signal(signum)

    specs = {key: (prefix, env) for key, prefix, env in tasks}

    def start(key):
        prefix, env = specs[key]
        proc = spawn(
            command,
            env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            encoding="utf-8",
            errors="replace",  # a stray byte must not stop the pump
            bufsize=1,
        )
        procs[key] = proc
        pump = threading.Thread(
            target=_pump, args=(proc.stdout, prefix), daemon=True
        )
        pump.start()
        pumps.append(pump)
        return proc

    previous = {s: signal.signal(s, forward) for s in FORWARDED_SIGNALS}
    try:
        for key, _, _ in tasks:
            start(key)
        if respawn:
            return supervise(procs, start)
        return supervise(procs)
    finally:
        stop_processes(procs.values(), grace)
        for pump in pumps:
            pump.join(5.0)
        for s, handler in previous.items():
            signal.signal(s, handler)


def _pump(stream, prefix: str) -> None:
    for line in iter(stream.readline, ""):
        sys.stdout.write(prefix + line)
        sys.stdout.flush()
    stream.close()

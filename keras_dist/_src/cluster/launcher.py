"""Starting the worker processes of this host.

Backend-neutral building blocks: pick a free port, build the command that
re-runs the current program, start the other ranks with the environment
variables torch.distributed (``env://``) and most launchers understand.
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

ENV_LAUNCHED = "KERAS_DIST_LAUNCHED"


ENV_NO_LAUNCH = "KERAS_DIST_NO_LAUNCH"


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

    Uses ``sys.orig_argv`` (so ``python -m pkg.module args`` and interpreter
    flags are kept) with ``sys.executable`` as the interpreter.

    Raises:
        RuntimeError: when the program cannot be re-run (an interactive
            session, a notebook or pytest).
    """
    main = sys.modules.get("__main__")
    argv = list(getattr(sys, "orig_argv", None) or [sys.executable] + sys.argv)
    interactive = hasattr(sys, "ps1") or not getattr(main, "__file__", None)
    script = os.path.basename(sys.argv[0] if sys.argv else "")
    under_pytest = script.startswith(("pytest", "py.test")) or (
        "-m" in argv and argv[argv.index("-m") + 1 :][:1] == ["pytest"]
    )
    if interactive or under_pytest or os.environ.get(ENV_NO_LAUNCH):
        where = "pytest" if under_pytest else "an interactive session"
        if os.environ.get(ENV_NO_LAUNCH):
            where = f"a process with {ENV_NO_LAUNCH} set"
        raise RuntimeError(
            f"keras_dist would start one process per device by re-running "
            f"this program, but it runs in {where}, which cannot be "
            "re-run. Put the training code in a script and run it with "
            "`python train.py` (keras_dist starts the other processes) or "
            "`torchrun --nproc_per_node=N train.py`."
        )
    return [sys.executable] + argv[1:]


def child_env(
    rank: int, world_size: int, port: int, extra: dict | None = None
) -> dict:
    """Returns the environment of the child process of `rank`."""
    env = dict(os.environ)
    env.update(
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world_size),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        **{ENV_LAUNCHED: str(os.getpid())},
    )
    env.update(extra or {})
    return env


def _set_parent_death_signal() -> None:
    """Linux only: the child gets SIGKILL when its parent dies."""
    try:
        import ctypes

        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except Exception:  # noqa: BLE001 - best effort; the watchdog remains.
        pass


def spawn(command: list[str], env: dict) -> subprocess.Popen:
    """Starts one child process running `command` in `env`."""
    preexec = _set_parent_death_signal if sys.platform == "linux" else None
    return subprocess.Popen(command, env=env, preexec_fn=preexec)


def start_workers(world_size: int, port: int, extra_env=None) -> dict:
    """Starts ranks 1..world_size-1 re-running this program.

    Returns:
        ``{rank: Popen}`` of the children.
    """
    command = relaunch_command()
    children = {}
    try:
        for rank in range(1, world_size):
            env = child_env(rank, world_size, port, extra_env)
            children[rank] = spawn(command, env)
    except BaseException:
        for proc in children.values():
            proc.kill()
        raise
    return children

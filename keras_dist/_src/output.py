"""What keras_dist tells its user, and output from the chief only.

keras_dist's messages go through the ``"keras_dist"`` logger of Python's
`logging`. Unless the user configured that logger (a handler or a level of
their own), keras_dist gives it one handler that writes ``keras_dist: ...``
lines to stderr, at the level ``KERAS_DIST_VERBOSE`` asks for:

- ``KERAS_DIST_VERBOSE=0``: warnings and errors only;
- ``1`` (default): also the one line saying what trains where;
- ``2``: also details such as how each process reads the input.

``logging.getLogger("keras_dist").setLevel(logging.WARNING)`` silences the
same lines from Python.
"""

from __future__ import annotations

import builtins
import functools
import logging
import os
import sys
import weakref

LOGGER_NAME = "keras_dist"
ENV_VERBOSE = "KERAS_DIST_VERBOSE"
_LEVELS = {"0": logging.WARNING, "1": logging.INFO, "2": logging.DEBUG}

_last_strategy = None  # a weak reference to the newest strategy


class _StderrHandler(logging.Handler):
    """Writes to the ``sys.stderr`` of the moment (so that redirections
    made after import, and pytest's capture, see the lines) and flushes."""

    def emit(self, record):
        try:
            sys.stderr.write(self.format(record) + "\n")
            sys.stderr.flush()
        except Exception:  # noqa: BLE001 - logging's own convention
            self.handleError(record)


def verbosity() -> int:
    """``KERAS_DIST_VERBOSE`` as a logging level (INFO when unset).

    Raises:
        ValueError: for a value other than 0, 1 or 2.
    """
    value = os.environ.get(ENV_VERBOSE, "1").strip() or "1"
    if value not in _LEVELS:
        raise ValueError(
            f"{ENV_VERBOSE}={value!r}: use 0 (warnings only), 1 (default: "
            "also the line saying what trains where) or 2 (also details)."
        )
    return _LEVELS[value]


def logger() -> logging.Logger:
    """The ``"keras_dist"`` logger, with keras_dist's stderr handler unless
    the user gave it a handler or a level."""
    log = logging.getLogger(LOGGER_NAME)
    if not log.handlers and log.level == logging.NOTSET:
        handler = _StderrHandler()
        handler.setFormatter(logging.Formatter("keras_dist: %(message)s"))
        log.addHandler(handler)
        log.propagate = False
        log.setLevel(verbosity())
    return log


# -- the chief ----------------------------------------------------------------
def set_last_strategy(strategy) -> None:
    """Records the newest strategy: its runtime says who the chief is."""
    global _last_strategy
    _last_strategy = weakref.ref(strategy)


def is_chief() -> bool:
    """Whether this process is the chief: the newest strategy's answer, or
    before any strategy, rank 0 of the job the launcher variables describe
    (``RANK``, ``TF_CONFIG``, SLURM, Open MPI); True without a launcher."""
    strategy = _last_strategy() if _last_strategy is not None else None
    if strategy is not None:
        return bool(strategy.is_chief)
    from keras_dist._src.cluster.environments import detect_environment

    try:
        return detect_environment().rank == 0
    except Exception:  # noqa: BLE001 - unreadable: the strategy will say
        return True


def chief_print(*args, **kwargs) -> None:
    """`print` on the chief only, flushed; nothing elsewhere.

    Works before a strategy exists: the launcher variables (``RANK``,
    ``TF_CONFIG``, SLURM, Open MPI) say which process is the chief. Takes
    `print`'s arguments (``sep``, ``end``, ``file``).
    """
    if is_chief():
        kwargs.setdefault("flush", True)
        builtins.print(*args, **kwargs)


def on_chief(function):
    """Decorator: runs `function` on the chief only; elsewhere the call does
    nothing and returns None.

    For output and files (a plot, a summary, an upload). The function must
    not contain collectives (``strategy.reduce``, ``gather``, ``fit``, a
    checkpoint save): the other processes do not make them, and the chief
    would wait for them forever.
    """

    @functools.wraps(function)
    def wrapper(*args, **kwargs):
        if not is_chief():
            return None
        return function(*args, **kwargs)

    return wrapper


# -- saying what runs ---------------------------------------------------------
def _plural(count: int, word: str) -> str:
    if count == 1:
        return f"{count} {word}"
    return f"{count} {word}{'es' if word.endswith('s') else 's'}"


def _mesh_text(strategy) -> str:
    from keras_dist._src import plan as plan_lib

    plan = strategy.plan
    mesh = plan.mesh
    if mesh is None and isinstance(plan, plan_lib.ShardedPlan):
        return (
            f"1-D mesh over the replicas, axis {plan.batch_axis!r} (each "
            f"variable of {plan.min_size}+ elements split)"
        )
    if mesh is None:
        return "no mesh (every variable whole on each replica)"
    return f"mesh {mesh.shape} axes {mesh.axis_names}"


def _batch_text(strategy, batch_size) -> str:
    replicas = strategy.num_replicas_in_sync
    if not batch_size:
        return "per-replica batch: the input's batch / " + str(replicas)
    low, high = batch_size // replicas, -(-batch_size // replicas)
    share = str(low) if low == high else f"{low}-{high}"
    return f"per-replica batch {share} (global {batch_size})"


def describe_start(strategy, call: str, batch_size) -> str:
    """The line saying what trains where, e.g. ``MirroredStrategy on jax:
    4 replicas, 1 process x 4 devices (cpu:0 ... cpu:3), no mesh ...,
    per-replica batch 32 (global 128)``."""
    from keras_dist._src import backends as backend_lib

    processes = strategy.num_workers
    mesh = strategy.plan.mesh
    total = mesh.size if mesh is not None else strategy.num_replicas_in_sync
    per_process = max(1, total // max(processes, 1))
    devices = list(strategy.plan.devices)
    shown = " ".join(devices[:8]) + (" ..." if len(devices) > 8 else "")
    return (
        f"{type(strategy).__name__} on {backend_lib.name()}: "
        f"{_plural(strategy.num_replicas_in_sync, 'replica')}, "
        f"{_plural(processes, 'process')} x "
        f"{_plural(per_process, 'device')} ({shown}), "
        f"{_mesh_text(strategy)}; {call}: {_batch_text(strategy, batch_size)}"
    )


def announce(strategy, call: str, batch_size) -> None:
    """Logs `describe_start` once per strategy, from the chief, at the
    first `fit`, `evaluate` or `predict` (INFO: ``KERAS_DIST_VERBOSE=0``
    hides it)."""
    if getattr(strategy, "_announced", False):
        return
    strategy._announced = True
    if strategy.is_chief:
        logger().info(describe_start(strategy, call, batch_size))


def one_replica_advice(strategy, process_per_device: bool) -> str | None:
    """What to do when a strategy meant for many devices found one, or None
    when it has several (or was given one device on purpose);
    `process_per_device`: the backend runs a process per device (torch)."""
    if not getattr(strategy, "_many_devices_meant", False):
        return None
    mesh = strategy.plan.mesh
    total = mesh.size if mesh is not None else strategy.num_replicas_in_sync
    if total != 1 or strategy.num_workers != 1:
        return None
    if os.environ.get("KERAS_DIST_LAUNCHED"):  # launch.ENV_LAUNCHED
        # ``keras-dist launch`` chose one worker (--nproc-per-node 1, or a
        # job that went on with the nodes left): it says so itself.
        return None
    name = type(strategy).__name__
    device = strategy.plan.devices[0] if strategy.plan.devices else "?"
    if process_per_device:
        fix = (
            "On torch each device is a process: KERAS_DIST_CPU_DEVICES=2 (or "
            "keras_dist.simulate_cpu_devices(2) right after `import "
            "keras_dist`) starts 2, or start them with `keras-dist launch "
            "--nproc-per-node 2 train.py`."
        )
    else:
        fix = (
            "On a CPU, split it: KERAS_DIST_CPU_DEVICES=4 (or "
            "keras_dist.simulate_cpu_devices(4) right after `import "
            "keras_dist`)."
        )
    if name == "MultiWorkerMirroredStrategy":
        fix = (
            "No launcher variables (TF_CONFIG, RANK/WORLD_SIZE) name other "
            "workers: start them with `keras-dist launch --nproc-per-node 2 "
            "train.py`. " + fix
        )
    return (
        f"{name} found one device ({device}): training runs on a single "
        f"replica, as without a strategy. {fix}"
    )


def warn_if_one_replica(strategy, process_per_device: bool) -> None:
    """Logs `one_replica_advice` as a warning, on the chief."""
    advice = one_replica_advice(strategy, process_per_device)
    if advice and strategy.is_chief:
        logger().warning(advice)


# -- describe's picture -------------------------------------------------------
def mesh_diagram(mesh, devices=()) -> str:
    """A text picture of `mesh`: the last axis across, every other axis
    down, each cell the device at that place.

    Args:
        mesh: a `DeviceMesh`, or None (data parallel without a mesh).
        devices: the replicas' devices, shown when `mesh` is None.
    """
    if mesh is None:
        return (
            f"no mesh: every variable is whole on each of "
            f"{_plural(len(devices), 'replica')} ({' '.join(devices)})"
        )
    import itertools

    names = list(mesh.devices or [f"#{i}" for i in range(mesh.size)])
    *row_axes, column_axis = list(zip(mesh.axis_names, mesh.shape))
    columns = [f"{column_axis[0]}={i}" for i in range(column_axis[1])]
    rows = []
    for index in itertools.product(*(range(size) for _, size in row_axes)):
        label = ",".join(f"{a}={i}" for (a, _), i in zip(row_axes, index))
        rows.append(label)
    rows = rows or [""]
    width = max(len(c) for c in columns + names)
    left = max(len(r) for r in rows)
    lines = [f"mesh {mesh.shape} {mesh.axis_names}:"]
    lines.append(" " * (left + 2) + "  ".join(f"{c:<{width}}" for c in columns))
    per_row = column_axis[1]
    for r, label in enumerate(rows):
        cells = names[r * per_row : (r + 1) * per_row]
        lines.append(
            f"{label:<{left}}  " + "  ".join(f"{c:<{width}}" for c in cells)
        )
    return "\n".join(line.rstrip() for line in lines)


def placement_line(row: dict, mesh) -> str:
    """One variable's placement: which mesh axis splits each dimension."""
    parts = []
    for dim, (size, axes) in enumerate(zip(row["shape"], row["layout"])):
        if axes is None:
            continue
        axes = axes if isinstance(axes, tuple) else (axes,)
        count = 1
        for axis in axes:
            if mesh is not None and axis in mesh.axis_names:
                count *= mesh.axis_size(axis)
        over = "+".join(axes)
        parts.append(f"dim {dim} of {size} split in {count} over {over}")
    where = "; ".join(parts) if parts else "whole on every device"
    return f"  {row['path']} {row['shape']}: {where}"

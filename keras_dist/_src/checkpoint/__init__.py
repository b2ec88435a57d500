"""Preemption-aware checkpoints: format, atomic writers, restore.

The public surface is `keras_dist.checkpoint` (functions below and
`CheckpointManager`) and `keras_dist.callbacks.BackupAndRestore`.
"""

from __future__ import annotations

import os

from keras_dist._src.checkpoint import format as fmt
from keras_dist._src.checkpoint.format import (
    CheckpointCorruptError,
    CheckpointError,
    CheckpointMismatchError,
)
from keras_dist._src.checkpoint.manager import (
    CheckpointManager,
    CheckpointNotFoundError,
)

_MANAGERS: dict = {}


def _manager(directory, keep=None, async_save=False) -> CheckpointManager:
    key = os.path.abspath(os.fspath(directory))
    manager = _MANAGERS.get(key)
    if manager is None:
        manager = _MANAGERS[key] = CheckpointManager(directory)
    manager.keep = None if keep is None else int(keep)
    manager.async_save = bool(async_save)
    return manager


def save(model, directory, step=None, *, keep=None, async_save=False):
    """Saves `model`'s whole training state under `directory`.

    Writes ``directory/ckpt-<step>`` atomically: the model's variables, the
    optimizer's and metrics' state, the random generators' states, the
    versions and the strategy's shape. Every process of a job calls it;
    with several processes (or variables split over devices) each writes
    the shards it owns, without gathering, and the chief commits once all
    have written (see `guides/preemption.md`).

    Args:
        model: a built (usually compiled) Keras model.
        directory: the directory holding the checkpoints.
        step: names the checkpoint; defaults to the optimizer's iteration
            count (0 without an optimizer).
        keep: keep only this many newest checkpoints (None keeps all).
        async_save: return once the state is copied to host memory and
            write it in a background thread; the next save into
            `directory`, `wait()` and the process's exit wait for it.

    Returns:
        The checkpoint's path.
    """
    if step is None:
        optimizer = getattr(model, "optimizer", None)
        step = int(optimizer.iterations.numpy()) if optimizer is not None else 0
    return _manager(directory, keep, async_save).save(model, int(step))


def restore(model, directory):
    """Restores `model` from the newest complete checkpoint in `directory`.

    `directory` may also be one ``ckpt-<step>`` directory. Damaged or
    partial checkpoints are skipped with a warning. The checkpoint may come
    from another backend, replica count, strategy or layout: each process
    reads only the parts its variables hold.

    Args:
        model: a built Keras model with the same variables (paths and
            shapes) as the saved one.
        directory: a checkpoint directory (or one checkpoint).

    Returns:
        The checkpoint's metadata (``"path"``, ``"step"``, ``"position"``,
        ``"versions"``, ``"strategy"``, ...).

    Raises:
        CheckpointNotFoundError: when there is no complete checkpoint.
        CheckpointMismatchError: naming the variables that do not match.
    """
    directory = os.fspath(directory)
    if fmt.step_of(directory) is not None and os.path.exists(
        os.path.join(directory, fmt.COMMIT_FILE)
    ):
        root = os.path.dirname(os.path.normpath(directory))
        return _manager(root).restore(model, path=directory)
    return _manager(directory).restore(model)


def latest(directory):
    """The path of the newest complete checkpoint in `directory`, or None.

    Partial writes and damaged checkpoints are skipped with a warning.
    """
    return fmt.latest(os.fspath(directory))


def wait():
    """Waits for every asynchronous save of this process to be written.

    Raises:
        CheckpointError: if one of them failed.
    """
    for manager in list(_MANAGERS.values()):
        manager.wait()


__all__ = [
    "CheckpointCorruptError",
    "CheckpointError",
    "CheckpointManager",
    "CheckpointMismatchError",
    "CheckpointNotFoundError",
    "latest",
    "restore",
    "save",
    "wait",
]

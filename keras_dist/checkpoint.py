"""Preemption-aware, portable checkpoints of a whole training state.

See ``guides/preemption.md``. `save`/`restore`/`latest` work for any built
Keras model, inside a keras_dist strategy or not; a checkpoint written on
one backend and replica count restores on another.
"""

from keras_dist._src.checkpoint import (
    CheckpointCorruptError,
    CheckpointError,
    CheckpointManager,
    CheckpointMismatchError,
    CheckpointNotFoundError,
    latest,
    restore,
    save,
    wait,
)

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

"""Callbacks for distributed and preemptible training.

`BackupAndRestore` resumes an interrupted `fit` at the exact step and saves
before preemption; see ``guides/preemption.md``.
"""

from keras_dist._src.checkpoint.backup import BackupAndRestore
from keras_dist._src.checkpoint.preemption import PREEMPTION_EXIT_CODE

__all__ = ["PREEMPTION_EXIT_CODE", "BackupAndRestore"]

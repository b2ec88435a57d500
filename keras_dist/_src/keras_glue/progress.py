"""The callback that reports a worker's progress to ``keras-dist launch``.

Added to `fit` on every process only when the launcher asked for reports
(``KERAS_DIST_PROGRESS_DIR``: under ``--max-restarts`` or a hang timeout);
see `keras_dist._src.cluster.progress` for the file it writes.
"""

from __future__ import annotations

import inspect
import os
import warnings

import keras

from keras_dist._src.cluster import progress
from keras_dist._src.keras_glue.callbacks import _listed, _replaced


class _ReportProgress(keras.callbacks.Callback):
    """Writes the position after each train batch (last of the callbacks,
    so a callback that hangs or raises in a batch leaves the previous
    step as the last reported), and a heartbeat at validation batches and
    epoch edges (so that validation is not a hang)."""

    _keras_dist_all_ranks = True
    # Only writes a file: Keras may keep dispatching batch ends
    # asynchronously (as it would without this callback).
    async_safe = True

    def __init__(self, writer):
        super().__init__()
        self._writer = writer
        self._epoch = 0
        self._trained = False

    def _global_step(self, batch) -> int:
        steps = (self.params or {}).get("steps")
        if not steps:
            return -1
        return self._epoch * steps + min(batch + 1, steps)

    def on_train_begin(self, logs=None):
        self._trained = False
        self._writer.report("start", 0, -1, -1)

    def on_train_batch_begin(self, batch, logs=None):
        # The step before: the same as the last batch end, except in a
        # run that `BackupAndRestore` resumed, whose skipped steps no
        # callback sees; so a failure repeated after a resume is told.
        # (Still "start" until a step ran here: the first may compile.)
        state = "train" if self._trained else "start"
        steps = (self.params or {}).get("steps")
        if batch > 0:
            step = self._global_step(batch - 1)
            self._writer.report(state, self._epoch, batch - 1, step)
        elif self._epoch > 0 and steps:
            step = self._epoch * steps
            self._writer.report(state, self._epoch - 1, steps - 1, step)

    def on_epoch_begin(self, epoch, logs=None):
        self._epoch = epoch
        self._writer.report()

    def on_train_batch_end(self, batch, logs=None):
        self._trained = True
        step = self._global_step(batch)
        self._writer.report("train", self._epoch, batch, step)

    def on_test_batch_end(self, batch, logs=None):
        self._writer.report()

    def on_epoch_end(self, epoch, logs=None):
        self._writer.report()

    def on_train_end(self, logs=None):
        self._writer.report("done")


_writer = None
_warned = False


def add_progress_report(method, args, kwargs, rank):
    """Appends the progress callback to a `fit` call's callbacks when this
    worker runs under ``keras-dist launch`` with progress reports; returns
    the arguments unchanged otherwise. Warns once when a hang timeout is
    set but no launcher reads the reports (another launcher started this
    worker), so that the setting is never silently ignored."""
    global _writer, _warned
    directory = os.environ.get(progress.ENV_PROGRESS_DIR)
    if not directory:
        if os.environ.get(progress.ENV_HANG_TIMEOUT) and not _warned:
            _warned = True
            warnings.warn(
                f"{progress.ENV_HANG_TIMEOUT} is set, but this worker was "
                "not started by `keras-dist launch`, which is what watches "
                "for hangs: no hang detection in this job. Start it with "
                "`keras-dist launch --hang-timeout SECONDS ...`.",
                stacklevel=3,
            )
        return args, kwargs
    if _writer is None or _writer.directory != directory:
        if _writer is not None:
            _writer.close()
        # The launcher's rank (its file names), where it set one.
        rank = int(os.environ.get("RANK", rank))
        _writer = progress.ProgressWriter(directory, rank)
        progress.register_stack_dump()
    bound = inspect.signature(method).bind(*args, **kwargs)
    arguments = bound.arguments
    callbacks = arguments.get("callbacks")
    listed = _listed(callbacks)
    arguments["callbacks"] = _replaced(
        callbacks, [*listed, _ReportProgress(_writer)]
    )
    return bound.args, bound.kwargs

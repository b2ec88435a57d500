"""`BackupAndRestore`: resume `fit` at the exact step, save on preemption.

At the start of `fit` the callback restores the newest complete checkpoint
of its directory and resumes at the saved position: the saved epoch, and
within it the saved step. The batches already trained are skipped by
letting the first calls of the train function only consume their data
(so the input's position and random draws are the same as in the
interrupted run), then the random generators are set to their state at
the save. Shuffling is reproduced by setting the generators to their state
at the start of the interrupted epoch before Keras draws its order.
"""

from __future__ import annotations

import os
import signal
import sys

import keras

from keras_dist._src.checkpoint import format as fmt
from keras_dist._src.checkpoint import (
    input_replay,
    preemption,
    runtime_glue,
    state,
)
from keras_dist._src.checkpoint import manager as manager_lib
from keras_dist._src.checkpoint.backup_dir import (
    _OWNER_TEMP,
    OWNER_FILE,
    _claim,
    _log,
    _remove_file,
)
from keras_dist._src.checkpoint.callback_states import (
    _callback_states,
    _set_callback_states,
)
from keras_dist._src.checkpoint.preemption import PREEMPTION_EXIT_CODE
from keras_dist._src.checkpoint.resume import (
    EPOCH_RNG_PREFIX,
    INPUT_RNG_PREFIX,
    _Resume,
)
from keras_dist._src.keras_glue import internals as glue


class BackupAndRestore(_Resume, keras.callbacks.Callback):
    """Backs up the training state; resumes an interrupted `fit` exactly.

    Saves a complete, atomic checkpoint (variables, optimizer, metrics,
    position, random-generator states) every epoch or every `save_freq`
    steps, and when the process receives one of `preemption_signals`:
    then every process stops after the same step, they save and the
    processes exit with `PREEMPTION_EXIT_CODE` (75). At the start of the
    next `fit` with the same `backup_dir` it restores the newest complete
    checkpoint and continues at the exact step (mid-epoch), so that an
    interrupted and resumed run ends with the same weights as one that
    was never interrupted (same backend and replica count, with
    `keras.utils.set_random_seed` called before building the model). When
    `fit` finishes, the backup is deleted.

    The callback owns its directory: it claims a new or empty one by
    writing `OWNER_FILE` there, resumes only from a directory with that
    marker, and deletes only the files it wrote. A directory holding
    anything else (e.g. checkpoints of `keras_dist.checkpoint.save`) is
    refused with a `ValueError` and left untouched.

    Works for models of any keras_dist strategy and for plain Keras models.
    With several processes, `backup_dir` must be on a filesystem every
    process shares: each writes the shards it owns (nothing is gathered on
    one host) and the chief commits.

    Args:
        backup_dir: directory for this run's checkpoints only: new or
            empty at the first start (the callback marks it as its own).
        save_freq: ``"epoch"``, a number of steps, or False (save only on
            preemption).
        keep: how many newest checkpoints to keep.
        async_save: write checkpoints in a background thread (the state is
            copied to host memory first); the next save, the end of `fit`
            and the process's exit wait for it.
        save_on_preemption: watch `preemption_signals` during `fit`.
        preemption_signals: signals that mean "save and stop": SIGTERM
            (Kubernetes, cloud VMs, SLURM at the time limit) by default; add
            ``signal.SIGUSR1`` for SLURM's ``--signal=USR1@90`` or
            ``signal.SIGINT`` for Ctrl-C (a second Ctrl-C stops at once).
        grace_period: seconds after the signal within which the process
            must have saved and exited; past it, it exits with
            `PREEMPTION_EXIT_CODE` without a new checkpoint. None waits
            without limit.
        exit_on_preemption: exit (``SystemExit(75)``) after the preemption
            save; if False, `fit` returns instead, with `preempted` set.
        preemption_check_freq: with several processes, agree on stopping
            every this many steps (one tiny all-reduce each time) and at
            the end of each epoch. One process checks every step for free.
        delete_checkpoint: delete the backup when `fit` finishes.
    """

    # Runs on every process of a keras_dist job (it takes part in
    # collectives); each writes its own shards, the chief commits.
    _keras_dist_all_ranks = True

    def __init__(
        self,
        backup_dir,
        save_freq="epoch",
        keep=1,
        async_save=False,
        save_on_preemption=True,
        preemption_signals=(signal.SIGTERM,),
        grace_period=25.0,
        exit_on_preemption=True,
        delete_checkpoint=True,
        preemption_check_freq=1,
    ):
        super().__init__()
        if not backup_dir:
            raise ValueError("BackupAndRestore needs a backup_dir.")
        valid = save_freq == "epoch" or save_freq is False
        if not valid and not (
            isinstance(save_freq, int)
            and not isinstance(save_freq, bool)
            and save_freq > 0
        ):
            raise ValueError(
                "save_freq must be 'epoch', a positive number of steps or "
                f"False; got {save_freq!r}."
            )
        if int(preemption_check_freq) < 1:
            raise ValueError(
                "preemption_check_freq must be >= 1; got "
                f"{preemption_check_freq!r}."
            )
        self.preemption_check_freq = int(preemption_check_freq)
        if grace_period is not None and grace_period <= 0:
            raise ValueError(f"grace_period must be > 0; got {grace_period}.")
        self.backup_dir = str(backup_dir)
        self.save_freq = save_freq
        self.save_on_preemption = bool(save_on_preemption)
        self.preemption_signals = tuple(preemption_signals or ())
        self.grace_period = grace_period
        self.exit_on_preemption = bool(exit_on_preemption)
        self.delete_checkpoint = bool(delete_checkpoint)
        self.manager = manager_lib.CheckpointManager(
            self.backup_dir, keep=keep, async_save=async_save
        )
        self.preempted = False
        self.restored_from = None
        self._watcher = preemption.SignalWatcher(self.preemption_signals)
        self._timer = None
        self._agreement = None
        self._runtime = None
        self._owned = set()  # checkpoint names in backup_dir that are ours
        self._wrapped = None  # fit's CallbackList, whose hooks we wrap
        self._unwrap_list = None
        self._others = []  # fit's other callbacks
        self._inputs = input_replay.InputPosition(None)
        self._reset_position()

    def _reset_position(self):
        self._epoch = 0
        self._step_in_epoch = 0
        self._global_step = 0
        self._last_saved = None
        self._last_saved_at = None
        self._epoch_rng = {}
        self._resume = None
        self._skipping = 0
        self._skipped_call = False  # the train-function call just skipped
        self._metric_keys = None  # names of the resumed epoch's metrics
        self._unskip = None
        self._metrics_pending = False

    # -- fit begins: restore -----------------------------------------------
    def on_train_begin(self, logs=None):
        """Claims the backup directory and restores the latest backup, if
        any, so that `fit` resumes at the saved epoch and step."""
        model = self.model
        self._reset_position()
        self.preempted = False
        self.restored_from = None
        self._runtime = runtime_glue.runtime_of(model)
        self._claim()
        found = self.manager.load(model)
        if self._runtime.is_chief:
            fmt.clean_temporaries(self.backup_dir)
        frame = _fit_frame(model)
        self._wrap_callback_list(frame)
        self._inputs = input_replay.InputPosition(
            None if frame is None else frame.f_locals.get("epoch_iterator")
        )
        if found is not None:
            self._restore(model, *found)
        if self.save_on_preemption and self.preemption_signals:
            self._watcher.install(frame)
            self._timer = preemption.GraceTimer(
                self._watcher, self.grace_period
            ).start()
        self._agreement = preemption.Agreement(self._runtime, self._watcher)

    def _claim(self) -> None:
        """Makes sure `backup_dir` is this callback's own (collective).

        A missing or empty directory is claimed with `OWNER_FILE`; one
        with the marker is resumed from (other files put there since are
        named on stderr and left untouched); anything else (a user's own
        checkpoints, other files, no marker) is refused, untouched.

        Raises:
            ValueError: naming the files the callback did not write.
        """
        problem = None
        if self._runtime.is_chief:
            problem, owned = _claim(self.backup_dir)
            self._owned = set(owned)
        if self._runtime.world_size > 1:
            code = self._runtime.broadcast(int(problem is not None), root=0)
            if int(code) and problem is None:
                problem = (
                    f"BackupAndRestore refuses backup_dir {self.backup_dir!r}"
                    ": it holds files it did not write (see the chief's "
                    "error)."
                )
        if problem is not None:
            raise ValueError(problem)

    def _wrap_callback_list(self, frame) -> None:
        """Takes the batch and epoch-end hooks of `fit`'s `CallbackList`.

        Skipped batches (see `_install_skip`) then reach no callback, and
        a preemption is acted on after every callback has seen the step
        or the epoch (not in the middle of the list). Without the list
        (a custom loop calling the hooks itself) this callback does both
        in its own hooks, as far as it can.
        """
        self._wrapped = None
        self._others = []
        callbacks = None if frame is None else frame.f_locals.get("callbacks")
        if not isinstance(callbacks, keras.callbacks.CallbackList) or not any(
            c is self for c in callbacks.callbacks
        ):
            return
        self._others = [c for c in callbacks.callbacks if c is not self]
        names = ("on_train_batch_begin", "on_train_batch_end", "on_epoch_end")
        original = {name: getattr(callbacks, name) for name in names}

        def on_train_batch_begin(batch, logs=None):
            if self._wrapped is not callbacks or not self._skipping:
                original["on_train_batch_begin"](batch, logs)

        def on_train_batch_end(batch, logs=None):
            if self._wrapped is not callbacks:
                return original["on_train_batch_end"](batch, logs)
            if self._skipped_call:
                self._skipped_batch_end(batch)
                return
            original["on_train_batch_end"](batch, logs)
            self._check_preemption(
                agree=self._global_step % self.preemption_check_freq == 0
            )

        def on_epoch_end(epoch, logs=None):
            original["on_epoch_end"](epoch, logs)
            if self._wrapped is callbacks:
                # Saved once every callback has seen the epoch's end (an
                # EarlyStopping after this one in the list included).
                self._epoch_save()
                self._check_preemption()

        hooks = {
            "on_train_batch_begin": on_train_batch_begin,
            "on_train_batch_end": on_train_batch_end,
            "on_epoch_end": on_epoch_end,
        }
        callbacks.__dict__.update(hooks)
        self._wrapped = callbacks

        def unwrap():
            self._wrapped = None
            for name, hook in hooks.items():
                if callbacks.__dict__.get(name) is hook:
                    del callbacks.__dict__[name]

        self._unwrap_list = unwrap

    # -- epochs and steps ----------------------------------------------------
    def on_epoch_begin(self, epoch, logs=None):
        """On the resumed epoch, replays the input to the saved step and
        gives back the random state, metrics and callbacks' states."""
        resume = self._resume
        if resume is not None and epoch == resume["epoch"]:
            self._inputs.replay(resume["inputs"], resume["input_rng"])
            # After every callback's `on_train_begin`, which resets them.
            _set_callback_states(
                self._others, resume["callbacks"], resume["arrays"]
            )
            if resume["step"]:
                # The shuffle of this epoch is drawn after this call.
                state.restore_rng(resume["epoch_rng"])
                metrics = glue.compile_metrics(self.model)
                if metrics is None or metrics.built:
                    self._restore_metrics(self.model)
                    # (Read now: JAX holds the variables apart during steps.)
                    self._metric_keys = list(self.model.get_metrics_result())
                else:  # built when the step is traced: see `_restore_metrics`
                    self._metrics_pending = True
            else:
                state.restore_rng(resume["rng"])
            if not self._skipping:
                self._resume = None
        self._epoch = epoch
        self._step_in_epoch = 0
        self._epoch_rng = state.capture_rng()
        self._inputs.epoch_begins()

    def _steps_done(self, batch) -> int:
        """Steps of the epoch done after the call that ended at `batch`.

        Keras numbers the last call of an epoch as if it ran a whole
        `steps_per_execution`; only the epoch's real steps count.
        """
        steps = self._steps()
        return min(batch + 1, steps) if steps else batch + 1

    def _skipped_batch_end(self, batch) -> None:
        """Accounts for a skipped call (no callback sees it)."""
        self._skipped_call = False
        self._skipping -= 1
        self._step_in_epoch = self._steps_done(batch)
        if not self._skipping:
            state.restore_rng(self._resume["rng"])
            self._resume = None

    def on_train_batch_end(self, batch, logs=None):
        """Counts the step, saves every `save_freq` steps and checks for
        preemption."""
        if self._skipped_call:  # only without the wrapped CallbackList
            self._skipped_batch_end(batch)
            return
        done = self._steps_done(batch)
        self._global_step += done - self._step_in_epoch
        self._step_in_epoch = done
        if isinstance(self.save_freq, int) and self.save_freq is not False:
            since = self._global_step - (self._last_saved or 0)
            if since >= self.save_freq:
                self._save()
        if self._wrapped is None:
            self._check_preemption(
                agree=self._global_step % self.preemption_check_freq == 0
            )

    def on_epoch_end(self, epoch, logs=None):
        """Saves at the epoch's end when `save_freq="epoch"` and checks
        for preemption."""
        self._epoch = epoch + 1
        self._step_in_epoch = 0
        if self._wrapped is None:
            self._epoch_save()
            self._check_preemption()

    def _epoch_save(self) -> None:
        if self.save_freq == "epoch":
            self._save()

    def on_train_end(self, logs=None):
        """Ends the replay of a resumed epoch if `fit` ended within it."""
        if self._skipping and self._unskip is not None:
            self._unskip()  # the saved position was past this fit's end
        self._skipping = 0
        self._skipped_call = False
        if self._unwrap_list is not None:
            self._unwrap_list()
            self._unwrap_list = None
        self._stop_watching()
        model = glue.callback_model(self)
        self.manager.wait(model)
        if model is not None:
            glue.set_initial_epoch(model, None)
        if self.delete_checkpoint and not self.preempted:
            self._remove_backup(model)

    def _remove_backup(self, model) -> None:
        """Deletes the files this callback owns, then the directory if it
        is empty (chief; collective)."""
        runtime = self.manager.runtime(model)
        if runtime.is_chief and os.path.isdir(self.backup_dir):
            for name in sorted(self._owned):
                if fmt.step_of(name) is not None:
                    fmt.remove(os.path.join(self.backup_dir, name))
            fmt.clean_temporaries(self.backup_dir)
            for name in os.listdir(self.backup_dir):
                if name == OWNER_FILE or _OWNER_TEMP.match(name):
                    _remove_file(os.path.join(self.backup_dir, name))
            try:
                os.rmdir(self.backup_dir)
            except OSError:
                pass  # files someone else put there: leave them
        self._owned = set()
        runtime.barrier("keras_dist/backup/removed")

    # -- saving and preemption ----------------------------------------------
    def _save(self) -> None:
        where = (self._epoch, self._step_in_epoch)
        if (
            self._last_saved == self._global_step
            and self._last_saved
            and self._last_saved_at == where
        ):
            return
        extra = {}
        if self._step_in_epoch:
            extra = state.prefixed(self._epoch_rng, EPOCH_RNG_PREFIX)
        # The input's own random state (`input_replay`).
        count, generators = self._inputs.saved(bool(self._step_in_epoch))
        extra.update(state.prefixed(generators, INPUT_RNG_PREFIX))
        scalars, arrays = _callback_states(self._others)
        extra.update(arrays)
        position = {
            "epoch": self._epoch,
            "step_in_epoch": self._step_in_epoch,
            "global_step": self._global_step,
            "steps_per_epoch": (self.params or {}).get("steps"),
        }
        if count is not None:  # a tf.data input, or arrays counting epochs
            position["input_iterators"] = count
        path = self.manager.save(
            self.model,
            self._global_step,
            position,
            extra_arrays=extra,
            extra={"callbacks": scalars},
        )
        self._owned.add(os.path.basename(path))
        self._last_saved = self._global_step
        self._last_saved_at = where

    def _check_preemption(self, agree=True) -> None:
        if self._agreement is None or self.preempted:
            return
        if not self.save_on_preemption:
            return
        if not self._agreement.should_stop(self._global_step, agree):
            return
        received = self._watcher.received
        self.manager.async_save, was_async = False, self.manager.async_save
        try:
            self._save()
        finally:
            self.manager.async_save = was_async
        self.preempted = True
        self._stop_watching()
        if self._unwrap_list is not None:
            self._unwrap_list()  # fit ends here: let its CallbackList go
            self._unwrap_list = None
        name = preemption.signal_name(received) if received else "a signal"
        where = (
            f"{self.backup_dir} {self._where(self._epoch, self._step_in_epoch)}"
            f" (global step {self._global_step})"
        )
        if self.exit_on_preemption:
            _log(
                self._runtime,
                f"preempted ({name}): saved {where}; exiting with code "
                f"{PREEMPTION_EXIT_CODE}.",
            )
            sys.stdout.flush()
            raise SystemExit(PREEMPTION_EXIT_CODE)
        _log(self._runtime, f"preempted ({name}): saved {where}.")
        self.model.stop_training = True

    def _stop_watching(self) -> None:
        self._watcher.uninstall()
        if self._timer is not None:
            self._timer.stop()
            self._timer = None


def _fit_frame(model):
    """The frame of the `fit` of `model` that is running, if found."""
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_name == "fit" and frame.f_locals.get("self") is (
            model
        ):
            return frame
        frame = frame.f_back
    return None

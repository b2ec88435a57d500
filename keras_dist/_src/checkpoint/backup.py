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

import signal
import sys

import keras

from keras_dist._src.checkpoint import format as fmt
from keras_dist._src.checkpoint import manager as manager_lib
from keras_dist._src.checkpoint import preemption, runtime_glue, state
from keras_dist._src.checkpoint.preemption import PREEMPTION_EXIT_CODE
from keras_dist._src.keras_glue import internals as glue

EPOCH_RNG_PREFIX = "epoch_begin/"


class BackupAndRestore(keras.callbacks.Callback):
    """Backs up the training state; resumes an interrupted `fit` exactly.

    Saves a complete, atomic checkpoint (variables, optimizer, metrics,
    position, random-generator states) every epoch or every `save_freq`
    steps, and when the process receives one of `preemption_signals`:
    then every process stops after the same step, the chief saves and the
    processes exit with `PREEMPTION_EXIT_CODE` (75). At the start of the
    next `fit` with the same `backup_dir` it restores the newest complete
    checkpoint and continues at the exact step (mid-epoch), so that an
    interrupted and resumed run ends with the same weights as one that
    was never interrupted (same backend and replica count, with
    `keras.utils.set_random_seed` called before building the model). When
    `fit` finishes, the backup is deleted.

    Works for models of any keras_dist strategy and for plain Keras models.
    With several processes, `backup_dir` must be on a filesystem every
    process can read; only the chief writes.

    Args:
        backup_dir: directory for this run's checkpoints only.
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
    # collectives); only the chief writes.
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
        self._reset_position()

    def _reset_position(self):
        self._epoch = 0
        self._step_in_epoch = 0
        self._global_step = 0
        self._last_saved = None
        self._epoch_rng = {}
        self._resume = None
        self._skipping = 0
        self._unskip = None
        self._metrics_pending = False

    # -- fit begins: restore -----------------------------------------------
    def on_train_begin(self, logs=None):
        model = self.model
        self._reset_position()
        self.preempted = False
        self.restored_from = None
        self._runtime = runtime_glue.runtime_of(model)
        found = self.manager.load(model)
        if self._runtime.is_chief:
            fmt.clean_temporaries(self.backup_dir)
        if found is not None:
            self._restore(model, *found)
        if self.save_on_preemption and self.preemption_signals:
            self._watcher.install(_fit_frame(model))
            self._timer = preemption.GraceTimer(
                self._watcher, self.grace_period
            ).start()
        self._agreement = preemption.Agreement(self._runtime, self._watcher)

    def _restore(self, model, path, metadata, arrays):
        manager_lib.apply(model, arrays, metrics=False)
        position = metadata.get("position", {})
        epoch = int(position.get("epoch", 0))
        step = int(position.get("step_in_epoch", 0))
        self._global_step = int(position.get("global_step", metadata["step"]))
        self._last_saved = self._global_step
        self._epoch = epoch
        self.restored_from = path
        glue.set_initial_epoch(model, epoch or None)
        self._resume = {
            "epoch": epoch,
            "step": step,
            "rng": state.rng_arrays(arrays),
            "epoch_rng": state.unprefixed(arrays, EPOCH_RNG_PREFIX),
            "arrays": arrays,
        }
        saved_steps = position.get("steps_per_epoch")
        steps = (self.params or {}).get("steps")
        if step and saved_steps and steps and saved_steps != steps:
            _log(
                self._runtime,
                f"warning: the backup was written with {saved_steps} steps "
                f"per epoch, this fit has {steps}; resuming at step {step} "
                "of the epoch will not match the interrupted run.",
            )
        spe = int(getattr(model, "steps_per_execution", 1) or 1)
        if step:
            self._install_skip(model, -(-step // spe), spe)
        _log(
            self._runtime,
            f"resuming from {path} (epoch {epoch + 1}, step {step}, "
            f"global step {self._global_step}).",
        )

    def _install_skip(self, model, calls, spe):
        """The next `calls` train-function calls only consume their data."""
        original = model.train_function
        backend = keras.backend.backend()
        remaining = [calls]

        def skip(*args, **kwargs):
            remaining[0] -= 1
            if remaining[0] <= 0:
                model.train_function = original
            # JAX: (state, iterator); TensorFlow: (iterator,); torch:
            # (list of the call's batches, already drawn).
            data = args[1] if backend == "jax" else args[0]
            if isinstance(data, (list, tuple)):
                batches = list(data)
            else:
                batches = [next(data) for _ in range(spe)]
            if remaining[0] == calls - 1 and self._metrics_pending:
                self._restore_metrics(model, batches[0])
            return ({}, args[0]) if backend == "jax" else {}

        self._skipping = calls
        self._unskip = lambda: setattr(model, "train_function", original)
        model.train_function = skip

    def _restore_metrics(self, model, batch=None):
        """Restores the metrics' state of the interrupted epoch."""
        self._metrics_pending = False
        metrics = glue.compile_metrics(model)
        if metrics is not None and not metrics.built:
            # Keras on TensorFlow without a strategy builds compiled metrics
            # when it traces the step; build them now, from a batch.
            glue.symbolic_build(model, batch)
        pairs = state.match(model, self._resume["arrays"], groups=("metrics",))
        with runtime_glue.scope_of(model):
            state.assign(pairs)

    # -- epochs and steps ----------------------------------------------------
    def on_epoch_begin(self, epoch, logs=None):
        resume = self._resume
        if resume is not None and epoch == resume["epoch"]:
            if resume["step"]:
                # The shuffle of this epoch is drawn after this call.
                state.restore_rng(resume["epoch_rng"])
                metrics = glue.compile_metrics(self.model)
                if metrics is None or metrics.built:
                    self._restore_metrics(self.model)
                else:  # built when the step is traced: see `_restore_metrics`
                    self._metrics_pending = True
            else:
                state.restore_rng(resume["rng"])
            if not self._skipping:
                self._resume = None
        self._epoch = epoch
        self._step_in_epoch = 0
        self._epoch_rng = state.capture_rng()

    def on_train_batch_end(self, batch, logs=None):
        if self._skipping:
            self._skipping -= 1
            self._step_in_epoch = batch + 1
            if not self._skipping:
                state.restore_rng(self._resume["rng"])
                self._resume = None
            return
        self._global_step += batch + 1 - self._step_in_epoch
        self._step_in_epoch = batch + 1
        if isinstance(self.save_freq, int) and self.save_freq is not False:
            since = self._global_step - (self._last_saved or 0)
            if since >= self.save_freq:
                self._save()
        self._check_preemption(
            agree=self._global_step % self.preemption_check_freq == 0
        )

    def on_epoch_end(self, epoch, logs=None):
        self._epoch = epoch + 1
        self._step_in_epoch = 0
        if self.save_freq == "epoch":
            self._save()
        self._check_preemption()

    def on_train_end(self, logs=None):
        if self._skipping and self._unskip is not None:
            self._unskip()  # the saved position was past this fit's end
        self._skipping = 0
        self._stop_watching()
        model = glue.callback_model(self)
        self.manager.wait(model)
        if model is not None:
            glue.set_initial_epoch(model, None)
        if self.delete_checkpoint and not self.preempted:
            self.manager.remove_all(model)

    # -- saving and preemption ----------------------------------------------
    def _save(self) -> None:
        if self._last_saved == self._global_step and self._last_saved:
            return
        extra = {}
        if self._step_in_epoch:
            extra = state.prefixed(self._epoch_rng, EPOCH_RNG_PREFIX)
        position = {
            "epoch": self._epoch,
            "step_in_epoch": self._step_in_epoch,
            "global_step": self._global_step,
            "steps_per_epoch": (self.params or {}).get("steps"),
        }
        self.manager.save(
            self.model, self._global_step, position, extra_arrays=extra
        )
        self._last_saved = self._global_step

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
        name = preemption.signal_name(received) if received else "a signal"
        where = (
            f"{self.backup_dir} at epoch {self._epoch + 1}, step "
            f"{self._step_in_epoch} (global step {self._global_step})"
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


def _log(runtime, message: str) -> None:
    if runtime is None or runtime.is_chief:
        sys.stderr.write(f"keras_dist: {message}\n")
        sys.stderr.flush()

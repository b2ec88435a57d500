"""`BackupAndRestore`'s resume: restoring a backup and skipping the
batches already trained (a mixin of the callback's restore-side methods).
"""

from __future__ import annotations

import keras

from keras_dist._src import backends as backend_lib
from keras_dist._src.checkpoint import manager as manager_lib
from keras_dist._src.checkpoint import runtime_glue, state
from keras_dist._src.checkpoint.backup_dir import _log
from keras_dist._src.keras_glue import internals as glue

#: The random states at the start of the saved epoch (its shuffle).
EPOCH_RNG_PREFIX = "epoch_begin/"
#: The random states of the input's own generators (`input_replay`).
INPUT_RNG_PREFIX = "input_rng/"


class _Resume:
    """The restore-side methods of `BackupAndRestore` (see there)."""

    def _restore(self, model, path, metadata, arrays):
        manager_lib.apply(model, arrays, metrics=False)
        position = metadata.get("position", {})
        epoch = int(position.get("epoch", 0))
        step = int(position.get("step_in_epoch", 0))
        self._global_step = int(position.get("global_step", metadata["step"]))
        self._last_saved = self._global_step
        self._last_saved_at = (epoch, step)
        self._epoch = epoch
        self.restored_from = path
        glue.set_initial_epoch(model, epoch or None)
        self._resume = {
            "epoch": epoch,
            "step": step,
            "rng": state.rng_arrays(arrays),
            "epoch_rng": state.unprefixed(arrays, EPOCH_RNG_PREFIX),
            "arrays": arrays,
            "callbacks": (metadata.get("user") or {}).get("callbacks") or {},
            "inputs": position.get("input_iterators"),
            "input_rng": state.unprefixed(arrays, INPUT_RNG_PREFIX),
        }
        saved_steps = position.get("steps_per_epoch")
        steps = self._steps()
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
            f"resuming from {path} ({self._where(epoch, step)}, global "
            f"step {self._global_step}).",
        )

    def _steps(self):
        """Steps per epoch of this fit (None while unknown)."""
        steps = (self.params or {}).get("steps")
        return int(steps) if steps else None

    def _where(self, epoch: int, step: int) -> str:
        """A position as people count it: ``at epoch 2, step 3 of 5`` or,
        at an epoch's boundary, ``after epoch 2 of 2`` (1-based)."""
        epochs = (self.params or {}).get("epochs")
        if step == 0 and epoch > 0:
            return f"after epoch {epoch}" + (f" of {epochs}" if epochs else "")
        steps = self._steps()
        return f"at epoch {epoch + 1}, step {step}" + (
            f" of {steps}" if steps else ""
        )

    def _install_skip(self, model, calls, spe):
        """The next `calls` train-function calls only consume their data."""
        original = model.train_function
        stateful = backend_lib.capabilities().stateful_train_function
        remaining = [calls]

        def skip(*args, **kwargs):
            remaining[0] -= 1
            if remaining[0] <= 0:
                model.train_function = original
            # JAX: (state, iterator); TensorFlow: (iterator,); torch:
            # (list of the call's batches, already drawn).
            data = args[1] if stateful else args[0]
            if isinstance(data, (list, tuple)):
                batches = list(data)
            elif stateful and spe > 1 and glue.keras_stacks_jax_steps():
                # Keras 3.16+ on JAX reads a call's batches as one group,
                # stacked on a new axis (a partial group as a list).
                group = next(data)
                if glue.is_partial_step_group(group):
                    batches = list(group)
                else:
                    batches = [
                        keras.tree.map_structure(
                            lambda x: None if x is None else x[0],
                            group,
                            none_is_leaf=True,
                        )
                    ]
            else:  # as Keras's step: the last call of an epoch may be short
                batches = [next(data)]
                for _ in range(spe - 1):
                    try:
                        batches.append(next(data))
                    except StopIteration:
                        break
            if remaining[0] == calls - 1 and self._metrics_pending:
                self._restore_metrics(model, batches[0])
            self._skipped_call = True
            logs = {}
            if remaining[0] <= 0:
                # The epoch may end here (every step of it was trained):
                # logs with the metrics' names make Keras report the
                # restored metrics as the epoch's logs.
                keys = self._metric_keys
                if keys is None:
                    keys = list(model.get_metrics_result())
                logs = {key: 0.0 for key in keys}
            return (logs, args[0]) if stateful else logs

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

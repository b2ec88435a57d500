"""Chief-only callbacks: what every non-chief process leaves out.

Only the chief (worker 0) prints progress and writes files; the other
processes of a job run the same `fit` without them. The same on every
backend (one process per device on torch, one per host on JAX and TF).
"""

from __future__ import annotations

import inspect

import keras
import numpy as np
from keras import tree

_CHIEF_ONLY = (
    keras.callbacks.ModelCheckpoint,
    keras.callbacks.CSVLogger,
    keras.callbacks.TensorBoard,
    keras.callbacks.ProgbarLogger,
)
#: A callback with this attribute set to True runs on every process.
ALL_RANKS_ATTR = "_keras_dist_all_ranks"


def _gate(callbacks, saving_is_collective=False) -> list:
    kept = []
    for callback in callbacks:
        if getattr(callback, ALL_RANKS_ATTR, False):
            kept.append(callback)
        elif isinstance(callback, keras.callbacks.BackupAndRestore):
            # Other ranks restore from the same backup but never write it
            # (where reading variables is a collective they make the same
            # save, which the model's wrapped save_weights discards).
            if not saving_is_collective:
                callback._save_model = lambda *a, **k: None
            callback.on_train_end = lambda *a, **k: None
            kept.append(callback)
        elif saving_is_collective and isinstance(
            callback, keras.callbacks.ModelCheckpoint
        ):
            # Its save reads variables split across processes: every rank
            # makes it; only the chief's reaches the file.
            kept.append(callback)
        elif not isinstance(callback, _CHIEF_ONLY):
            kept.append(callback)
    return kept


def gate_call_arguments(
    is_chief, method, args, kwargs, saving_is_collective=False
):
    """On ranks other than 0: no progress bar, no file-writing callbacks.

    Rewrites the arguments of `fit`/`evaluate`/`predict`: ``verbose=0`` and
    the callbacks without `ModelCheckpoint`, `CSVLogger`, `TensorBoard` and
    the progress bar; `BackupAndRestore` becomes read-only. A callback with
    ``_keras_dist_all_ranks = True`` is kept everywhere. With
    `saving_is_collective` (variables split across processes) the saving
    callbacks run everywhere: the model's wrapped saves discard all but
    the chief's file. On rank 0 the arguments are returned unchanged.
    """
    if is_chief:
        return args, kwargs
    bound = inspect.signature(method).bind(*args, **kwargs)
    arguments = bound.arguments
    if "verbose" in inspect.signature(method).parameters:
        arguments["verbose"] = 0
    callbacks = arguments.get("callbacks")
    if callbacks is not None:
        arguments["callbacks"] = _replaced(
            callbacks, _gate(_listed(callbacks), saving_is_collective)
        )
    return bound.args, bound.kwargs


def _listed(callbacks) -> list:
    """The callbacks of a `callbacks=` argument (a list, a CallbackList or
    None), as a list."""
    if isinstance(callbacks, keras.callbacks.CallbackList):
        return list(callbacks.callbacks)
    return list(tree.flatten(callbacks)) if callbacks is not None else []


def _replaced(callbacks, listed):
    """`listed` in place of `callbacks`: a new CallbackList for a list the
    user built (Keras adds no history or progress bar to one), else a
    list."""
    if isinstance(callbacks, keras.callbacks.CallbackList):
        return keras.callbacks.CallbackList(
            listed, model=callbacks.model, **(callbacks.params or {})
        )
    return listed


# -- `model.stop_training` set on some processes only ------------------------
_BATCH_HOOKS = (
    "on_batch_begin",
    "on_batch_end",
    "on_train_batch_begin",
    "on_train_batch_end",
)


def _sees_batches(callback) -> bool:
    """Whether `callback` is the user's own and runs code at each batch
    (so it may set ``stop_training`` in the middle of an epoch). Keras's
    and keras_dist's own callbacks decide from values every process sees
    alike (the reduced logs), or never stop training."""
    module = type(callback).__module__ or ""
    if module.split(".")[0] in ("keras", "keras_dist"):
        return False
    return any(
        getattr(type(callback), hook, None)
        is not getattr(keras.callbacks.Callback, hook)
        for hook in _BATCH_HOOKS
    )


class _AgreeOnStop(keras.callbacks.Callback):
    """Last of `fit`'s callbacks: at each epoch's end every process stops
    if any set ``model.stop_training`` (a callback that decides on one
    process only, from its own clock or under ``if strategy.is_chief``).
    Without it that process left the loop and the others waited for it in
    their next step's collective until the liveness timeout (JAX, torch),
    or failed with a collective type mismatch (TensorFlow)."""

    _keras_dist_all_ranks = True

    def __init__(self, runtime):
        super().__init__()
        self._runtime = runtime

    def _agree(self) -> None:
        stop = int(bool(getattr(self.model, "stop_training", False)))
        agreed = self._runtime.all_reduce(np.array([stop], np.int32), "max")
        self.model.stop_training = bool(agreed[0])

    def on_epoch_end(self, epoch, logs=None):
        self._agree()


class _AgreeOnStopEachBatch(_AgreeOnStop):
    """The same after each batch too: some process runs a callback of the
    user's at each batch (one collective a step; Keras then runs the
    callbacks synchronously, as it does for such a callback anyway)."""

    def on_train_batch_end(self, batch, logs=None):
        self._agree()


def add_stop_agreement(method, args, kwargs, runtime):
    """Appends the callback that makes every process of a job agree on
    ``model.stop_training`` to a `fit` call's callbacks (every process
    calls this: it makes one collective, on whether any process runs a
    per-batch callback of the user's)."""
    bound = inspect.signature(method).bind(*args, **kwargs)
    arguments = bound.arguments
    callbacks = arguments.get("callbacks")
    listed = _listed(callbacks)
    wanted = int(any(_sees_batches(c) for c in listed))
    each_batch = runtime.all_reduce(np.array([wanted], np.int32), "max")[0]
    agree = (_AgreeOnStopEachBatch if each_batch else _AgreeOnStop)(runtime)
    arguments["callbacks"] = _replaced(callbacks, [*listed, agree])
    return bound.args, bound.kwargs

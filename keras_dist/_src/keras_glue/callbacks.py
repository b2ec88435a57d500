"""Chief-only callbacks: what every non-chief process leaves out.

Only the chief (worker 0) prints progress and writes files; the other
processes of a job run the same `fit` without them. The same on every
backend (one process per device on torch, one per host on JAX and TF).
"""

from __future__ import annotations

import inspect

import keras
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
    if isinstance(callbacks, keras.callbacks.CallbackList):
        # A list the user built: a new one without the chief-only entries
        # (Keras adds no history or progress bar to a CallbackList).
        arguments["callbacks"] = keras.callbacks.CallbackList(
            _gate(callbacks.callbacks, saving_is_collective),
            model=callbacks.model,
            **(callbacks.params or {}),
        )
    elif callbacks is not None:
        arguments["callbacks"] = _gate(
            tree.flatten(callbacks), saving_is_collective
        )
    return bound.args, bound.kwargs

"""The state of Keras's own callbacks that a `BackupAndRestore` resume
restores (their counters, bests and EarlyStopping's best weights)."""

from __future__ import annotations

import keras
import numpy as np

CALLBACK_PREFIX = "callbacks/"
#: Keras callbacks whose state a resume restores, by the attributes that
#: hold it (Keras resets them in `on_train_begin`; a resumed run would
#: otherwise stop, or reduce the learning rate, later than an
#: uninterrupted one). EarlyStopping's `best_weights` go with them.
CALLBACK_STATE = (
    (
        keras.callbacks.EarlyStopping,
        ("wait", "stopped_epoch", "best", "best_epoch"),
    ),
    (keras.callbacks.ReduceLROnPlateau, ("wait", "best", "cooldown_counter")),
    (keras.callbacks.ModelCheckpoint, ("best",)),
)


def _stateful(callbacks):
    """(key, callback, attribute names) of the callbacks whose state a
    resume restores; the key counts callbacks of one kind in list order."""
    counts = {}
    for callback in callbacks:
        for kind, names in CALLBACK_STATE:
            if isinstance(callback, kind):
                index = counts.get(kind.__name__, 0)
                counts[kind.__name__] = index + 1
                yield f"{kind.__name__}/{index}", callback, names
                break


def _plain(value):
    """`value` as a JSON number (or None, a bool); `...` when it is not one
    (not saved)."""
    if value is None or isinstance(value, bool):
        return value
    if isinstance(value, (int, np.integer)):
        return int(value)
    if isinstance(value, (float, np.floating)):
        return float(value)
    try:  # a 0-d array or a backend's scalar tensor
        array = np.asarray(value)
    except Exception:
        return ...
    if array.shape == () and array.dtype.kind in "biuf":
        return _plain(array.item())
    return ...


def _callback_states(callbacks):
    """({key: {attribute: value}}, {array key: array}) of `callbacks`."""
    scalars, arrays = {}, {}
    for key, callback, names in _stateful(callbacks):
        values = {}
        for name in names:
            value = _plain(getattr(callback, name, ...))
            if value is not ...:
                values[name] = value
        scalars[key] = values
        weights = getattr(callback, "best_weights", None)
        if isinstance(callback, keras.callbacks.EarlyStopping) and weights:
            for i, weight in enumerate(weights):
                name = f"{CALLBACK_PREFIX}{key}/best_weights/{i:05d}"
                arrays[name] = np.asarray(weight)
    return scalars, arrays


def _set_callback_states(callbacks, scalars, arrays) -> None:
    """Gives `callbacks` the state `_callback_states` saved."""
    for key, callback, _ in _stateful(callbacks):
        for name, value in (scalars.get(key) or {}).items():
            setattr(callback, name, value)
        prefix = f"{CALLBACK_PREFIX}{key}/best_weights/"
        weights = sorted(
            (k, v) for k, v in arrays.items() if k.startswith(prefix)
        )
        if weights and isinstance(callback, keras.callbacks.EarlyStopping):
            callback.best_weights = [np.asarray(v) for _, v in weights]

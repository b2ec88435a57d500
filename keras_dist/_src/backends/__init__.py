"""Chooses the backend module once, from `keras.backend.backend()`."""

from __future__ import annotations

import importlib

import keras

from keras_dist._src.errors import UnsupportedBackendError

_MODULES = {
    "jax": "keras_dist._src.backends.jax",
    "tensorflow": "keras_dist._src.backends.tensorflow",
    "torch": "keras_dist._src.backends.torch",
}
_loaded = None


def name() -> str:
    """Returns the name of the active Keras backend."""
    return keras.backend.backend()


def get():
    """Returns the backend module for the active Keras backend.

    Raises:
        UnsupportedBackendError: for a Keras backend keras_dist cannot drive.
    """
    global _loaded
    if _loaded is None:
        backend = name()
        if backend not in _MODULES:
            raise UnsupportedBackendError(
                f"keras_dist does not support KERAS_BACKEND={backend!r}. "
                f"Set KERAS_BACKEND to one of {sorted(_MODULES)}."
            )
        _loaded = importlib.import_module(_MODULES[backend])
    return _loaded


def capabilities():
    """What the active backend declares of itself (its `CAPABILITIES`,
    a `contract.Capabilities`); the defaults for a Keras backend keras_dist
    cannot drive (nothing to declare)."""
    if name() not in _MODULES:
        from keras_dist._src.backends.capability import Capabilities

        return Capabilities()
    return get().CAPABILITIES


def refuse_unsupported(plan_type: type) -> None:
    """Raises the active backend's own error for `plan_type` when the
    backend refuses such plans (its `CAPABILITIES.refused_plans`), before
    any runtime or process starts.

    Raises:
        UnsupportedBackendError: from the backend's `ENGINES` entry, or
            for a Keras backend keras_dist cannot drive.
    """
    module = get()
    if plan_type in module.CAPABILITIES.refused_plans:
        module.ENGINES[plan_type](None, None, None)


def dispatch(engines: dict, plan, runtime, input_options):
    """Builds the engine a backend registers for `plan`'s type.

    `engines` maps plan types to factories ``(plan, runtime,
    input_options) -> Engine``; a plan type's nearest registered base
    applies.

    Raises:
        UnsupportedBackendError: when the backend has no engine for it.
    """
    for cls in type(plan).__mro__:
        if cls in engines:
            return engines[cls](plan, runtime, input_options)
    raise UnsupportedBackendError(
        f"The {name()} backend has no engine for {type(plan).__name__}. "
        f"It runs: {sorted(c.__name__ for c in engines)}."
    )

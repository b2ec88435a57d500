"""What checkpointing needs from the rest of keras_dist, in one place.

The model's strategy (if any), its `Runtime` (chief, barrier, broadcast,
all-reduce) and a description of its shape for the metadata. Plain Keras
models (no strategy) get a one-process runtime.
"""

from __future__ import annotations

import contextlib


def strategy_of(model):
    """The keras_dist strategy `model` is attached to, or None."""
    if model is None:
        return None
    try:
        from keras_dist._src.keras_glue.hook import strategy_of as find
    except ImportError:  # pragma: no cover - during a refactoring
        return None
    return find(model)


def runtime_of(model=None):
    """The `Runtime` of `model`'s strategy (or the active one), else local."""
    from keras_dist._src import runtime

    try:
        return runtime.runtime_of(model)
    except (AttributeError, ImportError):
        return runtime.LocalRuntime()


def scope_of(model):
    """The scope of `model`'s strategy (a no-op context without one)."""
    strategy = strategy_of(model)
    return (
        strategy.scope() if strategy is not None else contextlib.nullcontext()
    )


def lay_out(model) -> None:
    """Gives the variables created after `model` was attached (an
    optimizer built for a restore) their layout now, where the strategy's
    engine places variables itself (torch's DTensor variables): so that a
    restore reads, and each process holds, only its own parts. Engines
    whose variables take their layout when created (JAX, TensorFlow) have
    nothing to do."""
    strategy = strategy_of(model)
    if strategy is not None:
        strategy.extended.lay_out(model)


def describe(model, runtime) -> dict:
    """The strategy's shape: class, replicas, processes and devices."""
    strategy = strategy_of(model)
    info = {
        "strategy": type(strategy).__name__ if strategy else None,
        "num_replicas_in_sync": 1,
        "world_size": int(runtime.world_size),
        "devices": [],
    }
    if strategy is not None:
        info["num_replicas_in_sync"] = int(strategy.num_replicas_in_sync)
        info["devices"] = [str(d) for d in strategy.devices]
    return info

"""Which strategy scope and which model call are active on this thread.

Kept apart from the front end so that the Keras glue and the backends can
ask without importing `strategy` (no import circles).
"""

from __future__ import annotations

import threading

_state = threading.local()


def strategy_stack() -> list:
    """The strategies whose scopes are open on this thread, innermost last."""
    if not hasattr(_state, "stack"):
        _state.stack = []
    return _state.stack


def call_stack() -> list:
    """Names of the attached-model calls in progress, innermost last."""
    if not hasattr(_state, "calls"):
        _state.calls = []
    return _state.calls


def current_strategy():
    """Returns the active strategy, or None outside every scope."""
    stack = strategy_stack()
    return stack[-1] if stack else None


def current_call() -> str | None:
    """Name of the innermost `fit`/`evaluate`/`predict`/`*_on_batch` call of
    an attached model in progress on this thread, or None."""
    calls = call_stack()
    return calls[-1] if calls else None


def default_strategy():
    """The strategy used outside every scope (created once per thread)."""
    return getattr(_state, "default", None)


def set_default_strategy(strategy) -> None:
    """Remembers the default strategy of this thread."""
    _state.default = strategy


_default_factory = None


def set_default_factory(factory) -> None:
    """Registers what `get_strategy` builds outside every scope (the
    strategies package registers `OneDeviceStrategy`), so that the front
    end needs no import of the concrete strategies."""
    global _default_factory
    _default_factory = factory


def default_factory():
    """The registered factory of the default strategy."""
    return _default_factory

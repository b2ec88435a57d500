"""Typed errors raised by keras_dist: each says what went wrong, what to do."""


class KerasDistError(RuntimeError):
    """Base class of every error keras_dist raises on purpose."""


class DevicesAlreadyInitializedError(KerasDistError):
    """Simulated devices were requested after the backend had started."""


class UnsupportedBackendError(KerasDistError, NotImplementedError):
    """The strategy cannot run under the active Keras backend."""


class StrategyMixingError(KerasDistError, ValueError):
    """Two different strategies were mixed (nested scopes, foreign model)."""


class VariablesOutsideScopeError(KerasDistError, ValueError):
    """A model's variables were created outside the strategy's scope."""


class LayoutError(KerasDistError, ValueError):
    """A mesh, layout map or layout that cannot hold (unknown axis, a
    dimension its axes do not divide, a key that matches no variable)."""


class TPUNotFoundError(KerasDistError):
    """No TPU could be reached (none attached, a wrong name or address, no
    TPU runtime installed): the one error `TPUStrategy` raises for it."""

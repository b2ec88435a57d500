"""The one place where keras_dist meets the Keras trainer.

Keras has no per-model extension point that fires when a model is compiled,
so keras_dist wraps `keras.src.trainers.trainer.Trainer.compile` once (when
the first strategy is created). The wrapper calls Keras's own `compile` and,
only when a keras_dist scope is active, attaches the model to that strategy:

* the backend engine validates the model's variables and replaces the
  model's step functions with replicated ones (``Engine.attach``);
* the model's own ``fit``/``evaluate``/``predict``/``*_on_batch`` are
  wrapped (on the instance, not the class) so that they run inside the
  engine's call scope, with arguments the engine may adjust
  (``Engine.prepare_call``: e.g. no progress bar on non-chief ranks).

A model compiled outside every scope is not touched, unless its variables
were created in a keras_dist scope: then compiling it there is refused with a
clear error (it would not train replicated). If a Keras release moves
`Trainer.compile`, this file is the one that breaks.
"""

from __future__ import annotations

import functools

from keras_dist._src.context import current_strategy
from keras_dist._src.core.inputs import check_call_inputs

_WRAPPED_METHODS = (
    "fit",
    "evaluate",
    "predict",
    "train_on_batch",
    "test_on_batch",
    "predict_on_batch",
)
_installed = False
STRATEGY_ATTR = "_keras_dist_strategy"


def install() -> None:
    """Wraps `Trainer.compile` once; idempotent."""
    global _installed
    if _installed:
        return
    from keras.src.trainers.trainer import Trainer

    original = Trainer.compile

    @functools.wraps(original)
    def compile(self, *args, **kwargs):
        result = original(self, *args, **kwargs)
        strategy = current_strategy()
        if strategy is not None:
            attach(self, strategy)
        elif strategy_of(self) is None:
            _refuse_distributed_model_outside_scope(self)
        return result

    compile.__keras_dist_original__ = original
    Trainer.compile = compile
    _installed = True


def _refuse_distributed_model_outside_scope(model) -> None:
    from keras_dist._src import backends as backend_lib
    from keras_dist._src.errors import StrategyMixingError

    if backend_lib.get().variables_distributed(model):
        raise StrategyMixingError(
            f"Model {model.name!r} was built inside a strategy's scope but "
            "compiled outside it, so it would not train replicated. Call "
            "`model.compile(...)` inside the same `with strategy.scope():`."
        )


def strategy_of(model):
    """Returns the strategy `model` is attached to, or None."""
    return model.__dict__.get(STRATEGY_ATTR)


def attach(model, strategy) -> None:
    """Makes `model` train replicated under `strategy`.

    Raises:
        StrategyMixingError: if `model` is attached to another strategy.
    """
    from keras_dist._src.errors import StrategyMixingError

    previous = strategy_of(model)
    if previous is not None and previous is not strategy:
        raise StrategyMixingError(
            f"Model {model.name!r} was compiled under {previous!r} and cannot "
            f"be re-compiled under {strategy!r}. Build a new model inside "
            "the new strategy's scope."
        )
    strategy.extended.attach(model)
    model.__dict__[STRATEGY_ATTR] = strategy
    for name in _WRAPPED_METHODS:
        bound = getattr(type(model), name).__get__(model)
        model.__dict__[name] = _in_scope(bound, strategy, name)


def _in_scope(method, strategy, name):
    engine = strategy.extended

    @functools.wraps(method)
    def wrapper(*args, **kwargs):
        check_call_inputs(name, method, args, kwargs)
        with strategy._call_scope(name):
            args, kwargs = engine.prepare_call(name, method, args, kwargs)
            try:
                return method(*args, **kwargs)
            except StopIteration as error:
                # Keras lets StopIteration escape when the input yields no
                # batch at all (an empty generator or dataset).
                raise ValueError(
                    f"`{name}` got an input that yielded no batch. Pass a "
                    "non-empty input (check the data source and filters)."
                ) from error

    wrapper.__keras_dist_wrapped__ = True
    return wrapper

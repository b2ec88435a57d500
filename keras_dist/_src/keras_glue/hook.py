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
  (``Engine.prepare_call``: e.g. no progress bar on non-chief ranks);
* the model's ``save``/``save_weights``/``export`` are wrapped so that a job
  of several processes writes each file once: the chief writes, the other
  processes skip the write and wait until the file is complete (see
  `_chief_writes`).

A model compiled outside every scope is not touched, unless its variables
were created in a keras_dist scope: then compiling it there is refused with a
clear error (it would not train replicated). If a Keras release moves
`Trainer.compile`, this file is the one that breaks.
"""

from __future__ import annotations

import functools
import itertools

from keras_dist._src.cluster import supervision
from keras_dist._src.context import current_strategy
from keras_dist._src.core.inputs import check_call_inputs
from keras_dist._src.keras_glue.callbacks import (
    add_stop_agreement,
    gate_call_arguments,
)
from keras_dist._src.keras_glue.progress import add_progress_report

_WRAPPED_METHODS = (
    "fit",
    "evaluate",
    "predict",
    "train_on_batch",
    "test_on_batch",
    "predict_on_batch",
)
# Methods that write a file: in a job of several processes only the chief
# writes, the others wait for it (one process: Keras's own method).
_WRITE_METHODS = ("save", "save_weights", "export")
_installed = False
STRATEGY_ATTR = "_keras_dist_strategy"


def install() -> None:
    """Wraps `Trainer.compile` once; idempotent."""
    global _installed
    if _installed:
        return
    from keras_dist._src.keras_glue.internals import base_trainer_class

    Trainer = base_trainer_class()
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
    _mark_variables_created_in_scope()
    _installed = True


VARIABLE_SCOPE_ATTR = "_keras_dist_created_in"


def _mark_variables_created_in_scope() -> None:
    """Records on each Keras variable the strategy whose scope (or call) was
    active when it was created (`created_in`), so that a backend whose
    variables carry no placement (torch) can tell a model built in a scope
    and compiled outside it."""
    from keras.src.backend.common.variables import Variable as KerasVariable

    original = KerasVariable.__init__

    @functools.wraps(original)
    def __init__(self, *args, **kwargs):
        original(self, *args, **kwargs)
        strategy = current_strategy()
        if strategy is not None:
            self.__dict__[VARIABLE_SCOPE_ATTR] = strategy

    __init__.__keras_dist_original__ = original
    KerasVariable.__init__ = __init__


def created_in(variable):
    """The strategy in whose scope `variable` was created, or None."""
    return getattr(variable, "__dict__", {}).get(VARIABLE_SCOPE_ATTR)


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
    # An engine may run some of these calls itself (ParameterServerStrategy
    # owns the coordinator loop of `fit`): its `model_methods`.
    own = strategy.extended.model_methods
    own = own(model) if own is not None else {}
    for name in _WRAPPED_METHODS:
        bound = own.get(name) or getattr(type(model), name).__get__(model)
        model.__dict__[name] = _in_scope(bound, strategy, name)
    for name in _WRITE_METHODS:
        bound = getattr(type(model), name, None)
        if bound is not None:
            model.__dict__[name] = _chief_writes(
                bound.__get__(model), strategy, name
            )


def reads_collectively(strategy) -> bool:
    """Whether reading the variables of `strategy`'s models needs every
    process: a job of several processes whose plan splits variables
    across them (ModelParallel, ShardedDataParallel)."""
    from keras_dist._src.plan import ReplicatedPlan

    return strategy.runtime.world_size > 1 and not isinstance(
        strategy.plan, ReplicatedPlan
    )


# This process's file writes outside fit/evaluate/predict, numbered: the
# n-th on every process pairs with the chief's n-th (`_chief_writes`).
_WRITES = itertools.count(1)


def _chief_writes(method, strategy, name):
    """Wraps a file-writing method so that every process may call it.

    Outside `fit`/`evaluate`/`predict` (what a user writes after training,
    on every process): the chief writes and publishes the outcome in the
    job's key-value store, and every other process waits for it there, so
    every process returns once the file is complete, and all raise if the
    chief's write failed. That is no collective: a save on the chief alone
    (``if strategy.is_chief: model.save(...)``, torch's ``rank == 0``
    idiom) works too. A process's n-th such write (of any model) pairs
    with the chief's n-th (the paths may differ: tf.distribute's tutorial
    has the other workers write elsewhere). Without a key-value store the
    outcome is broadcast (every process must call). Inside such a call (a
    callback: some run on the chief only, e.g. `ModelCheckpoint` on torch)
    nothing is exchanged, since the other processes may not be calling:
    the chief writes and the others skip.

    Where variables are split across processes, reading them is a
    collective: every process then runs the same save (the callbacks that
    save run on every process too), the chief into the file and the others
    into a temporary directory that is removed at once, so that every
    process makes the same reads in the same order.
    """
    import inspect
    import os
    import shutil
    import tempfile
    import time

    from keras_dist._src.errors import KerasDistError

    def elsewhere(args, kwargs):
        """Calls `method` with its file path moved to a temporary dir."""
        bound = inspect.signature(method).bind(*args, **kwargs)
        path = os.fspath(bound.arguments["filepath"])
        directory = tempfile.mkdtemp(prefix="keras_dist_discard_")
        try:
            bound.arguments["filepath"] = os.path.join(
                directory, os.path.basename(path.rstrip("/")) or "file"
            )
            method(*bound.args, **bound.kwargs)
        finally:
            shutil.rmtree(directory, ignore_errors=True)

    def chief_failed(reason):
        """The error every other process raises for the chief's failure."""
        return KerasDistError(
            f"`model.{name}` failed on the chief (process 0), which writes "
            f"the file: {reason}"
        )

    def published(args, kwargs):
        """The chief's write, its outcome published; the others wait."""
        from keras_dist._src.cluster.supervision import liveness_timeout

        runtime = strategy.runtime
        bound = inspect.signature(method).bind(*args, **kwargs)
        path = os.fspath(bound.arguments["filepath"])
        key = f"keras_dist/write/{next(_WRITES)}"
        if runtime.is_chief:
            try:
                result = method(*args, **kwargs)
            except Exception as error:
                runtime.publish(key, f"failed: {type(error).__name__}: {error}")
                raise
            runtime.publish(key, "ok")
            return result
        seconds = liveness_timeout()
        start = time.monotonic()
        outcome = runtime.wait_for(key, seconds)
        if outcome is None and time.monotonic() - start < seconds - 1:
            raise KerasDistError(
                f"`model.{name}({path!r})` lost the job's store before the "
                "chief (process 0) said whether it wrote that file: the "
                "chief's process, which hosts the store, died or exited."
            )
        if outcome is None:
            raise KerasDistError(
                f"`model.{name}({path!r})` waited {seconds} s for the chief "
                "(process 0) to write that file, and it did not. Call it "
                "on every process, or on the chief alone (`if "
                "strategy.is_chief:`), not on the other processes alone."
            )
        if outcome != "ok":
            raise chief_failed(outcome[len("failed: ") :])
        return None

    @functools.wraps(method)
    def wrapper(*args, **kwargs):
        runtime = strategy.runtime
        if runtime.world_size <= 1:
            return method(*args, **kwargs)
        from keras_dist._src.context import current_call

        collective = reads_collectively(strategy)
        if current_call() is not None:
            if runtime.is_chief:
                return method(*args, **kwargs)
            if collective:
                elsewhere(args, kwargs)
            return None
        if not collective and runtime.has_key_values:
            return published(args, kwargs)
        if runtime.has_key_values:
            # A collective read on some processes only (`if
            # strategy.is_chief:`) would wait for the others in it.
            supervision.agree_on_call(
                runtime,
                name,
                f"Under {type(strategy).__name__}, `model.{name}` reads "
                "variables split over the processes: call it on every "
                "process (the chief writes the file), not under `if "
                "strategy.is_chief:`.",
            )
        result, error = None, None
        try:
            if runtime.is_chief:
                result = method(*args, **kwargs)
            elif collective:
                elsewhere(args, kwargs)
        except Exception as caught:  # noqa: BLE001 - re-raised below.
            error = caught
        failure = runtime.broadcast(
            ""
            if error is None or not runtime.is_chief
            else f"{type(error).__name__}: {error}",
            0,
        )
        if error is not None:
            raise error
        if failure:
            raise chief_failed(failure)
        return result

    wrapper.__keras_dist_wrapped__ = True
    return wrapper


def _in_scope(method, strategy, name):
    engine = strategy.extended

    @functools.wraps(method)
    def wrapper(*args, **kwargs):
        check_call_inputs(name, method, args, kwargs)
        from keras_dist._src.context import current_call

        runtime = strategy.runtime
        top = current_call() is None
        outer = top and runtime.world_size > 1
        if outer and runtime.has_key_values:
            supervision.agree_on_call(runtime, name)
        with strategy._call_scope(name):
            strategy._announce(name, method, args, kwargs)  # once
            args, kwargs = engine.prepare_call(name, method, args, kwargs)
            # After the engine's own look at the caller's arguments (which
            # must be the same on every process).
            args, kwargs = gate_call_arguments(
                strategy.is_chief,
                method,
                args,
                kwargs,
                saving_is_collective=reads_collectively(strategy),
            )
            if name == "fit" and top:
                # Before the stop agreement's collective: a rank stuck in
                # a callback is then the one whose report is behind.
                args, kwargs = add_progress_report(
                    method, args, kwargs, runtime.rank
                )
            if name == "fit" and outer:
                args, kwargs = add_stop_agreement(method, args, kwargs, runtime)
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

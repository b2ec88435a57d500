"""Exact metrics across ranks: the all-reduce of metric updates.

Each rank updates its model's metric variables with its own shard of a
step. `MetricSync` makes them exact by all-reducing, in one collective,
how much every metric variable changed since a snapshot (numerators and
denominators add up), so logs equal single-device ones on every rank. When
nothing reads the values after each step (`reads_batch_logs`), that
all-reduce waits until Keras reads them (`get_metrics_result`, at the end
of an epoch or an evaluation) and covers every step since.
"""

from __future__ import annotations

import inspect

import keras
import torch
import torch.distributed as dist

from keras_dist._src.keras_glue import internals as glue

_BATCH_HOOKS = {
    "fit": ("on_train_batch_begin", "on_train_batch_end"),
    "evaluate": ("on_test_batch_begin", "on_test_batch_end"),
}


def _implements(callback, hook) -> bool:
    # Keras marks its no-op hooks (as its CallbackList does to skip batch
    # hooks); anything else counts as implemented.
    method = getattr(callback, hook, None)
    return method is not None and not glue.is_default_callback_hook(method)


def reads_batch_logs(name, method, args, kwargs) -> bool:
    """Whether a `fit`/`evaluate` call reads metric values after each step.

    True when the progress bar updates every step (``verbose`` 1 or
    ``"auto"``, except in `fit`'s validation) or a callback other than
    `History` and the progress bar implements a batch hook (``on_batch_*``
    included). When False, keras_dist all-reduces metric updates once, when
    the values are read at the end of the epoch, instead of after every
    step. Computed from the caller's arguments, so it is the same on every
    rank.
    """
    hooks = _BATCH_HOOKS.get(name)
    if hooks is None:
        return True
    arguments = inspect.signature(method).bind(*args, **kwargs).arguments
    callbacks = arguments.get("callbacks") or []
    quiet = (keras.callbacks.History, keras.callbacks.ProgbarLogger)
    if isinstance(callbacks, keras.callbacks.CallbackList):
        if not glue.is_fit_validation(arguments.get("kwargs", {})):
            quiet = (keras.callbacks.History,)  # a caller's own list
        # In `fit`'s validation, fit's progress bar ignores the steps.
        callbacks = callbacks.callbacks
    elif arguments.get("verbose", "auto") in ("auto", 1):
        return True
    return _any_batch_hook(callbacks, hooks, quiet)


def validation_reads_batch_logs(method, args, kwargs) -> bool:
    """Whether `fit`'s validation (the `evaluate` Keras calls inside `fit`)
    reads metric values after each step, decided on `fit`'s own arguments.

    That `evaluate` gets `fit`'s callbacks, and on ranks other than 0 those
    are already without the chief-only ones (`TensorBoard`, `CSVLogger`,
    ...): deciding there would differ between ranks, and their
    collectives would not match. So the decision is made once, from the
    caller's callbacks of `fit` (the progress bar ignores validation steps).
    """
    arguments = inspect.signature(method).bind(*args, **kwargs).arguments
    callbacks = arguments.get("callbacks") or []
    if isinstance(callbacks, keras.callbacks.CallbackList):
        callbacks = callbacks.callbacks
    quiet = (keras.callbacks.History, keras.callbacks.ProgbarLogger)
    return _any_batch_hook(callbacks, _BATCH_HOOKS["evaluate"], quiet)


def is_fit_validation_call(method, args, kwargs) -> bool:
    """Whether an `evaluate` call is `fit`'s validation."""
    arguments = inspect.signature(method).bind(*args, **kwargs).arguments
    return bool(glue.is_fit_validation(arguments.get("kwargs", {})))


def _any_batch_hook(callbacks, hooks, quiet) -> bool:
    """Whether a callback of `callbacks` (not of the `quiet` types)
    implements one of `hooks` or ``on_batch_*``."""
    hooks = (*hooks, "on_batch_begin", "on_batch_end")
    return any(
        _implements(callback, hook)
        for callback in keras.tree.flatten(callbacks)
        if not isinstance(callback, quiet)
        for hook in hooks
    )


def metric_snapshot(variables):
    """The values of `variables` as one float64 vector (None if none)."""
    if not variables:
        return None
    with torch.no_grad():
        return torch.cat(
            [v.value.detach().reshape(-1).to(torch.float64) for v in variables]
        )


def _write(variables, flat) -> None:
    offset = 0
    for v in variables:
        t = v.value
        n = t.numel()
        t.copy_(flat[offset : offset + n].view_as(t).to(t.dtype))
        offset += n


def all_reduce_metric_deltas(group, variables, before) -> None:
    """Adds up, across ranks (over `group`), each metric variable's change
    since `before` (a `metric_snapshot`)."""
    if before is None:
        return
    with torch.no_grad():
        after = metric_snapshot(variables)
        delta = after - before
        dist.all_reduce(delta, group=group)
        _write(variables, before + delta)


class MetricSync:
    """The metric all-reduce of one model, now or deferred.

    Args:
        engine: the rank's engine (its `aux_group` and
            `defer_metric_sync`).
        model: the model whose metrics are made exact.
    """

    def __init__(self, engine, model):
        self.engine = engine
        self.model = model
        # Metric values before the first step whose all-reduce is deferred.
        self._unsynced_since = None
        self._in_step = False
        # While a user's step runs: its metric baselines ("before": the
        # snapshot its updates count from; "base": the values to restore
        # on a stand-in sample of an empty shard, else None).
        self.user_step = None

    def install(self) -> None:
        """Replaces the model's metric reads and resets (on the instance)."""
        model = self.model
        cls = type(model)

        def get_metrics_result():
            # Keras's `compute_metrics` reads the values inside the step:
            # those reads stay local (a rank with no samples skips them),
            # except in a user's step, which every rank runs alike.
            if self.user_step is not None:
                self.sync_in_user_step()
            elif not self._in_step:
                self.sync()
            return glue.torch_local_metrics_result(model)

        def reset_metrics():
            self._unsynced_since = None
            self._in_step = False  # in case a step raised
            cls.reset_metrics(model)

        get_metrics_result.__doc__ = cls.get_metrics_result.__doc__
        reset_metrics.__doc__ = cls.reset_metrics.__doc__
        model.__dict__["get_metrics_result"] = get_metrics_result
        model.__dict__["reset_metrics"] = reset_metrics

    def variables(self) -> list:
        """The model's metric variables."""
        return list(self.model.metrics_variables)

    def local_result(self):
        """This rank's metric results as they are (no all-reduce)."""
        return glue.torch_local_metrics_result(self.model)

    def before_step(self):
        """Snapshot of the metric variables before a step, unless the one
        taken before an earlier, still unsynced step covers it."""
        self._in_step = True
        if self._unsynced_since is not None:
            return None
        return metric_snapshot(self.variables())

    def after_step(self, before, now=False) -> None:
        """Sums the metric updates over ranks now, or defers that.

        `now`: always now (a user's step: Keras may keep its returned logs
        instead of reading the metrics at the end, so they must be global).
        """
        self._in_step = False
        if self._unsynced_since is None:
            self._unsynced_since = before
        if now or not self.engine.defer_metric_sync:
            self.sync()

    def sync(self) -> None:
        """All-reduces the metric updates deferred since the last read.

        Called (on every rank alike) when Keras reads the metric values at
        the end of an epoch or an evaluation.
        """
        if self._unsynced_since is None:
            return
        before, self._unsynced_since = self._unsynced_since, None
        all_reduce_metric_deltas(
            self.engine.aux_group, self.variables(), before
        )

    def restore(self, snapshot) -> None:
        """Sets the metric variables back to `snapshot`."""
        if snapshot is None:
            return
        with torch.no_grad():
            _write(self.variables(), snapshot)

    def sync_in_user_step(self) -> None:
        """A read inside a user's step: its updates so far, summed over
        ranks (a stand-in's undone first); later ones count from here."""
        state = self.user_step
        if state["base"] is not None:
            self.restore(state["base"])
        if self._unsynced_since is None:
            self._unsynced_since = state["before"]
        self.sync()
        state["before"] = metric_snapshot(self.variables())
        if state["base"] is not None:
            state["base"] = state["before"]

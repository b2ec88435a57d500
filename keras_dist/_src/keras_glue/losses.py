"""Losses a model adds itself: the one kind a sharded step cannot make exact.

A term added with `add_loss` may be a mean over the batch (exact when each
replica's loss is weighted by its share of the global batch) or a sum
(about 1/N of one device's); the two cannot be told apart, so keras_dist
warns once per model. Weight and activity regularizers are exact and do not
warn.
"""

from __future__ import annotations

import threading
import warnings

from keras_dist._src.patching import InstancePatches


class watch_user_losses:  # noqa: N801 - used as a context manager
    """Whether the forward pass adds losses other than regularizers.

    Records `add_loss` calls that do not come from a layer's activity
    regularizer (which Keras calls, then divides by the batch size, then
    adds): those are the user's own, of unknown kind (a mean over the batch
    or a sum). Only while it is active: when the step is traced (TF) or
    for the first step (torch), since the patches are Python.

    tf.distribute traces each replica's forward pass in its own thread and
    switches threads at every collective (a synchronised BatchNorm's), so
    the watches of a model's replicas overlap: they share one set of
    patches, made by the first to enter and undone by the last to leave,
    and one record (a term found by any replica is found).
    """

    def __init__(self, model):
        self._model = model
        self._watch = None

    @property
    def found(self) -> bool:
        """Whether a user's own `add_loss` term was added."""
        return self._watch is not None and self._watch.found

    @property
    def layers(self) -> list:
        """The names of the layers that added such terms."""
        return [] if self._watch is None else list(self._watch.layers)

    def __enter__(self):
        model = self._model
        if model.__dict__.get("_keras_dist_add_loss_warned"):
            return self
        with _WATCHES_LOCK:
            watch = _WATCHES.get(id(model))
            if watch is None:
                watch = _WATCHES[id(model)] = _Watch(model)
            watch.users += 1
        self._watch = watch
        return self

    def __exit__(self, *exc):
        watch = self._watch
        if watch is None:
            return False
        with _WATCHES_LOCK:
            watch.users -= 1
            if watch.users:
                return False
            del _WATCHES[id(self._model)]
        watch.patches.restore()
        return False


_WATCHES_LOCK = threading.Lock()
_WATCHES = {}  # id(model) -> its _Watch while one is active


class _Watch:
    """The patches of one model's layers that record user `add_loss` terms."""

    def __init__(self, model):
        self.users = 0
        self.found = False
        self.layers = []  # names of the layers that added them
        self.patches = InstancePatches()
        for layer in model._flatten_layers(include_self=True):
            state = {"regularizing": False}
            original_add = layer.add_loss

            def add_loss(
                loss, state=state, original_add=original_add, name=layer.name
            ):
                if state["regularizing"]:
                    state["regularizing"] = False
                else:
                    self.found = True
                    if name not in self.layers:
                        self.layers.append(name)
                return original_add(loss)

            self.patches.set(layer, "add_loss", add_loss)
            regularizer = layer.activity_regularizer
            if regularizer is not None:

                def regularize(x, state=state, regularizer=regularizer):
                    state["regularizing"] = True
                    return regularizer(x)

                self.patches.set(layer, "activity_regularizer", regularize)


def warn_user_losses(model, layers=()) -> None:
    """Warns once per model that its own `add_loss` terms may not equal
    one device's under a multi-replica strategy.

    Args:
        model: the model.
        layers: names of the layers that added the terms (named in the
            warning).
    """
    if model.__dict__.get("_keras_dist_add_loss_warned"):
        return
    model.__dict__["_keras_dist_add_loss_warned"] = True
    named = f" (layers {', '.join(map(repr, layers))})" if layers else ""
    warnings.warn(
        f"Model {model.name!r} adds losses with `add_loss`{named}, other "
        "than weight and activity regularizers. Under a keras_dist strategy "
        "with several replicas each replica's loss, `add_loss` values "
        "included, is weighted by its share of the global batch: exact for "
        "a loss that is a mean over the batch, but a loss that sums over the "
        "batch "
        "(or counts batch-size-dependent terms) comes out smaller than on "
        "one device (roughly divided by the replica count), and training "
        "may differ from one device. Make such losses means over the batch, "
        "or compute them in an overridden `compute_loss` as a mean.",
        stacklevel=2,
    )

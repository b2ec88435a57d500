"""Losses a model adds itself: the one kind a sharded step cannot make exact.

A term added with `add_loss` may be a mean over the batch (exact when each
replica's loss is weighted by its share of the global batch) or a sum
(about 1/N of one device's); the two cannot be told apart, so keras_dist
warns once per model. Weight and activity regularizers are exact and do not
warn.
"""

from __future__ import annotations

import warnings

from keras_dist._src.patching import InstancePatches


class watch_user_losses:  # noqa: N801 - used as a context manager
    """Whether the forward pass adds losses other than regularizers.

    Records `add_loss` calls that do not come from a layer's activity
    regularizer (which Keras calls, then divides by the batch size, then
    adds): those are the user's own, of unknown kind (a mean over the batch
    or a sum). Only while it is active: when the step is traced (TF) or
    for the first step (torch), since the patches are Python.
    """

    def __init__(self, model):
        self._model = model
        self.found = False
        self.layers = []  # names of the layers that added them

    def __enter__(self):
        self._patches = InstancePatches()
        if self._model.__dict__.get("_keras_dist_add_loss_warned"):
            return self
        for layer in self._model._flatten_layers(include_self=True):
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

            self._patches.set(layer, "add_loss", add_loss)
            regularizer = layer.activity_regularizer
            if regularizer is not None:

                def regularize(x, state=state, regularizer=regularizer):
                    state["regularizing"] = True
                    return regularizer(x)

                self._patches.set(layer, "activity_regularizer", regularize)
        return self

    def __exit__(self, *exc):
        self._patches.restore()
        return False


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

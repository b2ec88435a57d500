"""Installing a policy's step functions on a Keras model (torch).

Keras's torch trainer builds ``model.train_function`` (and the test and
predict ones) with ``make_*_function``; keras_dist replaces those
factories on the model instance. `ModelSteps` is what every torch policy
shares: the factories (cached as Keras caches them, ``steps_per_execution``
checked, inference without gradients), the policy's preparation before a
function is built (`prepare`: the chief's values, DTensor layouts), and
the global dropout mask (`install_global_dropout`). A policy subclasses
it with its `train_step`, `test_step` and `predict_step` (each given the
batch Keras passes, unpacked).
"""

from __future__ import annotations

import warnings

import keras
import torch

from keras_dist._src.keras_glue import internals as glue


class ModelSteps:
    """A policy's steps, installed on one model.

    Args:
        engine: the rank's engine.
        model: the Keras model compiled in the strategy's scope.
    """

    def __init__(self, engine, model):
        self.engine = engine
        self.model = model
        self._jit_compile_noted = False  # warned about jit_compile=True

    def install(self) -> None:
        """Replaces the model's step-function factories (on the
        instance); a policy extends it with its layer replacements."""
        model = self.model
        model.__dict__["make_train_function"] = self.make_train_function
        model.__dict__["make_test_function"] = self.make_test_function
        model.__dict__["make_predict_function"] = self.make_predict_function
        model.train_function = None
        model.test_function = None
        model.predict_function = None

    def prepare(self) -> None:
        """The policy's work before a step function is built (none)."""

    def _check_compile_options(self) -> None:
        if (
            getattr(self.model, "jit_compile", False) is True
            and not self._jit_compile_noted
        ):
            # Keras on one torch device compiles its step with
            # torch.compile; the policy's step (DDP or DTensor collectives,
            # exact global-batch losses) runs eagerly.
            self._jit_compile_noted = True
            if self.engine.is_chief:
                warnings.warn(
                    "compile(jit_compile=True) is not applied by keras_dist's "
                    "torch step (DDP or DTensor collectives): the step runs "
                    "eagerly, and its results are one device's. Compile with "
                    "jit_compile=False (the default on torch) to silence "
                    "this.",
                    stacklevel=2,
                )

    def train_function(self):
        """The function `model.train_function` is set to; by default the
        policy's `train_step` on each batch Keras passes (one, or up to
        `steps_per_execution`), returning the last step's logs."""
        return over_batches(self.train_step)

    def make_train_function(self, force=False):
        """Builds the policy's train function."""
        model = self.model
        if model.train_function is not None and not force:
            return model.train_function
        self._check_compile_options()
        self.prepare()
        model.train_function = self.train_function()
        return model.train_function

    def make_test_function(self, force=False):
        """Builds the policy's test function (no gradients)."""
        return self._make_inference_function(
            "test_function", self.test_step, force
        )

    def make_predict_function(self, force=False):
        """Builds the policy's predict function (no gradients)."""
        return self._make_inference_function(
            "predict_function", self.predict_step, force
        )

    def _make_inference_function(self, attribute, step, force):
        """Sets `model.<attribute>` to run `step` without gradients."""
        model = self.model
        if getattr(model, attribute) is not None and not force:
            return getattr(model, attribute)
        self._check_compile_options()
        self.prepare()
        concatenate = attribute == "predict_function"

        def function(data):
            # Up to `steps_per_execution` batches: predict's outputs are
            # concatenated (as Keras's own predict function does), the
            # test logs are the last step's.
            outputs = []
            with torch.no_grad():
                for batch in data:
                    outputs.append(step(batch))
            if not concatenate or len(outputs) == 1:
                return outputs[-1] if outputs else {}
            return keras.tree.map_structure(
                lambda *parts: torch.cat(parts, dim=0), *outputs
            )

        setattr(model, attribute, function)
        return function

    def train_step(self, data):
        """One training step of this rank (a policy's)."""
        raise NotImplementedError(type(self).__name__)

    def test_step(self, data):
        """One evaluation step of this rank (a policy's)."""
        raise NotImplementedError(type(self).__name__)

    def predict_step(self, data):
        """One prediction step of this rank (a policy's)."""
        raise NotImplementedError(type(self).__name__)


def over_batches(step):
    """A train function of `step`: runs it on each batch Keras passes (one,
    or up to `steps_per_execution`) and returns the last step's logs."""

    def train_function(data):
        logs = {}
        for batch in data:
            logs = step(batch)
        return logs

    return train_function


def install_global_dropout(model, draw) -> None:
    """Makes every `keras.layers.Dropout` of `model` drop what one device
    drops.

    ``draw(layer, original, inputs)`` returns the mask of kept values for
    `inputs` (drawn with the layer's own call `original` for the global
    batch's shape, and cut or placed as `inputs` is), or None where
    Keras's call applies as it is. A training call with no mask and every
    call outside training is Keras's own.
    """
    glue.wrap_layer_calls(
        model,
        lambda layer: type(layer) is keras.layers.Dropout,
        lambda layer, original: _dropout_call(layer, original, draw),
    )


def _dropout_call(layer, original, draw):
    def call(inputs, training=False):
        kept = draw(layer, original, inputs) if training else None
        if kept is None:
            return original(inputs, training=training)
        seeded = (
            layer.noise_shape is not None
            or glue.seed_generator_initial_seed(layer.seed_generator)
            is not None
        )
        if seeded:
            # Keras's seeded path: where(mask, inputs / keep_prob, 0).
            keep_prob = 1.0 - layer.rate
            return torch.where(
                kept != 0, inputs / keep_prob, torch.zeros_like(inputs)
            )
        return inputs * kept  # torch's dropout: inputs * (mask / keep_prob)

    return call

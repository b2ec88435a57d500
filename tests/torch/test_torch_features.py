"""Keras training features under the torch MirroredStrategy (2 ranks).

Two scripts, run in the torch tests' shared job (`tests/torch/conftest.py`),
check several features and write each rank's results to JSON; their
reference is plain Keras on one device in the chief's process (same seed,
same initial weights):

* `fit(shuffle=True)` after `keras.utils.set_random_seed` draws the batches
  one device draws, and seeded and unseeded `Dropout` drop what one device
  drops (global masks), with an empty shard in the last batch;
* the user's global generators end as plain Keras leaves them;
* overridden `train_step` (torch style, with a synchronised
  BatchNormalization and an empty shard in the last step), `test_step` and
  `predict_step` run, exactly; an overridden `compute_loss` is exact;
  weight and activity regularizers (`add_loss` terms) are exact;
* `model.save`/`save_weights` called on every rank write a valid file;
* an exception raised in `fit` and caught by the script does not stop the
  job (the except branch runs on every rank, a second `fit` follows);
* a model built in the scope and compiled outside it is refused.
"""

from __future__ import annotations

import json

import pytest

keras = pytest.importorskip("keras")
if keras.backend.backend() != "torch":
    pytest.skip("needs KERAS_BACKEND=torch", allow_module_level=True)

from tests.utils import register_torch_part  # noqa: E402

SCRIPT = """
import json, os, sys, warnings
import numpy as np
import torch
import keras
import keras_dist
from keras_dist._src.errors import StrategyMixingError

out = sys.argv[1]
strategy = keras_dist.MirroredStrategy(devices=["cpu:0", "cpu:1"])
rank = strategy.worker_index
result = {}
rng = np.random.default_rng(0)
# 22 samples, batch 7: steps of 7, 7, 7 and 1 samples (shards 4/3, 1/0).
x = rng.normal(size=(22, 6)).astype("float32")
y = rng.normal(size=(22, 2)).astype("float32")


def rel(a, b):
    return max(
        float(np.max(np.abs(p - q)) / max(np.max(np.abs(p)), 1e-12))
        for p, q in zip(a, b)
    )


def dropout_model():
    return keras.Sequential([
        keras.Input((6,)),
        keras.layers.Dense(8, activation="tanh"),
        keras.layers.Dropout(0.3, seed=3),
        keras.layers.Dense(8, activation="tanh"),
        keras.layers.Dropout(0.4),
        keras.layers.Dense(2),
    ])


class CustomStep(keras.Sequential):
    def train_step(self, data):
        x, y = data
        self.zero_grad()
        y_pred = self(x, training=True)
        loss = self.compute_loss(x=x, y=y, y_pred=y_pred)
        loss.backward()
        weights = self.trainable_weights[:]
        with torch.no_grad():
            self.optimizer.apply([v.value.grad for v in weights], weights)
        for metric in self.metrics:
            if metric.name == "loss":
                metric.update_state(loss)
        return {m.name: m.result() for m in self.metrics}

    def test_step(self, data):
        x, y = data
        loss = self.compute_loss(x=x, y=y, y_pred=self(x, training=False))
        for metric in self.metrics:
            if metric.name == "loss":
                metric.update_state(loss)
        return {m.name: m.result() for m in self.metrics}

    def predict_step(self, data):
        return 2.0 * self(data, training=False) + 1.0


class CustomLoss(keras.Sequential):
    def compute_loss(self, x=None, y=None, y_pred=None, sample_weight=None,
                     training=True):
        err = keras.ops.mean(keras.ops.abs(y - y_pred))
        return 2.0 * err + super().compute_loss(
            x, y, y_pred, sample_weight, training=training)


def small(cls, *extra):
    # Weight and activity regularizers: `add_loss` terms that are batch
    # independent and a mean over the batch (exact under sharding).
    return cls([keras.Input((6,)),
                keras.layers.Dense(4, activation="tanh",
                                   kernel_regularizer="l2",
                                   activity_regularizer="l2"),
                *extra,
                keras.layers.Dense(2)])


CASES = {
    "shuffle_dropout": (dropout_model, dict(shuffle=True)),
    # Synchronised BatchNorm in the user's step; rank 1's last shard is
    # empty, so it runs a stand-in sample that counts for nothing and must
    # meet rank 0 in the same collectives.
    "train_step": (
        lambda: small(CustomStep, keras.layers.BatchNormalization()),
        dict(shuffle=False),
    ),
    "compute_loss": (lambda: small(CustomLoss), dict(shuffle=False)),
}


def train(case, in_scope):
    build, fit_kwargs = CASES[case]
    keras.utils.set_random_seed(1234)
    if in_scope:
        with strategy.scope():
            model = build()
            model.compile(keras.optimizers.SGD(0.1, momentum=0.9), "mse")
    else:
        model = build()
        model.compile(keras.optimizers.SGD(0.1, momentum=0.9), "mse")
    init = [w.copy() for w in model.get_weights()]
    model.fit(x, y, batch_size=7, epochs=2, verbose=0, **fit_kwargs)
    after = [int(torch.randint(0, 2**30, (1,))), int(np.random.randint(2**30))]
    # Equal shards (8 = 4 + 4): a per-rank mean of the loss is exact too.
    loss = model.evaluate(x, y, batch_size=8, verbose=0, return_dict=True)
    pred = model.predict(x, batch_size=7, verbose=0)
    return init, model.get_weights() + [pred], after, loss["loss"]


for case in CASES:
    if rank == 0:
        ref_init, ref, ref_after, ref_loss = train(case, in_scope=False)
    init, got, after, loss = train(case, in_scope=True)
    if rank == 0:
        result[case] = {
            "init": rel(ref_init, init),
            "weights": rel(ref[:-1], got[:-1]),
            "predict": rel(ref[-1:], got[-1:]),
            "evaluate": abs(loss - ref_loss) / abs(ref_loss),
            "generators_as_plain_keras": after == ref_after,
        }
    result[case + "_generators"] = after

# Saving from every rank.
with strategy.scope():
    model = small(keras.Sequential)
    model.compile("sgd", "mse", jit_compile=True)  # not applied: a warning
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    model.fit(x, y, batch_size=8, epochs=1, verbose=0)
result["jit_compile_warnings"] = sum(
    "jit_compile=True" in str(w.message) for w in caught)
for _ in range(2):
    model.save(os.path.join(out, "model.keras"))
    model.save_weights(os.path.join(out, "model.weights.h5"))
loaded = keras.saving.load_model(os.path.join(out, "model.keras"))
result["save"] = rel(model.get_weights(), loaded.get_weights())
loaded.load_weights(os.path.join(out, "model.weights.h5"))
result["save_weights"] = rel(model.get_weights(), loaded.get_weights())
# A write that fails on the chief fails on every rank, with its reason.
try:
    model.save(os.path.join(out, "no_such_folder", "m.keras"))
except Exception as error:
    result["failed_save"] = f"{type(error).__name__}: {error}"
# Saving on the chief alone (torch's `rank == 0` idiom), then more
# collectives: the job goes on.
if strategy.is_chief:
    model.save(os.path.join(out, "chief.keras"))
result["after_chief_save"] = model.evaluate(x, y, batch_size=8, verbose=0)


# An exception caught around fit does not end the job.
class Boom(keras.callbacks.Callback):
    def on_epoch_begin(self, epoch, logs=None):
        if epoch == 1:
            raise ValueError("boom")


try:
    model.fit(x, y, batch_size=8, epochs=3, verbose=0, callbacks=[Boom()])
except ValueError as error:
    result["caught"] = str(error)
history = model.fit(x, y, batch_size=8, epochs=1, verbose=0)
result["fit_after_caught"] = len(history.history["loss"])

# Built in the scope, compiled outside: refused.
with strategy.scope():
    outside = small(keras.Sequential)
try:
    outside.compile("sgd", "mse")
    result["mixing"] = "compiled"
except StrategyMixingError as error:
    result["mixing"] = type(error).__name__

with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
    json.dump(result, f)
"""


FEATURES = register_torch_part("features", SCRIPT)


@pytest.mark.multi_process
@pytest.mark.slow
@pytest.mark.torch_part(FEATURES)
def test_torch_training_features(torch_parts):
    out = torch_parts.output(FEATURES)
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)]
    chief = ranks[0]
    for case in ("shuffle_dropout", "train_step", "compute_loss"):
        assert chief[case]["init"] == 0.0, case
        for key in ("weights", "predict", "evaluate"):
            assert chief[case][key] <= 1e-5, (case, key, chief[case])
        assert chief[case]["generators_as_plain_keras"], case
        # Every rank drew what the chief drew.
        assert ranks[1][case + "_generators"] == chief[case + "_generators"]
    # jit_compile=True is not applied: the chief warns once.
    assert [r["jit_compile_warnings"] for r in ranks] == [1, 0]
    assert (out / "chief.keras").is_file()
    assert ranks[0]["after_chief_save"] == ranks[1]["after_chief_save"]
    assert "failed on the chief" in ranks[1]["failed_save"]
    assert "no_such_folder" in ranks[0]["failed_save"]
    for result in ranks:
        assert result["save"] == 0.0 and result["save_weights"] == 0.0
        assert result["caught"] == "boom"
        assert result["fit_after_caught"] == 1
        assert result["mixing"] == "StrategyMixingError"


STEPS_AND_MASKS_SCRIPT = """
import json, os, sys
import numpy as np
import torch
import keras
import keras_dist

out = sys.argv[1]
strategy = keras_dist.MirroredStrategy(devices=["cpu:0", "cpu:1"])
rank = strategy.worker_index
rng = np.random.default_rng(0)
# 22 samples, batch 7: shards 4/3 and, in the last step, 1/0 (empty).
N, T, V = 22, 7, 9
tokens = rng.integers(1, V, size=(N, T))
for i, length in enumerate(rng.integers(1, T + 1, size=N)):
    tokens[i, length:] = 0  # padding: masked by Embedding(mask_zero=True)
labels = rng.integers(0, 3, size=(N, T))
weights_2d = rng.uniform(0.5, 2.0, size=(N, T)).astype("float32")
series = rng.normal(size=(N, T, 3)).astype("float32")
series[tokens == 0] = 0.0  # masked by Masking(0.0)
targets = rng.normal(size=(N, T, 2)).astype("float32")
# 20 samples, batch 7: every step (7, 7, 6) has samples on both ranks.
x = rng.normal(size=(20, 6)).astype("float32")
y = rng.normal(size=(20, 2)).astype("float32")
z = rng.normal(size=(22, 3)).astype("float32")
real = rng.normal(size=(22, 6)).astype("float32")


def rel(a, b):
    # Relative to each tensor's largest value; absolute below 1e-3 (the
    # attention key bias has a zero gradient: round-off near 1e-9).
    return max(
        float(np.max(np.abs(p - q)) / max(np.max(np.abs(p)), 1e-3))
        for p, q in zip(a, b)
    )


def embedding_lstm_attention():
    i = keras.Input((T,), dtype="int32")
    h = keras.layers.Embedding(V, 4, mask_zero=True)(i)
    h = keras.layers.LSTM(4, return_sequences=True)(h)
    h = keras.layers.MultiHeadAttention(2, 2)(h, h)
    return keras.Model(i, keras.layers.Dense(3)(h))


def two_outputs():
    # A masked sequence output and a pooled one with reduction="sum".
    i = keras.Input((T,), dtype="int32")
    h = keras.layers.Embedding(V, 4, mask_zero=True)(i)
    h = keras.layers.LSTM(4, return_sequences=True)(h)
    pooled = keras.layers.GlobalAveragePooling1D()(h)
    return keras.Model(i, {"seq": keras.layers.Dense(3, name="seq")(h),
                           "vec": keras.layers.Dense(2, name="vec")(pooled)})


def masking_gru():
    i = keras.Input((T, 3))
    h = keras.layers.Masking(0.0)(i)
    h = keras.layers.GRU(4, return_sequences=True)(h)
    return keras.Model(i, keras.layers.Dense(2)(h))


class GuideStep(keras.Sequential):
    # The Keras guide's torch `train_step`/`test_step`: loss tracker fed
    # a scalar, compiled metrics through `self.metrics`.
    def train_step(self, data):
        x, y = data
        self.zero_grad()
        y_pred = self(x, training=True)
        loss = self.compute_loss(x=x, y=y, y_pred=y_pred)
        loss.backward()
        weights = self.trainable_weights[:]
        with torch.no_grad():
            self.optimizer.apply([v.value.grad for v in weights], weights)
        return self._update(loss, y, y_pred)

    def test_step(self, data):
        x, y = data
        y_pred = self(x, training=False)
        loss = self.compute_loss(x=x, y=y, y_pred=y_pred, training=False)
        return self._update(loss, y, y_pred)

    def _update(self, loss, y, y_pred):
        for metric in self.metrics:
            if metric.name == "loss":
                metric.update_state(loss)
            else:
                metric.update_state(y, y_pred)
        return {m.name: m.result() for m in self.metrics}


class GAN(keras.Model):
    # Two models, two optimizers, two Mean trackers (the Keras GAN guide;
    # the latent points come with the data, so that both runs draw alike).
    def __init__(self):
        super().__init__()
        self.generator = keras.Sequential(
            [keras.Input((3,)), keras.layers.Dense(6)])
        self.discriminator = keras.Sequential(
            [keras.Input((6,)), keras.layers.Dense(4, activation="tanh"),
             keras.layers.Dense(1)])
        self.d_loss = keras.metrics.Mean(name="d_loss")
        self.g_loss = keras.metrics.Mean(name="g_loss")

    @property
    def metrics(self):
        return [self.d_loss, self.g_loss]

    def call(self, inputs):
        return self.discriminator(self.generator(inputs[1]))

    def compile(self, d_optimizer, g_optimizer):
        super().compile()
        self.d_optimizer, self.g_optimizer = d_optimizer, g_optimizer
        self.loss_fn = keras.losses.BinaryCrossentropy(from_logits=True)

    def train_step(self, data):
        real, z = data[0] if isinstance(data[0], tuple) else data
        n = real.shape[0]
        combined = torch.concat([self.generator(z), real], axis=0)
        truth = torch.concat([torch.ones((n, 1)), torch.zeros((n, 1))], 0)
        self.zero_grad()
        d_loss = self.loss_fn(truth, self.discriminator(combined))
        d_loss.backward()
        d_weights = self.discriminator.trainable_weights
        with torch.no_grad():
            self.d_optimizer.apply([v.value.grad for v in d_weights],
                                   d_weights)
        self.zero_grad()
        fake = self.discriminator(self.generator(z))
        g_loss = self.loss_fn(torch.zeros((n, 1)), fake)
        g_loss.backward()
        g_weights = self.generator.trainable_weights
        with torch.no_grad():
            self.g_optimizer.apply([v.value.grad for v in g_weights],
                                   g_weights)
        self.d_loss.update_state(d_loss)
        self.g_loss.update_state(g_loss)
        return {"d_loss": self.d_loss.result(),
                "g_loss": self.g_loss.result()}


sce = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
CASES = {
    "embedding_lstm_attention": (
        embedding_lstm_attention, sce, ["accuracy"],
        (tokens, labels, weights_2d)),
    "masking_gru": (masking_gru, "mse", ["mae"], (series, targets, None)),
    "two_outputs": (
        two_outputs,
        {"seq": sce, "vec": keras.losses.MeanSquaredError(reduction="sum")},
        None, (tokens, {"seq": labels, "vec": targets[:, 0]}, None)),
    "guide_step": (
        lambda: GuideStep([keras.Input((6,)),
                           keras.layers.Dense(4, activation="tanh"),
                           keras.layers.Dense(2)]),
        "mse", ["mae"], (x, y, None)),
}


def train(case):
    keras.utils.set_random_seed(5)
    if case == "gan":
        model = GAN()
        model.compile(keras.optimizers.Adam(1e-2), keras.optimizers.SGD(0.1))
        history = model.fit((real, z), batch_size=7, epochs=2, verbose=0)
        return model.get_weights(), history.history, {}
    build, loss, metrics, (a, b, w) = CASES[case]
    model = build()
    # Weighted metrics read the sample weights Keras's masked loss scaled.
    model.compile(keras.optimizers.SGD(0.5), loss, metrics=metrics,
                  weighted_metrics=["accuracy"] if w is not None else None)
    history = model.fit(a, b, sample_weight=w, batch_size=7, epochs=2,
                        verbose=0)
    logs = model.evaluate(a, b, sample_weight=w, batch_size=7, verbose=0,
                          return_dict=True)
    return model.get_weights(), history.history, logs


result = {}
for case in [*CASES, "gan"]:
    if rank == 0:
        ref_weights, ref_history, ref_logs = train(case)
    with strategy.scope():
        weights, history, logs = train(case)
    if rank == 0:
        result[case] = {
            "weights": rel(ref_weights, weights),
            "history": max(
                abs(a - b) / max(abs(a), 1e-6)
                for key in ref_history
                for a, b in zip(ref_history[key], history[key])
            ),
            "evaluate": max(
                [abs(ref_logs[k] - logs[k]) / max(abs(ref_logs[k]), 1e-6)
                 for k in ref_logs] or [0.0]
            ),
            "keys": sorted(history) == sorted(ref_history),
        }
    result[case + "_history"] = history
with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
    json.dump(result, f)
"""


STEPS_AND_MASKS = register_torch_part("steps_and_masks", STEPS_AND_MASKS_SCRIPT)


@pytest.mark.multi_process
@pytest.mark.slow
@pytest.mark.torch_part(STEPS_AND_MASKS)
def test_torch_masked_losses_and_user_step_logs(torch_parts):
    """Masked per-timestep losses (Embedding(mask_zero=True) + LSTM +
    attention with 2-D sample weights, Masking + GRU, a masked output
    beside a reduction="sum" one) and the logs of
    user-written steps (the Keras guide's, a GAN with two optimizers) equal
    one device's, on both ranks (issue #17)."""
    out = torch_parts.output(STEPS_AND_MASKS)
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)]
    chief = ranks[0]
    for case in (
        "embedding_lstm_attention",
        "masking_gru",
        "two_outputs",
        "guide_step",
        "gan",
    ):
        for key in ("weights", "history", "evaluate"):
            assert chief[case][key] <= 1e-5, (case, key, chief[case])
        assert chief[case]["keys"], case
        # Both ranks log the same values.
        assert ranks[1][case + "_history"] == chief[case + "_history"], case

"""CentralStorageStrategy trains exactly like one device.

TensorFlow: tf.distribute's CentralStorageStrategy over 4 simulated CPU
devices, with BatchNormalization and Dropout (Keras creates their
non-trainable variables with aggregation "none", which tf.distribute's
AggregatingVariable refuses to update in a replica) and SUM-aggregated
metrics (a confusion matrix among them), every step's logs included. JAX:
every variable in host memory (``pinned_host`` on the CPU
platform) after `fit`. Both against plain Keras on one device from the same
weights. torch: the clear error.
"""

import contextlib

import keras
import numpy as np
import pytest

import keras_dist
from tests.utils import (
    compiled_model,
    make_data,
    max_relative_difference,
)

BACKEND = keras.backend.backend()
TOLERANCE = 1e-5
# 90 samples, global batch 16: the last batch of each epoch has 10.
BATCH, EPOCHS = 16, 2


def _compiled(strategy=None):
    """`compiled_model` with a confusion-matrix metric too (`MeanIoU`,
    which Keras updates with ``assign(total + batch)``)."""
    model = compiled_model(strategy, dropout=0.2)
    scope = strategy.scope() if strategy else contextlib.nullcontext()
    with scope:
        model.compile(
            optimizer=model.optimizer,
            loss=model.loss,
            metrics=[
                "accuracy",
                keras.metrics.SparseCategoricalCrossentropy(name="xent"),
                keras.metrics.MeanIoU(3, sparse_y_pred=False, name="iou"),
            ],
        )
    return model


class _BatchLogs(keras.callbacks.Callback):
    """Every step's logs (what the progress bar shows)."""

    def __init__(self):
        super().__init__()
        self.logs = []

    def on_train_batch_end(self, batch, logs=None):
        self.logs.append([float(logs[k]) for k in sorted(logs)])


def _train(strategy):
    x, y, sw = make_data()
    reference = _compiled()
    weights = reference.get_weights()
    model = _compiled(strategy)
    model.set_weights(weights)
    logs = []
    for m in (reference, model):
        batches = _BatchLogs()
        history = m.fit(
            x,
            y,
            sample_weight=sw,
            batch_size=BATCH,
            epochs=EPOCHS,
            shuffle=False,
            verbose=0,
            callbacks=[batches],
        ).history
        evaluated = m.evaluate(x, y, batch_size=BATCH, verbose=0)
        predicted = m.predict(x, batch_size=BATCH, verbose=0)
        logs.append((history, evaluated, predicted, batches.logs))
    return reference, model, logs


def _check_parity(reference, model, logs):
    (h0, e0, p0, b0), (h1, e1, p1, b1) = logs
    assert np.allclose(b0, b1, rtol=TOLERANCE), (b0, b1)
    assert int(model.optimizer.iterations.numpy()) == int(
        reference.optimizer.iterations.numpy()
    )
    for key in h0:
        assert np.allclose(h0[key], h1[key], rtol=TOLERANCE), key
    assert np.allclose(e0, e1, rtol=TOLERANCE)
    assert np.max(np.abs(p0 - p1)) < TOLERANCE
    difference = max_relative_difference(
        reference.get_weights(), model.get_weights()
    )
    print(f"CentralStorage ({BACKEND}) max rel diff {difference:.2e}")
    assert difference < TOLERANCE, difference


@pytest.mark.multi_device
@pytest.mark.skipif(BACKEND != "tensorflow", reason="tf.distribute's own")
def test_tensorflow_central_storage_equals_one_device():
    import tensorflow as tf
    from tensorflow.python.distribute import ps_values

    strategy = keras_dist.CentralStorageStrategy()
    assert strategy.num_replicas_in_sync == 4
    assert strategy.parameter_device == "/cpu:0"
    reference, model, logs = _train(strategy)
    _check_parity(reference, model, logs)
    for variable in model.variables + model.optimizer.variables:
        value = variable.value
        assert isinstance(value, ps_values.AggregatingVariable), variable.path
        assert value.aggregation != tf.VariableAggregation.NONE, variable.path
        assert value.device.endswith("CPU:0"), (variable.path, value.device)


@pytest.mark.multi_device
@pytest.mark.skipif(BACKEND != "jax", reason="JAX memory kinds")
def test_jax_central_storage_keeps_state_in_host_memory():
    import jax

    strategy = keras_dist.CentralStorageStrategy()
    kinds = {m.kind for m in jax.devices()[0].addressable_memories()}
    expected = "pinned_host" if "pinned_host" in kinds else "unpinned_host"
    assert strategy.parameter_device == expected
    reference, model, logs = _train(strategy)
    _check_parity(reference, model, logs)
    state = (
        model.variables + model.optimizer.variables + model.metrics_variables
    )
    found = {(v.path, v.value.sharding.memory_kind) for v in state}
    assert {kind for _, kind in found} == {expected}, found
    # Replicated over the 4 compute devices (one copy per device in host
    # memory; each step computes on the devices).
    assert len(model.variables[0].value.sharding.device_set) == 4


@pytest.mark.skipif(BACKEND != "torch", reason="torch's answer")
def test_torch_central_storage_is_a_clear_error():
    with pytest.raises(
        keras_dist.UnsupportedBackendError, match="MirroredStrategy"
    ):
        keras_dist.CentralStorageStrategy()


def test_central_storage_by_name():
    if BACKEND == "torch":
        with pytest.raises(keras_dist.UnsupportedBackendError):
            keras_dist.strategy_from_name("central_storage")
        return
    strategy = keras_dist.strategy_from_name("central-storage")
    assert isinstance(strategy, keras_dist.CentralStorageStrategy)


def _two_outputs():
    inputs = keras.Input((3,))
    hidden = keras.layers.Dense(4, activation="tanh")(inputs)
    model = keras.Model(
        inputs,
        {
            "p": keras.layers.Dense(1, name="p")(hidden),
            "q": keras.layers.Dense(1, name="q")(hidden),
        },
    )
    model.compile(optimizer="sgd", loss={"p": "mse", "q": "mse"})
    return model


@pytest.mark.multi_device
@pytest.mark.skipif(BACKEND == "torch", reason="no CentralStorage on torch")
def test_central_storage_predict_first_then_fit_two_outputs_with_validation():
    """The order users call things in: `predict` before the first `fit`
    (on JAX it left the state in host memory, where Keras's symbolic build
    could not read it), then a two-output model validated in `fit` (on TF
    the per-output loss trackers, shared by the replicas' threads, kept a
    patch holding the training graph's tensor, and validation failed)."""
    x = np.random.default_rng(1).normal(size=(20, 3)).astype("float32")
    y = {"p": x[:, :1], "q": x[:, 1:2] * 2.0}
    keras.utils.set_random_seed(5)
    reference = _two_outputs()
    with keras_dist.CentralStorageStrategy().scope():
        model = _two_outputs()
    model.set_weights(reference.get_weights())
    results = []
    for m in (reference, model):
        predicted = m.predict(x, batch_size=8, verbose=0)
        # Batches of 10, split 3/3/2/2 over the replicas. (Of 8 in `fit`,
        # the last batch of 4 would weigh 1 in Keras 3.16's per-output
        # loss logs on TF, its full batches 8: a retraced step's batch
        # size is unknown. keras_dist weighs every batch 1, as 3.15.)
        history = m.fit(
            x,
            y,
            batch_size=10,
            epochs=2,
            shuffle=False,
            verbose=0,
            validation_data=(x, y),
        ).history
        evaluated = m.evaluate(x, y, batch_size=8, verbose=0, return_dict=True)
        results.append((predicted, history, evaluated, m.get_weights()))
    (p0, h0, e0, w0), (p1, h1, e1, w1) = results
    assert sorted(h0) == sorted(h1) and "val_q_loss" in h1
    for key in h0:
        np.testing.assert_allclose(h1[key], h0[key], rtol=TOLERANCE)
    for key in e0:
        np.testing.assert_allclose(e1[key], e0[key], rtol=TOLERANCE)
    for key in p0:
        np.testing.assert_allclose(p1[key], p0[key], atol=TOLERANCE)
    assert max_relative_difference(w0, w1) < TOLERANCE

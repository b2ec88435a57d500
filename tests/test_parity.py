"""N replicas train, evaluate and predict exactly like one device.

Runs under KERAS_BACKEND=jax and tensorflow with 4 simulated CPU devices
(the torch backend has its own multi-process tests in tests/torch/).
"""

import keras
import numpy as np
import pytest

import keras_dist
from tests.utils import (
    build_model,
    compile_model,
    compiled_model,
    make_data,
    max_relative_difference,
)

pytestmark = [
    pytest.mark.multi_device,
    pytest.mark.skipif(
        keras.backend.backend() not in ("jax", "tensorflow"),
        reason="single-process multi-device backends only",
    ),
]

TOLERANCE = 1e-5
# 90 samples, global batch 16: 6 steps an epoch, the last one of 10 samples
# (uneven over 4 replicas); 4 epochs = 24 steps. Evaluate and predict use a
# batch of 7, whose last batch of 6 does not divide among 4 replicas either.
EPOCHS, BATCH, EVAL_BATCH = 4, 16, 7


def _train(model):
    x, y, sw = make_data()
    history = model.fit(
        x,
        y,
        sample_weight=sw,
        batch_size=BATCH,
        epochs=EPOCHS,
        shuffle=False,
        verbose=0,
    )
    evaluation = model.evaluate(
        x,
        y,
        sample_weight=sw,
        batch_size=EVAL_BATCH,
        verbose=0,
        return_dict=True,
    )
    predictions = model.predict(x, batch_size=EVAL_BATCH, verbose=0)
    return model.get_weights(), history.history, evaluation, predictions


@pytest.fixture(scope="module")
def reference():
    """Plain Keras on one device: no keras_dist involved."""
    model = build_model()
    compile_model(model)
    return _train(model)


@pytest.mark.parametrize(
    "replicas",
    [
        pytest.param(1, marks=pytest.mark.slow),
        pytest.param(2, marks=pytest.mark.slow),
        pytest.param(4, marks=pytest.mark.fast),  # tools/test_fast.sh
    ],
)
def test_mirrored_matches_single_device(reference, replicas):
    strategy = keras_dist.MirroredStrategy(
        devices=[f"cpu:{i}" for i in range(replicas)]
    )
    assert strategy.num_replicas_in_sync == replicas
    with strategy.scope():
        model = build_model()
        compile_model(model)
    weights, history, evaluation, predictions = _train(model)
    ref_weights, ref_history, ref_evaluation, ref_predictions = reference

    difference = max_relative_difference(ref_weights, weights)
    print(f"{replicas} replicas: max relative weight difference {difference}")
    assert difference <= TOLERANCE
    for name, values in ref_history.items():
        np.testing.assert_allclose(history[name], values, rtol=1e-5)
    assert evaluation.keys() == ref_evaluation.keys()
    for name, value in ref_evaluation.items():
        np.testing.assert_allclose(evaluation[name], value, rtol=1e-5)
    assert predictions.shape == ref_predictions.shape
    np.testing.assert_allclose(predictions, ref_predictions, atol=1e-5)


@pytest.mark.slow
def test_fit_inside_the_scope(reference):
    """`fit`/`evaluate`/`predict` called inside the scope behave the same."""
    strategy = keras_dist.MirroredStrategy()
    with strategy.scope():
        model = build_model()
        compile_model(model)
        weights, history, evaluation, predictions = _train(model)
    assert max_relative_difference(reference[0], weights) <= TOLERANCE
    np.testing.assert_allclose(history["loss"], reference[1]["loss"], rtol=1e-5)
    np.testing.assert_allclose(predictions, reference[3], atol=1e-5)


@pytest.mark.slow
def test_batch_smaller_than_replica_count():
    """Batches of 3 and a last batch of 1 sample on 4 replicas are exact."""
    x, y, sw = make_data(n=10, seed=1)

    def run(strategy):
        model = compiled_model(strategy, seed=3)
        history = model.fit(
            x,
            y,
            sample_weight=sw,
            batch_size=3,
            epochs=6,
            shuffle=False,
            verbose=0,
        )
        evaluation = model.evaluate(x, y, batch_size=3, verbose=0)
        return model.get_weights(), history.history["loss"], evaluation

    ref = run(None)
    got = run(keras_dist.MirroredStrategy())
    assert max_relative_difference(ref[0], got[0]) <= TOLERANCE
    np.testing.assert_allclose(got[1], ref[1], rtol=1e-5)
    np.testing.assert_allclose(got[2], ref[2], rtol=1e-5)


@pytest.mark.slow
def test_replicas_hold_identical_variables():
    strategy = keras_dist.MirroredStrategy()
    with strategy.scope():
        model = build_model()
        compile_model(model)
    x, y, sw = make_data()
    model.fit(x, y, batch_size=BATCH, epochs=1, verbose=0)
    for variable in model.weights:
        parts = _per_device_values(variable)
        assert len(parts) == strategy.num_replicas_in_sync
        for part in parts[1:]:
            np.testing.assert_array_equal(part, parts[0])


def _per_device_values(variable):
    value = variable.value
    if keras.backend.backend() == "jax":
        return [np.asarray(s.data) for s in value.addressable_shards]
    return [np.asarray(v) for v in value.values]


@pytest.mark.slow
def test_batch_norm_statistics_global_by_default_per_replica_on_request():
    """With momentum 0 the moving statistics are those of the last batch."""
    x, y, _ = make_data()
    x, y = x[:64], y[:64]

    def moving_variance(strategy):
        model = compiled_model(strategy, bn_momentum=0.0)
        model.fit(x, y, batch_size=64, epochs=1, shuffle=False, verbose=0)
        bn = next(
            layer
            for layer in model.layers
            if isinstance(layer, keras.layers.BatchNormalization)
        )
        return model, np.asarray(bn.moving_variance)

    initial = build_model(bn_momentum=0.0)  # the weights the step starts from
    _, single = moving_variance(None)
    _, synced = moving_variance(keras_dist.MirroredStrategy())
    strategy = keras_dist.MirroredStrategy(sync_batch_norm=False)
    _, local = moving_variance(strategy)
    np.testing.assert_allclose(synced, single, rtol=1e-5)

    # Per-replica: the mean over replicas of each shard's variance.
    features = keras.Model(initial.inputs, initial.layers[1].output)
    h = np.asarray(features.predict(x, verbose=0))
    shards = np.array_split(h, strategy.num_replicas_in_sync)
    expected = np.mean([s.var(axis=(0, 1, 2)) for s in shards], axis=0)
    np.testing.assert_allclose(local, expected, rtol=1e-4)
    assert not np.allclose(local, single, rtol=1e-3)


@pytest.mark.slow
@pytest.mark.skipif(
    keras.backend.backend() != "jax", reason="JAX's engine places each batch"
)
def test_steps_per_execution_splits_every_batch_over_the_replicas():
    """With `steps_per_execution=4`, each step's batch is split over the 4
    replicas and the partial group at an epoch's end is exact. (Keras 3.16
    reads a group of batches stacked on a new leading axis: splitting that
    axis ran each step whole on one device, equal to one device yet not
    data parallel, and a partial group crashed. A full group now runs as
    one scan over its steps, each step's batch still split 4 ways.)"""
    from keras import tree

    from keras_dist._src.keras_glue import internals as glue

    x, y, sw = make_data()  # 6 steps an epoch: a group of 4, then 2

    def run(strategy):
        def build():
            model = build_model(seed=3)
            model.compile(
                optimizer=keras.optimizers.SGD(0.05, momentum=0.9),
                loss="sparse_categorical_crossentropy",
                metrics=["accuracy"],
                steps_per_execution=4,
            )
            return model

        if strategy is None:
            model = build()
        else:
            with strategy.scope():
                model = build()
        history = model.fit(
            x,
            y,
            sample_weight=sw,
            batch_size=BATCH,
            epochs=2,
            verbose=0,
            shuffle=False,
        )
        predictions = model.predict(x, batch_size=EVAL_BATCH, verbose=0)
        return model.get_weights(), history.history, predictions

    strategy = keras_dist.MirroredStrategy()
    engine = strategy.extended
    # (samples of each training step's batch, samples a device holds)
    placed = []
    groups = []
    place_batch, place_group = engine.place_batch, engine.place_group

    def spy_batch(batch):
        result = place_batch(batch)
        a = tree.flatten(result)[0]
        if a.ndim == 4:  # images: the training input
            placed.append((a.shape[0], a.sharding.shard_shape(a.shape)[0]))
        return result

    def spy_group(group):  # Keras 3.16's stacked groups, run as one scan
        result = place_group(group)
        a = tree.flatten(result)[0]
        steps, per_device = a.sharding.shard_shape(a.shape)[:2]
        assert steps == a.shape[0]  # every device runs every step
        groups.append(a.shape[0])
        placed.extend([(a.shape[1], per_device)] * a.shape[0])
        return result

    engine.place_batch, engine.place_group = spy_batch, spy_group
    got = run(strategy)
    ref = run(None)
    # Each step's batch of 16 split 4 ways; the last (10, which 4 does not
    # divide) replicated.
    epoch = [(16, 4)] * 5 + [(10, 10)]
    assert placed[:12] == epoch * 2
    if glue.keras_stacks_jax_steps():
        assert groups[:2] == [4, 4]  # the full group of each epoch
    assert max_relative_difference(ref[0], got[0]) <= TOLERANCE
    np.testing.assert_allclose(got[1]["loss"], ref[1]["loss"], rtol=1e-5)
    np.testing.assert_allclose(got[2], ref[2], rtol=1e-5, atol=1e-6)

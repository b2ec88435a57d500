"""Every Keras input type trains exactly as on one device; bad input fails
clearly. Single-process backends (JAX, TensorFlow) with 4 devices; the torch
backend's multi-process input tests live in tests/torch/."""

import math
import warnings

import keras
import numpy as np
import pytest

import keras_dist
from tests.utils import compiled_model, make_data, max_relative_difference

pytestmark = [
    pytest.mark.multi_device,
    pytest.mark.skipif(
        keras.backend.backend() not in ("jax", "tensorflow"),
        reason="single-process multi-device backends only",
    ),
]

N, BATCH, EPOCHS = 90, 16, 4  # 6 steps an epoch, last batch 10 samples
STEPS = math.ceil(N / BATCH)


def build(seed=0):
    """Two named inputs, so that dict and tuple inputs can be tested."""
    keras.utils.set_random_seed(seed)
    image = keras.Input((8, 8, 1), name="image")
    extra = keras.Input((2,), name="extra")
    h = keras.layers.Conv2D(4, 3, activation="tanh")(image)
    h = keras.layers.BatchNormalization()(h)
    h = keras.layers.Flatten()(h)
    h = keras.layers.Concatenate()([h, extra])
    h = keras.layers.Dense(8, activation="tanh")(h)
    outputs = keras.layers.Dense(3, activation="softmax")(h)
    return keras.Model({"image": image, "extra": extra}, outputs)


def data():
    x, y, sw = make_data(N)
    extra = np.random.default_rng(1).normal(size=(N, 2)).astype("float32")
    return {"image": x, "extra": extra}, y, sw


def batches():
    x, y, sw = data()
    for start in range(0, N, BATCH):
        s = slice(start, start + BATCH)
        yield {k: v[s] for k, v in x.items()}, y[s], sw[s]


class Batches(keras.utils.PyDataset):
    """A PyDataset of the same batches.

    One worker: with worker threads, Keras itself does not always deliver
    the batches in the same order (seen on one device already), so a parity
    test could not tell keras_dist's effect from Keras's.
    """

    def __init__(self):
        super().__init__(workers=1, use_multiprocessing=False)
        self.items = list(batches())

    def __len__(self):
        return len(self.items)

    def __getitem__(self, index):
        return self.items[index]


def _tf_dataset():
    import tensorflow as tf

    return tf.data.Dataset.from_tensor_slices(data()).batch(BATCH)


def _torch_loader():
    import torch

    x, y, sw = data()

    class Samples(torch.utils.data.Dataset):
        def __len__(self):
            return N

        def __getitem__(self, i):
            return (
                {"image": x["image"][i], "extra": x["extra"][i]},
                y[i],
                sw[i],
            )

    return torch.utils.data.DataLoader(Samples(), batch_size=BATCH)


def _grain_dataset():
    grain = pytest.importorskip("grain")
    x, y, sw = data()
    samples = [
        ({"image": x["image"][i], "extra": x["extra"][i]}, y[i], sw[i])
        for i in range(N)
    ]
    return grain.MapDataset.source(samples).batch(BATCH)


def _fit_kwargs(kind):
    x, y, sw = data()
    if kind == "numpy_dict":
        return dict(x=x, y=y, sample_weight=sw, batch_size=BATCH)
    if kind == "tf_data":
        return dict(x=_tf_dataset())
    if kind == "py_dataset":
        return dict(x=Batches())
    if kind == "generator":

        def forever():
            while True:
                yield from batches()

        return dict(x=forever(), steps_per_epoch=STEPS)
    if kind == "torch_dataloader":
        return dict(x=_torch_loader())
    if kind == "grain":
        return dict(x=_grain_dataset())
    raise AssertionError(kind)


def _train(strategy, kind):
    kwargs = _fit_kwargs(kind)
    model = compiled_model(strategy, build=build)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        history = model.fit(epochs=EPOCHS, shuffle=False, verbose=0, **kwargs)
    x, y, sw = data()
    evaluation = model.evaluate(
        x, y, sample_weight=sw, batch_size=7, verbose=0, return_dict=True
    )
    predictions = model.predict(x, batch_size=7, verbose=0)
    return model.get_weights(), history.history, evaluation, predictions


@pytest.mark.slow
@pytest.mark.parametrize(
    "kind",
    [
        "numpy_dict",
        "tf_data",
        "py_dataset",
        "generator",
        "torch_dataloader",
        "grain",
    ],
)
def test_input_type_matches_single_device(kind, monkeypatch):
    # The reference is plain Keras on one device with the same input:
    # keras_dist must not change what each type gives.
    reference = _train(None, kind)
    started = []
    count_started = keras.backend.backend() == "tensorflow"
    if count_started:
        from keras_dist._src.backends.tensorflow import inputs

        resolve = inputs.LazyIterator.resolve

        def counted(self):
            if self._iterator is None:
                # A count, not the iterator: one kept alive until teardown
                # is destroyed after Keras stopped its input (a PyDataset's
                # workers), and TF's teardown of it then stalled for 76 s.
                started.append(type(self).__name__)
            return resolve(self)

        monkeypatch.setattr(inputs.LazyIterator, "resolve", counted)
    got = _train(keras_dist.MirroredStrategy(), kind)
    if count_started and kind == "numpy_dict":  # no steps_per_epoch
        # One distributed iterator an epoch, one for evaluate, one for
        # predict: not the one Keras makes at each end and never reads.
        assert len(started) == EPOCHS + 2, len(started)
    difference = max_relative_difference(reference[0], got[0])
    print(f"{kind}: max relative weight difference {difference}")
    assert difference <= 1e-5
    for name, values in reference[1].items():
        np.testing.assert_allclose(got[1][name], values, rtol=1e-5)
    for name, value in reference[2].items():
        np.testing.assert_allclose(got[2][name], value, rtol=1e-5)
    np.testing.assert_allclose(got[3], reference[3], atol=1e-5)


@pytest.mark.slow
def test_shuffling_is_the_same_whatever_the_replica_count():
    x, y, sw = data()

    def run(strategy):
        model = compiled_model(strategy, build=build)
        keras.utils.set_random_seed(123)  # the shuffle seed
        model.fit(
            x,
            y,
            sample_weight=sw,
            batch_size=BATCH,
            epochs=2,
            shuffle=True,
            verbose=0,
        )
        return model.get_weights()

    single = run(None)
    replicated = run(keras_dist.MirroredStrategy())
    assert max_relative_difference(single, replicated) <= 1e-5


# -- bad input ---------------------------------------------------------------
@pytest.fixture(scope="module")
def small_model():
    strategy = keras_dist.MirroredStrategy()
    with strategy.scope():
        model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
        model.compile("sgd", "mse")
    return model


@pytest.mark.fast
def test_empty_input(small_model):
    import tensorflow as tf

    with pytest.raises(ValueError, match="0 samples"):
        small_model.fit(np.zeros((0, 3)), np.zeros((0,)), verbose=0)
    empty = tf.data.Dataset.from_tensor_slices(
        (np.zeros((0, 3)), np.zeros((0,)))
    ).batch(4)
    with pytest.raises(ValueError, match="no batch"):
        small_model.fit(empty, verbose=0)

    def nothing():
        return
        yield

    with pytest.raises(ValueError, match="(no batch|at least one batch)"):
        small_model.predict(nothing(), verbose=0)


@pytest.mark.fast
def test_infinite_input_without_steps(small_model):
    import tensorflow as tf

    infinite = (
        tf.data.Dataset.from_tensor_slices((np.ones((8, 3)), np.ones((8,))))
        .batch(4)
        .repeat()
    )
    with pytest.raises(ValueError, match="infinite.*steps_per_epoch"):
        small_model.fit(infinite, verbose=0)
    with pytest.raises(ValueError, match="infinite.*steps"):
        small_model.evaluate(infinite, verbose=0)
    history = small_model.fit(infinite, steps_per_epoch=3, verbose=0)
    assert len(history.history["loss"]) == 1
    data = (np.ones((8, 3)), np.ones((8,)))
    with pytest.raises(ValueError, match="validation_data.*validation_steps"):
        small_model.fit(*data, validation_data=infinite, verbose=0)
    with pytest.raises(ValueError, match="validation_data.*0 samples"):
        small_model.fit(
            *data, validation_data=(np.ones((0, 3)), np.ones((0,))), verbose=0
        )


@pytest.mark.fast
def test_batches_whose_shapes_or_structure_differ(small_model):
    def shapes():
        yield np.zeros((4, 3)), np.zeros((4,))
        yield np.zeros((4, 5)), np.zeros((4,))

    with pytest.raises(
        Exception,
        match="(first.*batch.*dimension|not compatible with expected)",
    ):
        small_model.fit(shapes(), verbose=0)

    def structures():
        yield np.zeros((4, 3)), np.zeros((4,))
        yield (np.zeros((4, 3)),), np.zeros((4,))

    with pytest.raises(ValueError, match="structure"):
        small_model.fit(structures(), verbose=0)


@pytest.mark.fast
def test_steps_per_epoch_longer_than_the_data(small_model):
    x, y = np.ones((8, 3)), np.ones((8,))
    with pytest.warns(UserWarning, match="ran out of data"):
        history = small_model.fit(
            x, y, batch_size=4, steps_per_epoch=5, epochs=3, verbose=0
        )
    # Each epoch sees the 2 batches there are, warns, and ends: no hang.
    assert len(history.history["loss"]) == 3

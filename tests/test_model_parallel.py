"""ModelParallel and ShardedDataParallel train exactly like one device.

JAX: 4 simulated CPU devices, meshes 2x2, 1x4 and 4x1 and a 1-D ZeRO-3
mesh, each against plain Keras on one device from the same weights; the
bytes each device holds are read from the arrays' shards. TensorFlow: the
clear error. torch has its own multi-process tests
(tests/torch/test_torch_model_parallel.py). The plan and layout-map checks
are backend-free and run everywhere.
"""

import warnings

import keras
import numpy as np
import pytest

import keras_dist
from keras_dist._src import plan as plan_lib
from tests.utils import max_relative_difference

BACKEND = keras.backend.backend()
jax_only = pytest.mark.skipif(BACKEND != "jax", reason="JAX layouts")
TOLERANCE = 1e-5
# 70 samples, global batch 16: the last batch of each epoch has 6 samples
# (split over a batch axis of 2, replicated over one of 4).
N, BATCH, EPOCHS = 70, 16, 2


def build():
    """Conv2D + BatchNormalization + two Dense layers, named for layouts."""
    keras.utils.set_random_seed(3)
    inputs = keras.Input((6, 6, 1))
    h = keras.layers.Conv2D(4, 3, activation="tanh", name="conv")(inputs)
    h = keras.layers.BatchNormalization(name="bn")(h)
    h = keras.layers.Flatten(name="flat")(h)
    h = keras.layers.Dense(16, activation="tanh", name="hidden")(h)
    outputs = keras.layers.Dense(4, activation="softmax", name="out")(h)
    return keras.Model(inputs, outputs)


def compile_model(model):
    model.compile(
        optimizer=keras.optimizers.Adam(0.01),
        loss="sparse_categorical_crossentropy",
        metrics=["accuracy"],
    )


def data():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(N, 6, 6, 1)).astype("float32")
    y = rng.integers(0, 4, N)
    sw = rng.uniform(0.5, 2.0, N).astype("float32")
    return x, y, sw


def train(model):
    x, y, sw = data()
    history = model.fit(
        x, y, sample_weight=sw, batch_size=BATCH, epochs=EPOCHS,
        shuffle=False, verbose=0,
    )  # fmt: skip
    evaluation = model.evaluate(x, y, batch_size=BATCH, verbose=0)
    predictions = model.predict(x, batch_size=BATCH, verbose=0)
    return model.get_weights(), history.history, evaluation, predictions


def layout_map(mesh):
    layouts = keras_dist.LayoutMap(mesh)
    layouts["conv/kernel"] = (None, None, None, "model")
    layouts["hidden/kernel"] = (None, "model")
    layouts["hidden/bias"] = ("model",)
    layouts["out/kernel"] = ("model", None)
    return layouts


# -- plans and layout maps (every backend) ------------------------------------
def test_layout_map_follows_keras_semantics():
    mesh = keras_dist.DeviceMesh((2, 2), ("batch", "model"), ["cpu:0"] * 4)
    layouts = keras_dist.LayoutMap(mesh)
    layouts[".*dense.*/kernel"] = (None, "model")
    layouts["emb/embeddings"] = (("batch", "model"), None)
    assert layouts["model/dense_3/kernel"] == (None, "model")
    assert layouts["emb/embeddings"] == (("batch", "model"), None)
    assert layouts["dense/bias"] is None  # no key: replicated
    layouts["dense_3/kernel"] = ("model", None)  # an exact key wins
    assert layouts["dense_3/kernel"] == ("model", None)
    layouts[".*_3/kernel"] = ("model", None)
    with pytest.raises(keras_dist.LayoutError, match="several LayoutMap"):
        layouts["x/dense_3/kernel"]
    for bad, message in [
        (("data", None), "does not have"),
        (("model", "model"), "twice"),
        ("model", "one entry per"),
    ]:
        with pytest.raises(keras_dist.LayoutError, match=message):
            layouts["other"] = bad


def test_keras_layout_map_is_accepted_as_it_is():
    keras_mesh = keras.distribution.DeviceMesh(
        (1, 1), ["batch", "model"], devices=["cpu:0"]
    )
    keras_map = keras.distribution.LayoutMap(keras_mesh)
    keras_map[".*kernel"] = (None, "model")
    ours = keras_dist.LayoutMap.from_any(keras_map)
    assert ours.device_mesh.axis_names == ("batch", "model")
    assert ours["hidden/kernel"] == (None, "model")


def test_plan_checks_name_the_variable_shape_and_axis():
    mesh = keras_dist.DeviceMesh((2, 2), ("batch", "model"), ["cpu:0"] * 4)
    plan = plan_lib.LayoutPlan(
        "mirrored", ("cpu:0",), mesh, "batch", layout_map=layout_map(mesh)
    )
    with pytest.raises(keras_dist.LayoutError, match=r"out/kernel.*\(5, 4\)"):
        plan_lib.check_variable_layout(
            plan, "out/kernel", (5, 4), ("model", None)
        )
    with pytest.raises(keras_dist.LayoutError, match="2 entries"):
        plan_lib.check_variable_layout(plan, "hidden/bias", (16,), (None, None))
    with pytest.raises(keras_dist.LayoutError, match="nearest paths"):
        plan_lib.check_unmatched(
            plan, ["conv/kernel", "hidden/kernel", "hidden/bias"], "m"
        )
    sharded = plan_lib.ShardedPlan(
        "mirrored", ("cpu:0",), keras_dist.DeviceMesh((4,), ("batch",)),
        "batch", min_size=64,
    )  # fmt: skip
    assert sharded.variable_layout("k", (6, 16)) == (None, "batch")
    assert sharded.variable_layout("k", (12, 8)) == ("batch", None)
    assert sharded.variable_layout("b", (16,)) is None  # under min_size
    assert sharded.variable_layout("k", (9, 15)) is None  # nothing divides


@pytest.mark.skipif(BACKEND != "tensorflow", reason="TensorFlow's answer")
def test_tensorflow_refuses_layouts_with_the_reason():
    mesh = keras_dist.DeviceMesh((2, 2), ("batch", "model"))
    with pytest.raises(keras_dist.UnsupportedBackendError, match="prototype"):
        keras_dist.ModelParallel(layout_map(mesh))
    with pytest.raises(keras_dist.UnsupportedBackendError, match="jax"):
        keras_dist.ShardedDataParallel()


# -- JAX: parity with one device ----------------------------------------------
@pytest.fixture(scope="module")
def reference():
    """Plain Keras on one device: no keras_dist involved."""
    model = build()
    compile_model(model)
    initial = model.get_weights()
    return initial, train(model)


def _strategies():
    def model_parallel(shape, devices=None):
        mesh = keras_dist.DeviceMesh(shape, ("batch", "model"), devices)
        return keras_dist.ModelParallel(layout_map(mesh), "batch")

    def over_both_axes():
        # A dimension split over the product of two axes (the guide's
        # tuple entry): Keras's own TensorLayout refuses the tuple.
        mesh = keras_dist.DeviceMesh((2, 2), ("batch", "model"))
        layouts = keras_dist.LayoutMap(mesh)
        layouts["hidden/kernel"] = (("batch", "model"), None)
        layouts["out/kernel"] = ("model", None)
        return keras_dist.ModelParallel(layouts, "batch")

    return {
        "mp2x2": lambda: model_parallel((2, 2)),
        "mp1x4": lambda: model_parallel((1, 4)),
        "mp4x1": lambda: model_parallel((4, 1)),
        "mp2x2_product": over_both_axes,
        # A script sized by its device count, run where there is one (a
        # one-GPU machine): Keras leaves the arrays single-device.
        "mp1x1": lambda: model_parallel((1, 1), ["cpu:0"]),
        "zero3": lambda: keras_dist.ShardedDataParallel(min_size=16),
    }


def _bytes_per_device(model):
    """Bytes of model and optimizer state on device 0, from the shards."""
    device = keras_dist_devices()[0]
    total = 0
    for v in model.variables + model.optimizer.variables:
        for shard in v.value.addressable_shards:
            if shard.device == device:
                total += shard.data.nbytes
    return total


def keras_dist_devices():
    import jax

    return jax.devices()


@jax_only
@pytest.mark.multi_device
@pytest.mark.parametrize(
    "name", ["mp2x2", "mp1x4", "mp4x1", "mp2x2_product", "mp1x1", "zero3"]
)
def test_parity_with_one_device(name, reference):
    initial, (weights, history, evaluation, predictions) = reference
    strategy = _strategies()[name]()
    with strategy.scope():
        model = build()
        model.set_weights(initial)
        compile_model(model)
    got = train(model)
    assert max_relative_difference(weights, got[0]) <= TOLERANCE
    for key in history:
        np.testing.assert_allclose(got[1][key], history[key], rtol=1e-5)
    np.testing.assert_allclose(got[2], evaluation, rtol=1e-5)
    np.testing.assert_allclose(got[3], predictions, atol=1e-5)
    rows = strategy.describe(model, print_fn=None)
    by_path = {r["path"]: r for r in rows}
    if name == "mp2x2":
        assert by_path["hidden/kernel"]["layout"] == (None, "model")
        # (64, 16) float32 split in 2 along "model".
        assert by_path["hidden/kernel"]["bytes_per_device"] == 64 * 16 * 2
        # Adam's slots follow their variable's layout.
        slot = [r for r in rows if r["path"].endswith("hidden_kernel_momentum")]
        assert slot[0]["layout"] == (None, "model")
    if name == "mp2x2_product":
        product = (("batch", "model"), None)
        assert by_path["hidden/kernel"]["layout"] == product
        assert by_path["hidden/kernel"]["bytes_per_device"] == 64 * 16
        slot = [r for r in rows if r["path"].endswith("hidden_kernel_momentum")]
        assert slot[0]["layout"] == product
    measured = _bytes_per_device(model)
    described = sum(
        r["bytes_per_device"] for r in rows if r["group"] != "metrics"
    )
    assert measured == described
    full = sum(
        int(np.prod(v.shape)) * 4
        for v in model.variables + model.optimizer.variables
    )
    if name == "zero3":
        # Every variable of >= 16 elements is split 4 ways.
        assert measured < 0.3 * full, (measured, full)
    elif name not in ("mp4x1", "mp1x1"):
        assert measured < full


def test_optimizer_slots_estimate_the_state_before_it_is_built():
    from keras_dist._src.strategy import optimizer_slots

    opt = keras.optimizers
    assert optimizer_slots(opt.SGD()) == 0
    assert optimizer_slots(opt.SGD(momentum=0.9)) == 1
    assert optimizer_slots(opt.Adam()) == 2
    assert optimizer_slots(opt.Adam(amsgrad=True)) == 3
    assert optimizer_slots(opt.RMSprop(momentum=0.5, centered=True)) == 3

    class Custom(opt.SGD):
        pass

    assert optimizer_slots(Custom()) is None  # unknown: not guessed


@jax_only
@pytest.mark.multi_device
def test_describe_before_the_first_step_says_what_is_missing():
    # Keras builds the optimizer's slots at the first step: a table of the
    # model's variables alone understated a device's bytes by two thirds.
    strategy = _strategies()["mp2x2"]()
    with strategy.scope():
        model = build()
        compile_model(model)
    with pytest.warns(UserWarning, match="optimizer is not built yet"):
        before = strategy.describe(model, print_fn=None)
    with strategy.scope():
        model.optimizer.build(model.trainable_variables)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        after = strategy.describe(model, print_fn=None)
    assert len(after) > len(before)
    slot = [r for r in after if r["path"].endswith("hidden_kernel_momentum")]
    assert slot[0]["layout"] == (None, "model")
    # The expected peak per device, in float32 elements on the 2x2 mesh:
    # conv/kernel 36 / 2, hidden/kernel 1024 / 2, hidden/bias 16 / 2 and
    # out/kernel 64 / 2 split over "model"; conv/bias 4, bn 4 x 4 and
    # out/bias 4 whole. Trainable: all but bn's two moving statistics.
    parameters = 4 * (18 + 4 + 16 + 512 + 8 + 32 + 4)
    gradients = parameters - 4 * 8
    largest = 4 * 1024  # hidden/kernel, whole
    estimate = before.expected_peak
    assert estimate == {
        "parameters": parameters,
        "optimizer_state": 2 * gradients,  # Adam: two moments
        "optimizer_state_estimated": True,
        "gradients": gradients,
        "largest_variable": largest,
        "total": parameters + 3 * gradients + largest,
    }
    # Built: Adam's moments plus its iteration count and learning rate.
    built = after.expected_peak
    extra = sum(
        r["bytes_per_device"]
        for r in after
        if r["path"].endswith(("iteration", "learning_rate"))
    )
    assert extra in (8 + 4, 4 + 4)  # int64 iteration, or int32 in JAX
    assert built["optimizer_state"] == 2 * gradients + extra
    assert not built["optimizer_state_estimated"]
    assert built["total"] == estimate["total"] + extra
    lines = []
    strategy.describe(model, print_fn=lines.append)
    assert f"  total              {built['total']}" in lines[0]


@jax_only
@pytest.mark.multi_device
def test_describe_draws_the_mesh_and_each_variable_placement(capsys):
    # A table of tuples told where a variable lives only to who could read
    # a layout; the picture names the devices at each place of the mesh.
    strategy = _strategies()["mp2x2_product"]()
    with strategy.scope():
        model = build()
        compile_model(model)
        model.optimizer.build(model.trainable_variables)
    rows = strategy.describe(model)
    lines = capsys.readouterr().out.splitlines()
    assert lines[:5] == [
        "mesh (2, 2) ('batch', 'model'):",
        "         model=0  model=1",
        "batch=0  cpu:0    cpu:1",
        "batch=1  cpu:2    cpu:3",
        "placement of the model's variables:",
    ]
    assert (
        "  hidden/kernel (64, 16): dim 0 of 64 split in 4 over batch+model"
        in (lines)
    )
    assert "  out/kernel (16, 4): dim 0 of 16 split in 2 over model" in lines
    assert "  out/bias (4,): whole on every device" in lines
    table = lines.index("") + 1
    assert lines[table].split() == ["path", "shape", "layout", "bytes/device"]
    # One line a variable, in the order of the returned rows (then the
    # total and the expected peak per device).
    body = lines[table + 1 : table + 1 + len(rows)]
    assert [line.split()[0] for line in body] == [r["path"] for r in rows]


@jax_only
@pytest.mark.multi_device
@pytest.mark.parametrize("first", ["fit", "predict"])
def test_a_model_its_first_call_builds_gets_its_layouts(first):
    """A model made in the scope without an input shape is built by its
    first `fit` (Keras's symbolic build) or `predict` (a call): its
    variables and Adam's slots still get their layouts, and training
    equals one device."""

    def unbuilt():
        return keras.Sequential(
            [
                keras.layers.Dense(16, activation="tanh", name="hidden"),
                keras.layers.Dense(4, name="out"),
            ]
        )

    rng = np.random.default_rng(1)
    x = rng.normal(size=(20, 6)).astype("float32")
    y = rng.normal(size=(20, 4)).astype("float32")
    keras.utils.set_random_seed(5)
    plain = unbuilt()
    plain.build((None, 6))
    initial = plain.get_weights()
    plain.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
    plain.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
    layouts = keras_dist.LayoutMap(
        keras_dist.DeviceMesh((2, 2), ("batch", "model"))
    )
    layouts[".*hidden/kernel"] = (None, "model")
    layouts[".*out/kernel"] = ("model", None)
    strategy = keras_dist.ModelParallel(layouts, "batch")
    with strategy.scope():
        model = unbuilt()
        model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
    # The same initial weights, set once the model has its variables.
    callbacks = [
        keras.callbacks.LambdaCallback(
            on_train_begin=lambda logs: model.set_weights(initial)
        )
    ]
    if first == "predict":
        model.predict(x, batch_size=8, verbose=0)
    model.fit(
        x, y, batch_size=8, epochs=1, shuffle=False, verbose=0,
        callbacks=callbacks,
    )  # fmt: skip
    difference = max_relative_difference(
        plain.get_weights(), model.get_weights()
    )
    assert difference <= TOLERANCE
    got = {r["path"]: r["layout"] for r in strategy.describe(model, None)}
    name = model.name
    assert got[f"{name}/hidden/kernel"] == (None, "model")
    assert got[f"{name}/out/kernel"] == ("model", None)
    slots = [p for p in got if p.endswith("hidden_kernel_momentum")]
    assert slots and got[slots[0]] == (None, "model"), sorted(got)


@jax_only
@pytest.mark.multi_device
def test_layout_errors_are_clear():
    mesh = keras_dist.DeviceMesh((2, 2), ("batch", "model"))
    layouts = keras_dist.LayoutMap(mesh)
    layouts["hiden/kernel"] = (None, "model")  # a typo matches nothing
    strategy = keras_dist.ModelParallel(layouts)
    with pytest.raises(keras_dist.LayoutError, match="hidden/kernel"):
        with strategy.scope():
            compile_model(build())
    # A regex key whose paths exact keys take first says so.
    layouts = keras_dist.LayoutMap(mesh)
    layouts["hidden/kernel"] = (None, "model")
    layouts["hidden/ker.*"] = ("model", None)
    with pytest.raises(keras_dist.LayoutError, match="exact keys take them"):
        with keras_dist.ModelParallel(layouts).scope():
            compile_model(build())
    # An empty map would shard nothing.
    strategy = keras_dist.ModelParallel(keras_dist.LayoutMap(mesh))
    with pytest.raises(keras_dist.LayoutError, match="empty"):
        with strategy.scope():
            compile_model(build())
    layouts = keras_dist.LayoutMap(mesh)
    layouts["out/kernel"] = (None, "model")  # 4 classes: fine; 3 would not
    layouts["conv/kernel"] = ("model", None, None, None)  # 3 % 2 != 0
    strategy = keras_dist.ModelParallel(layouts)
    with pytest.raises(keras_dist.LayoutError, match=r"conv/kernel.*\(3, 3"):
        with strategy.scope():
            build()
    with pytest.raises(keras_dist.LayoutError, match="needs 8 devices"):
        keras_dist.ModelParallel(
            keras_dist.LayoutMap(keras_dist.DeviceMesh((2, 4), ("a", "b")))
        )
    model = build()  # outside any scope
    strategy = keras_dist.ModelParallel(layout_map(mesh))
    with pytest.raises(keras_dist.VariablesOutsideScopeError):
        with strategy.scope():
            compile_model(model)


@jax_only
@pytest.mark.multi_device
def test_checkpoint_moves_between_layouts(tmp_path, reference):
    """A 2x2 ModelParallel checkpoint restores into ShardedDataParallel,
    Mirrored and one device, with the same values."""
    initial, _ = reference
    x, y, sw = data()
    mesh = keras_dist.DeviceMesh((2, 2), ("batch", "model"))
    strategy = keras_dist.ModelParallel(layout_map(mesh))
    with strategy.scope():
        model = build()
        model.set_weights(initial)
        compile_model(model)
    model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    keras_dist.checkpoint.save(model, tmp_path, step=5)
    saved = [np.asarray(v) for v in model.get_weights()]
    for target in (
        keras_dist.ShardedDataParallel(min_size=16),
        keras_dist.MirroredStrategy(),
        None,
    ):
        if target is None:
            other = build()
            compile_model(other)
        else:
            with target.scope():
                other = build()
                compile_model(other)
        keras_dist.checkpoint.restore(other, tmp_path)
        assert max_relative_difference(saved, other.get_weights()) == 0.0


@jax_only
@pytest.mark.multi_device
def test_sharded_embedding_trains_row_sharded_like_one_device():
    """The parameter-server model file on JAX: `ShardedEmbedding`'s table
    row-sharded over "model" by a LayoutMap (2x2 mesh) trains like Keras's
    `Embedding` on one device."""

    def make():
        keras.utils.set_random_seed(5)
        ids = keras.Input((3,), dtype="int32")
        h = keras_dist.layers.ShardedEmbedding(12, 4, name="table")(ids)
        h = keras.layers.GlobalAveragePooling1D()(h)
        model = keras.Model(ids, keras.layers.Dense(1, name="head")(h))
        model.compile(optimizer=keras.optimizers.Adam(0.05), loss="mse")
        return model

    rng = np.random.default_rng(0)
    ids = rng.integers(0, 12, (40, 3)).astype("int32")
    target = rng.normal(size=(40, 1)).astype("float32")
    reference = make()
    initial = reference.get_weights()
    reference.fit(ids, target, batch_size=8, epochs=2, shuffle=False, verbose=0)
    mesh = keras_dist.DeviceMesh((2, 2), ("batch", "model"))
    layouts = keras_dist.LayoutMap(mesh)
    layouts[".*table/embeddings"] = ("model", None)
    strategy = keras_dist.ModelParallel(layouts, "batch")
    with strategy.scope():
        model = make()
        model.set_weights(initial)
    model.fit(ids, target, batch_size=8, epochs=2, shuffle=False, verbose=0)
    table = [r for r in strategy.describe(model, print_fn=None)
             if r["path"].endswith("table/embeddings")][0]  # fmt: skip
    assert table["layout"] == ("model", None)
    assert table["bytes_per_device"] == 12 * 4 * 4 // 2
    assert (
        max_relative_difference(reference.get_weights(), model.get_weights())
        <= TOLERANCE
    )

"""Activations under layouts: Keras's ``"…/output"`` LayoutMap keys and
rematerialization (`keras.RematScope`, `keras.remat`).

The key checks are backend-free. JAX (4 simulated devices): a model with
an output key trains as plain Keras on one device does, and the key is a
sharding constraint in the step and on a layer called by hand; models
built in ``RematScope(mode="full")`` or computing through `keras.remat`
train under ModelParallel and ShardedDataParallel as plain Keras on one
device; and the activation memory that remat saves is printed (XLA's
``memory_analysis`` of the compiled gradient, nothing asserted). torch's
counterparts run in the shared torch job
(tests/torch/test_torch_layer_calls.py).
"""

import contextlib

import keras
import numpy as np
import pytest

import keras_dist
from keras_dist._src import plan as plan_lib
from keras_dist._src.keras_glue import internals as glue
from tests.utils import max_relative_difference

BACKEND = keras.backend.backend()
jax_only = pytest.mark.skipif(BACKEND != "jax", reason="JAX layouts")


class RematDense(keras.layers.Layer):
    """A Dense layer computed through `keras.remat` (recomputed in the
    backward pass), as Keras's example of `keras.remat` does inside a
    layer's call."""

    def __init__(self, width, **kwargs):
        super().__init__(**kwargs)
        self.dense = keras.layers.Dense(width, activation="tanh", name="inner")

    def build(self, shape):
        self.dense.build(shape)

    def call(self, h):
        # A function made at each call: JAX's checkpoint caches its trace
        # by the function object, and `keras.remat(self.dense)` reuses the
        # trace of an earlier `jit` (plain Keras fails alike: "Array has
        # been deleted" in `predict` after `fit`).
        return keras.remat(lambda x: self.dense(x))(h)


def build(width=32, depth=2, remat=None, remat_fn=False, features=8):
    """Dense layers named for layouts; optionally built in a RematScope
    or computing through `keras.remat` (no `clear_session`: it would
    end the strategy's scope)."""
    keras.utils.set_random_seed(5)
    scope = keras.RematScope(mode=remat) if remat else None
    if scope:
        scope.__enter__()
    inputs = keras.Input((features,))
    h = inputs
    for i in range(depth):
        name = "hidden" if i == 0 else f"hidden_{i}"
        if remat_fn:
            h = RematDense(width, name=name)(h)
        else:
            h = keras.layers.Dense(width, activation="tanh", name=name)(h)
    outputs = keras.layers.Dense(4, name="out")(h)
    if scope:
        scope.__exit__(None, None, None)
    model = keras.Model(inputs, outputs)
    model.compile(
        optimizer=keras.optimizers.SGD(0.1, momentum=0.5),
        loss="mse",
    )
    return model


def data(n=48, features=8):
    rng = np.random.default_rng(1)
    x = rng.normal(size=(n, features)).astype("float32")
    return x, rng.normal(size=(n, 4)).astype("float32")


def train(model):
    x, y = data()
    model.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
    return model.get_weights(), model.predict(x, batch_size=16, verbose=0)


def reference(**kwargs):
    """Plain Keras on one device: initial weights and results."""
    model = build(**kwargs)
    initial = model.get_weights()
    return initial, train(model)


def output_map(mesh):
    layouts = keras_dist.LayoutMap(mesh)
    layouts["hidden/kernel"] = (None, "model")
    layouts["hidden/output"] = ("batch", "model")
    return layouts


# -- the keys (every backend) -------------------------------------------------
def test_output_keys_lay_out_outputs_and_only_outputs():
    mesh = keras_dist.DeviceMesh((2, 2), ("batch", "model"), ["cpu:0"] * 4)
    layouts = keras_dist.LayoutMap(mesh)
    layouts[".*hidden.*"] = (None, "model")  # a variable key
    layouts["hidden.*/output"] = ("batch", "model")
    assert layouts["hidden/kernel"] == (None, "model")
    assert layouts["hidden/output"] == ("batch", "model")
    assert layouts["out/output"] is None
    plan = plan_lib.LayoutPlan(
        "mirrored", ("cpu:0",), mesh, "batch", layout_map=layouts
    )
    assert plan.output_keys() == ["hidden.*/output"]
    assert plan.output_layout("hidden_1/output") == ("batch", "model")
    # Output keys are checked against the layers' call paths (a nested
    # subclassed model's name comes first), variable keys against
    # variable paths.
    model = build()
    paths = plan_lib.layer_output_paths(model, glue.flatten_layers)
    assert "hidden/output" in paths and "out/output" in paths
    plan_lib.check_unmatched(plan, paths, "model")
    plan_lib.check_unmatched(plan, [v.path for v in model.variables], "m")
    layouts["hiden/output"] = (None, "model")  # a typo
    with pytest.raises(keras_dist.LayoutError, match="no layer output"):
        plan_lib.check_unmatched(plan, paths, "model")


# -- JAX ----------------------------------------------------------------------
@jax_only
@pytest.mark.multi_device
def test_output_keys_constrain_layer_outputs_like_keras(monkeypatch):
    import jax

    initial, (weights, predictions) = reference()
    constrained = []
    keep = jax.lax.with_sharding_constraint

    def counted(x, sharding):
        constrained.append(sharding.spec)
        return keep(x, sharding)

    monkeypatch.setattr(jax.lax, "with_sharding_constraint", counted)
    mesh = keras_dist.DeviceMesh((2, 2), ("batch", "model"))
    strategy = keras_dist.ModelParallel(output_map(mesh), "batch")
    with strategy.scope():
        model = build()
        model.set_weights(initial)
    got = train(model)
    assert max_relative_difference(weights, got[0]) <= 1e-5
    np.testing.assert_allclose(got[1], predictions, atol=1e-5)
    spec = jax.sharding.PartitionSpec("batch", "model")
    assert constrained and set(constrained) == {spec}
    # A layer called by hand: its output takes the key's layout too.
    x, _ = data()
    out = model.get_layer("hidden")(x[:8])
    assert out.sharding.spec == spec
    # One entry per dimension of the output.
    layouts = keras_dist.LayoutMap(mesh)
    layouts["hidden/output"] = ("batch", None, "model")
    with keras_dist.ModelParallel(layouts, "batch").scope():
        model = build()
    with pytest.raises(keras_dist.LayoutError, match="3 entries.*2 dim"):
        train(model)


@jax_only
@pytest.mark.multi_device
@pytest.mark.parametrize("how", ["scope", "function"])
def test_remat_under_layouts_matches_one_device(how):
    kwargs = {"remat": "full"} if how == "scope" else {"remat_fn": True}
    initial, (weights, predictions) = reference(**kwargs)
    mesh = keras_dist.DeviceMesh((2, 2), ("batch", "model"))
    layouts = keras_dist.LayoutMap(mesh)
    layouts["hidden.*/kernel"] = (None, "model")
    layouts["hidden/output"] = ("batch", "model")
    for strategy in (
        keras_dist.ModelParallel(layouts, "batch"),
        keras_dist.ShardedDataParallel(min_size=16),
    ):
        with strategy.scope():
            model = build(**kwargs)
            model.set_weights(initial)
        got = train(model)
        assert max_relative_difference(weights, got[0]) <= 1e-5
        np.testing.assert_allclose(got[1], predictions, atol=1e-5)


class Block(keras.layers.Layer):
    """A residual MLP block (width -> 4 width -> width): what remat keeps
    only the input of, where it is rematerialized."""

    def __init__(self, width, **kwargs):
        super().__init__(**kwargs)
        self.up = keras.layers.Dense(4 * width, activation="relu", name="up")
        self.down = keras.layers.Dense(width, name="down")

    def build(self, shape):
        self.up.build(shape)
        self.down.build(tuple(shape[:-1]) + (self.up.units,))

    def call(self, h):
        return h + self.down(self.up(h))


@jax_only
@pytest.mark.multi_device
@pytest.mark.slow
def test_remat_activation_memory_is_reported():
    """Prints XLA's temporary bytes per device and the matrix products in
    the compiled gradient of 4 residual MLP blocks (256 -> 1024 -> 256,
    batch 64 of 64 positions: the activations outweigh the weights) on a
    2x2 mesh, with and without ``RematScope(mode="full")``; asserts
    nothing about them."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec

    mesh = keras_dist.DeviceMesh((2, 2), ("batch", "model"))
    layouts = keras_dist.LayoutMap(mesh)
    layouts["block_.*/up/kernel"] = (None, "model")
    layouts["block_.*/down/kernel"] = ("model", None)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(64, 64, 256)).astype("float32")
    y = rng.normal(size=(64, 64, 256)).astype("float32")
    found = {}
    for remat in (None, "full"):
        with keras_dist.ModelParallel(layouts, "batch").scope():
            with (
                keras.RematScope(mode=remat)
                if remat
                else contextlib.nullcontext()
            ):
                inputs = keras.Input((64, 256))
                h = inputs
                for i in range(4):
                    h = Block(256, name=f"block_{i}")(h)
            model = keras.Model(inputs, h)
        trainable = [v.value for v in model.trainable_variables]
        jax_mesh = trainable[0].sharding.mesh
        batch = NamedSharding(jax_mesh, PartitionSpec("batch"))

        def loss(trainable, x, y, model=model):
            out, _ = model.stateless_call(trainable, [], x, training=True)
            return jnp.mean((out - y) ** 2)

        gradient = jax.jit(jax.grad(loss))
        placed = [jax.device_put(a, batch) for a in (x, y)]
        traced = str(jax.make_jaxpr(jax.grad(loss))(trainable, x, y))
        compiled = gradient.lower(trainable, *placed).compile()
        found[remat] = (
            compiled.memory_analysis().temp_size_in_bytes,
            traced.count("dot_general"),
            compiled.as_text().count(" dot("),
        )
    print(
        "\nOne gradient of 4 MLP blocks, batch 64 x 64 positions, "
        "ModelParallel 2x2 on CPU: (XLA temp bytes per device, matrix "
        "products traced, matrix products compiled)\n"
        f"  without remat: {found[None]}\n"
        f"  RematScope(mode='full'): {found['full']}"
    )

"""torch layouts outside `fit`: layers called by hand (a sampler's greedy
`generate`), Keras's ``"…/output"`` layout keys, and rematerialization
(`keras.RematScope`, `keras.remat`), against plain Keras on one device.

One part of the shared 2-rank torch job (`register_torch_part`) trains a
tiny causal language model (Embedding -> Dense -> Dense to the
vocabulary) under `ModelParallel` (1x2 mesh: the table split by rows, a
kernel by columns; also as a subclassed model built by a first call on
data in the scope) and `ShardedDataParallel`, then generates 3 tokens by
calling the layers one by one, as KerasHub's samplers call
``backbone.token_embedding``; once more with an ``"hidden/output"`` key
and the layers built in ``RematScope(mode="full")``, and under
`ShardedDataParallel` with a layer that computes through `keras.remat`.
The test process trains the same models with plain Keras from rank 0's
initial weights and generates alike.
"""

from __future__ import annotations

import json
import pathlib

import numpy as np
import pytest

keras = pytest.importorskip("keras")
if keras.backend.backend() != "torch":
    pytest.skip("needs KERAS_BACKEND=torch", allow_module_level=True)

from tests.utils import (  # noqa: E402
    max_relative_difference,
    register_torch_part,
)

#: The model, data and sampler: run by the part and, for the one-device
#: reference, by plain Keras in the test process.
MODEL = """
import numpy as np
import keras

V, L = 16, 6
rng = np.random.default_rng(0)
ids = rng.integers(0, V, size=(36, L + 1))
x, y = ids[:, :-1], ids[:, 1:]
prompt = ids[:2, :3]


class RematMLP(keras.layers.Layer):
    # Computes through keras.remat (recomputed in the backward pass).
    def build(self, shape):
        self.dense = keras.layers.Dense(12, activation="tanh", name="inner")
        self.dense.build(shape)

    def call(self, h):
        return keras.remat(self.dense)(h)


class Subclassed(keras.Model):
    def __init__(self):
        super().__init__(name="lm")
        self.embedding = keras.layers.Embedding(V, 8, name="embedding")
        self.hidden = keras.layers.Dense(12, activation="tanh", name="hidden")
        self.head = keras.layers.Dense(V, name="head")

    def build(self, shape):
        self.embedding.build(shape)
        self.hidden.build(shape + (8,))
        self.head.build(shape + (12,))

    def call(self, ids):
        return self.head(self.hidden(self.embedding(ids)))


def before_compile(model):
    pass  # the part records which variables are split already


def compile_model(model):
    before_compile(model)
    model.compile(
        keras.optimizers.SGD(0.5, momentum=0.5),
        keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    return model


def build(seed, remat=None, remat_fn=False, subclassed=False):
    keras.backend.clear_session()  # the same layer names every time
    keras.utils.set_random_seed(seed)
    if subclassed:
        # Built (its own `build`) by its first call, eagerly, on data.
        model = Subclassed()
        model(x[:2])
        return compile_model(model)
    scope = keras.RematScope(mode=remat) if remat else None
    if scope:
        scope.__enter__()
    inp = keras.Input((None,), dtype="int32")
    h = keras.layers.Embedding(V, 8, name="embedding")(inp)
    hidden = RematMLP if remat_fn else keras.layers.Dense
    kwargs = {} if remat_fn else {"units": 12, "activation": "tanh"}
    h = hidden(name="hidden", **kwargs)(h)
    logits = keras.layers.Dense(V, name="head")(h)
    if scope:
        scope.__exit__(None, None, None)
    return compile_model(keras.Model(inp, logits))


def generate(model, tokens, steps=3):
    # A sampler: the layers called one by one, not model(...).
    layers = [model.get_layer(n) for n in ("embedding", "hidden", "head")]
    every = []
    for _ in range(steps):
        h = keras.ops.convert_to_tensor(tokens)
        for layer in layers:
            h = layer(h)
        logits = keras.ops.convert_to_numpy(h)[:, -1]
        every.append(logits.tolist())
        tokens = np.concatenate([tokens, logits.argmax(-1)[:, None]], 1)
    return every, tokens.tolist()


def train_and_generate(model):
    model.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0)
    logits, tokens = generate(model, prompt)
    weights = [w.tolist() for w in model.get_weights()]
    return {"logits": logits, "tokens": tokens, "weights": weights}
"""

#: name -> (strategy expression, build() keyword arguments).
CASES = {
    "mp": ("keras_dist.ModelParallel(layout_map(), 'batch')", {}),
    "sdp": ("keras_dist.ShardedDataParallel(min_size=16)", {}),
    "mp_subclassed": (
        "keras_dist.ModelParallel(layout_map(), 'batch')",
        {"subclassed": True},
    ),
    "mp_output_remat": (
        "keras_dist.ModelParallel(layout_map(output=True), 'batch')",
        {"remat": "full"},
    ),
    "sdp_remat_fn": (
        "keras_dist.ShardedDataParallel(min_size=16)",
        {"remat_fn": True},
    ),
}

SCRIPT = (
    MODEL
    + f"""
import os, sys, time
import keras_dist

out = sys.argv[1]
rank = int(os.environ.get("RANK", 0))


def layout_map(output=False):
    mesh = keras_dist.DeviceMesh((1, 2), ("batch", "model"))
    layouts = keras_dist.LayoutMap(mesh)
    layouts["(lm/)?embedding/embeddings"] = ("model", None)
    layouts["(lm/)?hidden/kernel"] = (None, "model")
    if output:
        # Keras's activation key: the hidden features split over "model".
        layouts["hidden/output"] = ("batch", None, "model")
    return layouts


# Counted: the checkpoints Keras's torch remat makes, and the "/output"
# layouts applied.
import torch.utils.checkpoint as checkpoint
from keras_dist._src import plan as plan_lib
counts = {{"remat": 0, "output": 0}}
keras_checkpoint = checkpoint.checkpoint
def counted_checkpoint(*args, **kwargs):
    counts["remat"] += 1
    return keras_checkpoint(*args, **kwargs)
checkpoint.checkpoint = counted_checkpoint
output_layout = plan_lib.LayoutPlan.output_layout
def counted_output_layout(self, path):
    layout = output_layout(self, path)
    counts["output"] += layout is not None
    return layout
plan_lib.LayoutPlan.output_layout = counted_output_layout

from keras_dist._src.keras_glue import internals as glue
from torch.distributed.tensor import DTensor
split_at_build = []
def before_compile(model):
    split_at_build[:] = sorted(
        v.path for v in model.weights
        if isinstance(glue.variable_value(v), DTensor)
    )

result = {{}}
for name, (make, kwargs) in {CASES!r}.items():
    start = time.monotonic()
    counts.update(remat=0, output=0)
    strategy = eval(make)
    with strategy.scope():
        model = build(seed=rank, **kwargs)  # rank 0's weights are used
    init = [w.tolist() for w in model.get_weights()]
    result[name] = dict(train_and_generate(model), init=init)
    if name == "mp":
        # Keras's shape inference through a laid-out layer, by hand.
        spec = model.get_layer("hidden")(keras.Input((None, 8)))
        result[name]["symbolic"] = list(spec.shape)
    result[name]["split_at_build"] = list(split_at_build)
    result[name]["seconds"] = time.monotonic() - start
    result[name]["counts"] = dict(counts)
if rank == 0:
    with open(os.path.join(out, "result.json"), "w") as f:
        json.dump(result, f)
"""
)
SCRIPT = "import json\n" + SCRIPT

LAYER_CALLS = register_torch_part("layer_calls", SCRIPT)


@pytest.fixture(scope="module")
def reference_model():
    """The part's model source run here (plain Keras, one device)."""
    namespace = {}
    exec(MODEL, namespace)
    return namespace


@pytest.mark.multi_process
@pytest.mark.slow
@pytest.mark.torch_part(LAYER_CALLS)
@pytest.mark.parametrize("name", list(CASES))
def test_layers_called_by_hand_generate_as_one_device(
    name, torch_parts, reference_model
):
    out = torch_parts.output(LAYER_CALLS)
    got = json.loads((pathlib.Path(out) / "result.json").read_text())[name]
    print(f"{name}: {got['seconds']:.1f} s on the ranks")
    kwargs = CASES[name][1]
    model = reference_model["build"](seed=0, **kwargs)
    model.set_weights([np.asarray(w, "float32") for w in got["init"]])
    want = reference_model["train_and_generate"](model)
    weights = max_relative_difference(want["weights"], got["weights"])
    logits = np.abs(np.subtract(got["logits"], want["logits"])).max()
    print(f"{name}: weights {weights:.1e} (relative), logits {logits:.1e}")
    assert weights <= 1e-5
    np.testing.assert_allclose(
        got["logits"], want["logits"], rtol=1e-5, atol=1e-5
    )
    assert got["tokens"] == want["tokens"]
    counts = got["counts"]
    # Rematerialized where asked (every hidden call of the steps and of
    # the sampler), and the output key applied in every step and call.
    remat = bool(kwargs.get("remat") or kwargs.get("remat_fn"))
    assert (counts["remat"] > 0) == remat, counts
    assert (counts["output"] > 0) == (name == "mp_output_remat"), counts
    if name == "mp":
        assert got["symbolic"] == [None, None, 12]
    if name.startswith("mp"):
        # Split as they were made, before compile, functional or built by
        # a first call on data (whose outputs came back whole).
        prefix = "lm/" if kwargs.get("subclassed") else ""
        want_split = [f"{prefix}embedding/embeddings", f"{prefix}hidden/kernel"]
        assert got["split_at_build"] == want_split

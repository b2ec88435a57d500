"""torch layouts: optimizer updates on each rank's shards
(`backends/torch/shard_update.py`) equal one device for every optimizer
they apply to.

One script on 2 gloo processes trains the same MLP under ModelParallel on a
(1, 2) ("batch", "model") mesh (first kernel split by columns, its bias
split, second kernel split by rows) with each of Keras's elementwise torch
optimizers and a few of their options, and records whether the update ran
on the shards. The reference is plain Keras on one device in the test
process, from the same seed. Clipping by norm and optimizers outside the
list keep the DTensor update (checked in this process).
"""

from __future__ import annotations

import json

import numpy as np
import pytest

keras = pytest.importorskip("keras")
if keras.backend.backend() != "torch":
    pytest.skip("needs KERAS_BACKEND=torch", allow_module_level=True)

from tests.utils import (  # noqa: E402
    ROOT,
    max_relative_difference,
    register_torch_part,
)

#: (name, optimizer class, keyword arguments).
CASES = [
    ("sgd_nesterov", "SGD", {"momentum": 0.9, "nesterov": True}),
    ("adam", "Adam", {}),
    ("adam_amsgrad", "Adam", {"amsgrad": True}),
    ("adamw", "AdamW", {"weight_decay": 0.1}),
    ("rmsprop_centered", "RMSprop", {"centered": True, "momentum": 0.5}),
    ("adagrad", "Adagrad", {}),
    ("adadelta", "Adadelta", {"learning_rate": 1.0}),
    ("adamax", "Adamax", {}),
    ("nadam", "Nadam", {}),
    ("lion", "Lion", {"learning_rate": 0.01}),
    ("adam_clipvalue_ema", "Adam", {"clipvalue": 0.05, "use_ema": True}),
]

SCRIPT = """
import json, os, sys
sys.path.insert(0, {root!r})
import numpy as np
import keras, keras_dist
from tests.torch.test_torch_shard_update import CASES, train

mesh = keras_dist.DeviceMesh((1, 2), ("batch", "model"))
layouts = keras_dist.LayoutMap(mesh)
layouts[".*/dense/kernel"] = (None, "model")
layouts[".*/dense/bias"] = ("model",)
layouts[".*/dense_1/kernel"] = ("model", None)
strategy = keras_dist.ModelParallel(layouts, "batch")
out = {{}}
for name, cls, kwargs in CASES:
    weights, on_shards = train(strategy, cls, kwargs)
    out[name] = {{"weights": [w.tolist() for w in weights],
                 "on_shards": on_shards}}
if os.environ.get("RANK", "0") == "0":
    with open(os.path.join(sys.argv[1], "out.json"), "w") as f:
        json.dump(out, f)
"""
PART = register_torch_part("shard_update", SCRIPT.format(root=str(ROOT)))


def train(strategy, cls, kwargs):
    """Trains the MLP with `keras.optimizers.<cls>(**kwargs)` (in
    `strategy`'s scope, or plain); returns its weights and whether the
    update ran on the shards."""
    import contextlib

    keras.backend.clear_session()  # the same layer names every time
    keras.utils.set_random_seed(0)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(24, 4)).astype("float32")
    y = rng.normal(size=(24, 2)).astype("float32")
    scope = strategy.scope() if strategy else contextlib.nullcontext()
    with scope:
        model = keras.Sequential(
            [
                keras.Input((4,)),
                keras.layers.Dense(8, activation="tanh"),
                keras.layers.Dense(2),
            ]
        )
        kwargs = dict(kwargs)
        kwargs.setdefault("learning_rate", 0.05)
        optimizer = getattr(keras.optimizers, cls)(**kwargs)
        model.compile(optimizer=optimizer, loss="mse")
    model.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0)
    return model.get_weights(), "apply" in vars(model.optimizer)


@pytest.mark.multi_process
@pytest.mark.slow
@pytest.mark.torch_part(PART)
def test_updates_on_shards_match_one_device(torch_parts):
    out = torch_parts.output(PART)
    got = json.loads((out / "out.json").read_text())
    for name, cls, kwargs in CASES:
        reference, _ = train(None, cls, kwargs)
        assert got[name]["on_shards"], f"{name}: the DTensor update ran"
        weights = [np.asarray(w) for w in got[name]["weights"]]
        diff = max_relative_difference(reference, weights)
        print(f"{name}: max relative difference {diff:.3g}")
        # float32 parity (CONTRIBUTING.md): the row-split kernel's partial
        # sums are added in another order than one device adds them.
        assert diff <= 1e-5, f"{name}: weights differ by {diff:.3g}"


def test_norm_clipping_and_other_optimizers_keep_the_dtensor_update():
    from keras_dist._src.backends.torch import shard_update

    assert shard_update.updates_on_shards(keras.optimizers.Adam())
    assert not shard_update.updates_on_shards(keras.optimizers.Adam(clipnorm=1))
    assert not shard_update.updates_on_shards(
        keras.optimizers.SGD(global_clipnorm=1)
    )
    assert not shard_update.updates_on_shards(keras.optimizers.Adafactor())
    assert not shard_update.updates_on_shards(
        keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD())
    )

    class Custom(keras.optimizers.Adam):  # may change the update
        pass

    assert not shard_update.updates_on_shards(Custom())

"""torch: a model's own `add_loss` terms get one warning naming the layer
(a sum over the batch cannot equal one device under sharding);
regularizers do not."""

import json

import pytest

keras = pytest.importorskip("keras")
if keras.backend.backend() != "torch":
    pytest.skip("needs KERAS_BACKEND=torch", allow_module_level=True)

from tests.utils import register_torch_part  # noqa: E402

SCRIPT = """
import json, os, sys, warnings
import numpy as np
import keras
import keras_dist

strategy = keras_dist.MirroredStrategy(devices=["cpu:0", "cpu:1"])


class SumPenalty(keras.layers.Layer):
    def __init__(self):
        super().__init__(name="sum_penalty")

    def call(self, x):
        self.add_loss(0.01 * keras.ops.sum(keras.ops.square(x)))
        return x


def build(own_loss):
    inputs = keras.Input((4,))
    h = keras.layers.Dense(
        3,
        kernel_regularizer="l2",
        activity_regularizer="l2",
    )(inputs)
    if own_loss:
        h = SumPenalty()(h)
    return keras.Model(inputs, keras.layers.Dense(1)(h))


x = np.ones((10, 4), "float32")
results = {}
for own_loss in (False, True):
    with strategy.scope():
        model = build(own_loss)
        model.compile("sgd", "mse")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model.fit(x, x[:, :1], batch_size=4, epochs=2, verbose=0)
    messages = [str(w.message) for w in caught if "add_loss" in str(w.message)]
    results[str(own_loss)] = len(messages)
    results[str(own_loss) + "_names_layer"] = all(
        "'sum_penalty'" in m for m in messages
    )
if strategy.is_chief:
    with open(os.path.join(sys.argv[1], "warned.json"), "w") as f:
        json.dump(results, f)
"""


PART = register_torch_part("user_losses", SCRIPT)


@pytest.mark.slow
@pytest.mark.multi_process
@pytest.mark.torch_part(PART)
def test_own_add_loss_warns_once_regularizers_do_not(torch_parts):
    out = torch_parts.output(PART) / "warned.json"
    warned = json.loads(out.read_text())
    assert warned["False"] == 0 and warned["True"] == 1, warned
    # The warning names the layer that adds the term.
    assert warned["True_names_layer"], warned

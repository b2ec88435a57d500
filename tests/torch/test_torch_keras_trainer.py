"""What Keras's own torch trainer does in a keras_dist job (2 ranks).

Since Keras 3.16 the torch trainer does data parallelism itself whenever
`torch.distributed` is initialized: it wraps a model in
`DistributedDataParallel` when it builds a step function, and its
`get_metrics_result` all-reduces every metric variable. keras_dist owns the
steps of the models in its scope and sums their metrics itself, so:

* a model the chief trains alone (a one-device reference, outside every
  scope) must stay a one-process model: no DDP set-up waiting for ranks
  that never come;
* a count metric reads the number of samples of one device, not twice it;
* `steps_per_execution` > 1 runs a group of batches per call, exact;
* arrays that differ between the processes (data made before the
  strategy, unseeded) get a clear warning.

The part runs in the torch tests' shared job on either Keras.
"""

from __future__ import annotations

import json
import pathlib

import numpy as np
import pytest

keras = pytest.importorskip("keras")
if keras.backend.backend() != "torch":
    pytest.skip("needs KERAS_BACKEND=torch", allow_module_level=True)

from tests.utils import register_torch_part  # noqa: E402

SCRIPT = """
import contextlib, json, sys, time
import numpy as np
import keras
import keras_dist

out = sys.argv[1]
strategy = keras_dist.MirroredStrategy(devices=["cpu:0", "cpu:1"])
rank = strategy.worker_index
rng = np.random.default_rng(3)
# 22 samples, batch 4: 6 steps (the last of 2 samples), in groups of 3.
x = rng.normal(size=(22, 5)).astype("float32")
y = (x @ rng.normal(size=(5, 1))).astype("float32")


class SampleCount(keras.metrics.Metric):
    def __init__(self, name="count", **kwargs):
        super().__init__(name=name, **kwargs)
        self.count = self.add_variable(
            shape=(), initializer="zeros", name="count"
        )

    def update_state(self, y_true, y_pred, sample_weight=None):
        n = keras.ops.shape(y_true)[0]
        self.count.assign_add(keras.ops.cast(n, "float32"))

    def result(self):
        return self.count


def build():
    model = keras.Sequential([
        keras.Input((5,)),
        keras.layers.Dense(6, activation="tanh"),
        keras.layers.Dense(1),
    ])
    return model


def train(model, steps_per_execution, scope):
    with scope:
        model.compile(
            keras.optimizers.SGD(0.05, momentum=0.9), "mse",
            metrics=["mae", SampleCount()],
            steps_per_execution=steps_per_execution,
        )
    history = model.fit(x, y, batch_size=4, epochs=2, shuffle=False,
                        verbose=0)
    evaluation = model.evaluate(x, y, batch_size=4, verbose=0,
                                return_dict=True)
    predictions = model.predict(x, batch_size=4, verbose=0)
    return {
        "history": history.history,
        "evaluate": evaluation,
        "weights": [w.tolist() for w in model.get_weights()],
        "predict": predictions.tolist(),
    }


keras.utils.set_random_seed(0)
initial = build().get_weights()
result = {}
if rank == 0:
    # The chief's lone work: a one-device reference outside every scope,
    # while rank 1 waits in the strategy's next collective.
    start = time.monotonic()
    reference = build()
    reference.set_weights(initial)
    result["reference"] = train(reference, 1, contextlib.nullcontext())
    result["lone_seconds"] = time.monotonic() - start
for steps in (1, 3):
    with strategy.scope():
        model = build()
        model.set_weights(initial)
    result[f"spe{steps}"] = train(model, steps, strategy.scope())
# Data made before the strategy from an unseeded generator differs
# between the processes: a clear warning on the chief.
import warnings
with strategy.scope():
    model = build()
    model.compile("sgd", "mse")
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    model.fit(x + rank, y, batch_size=8, epochs=1, verbose=0)
    model.fit(x, y, batch_size=8, epochs=1, verbose=0)
result["differ_warnings"] = [
    str(w.message) for w in caught if "different arrays" in str(w.message)
]
with open(f"{out}.r{rank}.json", "w") as f:
    json.dump(result, f)
"""

PART = register_torch_part("keras_trainer", SCRIPT)


def _max_relative(a, b):
    return max(
        float(np.max(np.abs(np.subtract(p, q))) / max(np.max(np.abs(p)), 1e-12))
        for p, q in zip(a, b)
    )


@pytest.mark.multi_process
@pytest.mark.slow
@pytest.mark.torch_part(PART)
def test_keras_torch_trainer_leaves_keras_dist_the_step(torch_parts):
    out = torch_parts.output(PART)
    ranks = [
        json.loads(pathlib.Path(f"{out}.r{r}.json").read_text()) for r in (0, 1)
    ]
    chief = ranks[0]
    reference = chief["reference"]
    # The chief trained its reference alone, with no collective: seconds,
    # not the collective timeout (3.16's DDP set-up waited 45 s and died).
    assert chief["lone_seconds"] < 30, chief["lone_seconds"]
    # One device counts 22 samples an epoch and in `evaluate`.
    assert reference["history"]["count"] == [22.0, 22.0]
    assert reference["evaluate"]["count"] == 22.0
    for steps in ("spe1", "spe3"):
        for rank in ranks:
            got = rank[steps]
            assert got["history"]["count"] == [22.0, 22.0], steps
            assert got["evaluate"]["count"] == 22.0, steps
            np.testing.assert_allclose(
                got["history"]["loss"],
                reference["history"]["loss"],
                rtol=1e-5,
                err_msg=steps,
            )
            np.testing.assert_allclose(
                got["evaluate"]["mae"],
                reference["evaluate"]["mae"],
                rtol=1e-5,
                err_msg=steps,
            )
            assert (
                _max_relative(reference["weights"], got["weights"]) <= 1e-5
            ), steps
            # `predict` returns every row, in order, on every rank.
            assert len(got["predict"]) == 22
            np.testing.assert_allclose(
                got["predict"], reference["predict"], rtol=1e-4, atol=1e-6
            )
    # Different arrays on the two processes: one warning, on the chief,
    # naming process 1; the same arrays: none.
    (message,) = chief["differ_warnings"]
    assert "process(es) [1]" in message and "ShardPolicy.OFF" in message
    assert ranks[1]["differ_warnings"] == []

"""torch `ModelParallel` and `ShardedDataParallel` (DTensor) against one
device.

One script run on 2 gloo processes trains the same model (Conv2D +
BatchNormalization + two Dense layers, SGD with momentum) under
ModelParallel on a 1x2 and a 2x1 ("batch", "model") mesh and under
ShardedDataParallel on a 1-D mesh, each from rank 0's initial weights;
it also records bytes per rank (`strategy.describe`, from the local
shards) under MirroredStrategy, a LayoutMap key that matches nothing, and
a checkpoint written under ModelParallel 1x2 and restored into the 2x1
layout. A second run trains on 4 processes with a 2x2 mesh, with
Dropout(0.3). The reference is plain Keras on one device in the test
process, from the same initial weights; the checkpoint is also restored
there.
"""

from __future__ import annotations

import json
import pathlib

import numpy as np
import pytest

keras = pytest.importorskip("keras")
if keras.backend.backend() != "torch":
    pytest.skip("needs KERAS_BACKEND=torch", allow_module_level=True)

import keras_dist  # noqa: E402
from tests.utils import (  # noqa: E402
    build_model,
    compile_model,
    make_data,
    max_relative_difference,
    run_torch_script,
)

ROOT = pathlib.Path(__file__).resolve().parents[2]
N, BATCH, EPOCHS = 83, 16, 2

COMMON = f"""
import json, os
import numpy as np
import keras, keras_dist
from tests.utils import build_model, compile_model, make_data

rank = int(os.environ.get("RANK", 0))
dropout = float(os.environ.get("DROPOUT", "0"))
x, y, sw = make_data({N})
out = {{}}


def layout_map(shape):
    mesh = keras_dist.DeviceMesh(shape, ("batch", "model"))
    layouts = keras_dist.LayoutMap(mesh)
    layouts["batch_normalization/gamma"] = ("model",)
    layouts["dense/kernel"] = (None, "model")
    layouts["dense_1/kernel"] = ("model", None)
    return layouts


def build(strategy):
    keras.backend.clear_session()  # the same layer names every time
    with strategy.scope():
        # Rank 0's weights are used.
        model = build_model(seed=rank, dropout=dropout)
        compile_model(model)
    return model


def describe(strategy, model):
    rows = strategy.describe(model, print_fn=None)
    return {{
        r["group"] + "/" + r["path"]: [r["bytes_per_device"],
                                       [str(a) for a in r["layout"]]]
        for r in rows
    }}


def train(name, strategy):
    model = build(strategy)
    init = model.get_weights()  # every rank: a gather of the shards
    history = model.fit(x, y, sample_weight=sw, batch_size={BATCH},
                        epochs={EPOCHS}, shuffle=False, verbose=0)
    evaluation = model.evaluate(x, y, sample_weight=sw, batch_size=7,
                                verbose=0, return_dict=True)
    predictions = model.predict(x[:10], batch_size=4, verbose=0)
    weights = model.get_weights()
    if rank == 0:
        np.savez(f"{{name}}_init.npz", *init)
        np.savez(f"{{name}}_weights.npz", *weights)
        np.save(f"{{name}}_pred.npy", predictions)
    out[name] = {{"history": history.history, "evaluate": evaluation,
                 "describe": describe(strategy, model)}}
    return model
"""

TWO = (
    COMMON
    + """
model = train("mp1x2", keras_dist.ModelParallel(layout_map((1, 2)), "batch"))
keras_dist.checkpoint.save(model, "ckpt", step=1)
restored = build(keras_dist.ModelParallel(layout_map((2, 1)), "batch"))
keras_dist.checkpoint.restore(restored, "ckpt")
out["restored"] = [w.tolist() for w in restored.get_weights()]
train("mp2x1", keras_dist.ModelParallel(layout_map((2, 1)), "batch"))
train("sdp", keras_dist.ShardedDataParallel())
mirrored = keras_dist.MirroredStrategy()
model = build(mirrored)
with mirrored.scope():
    model.optimizer.build(model.trainable_variables)
out["mirrored"] = describe(mirrored, model)
try:
    layouts = layout_map((1, 2))
    layouts["dense_9/kernel"] = (None, "model")
    build(keras_dist.ModelParallel(layouts, "batch")).fit(
        x[:16], y[:16], epochs=1, verbose=0)
    out["error"] = None
except keras_dist.LayoutError as error:
    out["error"] = str(error)
# The parameter-server model file: ShardedEmbedding's table row-sharded.
keras.backend.clear_session()
mesh = keras_dist.DeviceMesh((1, 2), ("batch", "model"))
layouts = keras_dist.LayoutMap(mesh)
layouts[".*table/embeddings"] = ("model", None)
strategy = keras_dist.ModelParallel(layouts, "batch")
with strategy.scope():
    keras.utils.set_random_seed(rank)
    ids_in = keras.Input((3,), dtype="int32")
    h = keras_dist.layers.ShardedEmbedding(12, 4, name="table")(ids_in)
    h = keras.layers.GlobalAveragePooling1D()(h)
    model = keras.Model(ids_in, keras.layers.Dense(1, name="head")(h))
    model.compile(optimizer=keras.optimizers.Adam(0.05), loss="mse")
rng = np.random.default_rng(0)
ids = rng.integers(0, 12, (40, 3)).astype("int32")
target = rng.normal(size=(40, 1)).astype("float32")
init = model.get_weights()
model.fit(ids, target, batch_size=8, epochs=2, shuffle=False, verbose=0)
weights = model.get_weights()
out["table"] = describe(strategy, model)["model/table/embeddings"]
if rank == 0:
    np.savez("embedding.npz", ids=ids, target=target)
    np.savez("embedding_init.npz", *init)
    np.savez("embedding_weights.npz", *weights)
with open(f"logs{rank}.json", "w") as f:
    json.dump(out, f)
# Last: a strategy that fails to start leaves the job.
try:
    keras_dist.ShardedDataParallel(
        input_options=keras_dist.InputOptions(shard_policy="file"))
    message = "no error"
except keras_dist.UnsupportedBackendError as error:
    message = str(error)
with open(f"policy{rank}.txt", "w") as f:
    f.write(message)
"""
)

FOUR = (
    COMMON
    + """
train("mp2x2", keras_dist.ModelParallel(layout_map((2, 2)), "batch"))
with open(f"logs{rank}.json", "w") as f:
    json.dump(out, f)
"""
)


def _load(path):
    arrays = np.load(path)
    return [arrays[k] for k in arrays.files]


def _reference(init, dropout=0.0):
    """Plain Keras on one device from `init`: weights, logs, predictions."""
    keras.backend.clear_session()
    model = build_model(dropout=dropout)
    model.set_weights(init)
    compile_model(model)
    x, y, sw = make_data(N)
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
        x, y, sample_weight=sw, batch_size=7, verbose=0, return_dict=True
    )
    predictions = model.predict(x[:10], batch_size=4, verbose=0)
    return model.get_weights(), history.history, evaluation, predictions


def _check_parity(tmp_path, name, world, dropout=0.0):
    init = _load(tmp_path / f"{name}_init.npz")
    weights, history, evaluation, predictions = _reference(init, dropout)
    got = _load(tmp_path / f"{name}_weights.npz")
    difference = max_relative_difference(weights, got)
    assert difference <= 1e-5, (name, difference)
    np.testing.assert_allclose(
        np.load(tmp_path / f"{name}_pred.npy"), predictions, rtol=1e-5
    )
    for rank in range(world):
        logs = json.loads((tmp_path / f"logs{rank}.json").read_text())[name]
        for key, values in history.items():
            np.testing.assert_allclose(
                logs["history"][key], values, rtol=1e-5, err_msg=key
            )
        for key, value in evaluation.items():
            np.testing.assert_allclose(
                logs["evaluate"][key], value, rtol=1e-5, err_msg=key
            )
    return difference


def _run(tmp_path, script, world, dropout=0.0):
    proc, _ = run_torch_script(
        tmp_path,
        script,
        timeout=900,
        env={
            "KERAS_DIST_CPU_DEVICES": str(world),
            "PYTHONPATH": str(ROOT),
            "DROPOUT": str(dropout),
        },
    )
    assert proc.returncode == 0, proc.stderr[-4000:]


@pytest.mark.multi_process
@pytest.mark.slow
def test_two_processes_layouts_match_one_device(tmp_path):
    _run(tmp_path, TWO, 2)
    for name in ("mp1x2", "mp2x1", "sdp"):
        _check_parity(tmp_path, name, 2)
    logs = json.loads((tmp_path / "logs0.json").read_text())

    # Bytes per rank, from each rank's local shards.
    mirrored = logs["mirrored"]
    mp, sdp = logs["mp1x2"]["describe"], logs["sdp"]["describe"]
    for key in ("model/dense/kernel", "optimizer/sgd/dense_kernel_momentum"):
        assert mp[key] == [mirrored[key][0] // 2, ["None", "model"]], key
        # ZeRO: the 144x16 kernel split along its largest dimension.
        assert sdp[key] == [mirrored[key][0] // 2, ["batch", "None"]], key
    assert mp["model/dense_1/kernel"][1] == ["model", "None"]
    assert mp["model/batch_normalization/gamma"] == [8, ["model"]]
    assert sdp["model/conv2d/kernel"] == mirrored["model/conv2d/kernel"]
    assert all(v[1] == [] for k, v in mp.items() if k.startswith("metrics/"))
    total = {
        name: sum(v[0] for v in rows.values())
        for name, rows in (("mirrored", mirrored), ("sdp", sdp), ("mp", mp))
    }
    assert total["sdp"] < 0.6 * total["mirrored"], total
    assert total["mp"] < 0.6 * total["mirrored"], total

    # ShardedEmbedding row-sharded over "model" trains like one device.
    assert logs["table"] == [12 * 4 * 4 // 2, ["model", "None"]]
    data = np.load(tmp_path / "embedding.npz")
    keras.backend.clear_session()
    ids = keras.Input((3,), dtype="int32")
    h = keras.layers.Embedding(12, 4, name="table")(ids)
    h = keras.layers.GlobalAveragePooling1D()(h)
    reference = keras.Model(ids, keras.layers.Dense(1, name="head")(h))
    reference.compile(optimizer=keras.optimizers.Adam(0.05), loss="mse")
    reference.set_weights(_load(tmp_path / "embedding_init.npz"))
    reference.fit(
        data["ids"], data["target"], batch_size=8, epochs=2, shuffle=False,
        verbose=0,
    )  # fmt: skip
    got = _load(tmp_path / "embedding_weights.npz")
    assert max_relative_difference(reference.get_weights(), got) <= 1e-5

    # Every rank reads the whole input: FILE sharding is refused.
    for rank in (0, 1):
        message = (tmp_path / f"policy{rank}.txt").read_text()
        assert "ShardPolicy.FILE is not available" in message, message

    # A key that matches no variable.
    assert "'dense_9/kernel'" in logs["error"], logs["error"]
    assert "match no variable" in logs["error"], logs["error"]

    # The 1x2 checkpoint, restored into the 2x1 layout and into one device.
    saved = _load(tmp_path / "mp1x2_weights.npz")
    restored = [np.asarray(w) for w in logs["restored"]]
    assert max_relative_difference(saved, restored) == 0.0
    keras.backend.clear_session()
    model = build_model(seed=5)
    compile_model(model)
    keras_dist.checkpoint.restore(model, tmp_path / "ckpt")
    assert max_relative_difference(saved, model.get_weights()) == 0.0


@pytest.mark.multi_process
@pytest.mark.slow
def test_four_processes_2x2_mesh_matches_one_device(tmp_path):
    # With Dropout(0.3): each mask is the global batch's, as on one device.
    _run(tmp_path, FOUR, 4, dropout=0.3)
    _check_parity(tmp_path, "mp2x2", 4, dropout=0.3)
    logs = json.loads((tmp_path / "logs0.json").read_text())["mp2x2"]
    assert logs["describe"]["model/dense/kernel"][1] == ["None", "model"]

"""torch `ModelParallel` and `ShardedDataParallel` (DTensor) against one
device.

One script run on 2 gloo processes trains the same model (Conv2D +
BatchNormalization + two Dense layers, SGD with momentum) under
ModelParallel on a 1x2 and a 2x1 ("batch", "model") mesh and under
ShardedDataParallel on a 1-D mesh, each from rank 0's initial weights;
it also records bytes per rank (`strategy.describe`, from the local
shards) under MirroredStrategy, a LayoutMap key that matches nothing, and
a checkpoint written under ModelParallel 1x2 and restored into the 2x1
layout. Beside it, one JAX process writes a ModelParallel 2x2 checkpoint
(4 simulated devices) that the torch job restores into its 1x2 layout (each
rank reading only its shards, then one step of `fit`) and into
MirroredStrategy, and restores the torch job's 1x2 checkpoint into its 2x2
layout. The 2-process script also trains a lookup model, a
MultiHeadAttention model and a model with an unused variable under
ModelParallel or ShardedDataParallel, counting ShardedDataParallel's
gathers of each layer's split variables. A second run trains on 4
processes with a 2x2 mesh, with Dropout(0.3). The reference is plain
Keras on one device in the test process, from the same initial weights;
the checkpoints are also restored there.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

keras = pytest.importorskip("keras")
if keras.backend.backend() != "torch":
    pytest.skip("needs KERAS_BACKEND=torch", allow_module_level=True)

import keras_dist  # noqa: E402
from tests.utils import (  # noqa: E402
    ROOT,
    build_half_used_model,
    build_model,
    build_tied_model,
    compile_model,
    make_data,
    max_relative_difference,
    run_torch_script,
)

N, BATCH, EPOCHS = 83, 16, 2

COMMON = f"""
import json, os
import numpy as np
import keras, keras_dist
from tests.utils import build_model, build_tied_model, compile_model, make_data

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


def counter(function):
    # `function`, counting its calls in `.calls`.
    def counted(*args, **kwargs):
        counted.calls += 1
        return function(*args, **kwargs)
    counted.calls = 0
    return counted


# A training BatchNorm of a batch split over "batch": one fused function.
from keras_dist._src.backends.torch import batch_norm as _batch_norm
fused = _batch_norm._SyncNormalization
fused.apply = counter(fused.apply)


def train(name, strategy):
    model = build(strategy)
    init = model.get_weights()  # every rank: a gather of the shards
    fused.apply.calls = 0
    history = model.fit(x, y, sample_weight=sw, batch_size={BATCH},
                        epochs={EPOCHS}, shuffle=False, verbose=0)
    fused_calls = fused.apply.calls
    evaluation = model.evaluate(x, y, sample_weight=sw, batch_size=7,
                                verbose=0, return_dict=True)
    predictions = model.predict(x[:10], batch_size=4, verbose=0)
    weights = model.get_weights()
    if rank == 0:
        np.savez(f"{{name}}_init.npz", *init)
        np.savez(f"{{name}}_weights.npz", *weights)
        np.save(f"{{name}}_pred.npy", predictions)
    out[name] = {{"history": history.history, "evaluate": evaluation,
                 "describe": describe(strategy, model),
                 "fused": fused_calls}}
    return model


def fit_and_keep(name, model, ids, target):
    # Trains as `_train_reference` does; rank 0 keeps the data and the
    # initial and final weights (name.npz, _init.npz, _weights.npz).
    init = model.get_weights()
    model.fit(ids, target, batch_size=8, epochs=2, shuffle=False, verbose=0)
    weights = model.get_weights()  # every rank: a gather of the shards
    if rank == 0:
        np.savez(f"{{name}}.npz", ids=ids, target=target)
        np.savez(f"{{name}}_init.npz", *init)
        np.savez(f"{{name}}_weights.npz", *weights)
"""

FROM_JAX = """


def keyed_variables(model):
    return {
        group + "/" + v.path: v
        for group, variables in (
            ("model", model.variables),
            ("optimizer", model.optimizer.variables),
            ("metrics", model.metrics_variables),
        )
        for v in variables
    }


def restore_from_jax():
    # The JAX ModelParallel 2x2 checkpoint written beside this job: each
    # rank's shards, the whole values, and one step of fit after it.
    import time
    from keras_dist._src.keras_glue import internals
    deadline = time.monotonic() + 600
    while not os.path.isdir("jax_ckpt/ckpt-1"):
        if os.path.exists("jax.error") or time.monotonic() > deadline:
            raise RuntimeError("the JAX process wrote no checkpoint")
        time.sleep(0.05)
    strategy = keras_dist.ModelParallel(layout_map((1, 2)), "batch")
    model = build(strategy)
    keras_dist.checkpoint.restore(model, "jax_ckpt")
    local = dict()
    for key, v in keyed_variables(model).items():
        value = internals.variable_value(v)
        if hasattr(value, "to_local"):  # this rank's part only
            value = value.to_local()
        local[key] = value.detach().cpu().numpy()
    whole = {k: np.asarray(v) for k, v in keyed_variables(model).items()}
    np.savez("from_jax_local%d.npz" % rank, **local)
    if rank == 0:  # (every rank gathered)
        np.savez("from_jax_whole.npz", **whole)
    rows = describe(strategy, model)
    model.fit(x[:16], y[:16], sample_weight=sw[:16], batch_size=16,
              epochs=1, shuffle=False, verbose=0)
    weights = model.get_weights()  # every rank: a gather
    if rank == 0:
        np.savez("from_jax_step.npz", *weights)
    return rows
"""

# One JAX process on 4 simulated devices, started beside the torch job:
# writes a ModelParallel 2x2 checkpoint (kernels split over "model",
# replicated over "batch") of a model whose every variable, optimizer slot
# and metric holds distinct values (set, not trained: a compilation less),
# then restores the torch job's 1x2 checkpoint into the 2x2 layout.
JAX = """
import json, os, time, traceback
import numpy as np
import keras, keras_dist
from tests.utils import build_model, compile_model


def build(seed):
    keras.backend.clear_session()
    mesh = keras_dist.DeviceMesh((2, 2), ("batch", "model"))
    layouts = keras_dist.LayoutMap(mesh)
    layouts["batch_normalization/gamma"] = ("model",)
    layouts["dense/kernel"] = (None, "model")
    layouts["dense_1/kernel"] = ("model", None)
    with keras_dist.ModelParallel(layouts, "batch").scope():
        model = build_model(seed=seed)
        compile_model(model)
        model.optimizer.build(model.trainable_variables)
    return model


def shards(model):
    kernel = model.get_layer("dense").kernel.value
    return sorted(set(tuple(s.data.shape) for s in kernel.addressable_shards))


try:
    model = build(11)
    rng, state = np.random.default_rng(1), dict()
    for group, variables in (
        ("model", model.variables),
        ("optimizer", model.optimizer.variables),
        ("metrics", model.metrics_variables),
    ):
        for v in variables:
            value = rng.uniform(0.5, 1.5, v.shape).astype(v.dtype)
            if "int" in v.dtype:
                value = np.full(v.shape, 7, v.dtype)
            v.assign(value)
            state[group + "/" + v.path] = keras.ops.convert_to_numpy(v)
    np.savez("jax_state.npz", **state)
    saved_shards = shards(model)
    keras_dist.checkpoint.save(model, "jax_ckpt", step=1)
    deadline = time.monotonic() + 600
    while not os.path.isdir("ckpt/ckpt-1"):  # the torch job's
        if os.path.exists("torch.done") or time.monotonic() > deadline:
            raise RuntimeError("the torch job wrote no checkpoint")
        time.sleep(0.05)
    model = build(12)
    keras_dist.checkpoint.restore(model, "ckpt")
    np.savez("jax_restored.npz", *model.get_weights())
    with open("jax.json", "w") as f:
        json.dump({"saved": saved_shards, "restored": shards(model)}, f)
except BaseException:
    with open("jax.error", "w") as f:
        f.write(traceback.format_exc())
    raise
"""

TWO = (
    COMMON
    + FROM_JAX
    + """
model = train("mp1x2", keras_dist.ModelParallel(layout_map((1, 2)), "batch"))
keras_dist.checkpoint.save(model, "ckpt", step=1)
restored = build(keras_dist.ModelParallel(layout_map((2, 1)), "batch"))
keras_dist.checkpoint.restore(restored, "ckpt")
out["restored"] = [w.tolist() for w in restored.get_weights()]
# Whole values added to and taken from a split variable, on every rank.
kernel = model.get_layer("dense").kernel
before = kernel.numpy()
kernel.assign_add(np.full(before.shape, 0.5, "float32"))
kernel.assign_sub(np.float32(0.25))
out["updated"] = float(np.abs(kernel.numpy() - (before + 0.5 - 0.25)).max())
out["from_jax"] = restore_from_jax()
train("mp2x1", keras_dist.ModelParallel(layout_map((2, 1)), "batch"))
model = train("sdp", keras_dist.ShardedDataParallel())
# One more step, counting the collectives that sum its gradients: every
# gradient (each a Partial sum) in one all-reduce (the replicated
# variables') and one reduce-scatter (the split kernel's), not one each.
import torch.distributed as torch_dist
from keras_dist._src.backends.torch import shard_update
reduced = {"grads": 0, "collectives": 0}
together = shard_update._reduce_together
def counting_together(grads, variables):
    saved = torch_dist.all_reduce, shard_update._reduce_scatter
    torch_dist.all_reduce = all_reduce = counter(saved[0])
    shard_update._reduce_scatter = reduce_scatter = counter(saved[1])
    before = list(grads)
    try:
        result = together(grads, variables)
    finally:
        torch_dist.all_reduce, shard_update._reduce_scatter = saved
    reduced["grads"] += sum(g is not r for g, r in zip(before, result))
    reduced["collectives"] += all_reduce.calls + reduce_scatter.calls
    return result
shard_update._reduce_together = counting_together
# And the all-gathers of the layers' split variables: the Dense kernel's,
# once forward and once again backward (autograd keeps no whole value).
from keras_dist._src.backends.torch import layer_gather
gather = layer_gather._all_gather
layer_gather._all_gather = counter(gather)
model.fit(x[:16], y[:16], batch_size=16, epochs=1, verbose=0)
shard_update._reduce_together = together
out["sdp_reduce"] = [reduced, len(model.trainable_weights),
                     layer_gather._all_gather.calls]
layer_gather._all_gather = gather
mirrored = keras_dist.MirroredStrategy()
model = build(mirrored)
with mirrored.scope():
    model.optimizer.build(model.trainable_variables)
out["mirrored"] = describe(mirrored, model)
keras_dist.checkpoint.restore(model, "jax_ckpt")  # JAX 2x2 into Mirrored
np.savez("mirrored_from_jax%d.npz" % rank,
         **{k: np.asarray(v) for k, v in keyed_variables(model).items()})
try:
    layouts = layout_map((1, 2))
    layouts["dense_9/kernel"] = (None, "model")
    build(keras_dist.ModelParallel(layouts, "batch")).fit(
        x[:16], y[:16], epochs=1, verbose=0)
    out["error"] = None
except keras_dist.LayoutError as error:
    out["error"] = str(error)
# A layer made on rank 1 alone shifts its layer names (dense_1, dense_2):
# the keys split other variables there. Refused on both ranks.
keras.backend.clear_session()
if rank == 1:
    keras.layers.Dense(1)
try:
    with keras_dist.ModelParallel(layout_map((1, 2)), "batch").scope():
        compile_model(build_model(seed=0))
    out["shifted"] = None
except keras_dist.LayoutError as error:
    out["shifted"] = str(error)
# The parameter-server model file: ShardedEmbedding's table row-sharded.
keras.backend.clear_session()
mesh = keras_dist.DeviceMesh((1, 2), ("batch", "model"))
layouts = keras_dist.LayoutMap(mesh)
layouts[".*table/embeddings"] = ("model", None)
strategy = keras_dist.ModelParallel(layouts, "batch")


def lookup_model(strategy, embedding, vocabulary=12):
    with strategy.scope():
        keras.utils.set_random_seed(rank)
        ids_in = keras.Input((3,), dtype="int32")
        h = embedding(vocabulary, 4, name="table")(ids_in)
        # A Dense on the lookup's [batch, ids, 4] output reshapes it.
        h = keras.layers.Dense(3, name="proj")(h)
        h = keras.layers.GlobalAveragePooling1D()(h)
        model = keras.Model(ids_in, keras.layers.Dense(1, name="head")(h))
        model.compile(optimizer=keras.optimizers.Adam(0.05), loss="mse")
    return model


model = lookup_model(strategy, keras_dist.layers.ShardedEmbedding)
rng = np.random.default_rng(0)
embedding_data = (rng.integers(0, 12, (40, 3)).astype("int32"),
                  rng.normal(size=(40, 1)).astype("float32"))
fit_and_keep("embedding", model, *embedding_data)
out["table"] = describe(strategy, model)["model/table/embeddings"]
# The same model under ShardedDataParallel: the table is split by rows
# over the batch axis (min_size: this small one too). A table no larger
# than the lookup's output (12 rows, 24 ids a batch) is gathered for the
# lookup; a larger one (40 rows) looks up by rows, and the lookup's output
# is split by batch rows again. Either way the layers after it compute
# on this rank's rows only.
out["sdp_lookup"] = {}
for vocabulary in (12, 40):
    keras.backend.clear_session()
    model = lookup_model(keras_dist.ShardedDataParallel(min_size=16),
                         keras.layers.Embedding, vocabulary)
    fit_and_keep(f"embedding_sdp{vocabulary}", model, *embedding_data)
    table, lookups = model.get_layer("table"), []
    lookup = table.__dict__["call"]  # keras_dist's, installed by the fit
    def spy(*args, **kwargs):
        result = lookup(*args, **kwargs)
        lookups.append([repr(p) for p in result.placements])
        return result
    table.__dict__["call"] = spy
    layer_gather._all_gather = counter(gather)
    model.fit(*embedding_data, batch_size=8, epochs=1, steps_per_epoch=1,
              verbose=0)
    out["sdp_lookup"][vocabulary] = [
        lookups[-1], [repr(p) for p in table.embeddings.value.placements],
        layer_gather._all_gather.calls]
    layer_gather._all_gather = gather
# MultiHeadAttention, its heads split over "model" (on CPUs attention runs
# torch's math kernel: DTensor has no rule for the flash kernel's backward).
keras.backend.clear_session()
layouts = keras_dist.LayoutMap(mesh)
layouts[".*mha/(query|key|value)/kernel"] = (None, "model", None)
layouts[".*mha/attention_output/kernel"] = ("model", None, None)
# A head split by rows after a LayerNormalization, and 15 sequences (an odd
# last batch): DTensor split that batch's gradient unevenly by rows.
layouts[".*head/kernel"] = ("model", None)
strategy = keras_dist.ModelParallel(layouts, "batch")


def mha_model(strategy):
    with strategy.scope():
        keras.utils.set_random_seed(rank)
        seq_in = keras.Input((6, 8))
        h = keras.layers.MultiHeadAttention(2, 4, name="mha")(seq_in, seq_in)
        h = keras.layers.LayerNormalization(name="ln")(seq_in + h)
        h = keras.layers.GlobalAveragePooling1D()(h)
        model = keras.Model(seq_in, keras.layers.Dense(4, name="head")(h))
        model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    return model


model = mha_model(strategy)
seqs = rng.normal(size=(15, 6, 8)).astype("float32")
targets = rng.normal(size=(15, 4)).astype("float32")
init = model.get_weights()
model.fit(seqs, targets, batch_size=8, epochs=2, shuffle=False, verbose=0)
weights = model.get_weights()
out["mha"] = describe(strategy, model)["model/mha/query/kernel"]
# Called directly (inference by hand): whole inputs in, whole outputs out.
direct = keras.ops.convert_to_numpy(model(seqs[:5]))
if rank == 0:
    np.savez("mha.npz", seqs=seqs, targets=targets, direct=direct)
    np.savez("mha_init.npz", *init)
    np.savez("mha_weights.npz", *weights)
# A save that reads split variables, on the chief alone: refused at once.
try:
    if rank == 0:
        model.save("alone.keras")
    else:
        model.predict(seqs[:2], verbose=0)
    out["alone"] = None
except keras_dist.KerasDistError as error:
    out["alone"] = str(error)
# The same model under ShardedDataParallel (min_size: these small kernels
# split too): MultiHeadAttention's four kernels gathered in one collective,
# the head's in another, each once forward and once again backward.
keras.backend.clear_session()
strategy = keras_dist.ShardedDataParallel(min_size=16)
model = mha_model(strategy)
init = model.get_weights()
layer_gather._all_gather = counter(gather)
model.fit(seqs, targets, batch_size=8, epochs=2, shuffle=False, verbose=0)
out["mha_sdp"] = [describe(strategy, model)["model/mha/query/kernel"],
                  layer_gather._all_gather.calls]
layer_gather._all_gather = gather
weights = model.get_weights()
if rank == 0:
    np.savez("mha_sdp_init.npz", *init)
    np.savez("mha_sdp_weights.npz", *weights)
# A split variable that the layer's call does not use gets no gradient,
# as on one device (a zero gradient would still move it: momentum, decay).
from tests.utils import build_half_used_model
keras.backend.clear_session()
with keras_dist.ShardedDataParallel(min_size=16).scope():
    model = build_half_used_model(seed=rank)
    model.compile(loss="mse", optimizer=keras.optimizers.SGD(
        0.1, momentum=0.9, weight_decay=0.1))
fit_and_keep("half_used", model, seqs[:, 0], targets[:, :1])
with open(f"logs{rank}.json", "w") as f:
    json.dump(out, f)
# A strategy refused for its arguments (tests/test_multi_worker.py checks
# that a later one still starts).
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
# KerasHub's Gemma/Llama maps: the table's rows over "model" and its width
# over "batch", which also splits the ids; the lookup's output feeds a
# Dense laid out ("batch", "model"), and the table scores the output
# (tied, as ReversibleEmbedding does).
keras.backend.clear_session()
mesh = keras_dist.DeviceMesh((2, 2), ("batch", "model"))
layouts = keras_dist.LayoutMap(mesh)
layouts[".*table/embeddings"] = ("model", "batch")
layouts[".*proj/kernel"] = ("batch", "model")
strategy = keras_dist.ModelParallel(layouts, "batch")
with strategy.scope():
    model = build_tied_model(seed=rank)
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
rng = np.random.default_rng(0)
fit_and_keep(
    "tied", model, rng.integers(0, 64, (40, 8)).astype("int32"),
    rng.normal(size=(40, 64)).astype("float32"))
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
        # With a batch axis of 2, each batch that splits evenly (every one
        # but each epoch's last: 83 = 5 x 16 + 3) normalises in one fused
        # BatchNorm (`batch_norm.sharded_call`), not in DTensor's
        # operators (two reduce-scatters of the activation's gradient).
        splits = name in ("mp2x1", "sdp", "mp2x2")
        assert logs["fused"] == (EPOCHS * (N // BATCH) if splits else 0)
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
    return proc


def _start_jax(tmp_path, stderr):
    """Starts the JAX process (`JAX`) in `tmp_path`."""
    (tmp_path / "jax_script.py").write_text(JAX)
    env = dict(
        os.environ,
        KERAS_BACKEND="jax",
        KERAS_DIST_CPU_DEVICES="4",
        PYTHONPATH=str(ROOT),
        TF_CPP_MIN_LOG_LEVEL="2",
    )
    return subprocess.Popen(
        [sys.executable, "jax_script.py"],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=stderr,
    )


def _check_jax_checkpoints(tmp_path, logs):
    """A JAX ModelParallel 2x2 checkpoint restored into the torch 1x2
    layout (each rank holding only its shards), into MirroredStrategy and
    into one device, and the torch 1x2 checkpoint restored into JAX's 2x2
    layout: exactly."""
    jax_logs = json.loads((tmp_path / "jax.json").read_text())
    # Saved and restored on JAX with the dense kernel (144, 16) split in two.
    assert jax_logs == {"saved": [[144, 8]], "restored": [[144, 8]]}
    saved = _load(tmp_path / "mp1x2_weights.npz")
    restored = _load(tmp_path / "jax_restored.npz")
    assert max_relative_difference(saved, restored) == 0.0

    state = np.load(tmp_path / "jax_state.npz")
    whole = np.load(tmp_path / "from_jax_whole.npz")
    assert sorted(whole.files) == sorted(state.files)
    for key in state.files:  # every variable, optimizer slot and metric
        np.testing.assert_array_equal(
            whole[key], state[key].astype(whole[key].dtype), err_msg=key
        )
    for rank in (0, 1):  # into MirroredStrategy: whole on every rank
        mirrored = np.load(tmp_path / f"mirrored_from_jax{rank}.npz")
        assert sorted(mirrored.files) == sorted(state.files)
        for key in state.files:
            np.testing.assert_array_equal(
                mirrored[key], state[key].astype(mirrored[key].dtype), key
            )
    # The kernels, gamma and their momenta split over "model" on both.
    split = {
        "dense/kernel": ["None", "model"],
        "dense_1/kernel": ["model", "None"],
        "batch_normalization/gamma": ["model"],
    }
    split.update(
        {f"sgd/{k.replace('/', '_')}_momentum": v for k, v in split.items()}
    )
    meta = json.loads(
        (tmp_path / "jax_ckpt" / "ckpt-1" / "metadata.json").read_text()
    )
    saved_layouts = {e["key"]: e.get("layout") for e in meta["arrays"]}
    rows = logs["from_jax"]
    for key in state.files:
        layout = split.get(key.partition("/")[2])
        if layout is None:
            assert "model" not in rows[key][1], key
            continue
        assert rows[key][1] == layout, key
        assert [str(a) for a in saved_layouts[key]] == layout, key
    for rank in (0, 1):
        local = np.load(tmp_path / f"from_jax_local{rank}.npz")
        assert sorted(local.files) == sorted(state.files)
        held = 0
        for key in state.files:
            part = state[key].astype(local[key].dtype)
            layout = rows[key][1]
            if "model" in layout:  # this rank's half along that dimension
                part = np.split(part, 2, axis=layout.index("model"))[rank]
            np.testing.assert_array_equal(local[key], part, err_msg=key)
            held += local[key].nbytes
            assert local[key].nbytes == rows[key][0], key
        assert held < sum(state[k].nbytes for k in state.files) * 0.6

    # One step of fit after the restore, against one device restored from
    # the same checkpoint.
    keras.backend.clear_session()
    model = build_model(seed=5)
    compile_model(model)
    keras_dist.checkpoint.restore(model, tmp_path / "jax_ckpt")
    np.testing.assert_array_equal(
        keras.ops.convert_to_numpy(model.get_layer("dense").kernel),
        state["model/dense/kernel"],
    )
    x, y, sw = make_data(N)
    model.fit(
        x[:16], y[:16], sample_weight=sw[:16], batch_size=16, epochs=1,
        shuffle=False, verbose=0,
    )  # fmt: skip
    got = _load(tmp_path / "from_jax_step.npz")
    difference = max_relative_difference(model.get_weights(), got)
    assert difference <= 1e-5, difference
    return difference


def _train_reference(model, optimizer, init, x, y):
    """Plain Keras on one device from the job's initial weights, as the
    job's script trains (MSE, batches of 8, 2 epochs, no shuffling)."""
    model.compile(optimizer=optimizer, loss="mse")
    model.set_weights(_load(init))
    model.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0)


@pytest.mark.multi_process
@pytest.mark.slow
def test_two_processes_layouts_match_one_device(tmp_path):
    with open(tmp_path / "jax.err", "w") as stderr:
        jax_process = _start_jax(tmp_path, stderr)
        try:
            _run(tmp_path, TWO, 2)
        finally:
            (tmp_path / "torch.done").touch()  # the JAX process waits no more
            try:
                jax_process.wait(timeout=600)
            finally:
                if jax_process.poll() is None:
                    jax_process.kill()
                    jax_process.wait()
    error = (tmp_path / "jax.err").read_text()
    assert jax_process.returncode == 0, error[-4000:]
    for name in ("mp1x2", "mp2x1", "sdp"):
        _check_parity(tmp_path, name, 2)
    logs = json.loads((tmp_path / "logs0.json").read_text())
    # assign_add / assign_sub of a NumPy value on a split variable (torch
    # refused to mix a tensor and a DTensor before).
    assert logs["updated"] == 0.0
    reduced, trainable, gathers = logs["sdp_reduce"]
    assert reduced == {"grads": trainable, "collectives": 2}, logs["sdp_reduce"]
    assert gathers == 2, logs["sdp_reduce"]

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

    # ShardedEmbedding row-sharded over "model" trains like one device,
    # also with a Dense on its sequence output.
    assert logs["table"] == [12 * 4 * 4 // 2, ["model", "None"]]
    data = np.load(tmp_path / "embedding.npz")
    keras.backend.clear_session()
    ids = keras.Input((3,), dtype="int32")
    h = keras.layers.Embedding(12, 4, name="table")(ids)
    h = keras.layers.Dense(3, name="proj")(h)
    h = keras.layers.GlobalAveragePooling1D()(h)
    reference = keras.Model(ids, keras.layers.Dense(1, name="head")(h))
    _train_reference(
        reference, keras.optimizers.Adam(0.05),
        tmp_path / "embedding_init.npz", data["ids"], data["target"],
    )  # fmt: skip
    got = _load(tmp_path / "embedding_weights.npz")
    assert max_relative_difference(reference.get_weights(), got) <= 1e-5
    # Under ShardedDataParallel too, with the lookup's output split by
    # batch rows (before: whole on both ranks, the global batch computed
    # twice and each Dense output all-reduced).
    # The 12-row table gathered for each lookup (one all-gather a step:
    # the lookup's backward needs only the ids), the 40-row one not.
    for vocabulary, gathers in ((12, 1), (40, 0)):
        output, table, calls = logs["sdp_lookup"][str(vocabulary)]
        assert output == table == ["Shard(dim=0)"], (output, table)
        assert calls == gathers, logs["sdp_lookup"]
        keras.backend.clear_session()
        ids = keras.Input((3,), dtype="int32")
        h = keras.layers.Embedding(vocabulary, 4, name="table")(ids)
        h = keras.layers.Dense(3, name="proj")(h)
        h = keras.layers.GlobalAveragePooling1D()(h)
        reference = keras.Model(ids, keras.layers.Dense(1, name="head")(h))
        _train_reference(
            reference, keras.optimizers.Adam(0.05),
            tmp_path / f"embedding_sdp{vocabulary}_init.npz", data["ids"],
            data["target"],
        )  # fmt: skip
        got = _load(tmp_path / f"embedding_sdp{vocabulary}_weights.npz")
        assert max_relative_difference(reference.get_weights(), got) <= 1e-5

    # MultiHeadAttention with its heads split, then a LayerNormalization
    # and a head split by rows, trains like one device (odd last batch too).
    assert logs["mha"][1] == ["None", "model", "None"], logs["mha"]
    data = np.load(tmp_path / "mha.npz")
    keras.backend.clear_session()
    seqs = keras.Input((6, 8))
    h = keras.layers.MultiHeadAttention(2, 4, name="mha")(seqs, seqs)
    h = keras.layers.LayerNormalization(name="ln")(seqs + h)
    h = keras.layers.GlobalAveragePooling1D()(h)
    reference = keras.Model(seqs, keras.layers.Dense(4, name="head")(h))
    _train_reference(
        reference, keras.optimizers.SGD(0.1), tmp_path / "mha_init.npz",
        data["seqs"], data["targets"],
    )  # fmt: skip
    got = _load(tmp_path / "mha_weights.npz")
    # Absolute too: the key projection's bias gets a zero gradient (softmax
    # ignores a shift of every score), so it stays at rounding noise.
    for want, have in zip(reference.get_weights(), got, strict=True):
        np.testing.assert_allclose(have, want, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(
        data["direct"],
        keras.ops.convert_to_numpy(reference(data["seqs"][:5])),
        rtol=1e-5,
        atol=1e-6,
    )
    # Under ShardedDataParallel, each layer's kernels gathered together
    # (2 layers x 2 passes x 2 steps x 2 epochs), from the same weights.
    assert logs["mha_sdp"] == [[128, ["batch", "None", "None"]], 16], logs
    for want, have in zip(
        _load(tmp_path / "mha_init.npz"),
        _load(tmp_path / "mha_sdp_init.npz"),
        strict=True,
    ):
        np.testing.assert_array_equal(have, want)
    got = _load(tmp_path / "mha_sdp_weights.npz")
    for want, have in zip(reference.get_weights(), got, strict=True):
        np.testing.assert_allclose(have, want, rtol=1e-5, atol=1e-7)
    # A variable the call leaves unused keeps its initial value there.
    data = np.load(tmp_path / "half_used.npz")
    keras.backend.clear_session()
    reference = build_half_used_model()
    _train_reference(
        reference, keras.optimizers.SGD(0.1, momentum=0.9, weight_decay=0.1),
        tmp_path / "half_used_init.npz", data["ids"], data["target"],
    )  # fmt: skip
    got = _load(tmp_path / "half_used_weights.npz")
    assert max_relative_difference(reference.get_weights(), got) <= 1e-5
    paths = [w.path for w in reference.weights]
    unused = paths.index(reference.get_layer("half").unused.path)
    np.testing.assert_array_equal(
        got[unused], _load(tmp_path / "half_used_init.npz")[unused]
    )

    # A collective save on the chief alone fails on every rank, naming
    # the fix, and writes nothing.
    alone = [
        json.loads((tmp_path / f"logs{r}.json").read_text())["alone"]
        for r in (0, 1)
    ]
    assert "`model.save` reads variables split" in alone[0], alone
    assert "rank 0 called `save`" in alone[1], alone
    assert not (tmp_path / "alone.keras").exists()

    # Every rank reads the whole input: FILE sharding is refused.
    for rank in (0, 1):
        message = (tmp_path / f"policy{rank}.txt").read_text()
        assert "ShardPolicy.FILE is not available" in message, message

    # A key that matches no variable.
    assert "'dense_9/kernel'" in logs["error"], logs["error"]
    assert "match no variable" in logs["error"], logs["error"]
    # Layer names that differ between ranks: both fail, naming the fix.
    for r in (0, 1):
        shifted = json.loads((tmp_path / f"logs{r}.json").read_text())
        message = shifted["shifted"]
        assert "differ between processes" in message, message
        assert "dense_1/kernel'" in message, message
        assert "explicit names" in message, message

    # The 1x2 checkpoint, restored into the 2x1 layout and into one device.
    saved = _load(tmp_path / "mp1x2_weights.npz")
    restored = [np.asarray(w) for w in logs["restored"]]
    assert max_relative_difference(saved, restored) == 0.0
    keras.backend.clear_session()
    model = build_model(seed=5)
    compile_model(model)
    keras_dist.checkpoint.restore(model, tmp_path / "ckpt")
    assert max_relative_difference(saved, model.get_weights()) == 0.0

    _check_jax_checkpoints(tmp_path, logs)


@pytest.mark.multi_process
@pytest.mark.slow
def test_four_processes_2x2_mesh_matches_one_device(tmp_path):
    # With Dropout(0.3): each mask is the global batch's, as on one device.
    proc = _run(tmp_path, FOUR, 4, dropout=0.3)
    # The tied table's scores, partial over both axes, are reduced by one
    # all-reduce over a flattened mesh; without one torch reduces each axis
    # in turn and warns so (once per rank).
    assert "sequential all_reduce" not in proc.stderr
    _check_parity(tmp_path, "mp2x2", 4, dropout=0.3)
    logs = json.loads((tmp_path / "logs0.json").read_text())["mp2x2"]
    assert logs["describe"]["model/dense/kernel"][1] == ["None", "model"]

    # A table split over both axes (KerasHub's map), looked up and tied.
    data = np.load(tmp_path / "tied.npz")
    keras.backend.clear_session()
    reference = build_tied_model()
    _train_reference(
        reference, keras.optimizers.SGD(0.1), tmp_path / "tied_init.npz",
        data["ids"], data["target"],
    )  # fmt: skip
    got = _load(tmp_path / "tied_weights.npz")
    assert max_relative_difference(reference.get_weights(), got) <= 1e-5

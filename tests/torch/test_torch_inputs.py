"""Input types, shard policies and bad input on torch (gloo, 2 processes).

Each script trains on several inputs in turn, so that few (slow) process
launches check many things. Runs only under ``KERAS_BACKEND=torch``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from concurrent import futures

import numpy as np
import pytest

keras = pytest.importorskip("keras")
if keras.backend.backend() != "torch":
    pytest.skip("needs KERAS_BACKEND=torch", allow_module_level=True)

from tests.utils import npz_max_relative_difference, run_torch_script  # noqa: E402

PRELUDE = """
import json, os, random, sys
import numpy as np
import keras_dist, keras
import torch


def make_strategy(n, policy="auto"):
    if n == 1:
        return keras_dist.OneDeviceStrategy()
    return keras_dist.MirroredStrategy(
        devices=[f"cpu:{i}" for i in range(n)],
        input_options=keras_dist.InputOptions(policy))


def seeded(n, fn, *args, **kwargs):
    # Every rank takes rank 0's generator states at each call, so a plain
    # one-device run (same seeds) shuffles alike with no emulation.
    del n
    return fn(*args, **kwargs)


def build(n_in=4):
    keras.utils.set_random_seed(0)
    a = keras.Input((n_in,), name="a")
    b = keras.Input((2,), name="b")
    h = keras.layers.Dense(8, activation="tanh")(
        keras.layers.Concatenate()([a, b]))
    return keras.Model({"a": a, "b": b}, keras.layers.Dense(1)(h))


def compile_model(model):
    model.compile(optimizer=keras.optimizers.SGD(0.05, momentum=0.9),
                  loss="mse", metrics=["mae"])


def dump(path, model, history, evaluation, prediction):
    np.savez(path + ".npz", *model.get_weights())
    np.save(path + ".pred.npy", np.asarray(prediction))
    with open(path + ".json", "w") as f:
        json.dump({"history": history.history, "evaluate": evaluation}, f)
"""

INPUT_TYPES = """
import tensorflow as tf

n, out = int(sys.argv[1]), sys.argv[2]
strategy = make_strategy(n)
rank = int(os.environ.get("RANK", 0))
rng = np.random.default_rng(0)
N = 41      # batch 8: 6 batches, the last one holds 1 sample (< 2 ranks)
xa = rng.normal(size=(N, 4)).astype("float32")
xb = rng.normal(size=(N, 2)).astype("float32")
y = (xa.sum(1, keepdims=True) - xb[:, :1]).astype("float32")
w = rng.uniform(0.5, 2.0, size=(N,)).astype("float32")
X = {"a": xa, "b": xb}


class Seq(keras.utils.PyDataset):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)

    @property
    def num_batches(self):
        return 6

    def __getitem__(self, i):
        s = slice(8 * i, 8 * i + 8)
        return {"a": xa[s], "b": xb[s]}, y[s]


def gen(loop):
    while True:
        for i in range(0, N, 8):
            yield {"a": xa[i:i + 8], "b": xb[i:i + 8]}, y[i:i + 8]
        if not loop:
            return


tds = torch.utils.data.TensorDataset(
    torch.tensor(xa), torch.tensor(xb), torch.tensor(y))


def collate(items):
    a, b, t = (torch.stack(v) for v in zip(*items))
    return {"a": a, "b": b}, t


def tf_ds():
    return tf.data.Dataset.from_tensor_slices((X, y)).batch(8)


def grain_ds():
    import grain

    samples = [({"a": xa[i], "b": xb[i]}, y[i]) for i in range(N)]
    return grain.MapDataset.source(samples).batch(8)


with strategy.scope():
    model = build()
    compile_model(model)
init = model.get_weights()
cases = {
    "numpy_dict_shuffled": lambda: dict(
        x=X, y=y, batch_size=8, shuffle=True, sample_weight=w,
        eval=(X, y), pred=X),
    "numpy_list": lambda: dict(
        x=[xa, xb], y=y, batch_size=8, shuffle=False, eval=([xa, xb], y),
        pred=[xa, xb]),
    "tf_data": lambda: dict(x=tf_ds(), eval=(tf_ds(),), pred=tf_ds()),
    "py_dataset_workers_shuffled": lambda: dict(
        x=Seq(workers=2, use_multiprocessing=True), shuffle=True,
        eval=(Seq(),), pred=Seq()),
    "generator": lambda: dict(
        x=gen(True), steps_per_epoch=6, eval=(gen(False),), pred=gen(False)),
    "torch_loader_shuffled": lambda: dict(
        x=torch.utils.data.DataLoader(
            tds, batch_size=8, shuffle=True, collate_fn=collate),
        eval=(torch.utils.data.DataLoader(
            tds, batch_size=8, collate_fn=collate),),
        pred=torch.utils.data.DataLoader(
            tds, batch_size=8, collate_fn=collate)),
    "grain": lambda: dict(x=grain_ds(), eval=(grain_ds(),), pred=grain_ds()),
    # steps_per_epoch longer than the data: Keras stops early (exactly).
    "steps_longer_than_data": lambda: dict(
        x=X, y=y, batch_size=8, shuffle=False, steps_per_epoch=50,
        eval=(X, y), pred=X),
}
for name, make in cases.items():
    keras.utils.set_random_seed(1)
    with strategy.scope():
        model.set_weights(init)
        compile_model(model)
    spec = make()
    evaluation, prediction = spec.pop("eval"), spec.pop("pred")
    history = seeded(n, model.fit, epochs=4, verbose=0, **spec)
    ev = seeded(n, model.evaluate, *evaluation, batch_size=8, verbose=0,
                return_dict=True)
    pr = seeded(n, model.predict, prediction, batch_size=8, verbose=0)
    dump(f"{out}.{name}.r{rank}", model, history, ev, pr)
"""

POLICIES = """
import tensorflow as tf

n, out, data_dir = int(sys.argv[1]), sys.argv[2], sys.argv[3]
strategy = make_strategy(n, "off")
rank = int(os.environ.get("RANK", 0))
files = sorted(os.path.join(data_dir, f) for f in os.listdir(data_dir))


def parse(line):
    v = tf.strings.to_number(tf.strings.split(line, ","))
    return {"a": v[:4], "b": v[4:6]}, v[6:7]


def read(paths):
    rows = [np.array(line.split(","), "float32")
            for p in paths for line in open(p).read().split()]
    rows = np.stack(rows)
    return {"a": rows[:, :4], "b": rows[:, 4:6]}, rows[:, 6:7]


def local_off(r):
    rng = np.random.default_rng(r)
    count = (50, 23)[r]
    xa = rng.normal(size=(count, 4)).astype("float32")
    xb = rng.normal(size=(count, 2)).astype("float32")
    return {"a": xa, "b": xb}, (xa.sum(1, keepdims=True) + xb[:, 1:]).astype(
        "float32")


def global_batches(parts, local):
    # Step k's global batch: every rank's k-th local batch, rank order.
    steps = max(-(-len(p[1]) // local) for p in parts)
    batches = []
    for k in range(steps):
        s = slice(k * local, (k + 1) * local)
        xs = [p[0] for p in parts]
        batches.append((
            {key: np.concatenate([x[key][s] for x in xs]) for key in "ab"},
            np.concatenate([p[1][s] for p in parts])))
    return batches


class Batches(keras.utils.PyDataset):
    def __init__(self, batches):
        super().__init__()
        self.batches = batches

    @property
    def num_batches(self):
        return len(self.batches)

    def __getitem__(self, i):
        return self.batches[i]


def file_ds():
    names = tf.data.Dataset.from_tensor_slices(files)
    return names.interleave(tf.data.TextLineDataset, cycle_length=1).map(
        parse).batch(8)


with strategy.scope():
    model = build()
    compile_model(model)
init = model.get_weights()
for policy in ("off", "file"):
    keras.utils.set_random_seed(1)
    with strategy.scope():
        model.set_weights(init)
        compile_model(model)
    if policy == "off":
        parts = [local_off(0), local_off(1)]
        local = 8                    # batch_size=16 is the global batch
    else:
        parts = [read(files[0::2]), read(files[1::2])]   # auto_shard's split
        local = 4                    # the dataset is batched with 8
    if n == 1:
        x = Batches(global_batches(parts, local))
        kw = dict(x=x, shuffle=False)
        ev = dict(x=x)
        pr = x
    elif policy == "off":
        strategy.extended.input_options = keras_dist.InputOptions("off")
        kw = dict(x=parts[rank][0], y=parts[rank][1], batch_size=16,
                  shuffle=False)
        ev = dict(kw)
        ev.pop("shuffle")
        pr = parts[rank][0]
    else:
        strategy.extended.input_options = keras_dist.InputOptions("auto")
        kw = dict(x=file_ds())
        ev = dict(x=file_ds())
        pr = file_ds()
    history = model.fit(epochs=3, verbose=0, **kw)
    evaluation = model.evaluate(verbose=0, return_dict=True, **ev)
    prediction = model.predict(pr, verbose=0, batch_size=16)
    dump(f"{out}.{policy}.r{rank}", model, history, evaluation, prediction)
"""

BAD = """
import tensorflow as tf

case = sys.argv[1]
strategy = make_strategy(2, "off" if case.startswith("off") else "data")
rank = int(os.environ.get("RANK", 0))  # unset on rank 0 (the launcher)
with strategy.scope():
    model = build()
    compile_model(model)
x = {"a": np.ones((16, 4), "float32"), "b": np.ones((16, 2), "float32")}
y = np.ones((16, 1), "float32")


def bad_shapes():
    yield x, y
    yield {"a": np.ones((4, 5), "float32"), "b": np.ones((4, 2))}, y[:4]


if case == "empty_arrays":
    model.fit({k: v[:0] for k, v in x.items()}, y[:0], verbose=0)
elif case == "infinite_tf_data":
    model.fit(tf.data.Dataset.from_tensor_slices((x, y)).batch(4).repeat(),
              verbose=0)
elif case == "bad_shapes":
    model.fit(bad_shapes(), verbose=0)
elif case == "off_all_empty":
    ds = tf.data.Dataset.from_tensor_slices((x, y)).take(0).batch(4)
    model.fit(ds, verbose=0)
"""


def _run(tmp_path, body, args, timeout=400, name="script.py", timeout_s=None):
    env = {
        "KERAS_DIST_CPU_DEVICES": "2",
        "TF_CPP_MIN_LOG_LEVEL": "3",
        "KERAS_DIST_VERBOSE": "2",  # the input-sharding choice (DEBUG)
    }
    if timeout_s:
        env["KERAS_DIST_TIMEOUT"] = str(timeout_s)
    source = PRELUDE + textwrap.dedent(body)
    return run_torch_script(tmp_path, source, args, timeout, env, name)


def _compare(tmp_path, names, ranks=2):
    """Asserts parity of every `name` run of 2 ranks with the one-device run;
    returns the largest weight difference per name."""
    figures = {}
    for name in names:
        ref = np.load(tmp_path / f"one.{name}.r0.npz")
        ref_logs = json.loads((tmp_path / f"one.{name}.r0.json").read_text())
        ref_pred = np.load(tmp_path / f"one.{name}.r0.pred.npy")
        worst = 0.0
        for rank in range(ranks):
            path = tmp_path / f"two.{name}.r{rank}"
            weights = np.load(f"{path}.npz")
            diff = npz_max_relative_difference(ref, weights)
            worst = max(worst, diff)
            assert diff <= 1e-5, (name, rank, diff)
            logs = json.loads(open(f"{path}.json").read())
            assert logs["history"].keys() == ref_logs["history"].keys()
            for key, values in ref_logs["history"].items():
                assert len(logs["history"][key]) == len(values), (name, key)
                np.testing.assert_allclose(
                    logs["history"][key], values, rtol=1e-5, err_msg=name
                )
            for key, value in ref_logs["evaluate"].items():
                np.testing.assert_allclose(
                    logs["evaluate"][key], value, rtol=1e-5, err_msg=name
                )
            prediction = np.load(f"{path}.pred.npy")
            assert prediction.shape == ref_pred.shape, name
            np.testing.assert_allclose(
                prediction, ref_pred, atol=1e-5, err_msg=name
            )
        figures[name] = worst
    return figures


# -- real processes ------------------------------------------------------------
@pytest.mark.multi_process
@pytest.mark.slow
def test_every_input_type_matches_one_device(tmp_path):
    with futures.ThreadPoolExecutor(2) as pool:
        one = pool.submit(_run, tmp_path, INPUT_TYPES, [1, tmp_path / "one"])
        two = pool.submit(
            _run, tmp_path, INPUT_TYPES, [2, tmp_path / "two"], name="s2.py"
        )
        (single, _), (double, _) = one.result(), two.result()
    assert single.returncode == 0, single.stderr[-3000:]
    assert double.returncode == 0, double.stderr[-3000:]
    assert (
        "keras_dist: each process reads all of the input and keeps its own "
        "part of every global batch (ShardPolicy.DATA)." in double.stderr
    )
    names = [
        "numpy_dict_shuffled",
        "numpy_list",
        "tf_data",
        "py_dataset_workers_shuffled",
        "generator",
        "torch_loader_shuffled",
        "grain",
        "steps_longer_than_data",
    ]
    print("max relative weight difference:", _compare(tmp_path, names))


def _write_files(data_dir):
    rng = np.random.default_rng(5)
    data_dir.mkdir()
    # Ranks get files 0, 2 (30 rows) and 1, 3 (13 rows): uneven.
    for i, rows in enumerate((20, 9, 10, 4)):
        values = rng.normal(size=(rows, 7)).round(3)
        values[:, 6] = values[:, :4].sum(1) - values[:, 5]
        lines = [",".join(f"{v:.3f}" for v in row) for row in values]
        (data_dir / f"part{i}.csv").write_text("\n".join(lines) + "\n")


@pytest.mark.multi_process
@pytest.mark.slow
def test_off_and_file_policies_uneven_ranks(tmp_path):
    data_dir = tmp_path / "data"
    _write_files(data_dir)
    with futures.ThreadPoolExecutor(2) as pool:
        jobs = [
            pool.submit(
                _run,
                tmp_path,
                POLICIES,
                [n, tmp_path / tag, data_dir],
                name=f"{tag}.py",
            )
            for n, tag in ((1, "one"), (2, "two"))
        ]
        (single, _), (double, _) = (j.result() for j in jobs)
    assert single.returncode == 0, single.stderr[-3000:]
    assert double.returncode == 0, double.stderr[-3000:]
    assert "each process reads its own files (ShardPolicy.FILE)" in (
        double.stderr
    )
    print(
        "max relative weight difference:", _compare(tmp_path, ["off", "file"])
    )


BAD_CASES = {
    "empty_arrays": "0 samples",
    "infinite_tf_data": "infinite",
    "bad_shapes": "rank",
    "off_all_empty": "empty",
}


@pytest.mark.multi_process
@pytest.mark.slow
def test_bad_input_fails_fast_on_every_rank(tmp_path):
    def one(case):
        case_dir = tmp_path / case
        case_dir.mkdir()
        return _run(case_dir, BAD, [case], timeout=480, timeout_s=400)

    with futures.ThreadPoolExecutor(2) as pool:
        results = dict(zip(BAD_CASES, pool.map(one, BAD_CASES)))
    for case, (proc, elapsed) in results.items():
        assert proc.returncode != 0, case
        # Far below the 400 s liveness timeout: the ranks failed fast.
        assert elapsed < 200, (case, elapsed)
        assert BAD_CASES[case] in proc.stderr, (case, proc.stderr[-3000:])


@pytest.mark.multi_process
@pytest.mark.slow
def test_custom_loop_example_equals_fit(tmp_path):
    root = os.path.dirname(os.path.dirname(os.path.dirname(__file__)))
    example = os.path.join(root, "examples", "custom_loop_torch.py")
    env = dict(
        os.environ,
        KERAS_BACKEND="torch",
        OMP_NUM_THREADS="1",
        TF_CPP_MIN_LOG_LEVEL="3",
    )
    proc = subprocess.run(
        [sys.executable, example, str(tmp_path / "loop")],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=400,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    for rank in range(2):
        result = json.loads((tmp_path / f"loop.r{rank}.json").read_text())
        assert result["moved"] > 1e-3  # training changed the weights
        assert result["difference"] <= 1e-5, result

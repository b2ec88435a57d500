"""ParameterServerStrategy: a real cluster of tf.distribute servers on
loopback ports, the chief in a process of its own (tests/ps_script.py; a
process that joins a cluster stays connected to it). TensorFlow only; the
other backends raise a clear error."""

import json
import os
import pathlib
import subprocess
import sys

import keras
import pytest

import keras_dist
from keras_dist._src.cluster.environments import (
    ClusterConfigError,
    read_task_spec,
)

BACKEND = keras.backend.backend()

SCRIPT = pathlib.Path(__file__).with_name("ps_script.py")
tf_only = pytest.mark.skipif(
    BACKEND != "tensorflow", reason="ParameterServerStrategy is TF only"
)


def _run(scenario, timeout=240, extra=()):
    env = dict(os.environ)
    env.pop("KERAS_DIST_CPU_DEVICES", None)
    env.pop("TF_CONFIG", None)
    env["KERAS_BACKEND"] = "tensorflow"
    result = subprocess.run(
        [sys.executable, str(SCRIPT), scenario, *extra],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    lines = [
        line for line in result.stdout.splitlines() if line.startswith("RESULT")
    ]
    assert result.returncode == 0 and lines, (
        f"{scenario} failed ({result.returncode}):\n"
        f"{result.stdout[-3000:]}\n{result.stderr[-5000:]}"
    )
    return json.loads(lines[-1][len("RESULT ") :])


@pytest.fixture(scope="module")
def two_workers():
    return _run("two_workers")


@tf_only
@pytest.mark.slow
@pytest.mark.multi_process
def test_one_worker_equals_one_device():
    out = _run("one_worker")
    assert out["weights_rel"] <= 1e-5
    assert out["loss"] == pytest.approx(out["loss_expected"], rel=1e-5)
    assert out["iterations"] == 12  # 3 epochs of 64 samples in batches of 16
    assert out["evaluate"] == pytest.approx(out["evaluate_expected"], 1e-6)
    assert out["predict_rel"] <= 1e-6
    # class_weight and validation_split: Keras's own results.
    weighted = out["weighted"]
    # 48 training samples in batches of 10 (the last of 8), 2 epochs: no
    # batch runs across an epoch's end.
    assert weighted["iterations"] == 10
    assert weighted["weights_rel"] <= 1e-5
    for key in ("loss", "val_loss"):
        assert weighted[key] == pytest.approx(weighted[f"{key}_expected"], 1e-5)


@tf_only
@pytest.mark.slow
@pytest.mark.multi_process
def test_two_workers_counters_and_metrics_exact(two_workers):
    # Keras's read-then-write assign_add lost updates here (78 of 100).
    assert two_workers["iterations"] == two_workers["scheduled"] == 100
    assert two_workers["counts"] == {
        "loss/count": 1600.0,
        "mean_absolute_error/count": 1600.0,
    }
    # Confusion-matrix metrics (`assign(v + increment)`) lost 570 of 1600.
    assert two_workers["confusion_total"] == 1600.0
    # + a dataset function (2 epochs of 10 steps) + a finite tf.data
    # dataset (2 epochs of its 4 batches).
    assert two_workers["iterations_after"] == 100 + 20 + 8
    assert two_workers["history_epochs"] == 2
    # A train_step override ran once per scheduled step, none lost.
    assert two_workers["override_calls"] == 40.0
    # steps_per_execution=4: closures of 4, 4 and 2 steps.
    assert two_workers["chunked"] == {"iterations": 10, "count": 160.0}
    assert two_workers["repr"] == "ParameterServerStrategy(workers=2, ps=2)"


@tf_only
@pytest.mark.slow
@pytest.mark.multi_process
def test_each_worker_reads_its_own_part_of_the_input(two_workers):
    parts = two_workers["parts"]
    # 64 samples in batches of 8: one epoch is 8 steps over both workers.
    for name in ("numpy", "dataset", "function"):
        part = parts[name]
        assert part["foreign"] == 0.0, (name, part)
        assert sum(part["per_worker"]) == part["count"] == 64.0, (name, part)


@tf_only
@pytest.mark.slow
@pytest.mark.multi_process
def test_two_workers_evaluate_exact_and_errors(two_workers):
    assert two_workers["evaluate"] == pytest.approx(
        two_workers["evaluate_expected"], rel=1e-6
    )
    errors = two_workers["errors"]
    assert "steps_per_epoch" in errors["endless"]
    assert "steps_per_epoch" in errors["function"]
    assert "variable_partitioner" in two_workers["embedding_error"]
    assert "embedding" in two_workers["embedding_error"]
    assert "ShardedEmbedding" in two_workers["embedding_error"]
    assert "tf.data.Dataset" in errors["pydataset"]
    assert "evaluate" in errors["pydataset"]  # ... accept a PyDataset
    # A generator: named, with what to pass (it was an IndexError).
    assert "got a generator" in errors["generator"], errors["generator"]
    assert "tf.data.Dataset" in errors["generator"]
    assert "PyDataset" in errors["predict_generator"]
    assert "validation_data" in errors["split_dataset"]
    assert "keras.callbacks.BackupAndRestore(" in errors["step_backup"]
    assert two_workers["evaluate_pydataset"] == pytest.approx(
        two_workers["evaluate_pydataset_expected"], rel=1e-6
    )


@tf_only
@pytest.mark.slow
@pytest.mark.multi_process
def test_sharded_embedding_rows_on_each_ps(two_workers):
    table = two_workers["table"]
    assert table["shards"] == [[5, 4], [5, 4]]
    assert sorted(table["devices"]) == [
        "/job:ps/replica:0/task:0",
        "/job:ps/replica:0/task:1",
    ]
    assert table["gradients"] == ["IndexedSlices", "IndexedSlices"]
    assert table["used_rows_moved"] and table["unused_rows_same"]
    assert table["iterations"] == 10
    assert table["lookup_rel"] <= 1e-6
    assert table["init_equal"]  # the shards start as one device's table


@tf_only
def test_sharded_embedding_outside_parameter_servers_is_one_variable():
    """`num_shards` applies under ParameterServerStrategy only (its doc)."""
    layer = keras_dist.layers.ShardedEmbedding(8, 4, num_shards=2, name="table")
    model = keras.Sequential(
        [keras.Input((3,), dtype="int32"), layer], name="net"
    )
    assert [v.path for v in model.weights] == ["net/table/embeddings"]
    with keras_dist.MirroredStrategy(["cpu:0"]).scope():
        layer = keras_dist.layers.ShardedEmbedding(8, 4, num_shards=2)
        layer.build((None, 3))
    assert [tuple(v.shape) for v in layer.weights] == [(8, 4)]


@pytest.mark.skipif(BACKEND == "tensorflow", reason="ModelParallel path")
def test_sharded_embedding_is_an_embedding_elsewhere():
    layer = keras_dist.layers.ShardedEmbedding(8, 4, name="table")
    # Named: an unnamed model's path depends on the models made before it.
    model = keras.Sequential(
        [keras.Input((3,), dtype="int32"), layer], name="net"
    )
    assert isinstance(layer, keras.layers.Embedding)
    assert [v.path for v in model.weights] == ["net/table/embeddings"]
    mesh = keras_dist.DeviceMesh((1, 2), ("batch", "model"))
    layout_map = keras_dist.LayoutMap(mesh)
    layout_map[".*embeddings"] = ("model", None)
    assert layout_map[model.weights[0].path] == ("model", None)


@tf_only
@pytest.mark.slow
@pytest.mark.multi_process
def test_same_script_serves_on_worker_and_ps_tasks():
    out = _run("same_script")
    assert [line.split(" (")[1].split(" at")[0] for line in out["ready"]] == [
        "ps 0",
        "worker 0",
    ]
    assert out["iterations"] == 8
    assert out["alive"] == [True, True]  # still serving after fit


@tf_only
@pytest.mark.slow
@pytest.mark.multi_process
def test_killed_worker_is_tolerated():
    out = _run("killed_worker", timeout=420)
    assert out["victim_returncode"] == -9
    assert out["epochs"] == 3
    # TF retries the closures the dead worker held on the other one.
    assert out["iterations"] >= out["scheduled"]
    # Then a ps task is killed: fit ends with keras_dist's clear error.
    assert "lost a ps task" in out["ps_error"]


@tf_only
@pytest.mark.slow
@pytest.mark.multi_process
def test_launch_ps_job_replaces_a_worker_and_restarts_after_a_lost_ps(
    tmp_path,
):
    # keras-dist launch --ps 1 --workers 2 --max-restarts 2: chief + 2
    # workers + 1 ps on loopback. Worker 1 killed as epoch 1 begins: the
    # launcher starts it again; ps 0 killed as epoch 2 begins: its
    # variables are lost, the launcher restarts the whole job and
    # BackupAndRestore resumes fit at epoch 2.
    env = dict(os.environ, KERAS_BACKEND="tensorflow", TF_CPP_MIN_LOG_LEVEL="2")
    env.pop("KERAS_DIST_CPU_DEVICES", None)
    env.pop("TF_CONFIG", None)
    launch = [sys.executable, "-m", "keras_dist.cli", "launch"]
    launch += ["--ps", "1", "--workers", "2", "--max-restarts", "2"]
    launch += ["--restart-backoff", "0.5"]
    proc = subprocess.run(
        launch + [str(SCRIPT), "launched", str(tmp_path)],
        env=env,
        capture_output=True,
        text=True,
        timeout=400,
    )
    log = f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    assert proc.returncode == 0, log
    assert "[chief] STRATEGY ParameterServerStrategy(workers=2, ps=1)" in (
        proc.stdout
    ), log
    assert (
        "worker task 1 was killed by SIGKILL; starting it again (restart 1 "
        "of 2)" in proc.stderr
    ), log
    assert "ps task 0 was killed by SIGKILL: the variables it held are " in (
        proc.stderr
    )
    assert "restarting the whole job (restart 2 of 2)" in proc.stderr, log
    results = [
        json.loads(line.split("RESULT ", 1)[1])
        for line in proc.stdout.splitlines()
        if line.startswith("[chief] RESULT ")
    ]
    assert len(results) == 1, log  # the first chief was stopped
    out = results[0]
    assert out["epochs"] == [2, 3]  # resumed after the saved epochs 0, 1
    # 4 epochs of 20 steps (a step retried after worker 1 died may count
    # twice: TF's at-least-once retries)
    assert out["iterations"] >= 80
    assert not out["backup_left"]  # Keras deletes it when fit completes


@pytest.mark.skipif(BACKEND == "tensorflow", reason="the error of JAX/torch")
def test_other_backends_raise_a_clear_error():
    with pytest.raises(keras_dist.UnsupportedBackendError) as info:
        keras_dist.ParameterServerStrategy({"worker": ["a:1"], "ps": ["b:1"]})
    message = str(info.value)
    assert "KERAS_BACKEND=tensorflow" in message
    assert "ModelParallel" in message


@tf_only
def test_no_cluster_is_a_clear_error(monkeypatch):
    monkeypatch.delenv("TF_CONFIG", raising=False)
    with pytest.raises(ClusterConfigError, match="TF_CONFIG is not set"):
        keras_dist.ParameterServerStrategy()
    with pytest.raises(ClusterConfigError, match="'worker' and 'ps'"):
        keras_dist.ParameterServerStrategy({"chief": ["127.0.0.1:1"]})
    evaluator = {
        "cluster": {"chief": ["h:1"], "worker": ["h:2"], "ps": ["h:3"]},
        "task": {"type": "evaluator", "index": 0},
    }
    monkeypatch.setenv("TF_CONFIG", json.dumps(evaluator))
    with pytest.raises(ClusterConfigError, match="'evaluator' task"):
        keras_dist.ParameterServerStrategy()


def test_task_spec_reads_every_task_type():
    cluster = {
        "chief": ["h:1"],
        "worker": ["h:2", "h:3"],
        "ps": ["h:4"],
    }
    for kind, index, address in (
        ("chief", 0, "h:1"),
        ("worker", 1, "h:3"),
        ("ps", 0, "h:4"),
        ("evaluator", 0, None),
    ):
        config = {"cluster": cluster, "task": {"type": kind, "index": index}}
        task = read_task_spec({"TF_CONFIG": json.dumps(config)})
        assert (task.task_type, task.task_index) == (kind, index)
        assert task.address == address
    assert read_task_spec({}).task_type is None
    bad = {"cluster": cluster, "task": {"type": "ps", "index": 3}}
    with pytest.raises(ClusterConfigError, match="outside the 1 'ps'"):
        read_task_spec({"TF_CONFIG": json.dumps(bad)})
    bad = {"cluster": cluster, "task": {"type": "boss", "index": 0}}
    with pytest.raises(ClusterConfigError, match="'boss'"):
        read_task_spec({"TF_CONFIG": json.dumps(bad)})


def test_serve_returns_on_chief_and_evaluator():
    from keras_dist._src.cluster.environments import TaskSpec

    assert keras_dist.serve(TaskSpec("chief", 0, {"chief": ["h:1"]})) is None
    assert keras_dist.serve(TaskSpec("evaluator", 0, {})) is None
    assert keras_dist.serve(TaskSpec()) is None

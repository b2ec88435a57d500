"""Every backend's Runtime passes the same barrier / broadcast / all-reduce /
all-gather tests: in one process, and with 2 real worker processes (started
by ``python -m keras_dist.launch``)."""

import json
import os
import subprocess
import sys

import keras
import numpy as np
import pytest

import keras_dist
from keras_dist._src import runtime as runtime_lib
from keras_dist._src.cluster.environments import ClusterEnvironment
from keras_dist._src.runtime import LocalRuntime, runtime_of

BACKEND = keras.backend.backend()

VALUE = {
    "array": np.arange(6, dtype="float32").reshape(2, 3),
    "ints": np.array([1, 2, 3], "int64"),
    "count": 7,
    "flag": True,
    "ratio": 0.25,
    "name": "keras_dist",
}


def _check_one_process(runtime):
    assert (runtime.rank, runtime.world_size, runtime.is_chief) == (0, 1, True)
    runtime.barrier()
    out = runtime.broadcast(VALUE)
    np.testing.assert_array_equal(out["array"], VALUE["array"])
    assert out["array"].dtype == np.float32
    assert out["name"] == "keras_dist" and out["count"] == 7
    total = runtime.all_reduce({"x": VALUE["ints"], "n": 3}, op="max")
    np.testing.assert_array_equal(total["x"], VALUE["ints"])
    assert total["n"] == 3
    gathered = runtime.all_gather(VALUE)
    assert len(gathered) == 1 and gathered[0]["ratio"] == 0.25
    with pytest.raises(ValueError, match="Unknown reduce op"):
        runtime.all_reduce(1, op="prod")
    with pytest.raises(ValueError, match="root 1"):
        runtime.broadcast(1, root=1)


JOB = ClusterEnvironment(
    source="explicit",
    rank=1,
    world_size=2,
    coordinator_host="127.0.0.1",
    coordinator_port=1,
)


@pytest.mark.parametrize(
    "topology, devices, given, detected, per_device, in_job, job, env",
    [
        # One device: alone, whatever the launcher says.
        ("one_device", ["cpu:0"], None, JOB, True, True, False, None),
        ("one_device", ["cpu:0"], JOB, JOB, False, False, False, None),
        # One process drives several devices (JAX, TensorFlow).
        ("mirrored", ["cpu:0", "cpu:1"], None, JOB, False, True, False, None),
        ("multi_worker", ["cpu:0"], None, JOB, False, False, True, JOB),
        ("multi_worker", ["cpu:0"], JOB, None, False, False, True, JOB),
        ("multi_worker", ["cpu:0"], None, None, False, False, False, "local"),
        # One process per device (torch): several devices are a job.
        ("mirrored", ["cpu:0", "cpu:1"], None, JOB, True, False, True, None),
        ("mirrored", ["cpu:0"], None, JOB, True, False, False, None),
        ("mirrored", ["cpu:0"], None, JOB, True, True, True, None),
        ("mirrored", ["cpu:0"], JOB, None, True, False, True, JOB),
        ("multi_worker", ["cpu:0"], None, JOB, True, True, True, JOB),
    ],
)
def test_membership_is_one_rule_for_every_backend(
    monkeypatch,
    topology,
    devices,
    given,
    detected,
    per_device,
    in_job,
    job,
    env,
):
    """`runtime.membership`: alone or one process of a job, from the
    strategy's topology, the given or detected environment and whether the
    backend runs a process per device."""
    detected = detected or ClusterEnvironment()
    monkeypatch.setattr(runtime_lib, "detect_environment", lambda: detected)
    member = runtime_lib.membership(
        topology,
        devices,
        given,
        process_per_device=per_device,
        in_job=lambda: in_job,
    )
    assert member.job is job
    if env == "local":
        assert member.environment.source == "local"
    else:
        assert member.environment is env
    with pytest.raises(ValueError):
        runtime_lib.membership(
            "two_hosts", devices, None, process_per_device=False
        )


def test_one_device_never_reads_the_launchers_variables():
    """A one-device strategy trains alone without asking whether a job
    runs: a partial launcher setting (RANK alone) must not stop it."""

    def in_job():
        raise AssertionError("asked")

    member = runtime_lib.membership(
        "one_device", ["cpu:0"], None, process_per_device=True, in_job=in_job
    )
    assert member.job is False


def test_local_runtime():
    _check_one_process(LocalRuntime())


def test_strategy_runtime_in_one_process():
    if BACKEND == "torch":
        pytest.skip("torch's MirroredStrategy starts processes")
    strategy = keras_dist.MirroredStrategy()  # 4 simulated devices
    _check_one_process(strategy.runtime)
    assert strategy.is_chief and strategy.worker_index == 0
    assert strategy.num_workers == 1
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    assert runtime_of(model).world_size == 1  # a plain model: one process


SCRIPT = """
import json, sys
import numpy as np
import keras_dist

strategy = keras_dist.MultiWorkerMirroredStrategy()
rt = strategy.runtime
rank = rt.rank
rt.barrier()
value = {"array": np.full((2, 2), rank + 1.5, "float32"),
         "n": 10 * (rank + 1), "s": "worker" * (rank + 1)}
out = {
    "rank": rank, "world": rt.world_size, "chief": rt.is_chief,
    "bcast": rt.broadcast(value, root=1),
    "sum": rt.all_reduce(value["array"], "sum"),
    "max": rt.all_reduce(value["n"], "max"),
    "min": rt.all_reduce(value["n"], "min"),
    "mean": rt.all_reduce(value["n"], "mean"),
    "gather": rt.all_gather({"n": value["n"], "s": value["s"]}),
    "big": rt.all_reduce(np.full(3, 2**40 + rank, "int64"), "sum"),
}
for i in range(20):   # many rounds: keys and sequence numbers stay in step
    assert rt.all_reduce(i, "max") == i
if strategy.num_replicas_in_sync == 2 and sys.argv[2] == "torch":
    import torch

    # strategy.reduce/gather on parts of 3 and 2 rows: along the batch
    # axis they combine; whole, their shapes differ: an error on both
    # ranks, after which the collectives stay in step.
    (part,) = strategy.distribute_dataset([np.arange(10.0).reshape(5, 2)])
    out["reduce_sum0"] = strategy.reduce("sum", part, axis=0).tolist()
    out["reduce_mean0"] = strategy.reduce("mean", part, axis=0).tolist()
    out["gathered"] = strategy.gather(part, axis=0).tolist()
    try:
        strategy.reduce("sum", part, axis=None)
        out["uneven"] = "no error"
    except ValueError as error:
        out["uneven"] = str(error)
    total = strategy.reduce("sum", torch.tensor(rank + 1, dtype=torch.int32))
    out["int_sum"] = [int(total), str(total.dtype)]
# The key-value store: the other worker publishes, this one waits (no
# collective); a key nobody publishes times out as None.
out["store"] = rt.has_key_values
if rt.has_key_values:
    if rank == 1:
        rt.publish("test/from1", "hello from 1")
    out["waited"] = rt.wait_for("test/from1", 60)
    out["missing"] = rt.wait_for(f"test/none{rank}", 0.5)
rt.barrier()


def plain(x):
    if isinstance(x, np.ndarray):
        return x.tolist()
    if isinstance(x, dict):
        return {k: plain(v) for k, v in x.items()}
    if isinstance(x, list):
        return [plain(v) for v in x]
    return x


with open(sys.argv[1] + f".{rank}.json", "w") as f:
    json.dump(plain(out), f)
"""


@pytest.mark.multi_process
@pytest.mark.slow
def test_runtime_collectives_with_two_processes(tmp_path):
    script = tmp_path / "runtime.py"
    script.write_text(SCRIPT)
    env = dict(os.environ, KERAS_BACKEND=BACKEND, OMP_NUM_THREADS="1")
    env.pop("KERAS_DIST_CPU_DEVICES", None)
    env.pop("XLA_FLAGS", None)
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "keras_dist.launch",
            "--nproc-per-node",
            "2",
            str(script),
            str(tmp_path / "out"),
            BACKEND,
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    results = [
        json.loads((tmp_path / f"out.{r}.json").read_text()) for r in (0, 1)
    ]
    for rank, out in enumerate(results):
        assert out["rank"] == rank and out["world"] == 2
        assert out["chief"] == (rank == 0)
        assert out["bcast"]["array"] == [[2.5, 2.5], [2.5, 2.5]]
        assert out["bcast"]["n"] == 20
        assert out["bcast"]["s"] == "workerworker"
        assert out["sum"] == [[4.0, 4.0], [4.0, 4.0]]
        assert (out["max"], out["min"], out["mean"]) == (20, 10, 15.0)
        assert out["gather"] == [
            {"n": 10, "s": "worker"},
            {"n": 20, "s": "workerworker"},
        ]
        if BACKEND == "torch":
            assert out["reduce_sum0"] == [20.0, 25.0]
            assert out["reduce_mean0"] == [4.0, 5.0]
            assert out["gathered"] == np.arange(10.0).reshape(5, 2).tolist()
            assert "differ in shape" in out["uneven"], out["uneven"]
            assert out["int_sum"] == [3, "torch.int32"]
        assert out["big"] == [2 * 2**40 + 1] * 3  # int64 exact
        assert out["store"]  # every backend's job has one
        assert out["waited"] == "hello from 1"
        assert out["missing"] is None

"""Preemption of a torch job of 2 processes (gloo on localhost).

The training script starts its second rank itself. SIGTERM reaches either
the first process only (``kill <pid>`` of the launcher) or every process
(``kill -- -<pgid>``, what a terminal's Ctrl-C or SLURM does): both ranks
stop after the same step, rank 0 saves, the job exits with code 75, and
the restarted job ends with the weights of an uninterrupted run.

A checkpoint directory that one rank cannot see fails the save (and a
restore) on both ranks at once, with the reason, and leaves nothing
half-written.
"""

from __future__ import annotations

import json
import os

import pytest

from tests.utils import register_torch_part

keras = pytest.importorskip("keras")
if keras.backend.backend() != "torch":
    pytest.skip("needs KERAS_BACKEND=torch", allow_module_level=True)

from tests.test_checkpoint_process import interrupt_and_resume  # noqa: E402


@pytest.mark.slow
@pytest.mark.multi_process
@pytest.mark.parametrize("to_all", [False, True], ids=["rank0", "all"])
def test_sigterm_stops_both_ranks_and_resumes_exactly(tmp_path, to_all):
    # Signalled on every rank, the job trains on a `tf.data` shuffle that
    # reshuffles each epoch; signalled on rank 0, on NumPy arrays.
    difference = interrupt_and_resume(
        tmp_path, "torch", ranks=2, to_all=to_all, tf_data=to_all
    )
    assert difference <= 1e-6


DIRECTORIES_DIFFER = """
import json, os, sys, time
import keras, keras_dist

out = sys.argv[1]
strategy = keras_dist.MirroredStrategy(devices=["cpu:0", "cpu:1"])
with strategy.scope():
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
    model.compile("sgd", "mse")
rank = strategy.worker_index
# Each rank its own directory, as tempfile.mkdtemp() in the script gives.
manager = keras_dist.checkpoint.CheckpointManager(os.path.join(out, f"r{rank}"))
start = time.monotonic()
try:
    manager.save(model, 1)
    error = None
except keras_dist.checkpoint.CheckpointError as caught:
    error = str(caught)
result = {"error": error, "seconds": time.monotonic() - start}
# A checkpoint the chief finds in its directory and rank 1 cannot see.
shared = os.path.join(out, "shared")
keras_dist.checkpoint.CheckpointManager(shared).save(model, 2)
mine = shared if rank == 0 else os.path.join(out, "elsewhere")
try:
    keras_dist.checkpoint.CheckpointManager(mine).restore(model)
    result["restore_error"] = None
except keras_dist.checkpoint.CheckpointError as caught:
    result["restore_error"] = str(caught)
with open(os.path.join(out, f"result.r{rank}.json"), "w") as f:
    json.dump(result, f)
"""

DIRECTORIES_DIFFER_PART = register_torch_part(
    "checkpoint_directories_differ", DIRECTORIES_DIFFER
)


@pytest.mark.multi_process
@pytest.mark.torch_part(DIRECTORIES_DIFFER_PART)
def test_a_directory_a_process_cannot_see_fails_every_process(torch_parts):
    # Before, rank 1 could not write its pieces nor say so, and the chief
    # waited 30 minutes (`shard_timeout`) for them.
    out = torch_parts.output(DIRECTORIES_DIFFER_PART)
    for rank in range(2):
        result = json.loads((out / f"result.r{rank}.json").read_text())
        assert result["error"] is not None, rank
        assert "process(es) [1] cannot see" in result["error"]
        assert "given different directories" in result["error"]
        assert result["seconds"] < 60, result
        # Restoring, every process learns that rank 1 cannot see it.
        assert "process(es) [1] cannot see it" in result["restore_error"]
    # Nothing half-written is left, and rank 1's paths were not touched.
    assert os.listdir(out / "r0") == []
    assert not (out / "r1").exists()
    assert not (out / "elsewhere").exists()

"""Preemption of a torch job of 2 processes (gloo on localhost).

The training script starts its second rank itself. SIGTERM reaches either
the first process only (``kill <pid>`` of the launcher) or every process
(``kill -- -<pgid>``, what a terminal's Ctrl-C or SLURM does): both ranks
stop after the same step, rank 0 saves, the job exits with code 75, and
the restarted job ends with the weights of an uninterrupted run.
"""

from __future__ import annotations

import pytest

keras = pytest.importorskip("keras")
if keras.backend.backend() != "torch":
    pytest.skip("needs KERAS_BACKEND=torch", allow_module_level=True)

from tests.test_checkpoint_process import interrupt_and_resume  # noqa: E402


@pytest.mark.slow
@pytest.mark.multi_process
@pytest.mark.parametrize("to_all", [False, True], ids=["rank0", "all"])
def test_sigterm_stops_both_ranks_and_resumes_exactly(tmp_path, to_all):
    difference = interrupt_and_resume(tmp_path, "torch", ranks=2, to_all=to_all)
    assert difference <= 1e-6

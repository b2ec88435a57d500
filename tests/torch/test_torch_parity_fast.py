"""The fast loop's torch parity test: 2 gloo processes against one device.

One script run whose strategy starts 2 ranks (``cpu:0``, ``cpu:1``); the
one-device reference is plain Keras trained here, in the test process, from
the same initial weights. 83 samples in global batches of 16 (the last one
of 3 splits 2/1), 4 epochs: 24 steps. The thorough multi-process tests (2
and 4 ranks, failures, every input type) are in test_torch_multiprocess.py
and test_torch_inputs.py, marked slow.
"""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

keras = pytest.importorskip("keras")
if keras.backend.backend() != "torch":
    pytest.skip("needs KERAS_BACKEND=torch", allow_module_level=True)

import keras_dist  # noqa: E402
from tests.utils import (  # noqa: E402
    ROOT,
    build_model,
    compile_model,
    make_data,
    max_relative_difference,
    run_torch_script,
)

N, BATCH, EPOCHS = 83, 16, 4

SCRIPT = f"""
import json, os
import numpy as np
import keras, keras_dist
from tests.utils import build_model, compile_model, make_data

strategy = keras_dist.MirroredStrategy(devices=["cpu:0", "cpu:1"])
rank = int(os.environ.get("RANK", 0))
if rank == 0:
    # Layers only rank 0 made (a reference model, say): its model's Dense
    # layers are named dense_9 and dense_10, rank 1's dense and dense_1,
    # which torch sorts the other way round.
    [keras.layers.Dense(1) for _ in range(9)]
with strategy.scope():
    model = build_model(seed=rank)  # rank 0's weights are broadcast
    compile_model(model)
if rank == 0:
    np.savez("init.npz", *model.get_weights())
x, y, sw = make_data({N})
history = model.fit(x, y, sample_weight=sw, batch_size={BATCH},
                    epochs={EPOCHS}, shuffle=False, verbose=0)
evaluation = model.evaluate(x, y, sample_weight=sw, batch_size=7,
                            verbose=0, return_dict=True)
np.savez(f"weights{{rank}}.npz", *model.get_weights())
# The ranks' layer names differ (above): their pieces take the chief's keys.
keras_dist.checkpoint.save(model, "ckpt", step=1)
with open(f"logs{{rank}}.json", "w") as f:
    json.dump({{"history": history.history, "evaluate": evaluation,
               "cores": sorted(os.sched_getaffinity(0))}}, f)
"""


@pytest.mark.multi_process
@pytest.mark.fast
def test_two_ranks_match_one_device(tmp_path):
    proc, _ = run_torch_script(
        tmp_path,
        SCRIPT,
        timeout=600,
        env={
            "KERAS_DIST_CPU_DEVICES": "2",
            "KERAS_DIST_CPU_BINDING": "auto",
            "PYTHONPATH": str(ROOT),
        },
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    # Messages are the chief's: the default AUTO policy is logged once.
    assert proc.stderr.count("ShardPolicy.AUTO") <= 1, proc.stderr[-3000:]

    init = np.load(tmp_path / "init.npz")
    model = build_model()
    model.set_weights([init[k] for k in init.files])
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
    reference = model.get_weights()

    # With KERAS_DIST_CPU_BINDING=auto each rank runs on cores of its own.
    cores = [
        set(json.loads((tmp_path / f"logs{r}.json").read_text())["cores"])
        for r in (0, 1)
    ]
    if len(os.sched_getaffinity(0)) >= 2:
        assert cores[0] and cores[1] and not cores[0] & cores[1], cores
    for rank in (0, 1):
        weights = np.load(tmp_path / f"weights{rank}.npz")
        weights = [weights[k] for k in weights.files]
        assert max_relative_difference(reference, weights) <= 1e-5, rank
        logs = json.loads((tmp_path / f"logs{rank}.json").read_text())
        for key, values in history.history.items():
            np.testing.assert_allclose(
                logs["history"][key], values, rtol=1e-5, err_msg=key
            )
        for key, value in evaluation.items():
            np.testing.assert_allclose(
                logs["evaluate"][key], value, rtol=1e-5, err_msg=key
            )

    # The checkpoint both ranks wrote, restored by plain Keras here (whose
    # layer names are the other rank's: matched in order, with a warning).
    restored = build_model(seed=5)
    compile_model(restored)
    with pytest.warns(UserWarning, match="paths differ"):
        keras_dist.checkpoint.restore(restored, tmp_path / "ckpt")
    chief = np.load(tmp_path / "weights0.npz")
    chief = [chief[k] for k in chief.files]
    assert max_relative_difference(chief, restored.get_weights()) == 0.0

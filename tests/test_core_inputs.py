"""Unit tests of the shared input code (`core/inputs.py`, `core/policies.py`),
without a model or processes: they run on every backend."""

import numpy as np
import pytest

pytestmark = pytest.mark.fast


def test_check_input_unit():
    """The one input check, without a model (every backend calls it)."""
    import itertools

    from keras_dist._src.core.inputs import check_input

    with pytest.raises(ValueError, match="infinite count.*`steps`"):
        check_input(itertools.count(), None)
    with pytest.raises(ValueError, match="infinite repeat"):
        check_input(itertools.repeat((1, 2)), None)
    check_input(itertools.repeat((1, 2), 3), None)  # finite
    check_input(itertools.count(), 5)
    with pytest.raises(ValueError, match="0 samples"):
        check_input({"a": np.ones((0, 2))}, None)
    check_input(np.ones((2, 2)), None)


def test_distributed_dataset_splits_every_sample_once_over_processes():
    """The one wrapper: 3 "processes" of 2 replicas each see every sample of
    every global batch exactly once (batches of 16, 5 and 1 samples)."""
    from keras_dist._src.core.inputs import DistributedDataset

    x = np.arange(22)
    batches = [x[:16], x[16:21], x[21:]]
    seen = []
    for process in range(3):
        local = [2 * process, 2 * process + 1]
        for parts in DistributedDataset(batches, 6, local, list):
            assert len(parts) == 2
            seen.extend(int(v) for part in parts for v in part)
    assert sorted(seen) == list(range(22))


def test_local_batch_size_splits_the_global_batch():
    from keras_dist._src.core import policies

    for batch in (1, 2, 7, 16):
        for world in (1, 2, 3):
            sizes = [
                policies.local_batch_size(batch, r, world) for r in range(world)
            ]
            assert sizes == [
                len(p) for p in np.array_split(range(batch), world)
            ]


def test_resolve_policy(tmp_path):
    from keras_dist import ShardPolicy
    from keras_dist._src.core import policies

    tf = pytest.importorskip("tensorflow")
    path = tmp_path / "rows.txt"
    path.write_text("1\n2\n")
    files = tf.data.TextLineDataset([str(path)]).batch(2)
    memory = tf.data.Dataset.range(4).batch(2)
    auto, data = ShardPolicy.AUTO, ShardPolicy.DATA
    assert policies.resolve_policy(auto, files) is ShardPolicy.FILE
    assert policies.resolve_policy(auto, memory) is data
    assert policies.resolve_policy(ShardPolicy.FILE, memory) is data
    assert policies.resolve_policy(ShardPolicy.FILE, np.ones(3)) is data
    assert policies.resolve_policy(ShardPolicy.OFF, memory) is ShardPolicy.OFF


def test_jax_gather_keeps_64_bit_values_exact():
    """JAX computes in 32 bits: the FILE/OFF gather must not round int64
    labels or float64 features (one process here; 2 in test_multi_worker)."""
    import keras

    if keras.backend.backend() != "jax":
        pytest.skip("JAX's process_allgather")
    from keras_dist._src.backends.jax.chief_values import (
        process_allgather as _process_allgather,
    )

    arrays = [
        np.array([2**40 + 1, -3], np.int64),
        np.array([[1 + 2**-40]], np.float64),
        np.array([0.5, 1.5], np.float32),
    ]
    (got,) = _process_allgather(arrays)
    for a, b in zip(arrays, got):
        assert a.dtype == b.dtype
        np.testing.assert_array_equal(a, b)


def test_jax_sync_moves_only_variables_whose_copies_differ():
    """`sync_variables` broadcasts a variable only where two processes
    hold the same part of it with different bytes (parts held by one
    process, or equal copies, travel not at all)."""
    import keras

    if keras.backend.backend() != "jax":
        pytest.skip("JAX's multi-process engine")
    import jax

    from keras_dist._src.backends.jax import chief_values as engine

    slots = len(jax.local_devices())
    one = np.zeros((3, slots, 2), np.uint64)
    one[:, 0] = [[1, 10], [2, 20], [3, 30]]
    other = one.copy()
    other[1, 0, 1] = 21  # the same part of variable 1, other bytes
    other[2, 0] = [4, 31]  # another part of variable 2: nothing to compare
    assert engine.differing_parts([one, other]) == [False, True, False]
    assert engine.differing_parts([one, one]) == [False, False, False]

    # Fingerprints of this process: equal values give equal fingerprints,
    # another value another one.
    class Held:
        def __init__(self, value):
            self.value = value

    a = engine.fingerprints([Held(jax.numpy.arange(6.0)), Held(np.ones(2))])
    b = engine.fingerprints([Held(jax.numpy.arange(6.0)), Held(np.zeros(2))])
    assert a.shape == (2, slots, 2)
    assert (a[0] == b[0]).all() and (a[0] != 0).any()
    assert (a[1, 0, 0] == b[1, 0, 0]) and (a[1, 0, 1] != b[1, 0, 1])

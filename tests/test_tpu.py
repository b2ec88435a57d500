"""TPUStrategy: topology-aware meshes, and a clear error without a TPU.

No TPU is attached here: the meshes are built from mock TPU devices (the
attributes `jax.experimental.mesh_utils` reads: platform, id, device_kind,
coords, core_on_chip, slice_index), and each backend's strategy must raise
its clear error.
"""

import dataclasses

import keras
import numpy as np
import pytest

import keras_dist

BACKEND = keras.backend.backend()


@dataclasses.dataclass(frozen=True)
class MockTPU:
    """What mesh_utils reads of a TPU v4 chip."""

    id: int
    coords: tuple
    slice_index: int = 0
    process_index: int = 0
    core_on_chip: int = 0
    platform: str = "tpu"
    device_kind: str = "TPU v4"


def _slice(first_id, slice_index, shape=(2, 2, 2)):
    """One slice of chips on a `shape` torus, ids in a scrambled order
    (so that a reshape of the id order is not the physical order)."""
    coords = [
        (x, y, z)
        for z in range(shape[2])
        for y in range(shape[1])
        for x in range(shape[0])
    ]
    order = np.random.default_rng(slice_index).permutation(len(coords))
    return [
        MockTPU(first_id + int(i), coords[i], slice_index, slice_index)
        for i in order
    ]


def _adjacent(a, b):
    return sum(abs(p - q) for p, q in zip(a.coords, b.coords)) == 1


jax_only = pytest.mark.skipif(BACKEND != "jax", reason="JAX meshes")


@jax_only
def test_one_slice_mesh_follows_the_torus():
    from keras_dist._src.backends.jax.tpu import topology_mesh

    devices = _slice(0, 0)
    mesh = topology_mesh((4, 2), devices)
    assert mesh.shape == (4, 2)
    assert sorted(d.id for d in mesh.flat) == list(range(8))
    # The inner (model) axis pairs physical neighbours; a reshape of the
    # device list would not.
    assert all(_adjacent(a, b) for a, b in mesh)
    naive = np.array(devices, dtype=object).reshape(4, 2)
    assert not all(_adjacent(a, b) for a, b in naive)


@jax_only
def test_several_slices_put_the_data_axis_over_dcn():
    from keras_dist._src.backends.jax.tpu import topology_mesh

    devices = _slice(0, 0) + _slice(8, 1)
    mesh = topology_mesh((4, 4), devices)
    assert mesh.shape == (4, 4)
    # Rows 0-1 of the data axis live in slice 0, rows 2-3 in slice 1: only
    # the data axis crosses DCN; each model-axis row stays in one slice.
    for row, expected in zip(mesh, (0, 0, 1, 1)):
        assert {d.slice_index for d in row} == {expected}
    one_d = topology_mesh((16,), devices)
    assert [d.slice_index for d in one_d] == [0] * 8 + [1] * 8
    with pytest.raises(keras_dist.LayoutError, match="multiple of 2"):
        topology_mesh((1, 16), devices)
    with pytest.raises(keras_dist.LayoutError, match="needs 8 devices"):
        topology_mesh((2, 4), devices)


@jax_only
def test_tpu_plan_becomes_a_layout_plan_over_the_torus():
    from keras_dist._src.backends.jax.tpu import layout_plan
    from keras_dist._src.plan import LayoutMap, TPUPlan

    devices = _slice(0, 0)
    user_map = LayoutMap(keras_dist.DeviceMesh((4, 2), ("batch", "model")))
    user_map["dense/kernel"] = (None, "model")
    plan = layout_plan(
        TPUPlan(
            topology="mirrored",
            devices=tuple(f"tpu:{i}" for i in range(8)),
            mesh_shape=(4, 2),
            layout_map=user_map,
        ),
        devices,
    )
    assert plan.mesh.axis_names == ("batch", "model")
    assert plan.batch_axis == "batch"
    assert plan.variable_layout("dense/kernel", (3, 4)) == (None, "model")
    ordered = [int(n.split(":")[1]) for n in plan.mesh.devices]
    grid = np.array(ordered).reshape(4, 2)
    by_id = {d.id: d for d in devices}
    assert all(_adjacent(by_id[a], by_id[b]) for a, b in grid)


def test_without_a_tpu_the_strategy_says_so():
    expected = (
        keras_dist.UnsupportedBackendError
        if BACKEND == "torch"
        else keras_dist.TPUNotFoundError
    )
    match = {"torch": "KERAS_BACKEND=jax", "jax": "no TPU"}.get(
        BACKEND, "could not reach a TPU"
    )
    with pytest.raises(expected, match=match):
        keras_dist.TPUStrategy()
    with pytest.raises(expected):
        keras_dist.strategy_from_name("tpu")


@pytest.mark.skipif(BACKEND != "tensorflow", reason="TPUClusterResolver")
def test_tensorflow_unreachable_tpu_name_is_the_same_error():
    with pytest.raises(keras_dist.TPUNotFoundError, match="no-such-tpu"):
        keras_dist.TPUStrategy(tpu="no-such-tpu")


@pytest.mark.skipif(BACKEND != "tensorflow", reason="TPUClusterResolver")
def test_tensorflow_silent_tpu_address_times_out_with_the_same_error():
    # A grpc:// address nothing answers makes TensorFlow wait forever (and
    # changes its cluster settings): in a process of its own.
    import os
    import socket
    import subprocess
    import sys

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    script = (
        "import keras_dist\n"
        "try:\n"
        f"    keras_dist.TPUStrategy(tpu='grpc://127.0.0.1:{port}')\n"
        "except keras_dist.TPUNotFoundError as error:\n"
        "    print('CLEAR', error)\n"
    )
    env = dict(os.environ, KERAS_DIST_TPU_TIMEOUT="2")
    env.pop("KERAS_DIST_CPU_DEVICES", None)
    out = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert "CLEAR" in out.stdout and "no answer within 2 s" in out.stdout


@jax_only
@pytest.mark.multi_device
def test_jax_tpu_strategy_trains_like_one_device(monkeypatch):
    # The JAX engine of TPUStrategy end to end, with the 4 simulated CPU
    # devices standing in for chips (mesh_utils orders CPU devices as
    # listed): data parallel over a (2, 2) mesh with one layout.
    import jax

    from keras_dist._src.backends.jax import tpu as jax_tpu
    from tests.utils import compiled_model, make_data, max_relative_difference

    monkeypatch.setattr(jax_tpu, "tpu_devices", lambda: list(jax.devices()))
    layout_map = keras_dist.LayoutMap(
        keras_dist.DeviceMesh((2, 2), ("batch", "model"))
    )
    layout_map[".*conv2d.*kernel"] = (None, None, None, "model")
    strategy = keras_dist.TPUStrategy(mesh_shape=(2, 2), layout_map=layout_map)
    assert strategy.num_replicas_in_sync == 2
    assert strategy.mesh.axis_names == ("batch", "model")
    x, y, sw = make_data()
    reference = compiled_model()
    model = compiled_model(strategy)
    model.set_weights(reference.get_weights())
    for m in (reference, model):
        m.fit(x, y, sample_weight=sw, batch_size=16, shuffle=False, verbose=0)
    kernel = next(v for v in model.variables if "conv2d" in v.path)
    assert kernel.value.sharding.spec == jax.sharding.PartitionSpec(
        None, None, None, "model"
    )
    difference = max_relative_difference(
        reference.get_weights(), model.get_weights()
    )
    print(f"TPUStrategy (JAX, CPU stand-ins) max rel diff {difference:.2e}")
    assert difference < 1e-5, difference

"""Which device a torch rank or one-device strategy trains on, and which
torch the DTensor strategies accept (no GPU needed: each choice is a
function of names, counts and versions; the GPU runs of the same paths are
in tests/gpu)."""

import pytest

keras = pytest.importorskip("keras")
if keras.backend.backend() != "torch":
    pytest.skip("needs KERAS_BACKEND=torch", allow_module_level=True)

import torch  # noqa: E402

from keras_dist._src.backends.torch.engine import _device_scope  # noqa: E402
from keras_dist._src.backends.torch.job import gpu_index  # noqa: E402
from keras_dist._src.backends.torch.sharded import (  # noqa: E402
    check_dtensor_version,
)
from keras_dist._src.errors import (  # noqa: E402
    KerasDistError,
    UnsupportedBackendError,
)
from keras_dist._src.keras_glue.internals import (  # noqa: E402
    torch_device_name as get_device,
)

ALL4 = ["gpu:0", "gpu:1", "gpu:2", "gpu:3"]


def test_each_local_rank_gets_the_gpu_the_strategy_names():
    # Every GPU (the default): local rank i on GPU i.
    assert [gpu_index(ALL4, r, 4, 4, True) for r in range(4)] == [0, 1, 2, 3]
    # Named GPUs: rank i on the i-th name, not on GPU i.
    named = ["gpu:2", "gpu:3"]
    assert [gpu_index(named, r, 2, 4, True) for r in range(2)] == [2, 3]
    # A launcher that shows each rank only its own GPU: all on cuda:0.
    assert [gpu_index(["gpu:0"], r, 4, 1) for r in range(4)] == [0] * 4


def test_more_ranks_than_gpus_is_an_error_that_says_what_to_do():
    with pytest.raises(KerasDistError, match="--nproc-per-node 1"):
        gpu_index(["gpu:0"], 1, 2, 1, started_here=True)
    with pytest.raises(KerasDistError, match="sees 2 GPU"):
        gpu_index(["gpu:0", "gpu:5"], 1, 2, 2, started_here=True)
    with pytest.raises(KerasDistError, match="sees none"):
        gpu_index(["gpu:0"], 0, 1, 0)


def test_one_device_scope_sends_keras_to_the_named_device():
    default = str(get_device())
    here = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    with _device_scope(here):
        assert str(get_device()) == default
    # Another device than Keras's default (a CPU on a GPU host, or a second
    # GPU): Keras creates variables and batches there inside the scope.
    other = (
        torch.device("cpu") if here.type == "cuda" else torch.device("cuda", 1)
    )
    with _device_scope(other):
        assert str(get_device()) == ("cpu" if here.type == "cuda" else "cuda:1")
    assert str(get_device()) == default


def test_dtensor_strategies_refuse_a_torch_too_old_for_their_steps():
    # torch 2.11 (a GPU machine's) failed in BatchNormalization and Conv2D.
    with pytest.raises(UnsupportedBackendError, match=r"torch 2\.13 or newer"):
        check_dtensor_version("2.11.0+cu130")
    # Version strings only: the running torch is a GPU machine's 2.11 too.
    for version in ("2.13.0+cpu", "2.13.1", "2.14.0a0+git1234", "3.0.0"):
        check_dtensor_version(version)


def test_tpu_devices_point_to_tpu_strategy_on_another_backend():
    from keras_dist._src.backends.torch.runtime import create_runtime

    with pytest.raises(ValueError, match="TPUStrategy on the JAX"):
        create_runtime("mirrored", ["tpu:0", "tpu:1"])
    with pytest.raises(ValueError, match=r"all 'gpu' or all 'cpu'") as info:
        create_runtime("mirrored", ["gpu:0", "cpu:0"])
    assert "TPU" not in str(info.value)


def test_a_missing_device_fails_before_any_rank_starts(monkeypatch):
    import keras_dist
    from keras_dist._src.backends.torch.devices import nameable_devices
    from keras_dist._src.cluster import launcher

    def start_workers(*args):
        raise AssertionError("ranks were started for a missing device")

    monkeypatch.setattr(launcher, "start_workers", start_workers)
    count = len(nameable_devices("cpu"))  # one per core, or simulated
    devices = [f"cpu:{i}" for i in range(count + 1)]
    with pytest.raises(ValueError, match=rf"cpu:{count}'\] do not exist"):
        keras_dist.MirroredStrategy(devices=devices)


def test_list_devices_names_what_mirrored_would_use(monkeypatch):
    from keras_dist._src.backends.torch import devices

    monkeypatch.setattr(devices, "_simulated_cpus", None)
    monkeypatch.delenv("KERAS_DIST_CPU_DEVICES", raising=False)
    monkeypatch.setattr(devices.os, "cpu_count", lambda: 8)
    monkeypatch.setattr(devices.torch.cuda, "is_available", lambda: False)
    # Without simulated devices: one CPU device, as on JAX and TensorFlow,
    # yet a strategy may name one per core (each is a process).
    assert devices.list_devices() == devices.default_devices() == ["cpu:0"]
    assert devices.nameable_devices("cpu") == [f"cpu:{i}" for i in range(8)]
    monkeypatch.setenv("KERAS_DIST_CPU_DEVICES", "3")
    assert devices.list_devices() == devices.default_devices()
    assert devices.default_devices() == ["cpu:0", "cpu:1", "cpu:2"]
    assert devices.nameable_devices() == ["cpu:0", "cpu:1", "cpu:2"]

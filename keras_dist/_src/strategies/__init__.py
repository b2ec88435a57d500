"""The concrete strategies (one file each), registered under names with
aliases."""

from __future__ import annotations

from keras_dist._src import context
from keras_dist._src.strategies.central_storage import (
    CentralStorageStrategy,
)
from keras_dist._src.strategies.mirrored import MirroredStrategy
from keras_dist._src.strategies.model_parallel import (
    ModelParallel,
    ShardedDataParallel,
)
from keras_dist._src.strategies.multi_worker import (
    MultiWorkerMirroredStrategy,
)
from keras_dist._src.strategies.one_device import OneDeviceStrategy
from keras_dist._src.strategies.parameter_server import (
    ParameterServerStrategy,
)
from keras_dist._src.strategies.tpu import TPUStrategy
from keras_dist._src.strategy import Strategy

_REGISTRY = {
    "one_device": OneDeviceStrategy,
    "mirrored": MirroredStrategy,
    "multi_worker_mirrored": MultiWorkerMirroredStrategy,
    "model_parallel": ModelParallel,
    "sharded_data_parallel": ShardedDataParallel,
    "central_storage": CentralStorageStrategy,
    "tpu": TPUStrategy,
    "parameter_server": ParameterServerStrategy,
}
_ALIASES = {
    "single_device": "one_device",
    "onedevice": "one_device",
    "default": "one_device",
    "data_parallel": "mirrored",
    "dp": "mirrored",
    "multi_worker": "multi_worker_mirrored",
    "multiworker": "multi_worker_mirrored",
    "mp": "model_parallel",
    "fsdp": "sharded_data_parallel",
    "zero3": "sharded_data_parallel",
    "sharded": "sharded_data_parallel",
    "centralstorage": "central_storage",
    "ps": "parameter_server",
}


context.set_default_factory(OneDeviceStrategy)


def available_strategies() -> list[str]:
    """Returns the names (and aliases) `strategy_from_name` accepts."""
    return sorted(set(_REGISTRY) | set(_ALIASES))


def strategy_from_name(name: str, **kwargs) -> Strategy:
    """Creates a strategy by name, e.g. ``strategy_from_name("mirrored")``.

    Raises:
        ValueError: for an unknown name, listing the known ones.
    """
    key = str(name).lower().replace("-", "_")
    key = _ALIASES.get(key, key)
    if key not in _REGISTRY:
        raise ValueError(
            f"Unknown strategy {name!r}. Known: {available_strategies()}."
        )
    return _REGISTRY[key](**kwargs)

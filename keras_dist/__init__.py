"""keras_dist: the same `model.fit` on many devices, on every Keras backend.

Build and compile a model inside ``strategy.scope()``; ``fit``, ``evaluate``
and ``predict`` then run replicated. See ``guides/distributed_training.md``.
"""

from keras_dist._src import quiet as _quiet  # isort: skip
from keras_dist._src.version import __version__ as __version__  # isort: skip

# The node launcher starts and supervises workers and never trains, and
# `keras-dist --help` / `--version` only answer (`quiet.needs_no_backend`):
# they import neither Keras nor a backend, which took 5.5 s of the
# launcher's 7.6 s start and 6.5 to 12.7 s of `keras-dist --help` here.
if _quiet.needs_no_backend():
    __all__: list[str] = []
else:
    from keras_dist import callbacks, checkpoint, layers
    from keras_dist._src.api import _apply_env as _apply_env
    from keras_dist._src.api import list_devices, simulate_cpu_devices
    from keras_dist._src.cluster.environments import (
        ClusterConfigError,
        ClusterEnvironment,
    )
    from keras_dist._src.cluster.parameter_server import serve
    from keras_dist._src.errors import (
        DevicesAlreadyInitializedError,
        KerasDistError,
        LayoutError,
        StrategyMixingError,
        TPUNotFoundError,
        UnsupportedBackendError,
        VariablesOutsideScopeError,
    )
    from keras_dist._src.keras_glue import (
        check_keras_version as _check_keras_version,
    )
    from keras_dist._src.options import InputOptions, ShardPolicy
    from keras_dist._src.output import chief_print as print  # noqa: A001
    from keras_dist._src.output import on_chief
    from keras_dist._src.plan import DeviceMesh, LayoutMap
    from keras_dist._src.strategies import (
        CentralStorageStrategy,
        MirroredStrategy,
        ModelParallel,
        MultiWorkerMirroredStrategy,
        OneDeviceStrategy,
        ParameterServerStrategy,
        ShardedDataParallel,
        TPUStrategy,
        available_strategies,
        strategy_from_name,
    )
    from keras_dist._src.strategy import Strategy, get_strategy, has_strategy
    from keras_dist._src.values import PerReplica, ReduceOp

    __all__ = [
        "CentralStorageStrategy",
        "TPUStrategy",
        "TPUNotFoundError",
        "ClusterConfigError",
        "ClusterEnvironment",
        "DeviceMesh",
        "LayoutError",
        "LayoutMap",
        "ModelParallel",
        "ShardedDataParallel",
        "MultiWorkerMirroredStrategy",
        "DevicesAlreadyInitializedError",
        "InputOptions",
        "KerasDistError",
        "MirroredStrategy",
        "OneDeviceStrategy",
        "ParameterServerStrategy",
        "PerReplica",
        "ReduceOp",
        "ShardPolicy",
        "Strategy",
        "StrategyMixingError",
        "UnsupportedBackendError",
        "VariablesOutsideScopeError",
        "available_strategies",
        "callbacks",
        "checkpoint",
        "get_strategy",
        "layers",
        "has_strategy",
        "list_devices",
        "on_chief",
        "print",
        "serve",
        "simulate_cpu_devices",
        "strategy_from_name",
    ]

    _apply_env()
    del _apply_env
    # A worker of `keras-dist launch` that reports progress dumps its
    # stacks when the launcher finds it hung (cluster/progress.py).
    from keras_dist._src.cluster.progress import register_stack_dump

    register_stack_dump()
    del register_stack_dump
    _check_keras_version()
    del _check_keras_version

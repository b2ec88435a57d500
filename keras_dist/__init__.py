"""keras_dist: the same `model.fit` on many devices, on every Keras backend.

Build and compile a model inside ``strategy.scope()``; ``fit``, ``evaluate``
and ``predict`` then run replicated. See ``guides/distributed_training.md``.
"""

from keras_dist._src import quiet as _quiet  # isort: skip

__version__ = "0.2.0"

# The node launcher (`quiet.started_as_launcher`) starts and supervises
# workers and never trains, so it imports neither Keras nor a backend: they
# were 5.5 s of its 7.6 s start here, paid before any worker started.
if _quiet.started_as_launcher():
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

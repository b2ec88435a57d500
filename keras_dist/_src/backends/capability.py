"""What each backend declares it can do, read before any runtime starts.

Kept apart from `contract.py` (which imports the runtime) so that the
backend registry can read it without importing the runtime. Not named
`capabilities.py`: importing that submodule would rebind the package's
`capabilities()` function to the module.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any


@dataclasses.dataclass(frozen=True)
class Capabilities:
    """What the shared code (checkpoints, layers, messages) needs to know
    of a backend, declared by the backend (its `CAPABILITIES`) so that no
    code outside `backends/` switches on the backend's name.

    Attributes:
        process_per_device: each device is a process of its own (torch),
            rather than one process driving several devices.
        stateful_train_function: Keras's train function takes the
            training state first and returns ``(logs, state)`` (JAX),
            rather than taking the data alone and returning the logs.
        native_tf_data: Keras iterates a `tf.data.Dataset` in its own
            graph on this backend (TensorFlow): the iterators it makes are
            counted, not remade each epoch.
        op_seed_generator: returns the framework's own generator of op
            seeds (a ``random.Random``) that a checkpoint saves, or None;
            None where the framework has none.
        refused_plans: plan types the backend refuses (its `ENGINES`
            entry raises `UnsupportedBackendError` whatever its
            arguments): a strategy asks before any runtime or process
            starts (`backends.refuse_unsupported`).
        connect_tpu: ``connect_tpu(tpu) -> (environment, devices)``: joins
            or connects to the TPU (`environment`: this process's place in
            a multi-host job, or None; `devices`: this process's TPU
            devices, None for every chip of a joined job); None where the
            backend has no TPUs.
    """

    process_per_device: bool = False
    stateful_train_function: bool = False
    native_tf_data: bool = False
    op_seed_generator: Callable[[], Any] | None = None
    refused_plans: tuple[type, ...] = ()
    connect_tpu: Callable[[str | None], tuple] | None = None

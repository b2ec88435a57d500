"""The backend-agnostic `Strategy` front end: scope, run, reduce, gather."""

from __future__ import annotations

import contextlib
import inspect
import warnings
from collections.abc import Callable, Sequence

from keras import tree

from keras_dist._src import backends as backend_lib
from keras_dist._src import context, output
from keras_dist._src.cluster.environments import ClusterEnvironment
from keras_dist._src.devices import check_devices_exist, normalize_device
from keras_dist._src.errors import (
    LayoutError,
    StrategyMixingError,
    UnsupportedBackendError,
)
from keras_dist._src.keras_glue import hook
from keras_dist._src.options import InputOptions
from keras_dist._src.plan import Plan, ReplicatedPlan, Topology
from keras_dist._src.runtime import Runtime
from keras_dist._src.values import ReduceOp

#: `Strategy.describe`'s default: print on the chief only.
_CHIEF = object()


class Strategy:
    """Distributes a Keras model's training over several devices.

    Build and compile the model inside `scope()`; `fit`, `evaluate` and
    `predict` then run replicated, with `batch_size` meaning the global batch
    split across `num_replicas_in_sync` replicas.

    A strategy composes three parts: the `ClusterEnvironment` (where this
    process stands in the job), the backend's `Runtime` (rank, chief,
    barrier, broadcast, all-reduce, all-gather of host values) and the
    backend's replicator for this kind of strategy (the *engine*: replicated
    step functions, input distribution). Subclasses choose the kind.

    Args:
        devices: device names such as ``["gpu:0", "gpu:1"]``; None for the
            backend's default devices (every device, on every worker).
        sync_batch_norm: whether BatchNormalization uses the statistics of
            the global batch (default, so results match one device) or of each
            replica's shard.
        input_options: an `InputOptions` (how input is sharded between
            workers); defaults to ``InputOptions()`` (``ShardPolicy.AUTO``).
    """

    #: How the strategy finds its processes (a `plan.Topology`; what it
    #: means on each backend: `runtime.membership`).
    topology = Topology.MIRRORED

    def __init__(
        self,
        devices: Sequence[str] | None,
        sync_batch_norm: bool = True,
        input_options: InputOptions | None = None,
        environment: ClusterEnvironment | None = None,
    ):
        if input_options is None:
            input_options = InputOptions()
        if not isinstance(input_options, InputOptions):
            raise TypeError(
                "input_options must be a keras_dist.InputOptions, e.g. "
                "InputOptions(shard_policy=ShardPolicy.DATA); got "
                f"{input_options!r}."
            )
        module = backend_lib.get()
        if devices is not None:
            devices = [normalize_device(d) for d in devices]
        # The runtime first: joining a job (jax.distributed.initialize) must
        # happen before the backend lists its devices.
        self._runtime = module.create_runtime(
            self.topology, devices, environment
        )
        try:
            if devices is None:
                devices = module.default_devices()
            available = module.nameable_devices()
            self._devices = tuple(check_devices_exist(devices, available))
            self._sync_batch_norm = bool(sync_batch_norm)
            self._input_options = input_options
            self._plan = self._make_plan(self._devices)
            self._engine = module.create_engine(
                self._plan, runtime=self._runtime, input_options=input_options
            )
        except (LayoutError, UnsupportedBackendError):
            # Raised alike on every process (from the arguments and the
            # job's shape): the job stays joined, so that a corrected
            # strategy can still be created in this program (neither torch
            # nor JAX can join a job twice).
            raise
        except BaseException:
            # Leave the job this process joined, so that it does not hold
            # the others (or its own exit) up.
            self._runtime.shutdown()
            raise
        hook.install()
        output.set_last_strategy(self)
        output.warn_if_one_replica(
            self, backend_lib.capabilities().process_per_device
        )

    def _make_plan(self, devices) -> Plan:
        """This strategy's plan over `devices` (this process's devices,
        once the runtime has joined the job). Data parallel by default."""
        return ReplicatedPlan(
            topology=self.topology,
            devices=tuple(devices),
            sync_batch_norm=self._sync_batch_norm,
        )

    # -- properties ---------------------------------------------------------
    @property
    def plan(self) -> Plan:
        """What this strategy asks of the backend: mesh, batch axis and the
        layout of every variable (a `keras_dist` plan)."""
        return self._plan

    @property
    def devices(self) -> tuple[str, ...]:
        """The devices replicas run on, as ``"type:index"`` names."""
        return self._devices

    @property
    def runtime(self) -> Runtime:
        """This process's `Runtime`: rank, chief, barrier, broadcast,
        all-reduce and all-gather of host values between processes."""
        return self._runtime

    @property
    def is_chief(self) -> bool:
        """Whether this process is the chief (worker 0), the one that should
        print and write files."""
        return self._runtime.is_chief

    @property
    def worker_index(self) -> int:
        """This process's index among the job's processes (0 = chief)."""
        return self._runtime.rank

    @property
    def num_workers(self) -> int:
        """Number of processes in the job (one per device on torch)."""
        return self._runtime.world_size

    @property
    def input_options(self) -> InputOptions:
        """How input is sharded between workers (`InputOptions`)."""
        return self._input_options

    @property
    def num_replicas_in_sync(self) -> int:
        """How many replicas take part in each step."""
        return self._engine.num_replicas_in_sync

    @property
    def extended(self):
        """The backend engine (a `tf.distribute.Strategy` on TensorFlow is
        reachable as ``extended.tf_strategy``). For advanced use only."""
        return self._engine

    # -- scope --------------------------------------------------------------
    def scope(self):
        """Context in which models and variables are created mirrored.

        Models compiled inside it train replicated. Re-entering the same
        strategy is allowed; nesting a different one raises.

        Raises:
            StrategyMixingError: when another strategy's scope is active.
        """
        return self._scope(self._engine.scope)

    def print(self, *args, **kwargs) -> None:
        """`print` on the chief only, flushed (nothing on other processes).

        Takes `print`'s arguments. On torch the script runs once per
        device, so a plain `print` appears once per process.
        """
        if self.is_chief:
            kwargs.setdefault("flush", True)
            print(*args, **kwargs)

    def _announce(self, name: str, method, args, kwargs) -> None:
        """Logs once, from the chief, what trains where (at the first
        `fit`, `evaluate` or `predict`, with that call's batch)."""
        if getattr(self, "_announced", False):
            return
        try:
            bound = inspect.signature(method).bind_partial(*args, **kwargs)
            batch_size = bound.arguments.get("batch_size")
        except (TypeError, ValueError):
            batch_size = kwargs.get("batch_size")
        output.announce(self, name, batch_size)

    @contextlib.contextmanager
    def _call_scope(self, name: str):
        """Context around `fit`/`evaluate`/`predict` of an attached model."""
        calls = context.call_stack()
        calls.append(name)
        try:
            with self._scope(self._engine.call_scope):
                yield self
        finally:
            calls.pop()

    @contextlib.contextmanager
    def _scope(self, engine_scope):
        stack = context.strategy_stack()
        if stack and stack[-1] is not self:
            raise StrategyMixingError(
                f"Cannot enter the scope of {self!r} inside the scope of "
                f"{stack[-1]!r}: different strategies cannot be nested. Exit "
                "the outer `with strategy.scope():` block first."
            )
        stack.append(self)
        try:
            with engine_scope():
                yield self
        finally:
            stack.pop()

    # -- replica computation -----------------------------------------------
    def run(self, fn: Callable, args: tuple = (), kwargs: dict | None = None):
        """Runs `fn(*args, **kwargs)` once on every replica.

        Per-replica arguments (from `distribute_dataset` or a previous `run`)
        are split so that each replica gets its own part; other arguments are
        passed to every replica as they are.

        Returns:
            Per-replica results (a `PerReplica`, or the backend's own type on
            TensorFlow), or plain values with a single replica.
        """
        with self.scope():
            return self._engine.run(fn, tuple(args), dict(kwargs or {}))

    def reduce(self, op, value, axis: int | None = None):
        """Combines per-replica `value` across replicas with `op`.

        Args:
            op: `ReduceOp.SUM` or `ReduceOp.MEAN` (or ``"sum"``/``"mean"``).
            value: per-replica value, e.g. the result of `run`, or a
                nested structure (list, dict) of them.
            axis: if given, also reduce along this axis of every per-replica
                part (e.g. ``axis=0`` for a mean over all samples).
        """
        op = ReduceOp.from_any(op)
        return tree.map_structure(
            lambda v: self._engine.reduce(op, v, axis), value
        )

    def gather(self, value, axis: int = 0):
        """Concatenates the per-replica parts of `value` along `axis`.

        `value` may be a nested structure of per-replica values.
        """
        return tree.map_structure(lambda v: self._engine.gather(v, axis), value)

    def distribute_dataset(self, dataset):
        """Returns `dataset` as an iterable of per-replica batches.

        Each global batch of `dataset` is split along its first axis across
        replicas, every sample going to exactly one replica.
        """
        return self._engine.distribute_dataset(dataset)

    def experimental_distribute_dataset(self, dataset, options=None):
        """Alias of `distribute_dataset`, named as in `tf.distribute`."""
        del options
        return self.distribute_dataset(dataset)

    def experimental_local_results(self, value) -> tuple:
        """Returns the per-replica parts of `value` as a tuple."""
        return self._engine.local_results(value)

    def describe(self, model, print_fn=_CHIEF) -> list[dict]:
        """Every variable's path, global shape, layout and bytes per device.

        Prints a picture of the device mesh, where each model variable is
        split, and a table of every variable (model, optimizer, metrics),
        once: on the chief. Returns the rows on every process.

        Args:
            model: a model built in this strategy's scope.
            print_fn: where the text goes: by default `print` on the chief
                only; a function given here is called on every process;
                None prints nothing.

        The table ends with the expected peak per device without
        activations: the device's shares of the parameters, the optimizer's
        state (its variables once built, else estimated from its type) and
        the gradients, plus the largest single variable whole (the
        transient while one variable is created, gathered or restored).

        Returns:
            One dict per variable: ``path``, ``group`` (model, optimizer or
            metrics), ``shape``, ``dtype``, ``layout`` (a tuple, None per
            whole dimension) and ``bytes_per_device``; the list's
            ``expected_peak`` attribute is a dict of bytes per device
            (see `expected_peak`).
        """
        if print_fn is _CHIEF:
            print_fn = self.print
        return describe_variables(
            self._engine, model, print_fn, self._plan.mesh, self._devices
        )

    def __repr__(self):
        return f"{type(self).__name__}(devices={list(self._devices)})"


def describe_variables(
    engine, model, print_fn=print, mesh=None, devices=()
) -> list[dict]:
    """`Strategy.describe`: rows of every variable's placement, printed
    below a picture of `mesh` (or of the replicas' `devices`)."""
    import numpy as np

    optimizer = getattr(model, "optimizer", None)
    groups = {
        "model": list(model.variables),
        "optimizer": list(optimizer.variables) if optimizer else [],
        "metrics": list(getattr(model, "metrics_variables", [])),
    }
    rows = []
    for group, variables in groups.items():
        for variable in variables:
            layout, local_shape = engine.placement(variable)
            itemsize = np.dtype(variable.dtype).itemsize
            rows.append(
                {
                    "path": variable.path,
                    "group": group,
                    "shape": tuple(variable.shape),
                    "dtype": str(variable.dtype),
                    "layout": tuple(layout),
                    "bytes_per_device": int(np.prod(local_shape)) * itemsize,
                }
            )
    trainable = {v.path for v in model.trainable_variables}
    peak = expected_peak(rows, optimizer, trainable)
    rows = Description(rows)
    rows.expected_peak = peak
    missing = None
    if optimizer is not None and not getattr(optimizer, "built", True):
        # Keras builds the optimizer (its slots) and the compiled metrics at
        # the first step: before it the table would understate a device's
        # bytes silently.
        missing = (
            "The optimizer is not built yet: its slots (e.g. Adam's moments, "
            "which follow their variables' layouts) and the compiled metrics "
            "are not listed. Call describe() after the first step of fit, or "
            "after model.optimizer.build(model.trainable_variables) in the "
            "strategy's scope."
        )
        warnings.warn(missing, stacklevel=3)
    if print_fn is not None:
        lines = [output.mesh_diagram(mesh, list(devices))]
        if mesh is not None:
            lines.append("placement of the model's variables:")
            lines += [
                output.placement_line(r, mesh)
                for r in rows
                if r["group"] == "model"
            ]
        lines.append("")
        width = max([len(r["path"]) for r in rows] + [4])
        lines += [
            f"{'path':<{width}}  {'shape':<16} {'layout':<24} bytes/device"
        ]
        for r in rows:
            lines.append(
                f"{r['path']:<{width}}  {str(r['shape']):<16} "
                f"{str(r['layout']):<24} {r['bytes_per_device']}"
            )
        total = sum(r["bytes_per_device"] for r in rows)
        lines.append(f"total bytes per device: {total}")
        lines.extend(_peak_lines(peak))
        if missing:
            lines.append(missing)
        print_fn("\n".join(lines))
    return rows


class Description(list):
    """`Strategy.describe`'s rows, with the summary as ``expected_peak``."""

    expected_peak: dict


# Slots per trainable variable of Keras's optimizers, by class name.
_SLOTS = {
    "Adam": 2,
    "AdamW": 2,
    "Adamax": 2,
    "Nadam": 2,
    "Adadelta": 2,
    "Ftrl": 2,
    "Adagrad": 1,
    "Lion": 1,
    "Adafactor": 2,
}


def optimizer_slots(optimizer) -> int | None:
    """How many variables the size of each trainable variable `optimizer`
    keeps (Adam 2, SGD with momentum 1, plain SGD 0); None if unknown."""
    name = type(optimizer).__name__
    if name == "SGD":
        return 1 if getattr(optimizer, "momentum", 0) else 0
    if name == "RMSprop":
        momentum = 1 if getattr(optimizer, "momentum", 0) else 0
        return 1 + momentum + int(bool(getattr(optimizer, "centered", 0)))
    if name in _SLOTS:
        return _SLOTS[name] + int(bool(getattr(optimizer, "amsgrad", False)))
    return None


def expected_peak(rows, optimizer, trainable) -> dict:
    """The expected peak bytes per device of `describe`'s `rows`.

    Args:
        rows: `describe` rows.
        optimizer: the model's optimizer, or None.
        trainable: the paths of the model's trainable variables.

    Returns:
        A dict: ``parameters`` (the model's variables' shards),
        ``optimizer_state`` (the optimizer's variables' shards once built,
        else the trainable shards times `optimizer_slots`; None when
        unknown), ``optimizer_state_estimated`` (bool), ``gradients``
        (the trainable variables' shards), ``largest_variable`` (the
        largest variable whole) and ``total`` (their sum; None when the
        optimizer's state is unknown). Activations are not included.
    """
    import numpy as np

    def share(group, only=None):
        return sum(
            r["bytes_per_device"]
            for r in rows
            if r["group"] == group and (only is None or r["path"] in only)
        )

    gradients = share("model", only=trainable)
    estimated = optimizer is not None and not getattr(optimizer, "built", 1)
    if optimizer is None:
        state = 0
    elif estimated:
        slots = optimizer_slots(optimizer)
        state = None if slots is None else slots * gradients
    else:
        state = share("optimizer")
    largest = max(
        (
            int(np.prod(r["shape"])) * np.dtype(r["dtype"]).itemsize
            for r in rows
        ),
        default=0,
    )
    parts = {
        "parameters": share("model"),
        "optimizer_state": state,
        "gradients": gradients,
        "largest_variable": largest,
    }
    total = None if state is None else sum(parts.values())
    return dict(parts, optimizer_state_estimated=estimated, total=total)


def _peak_lines(peak) -> list[str]:
    """`expected_peak` as lines of `describe`'s table."""
    state = peak["optimizer_state"]
    if state is None:
        state_note = "unknown for this optimizer: not in the total"
    elif peak["optimizer_state_estimated"]:
        state_note = "estimated from the optimizer's type: not built yet"
    else:
        state_note = "the optimizer's variables"
    total = peak["total"]
    return [
        "expected peak per device (bytes, without activations):",
        f"  parameters         {peak['parameters']}",
        f"  optimizer state    {state}  ({state_note})",
        f"  gradients          {peak['gradients']}",
        f"  largest variable   {peak['largest_variable']}  (whole, while "
        "it is created, gathered or restored)",
        f"  total              {total if total is not None else 'unknown'}",
    ]


def get_strategy() -> Strategy:
    """Returns the strategy whose scope is active, or the default strategy.

    Outside every scope the default is a `OneDeviceStrategy` on the first
    device (created once).
    """
    strategy = context.current_strategy()
    if strategy is not None:
        return strategy
    default = context.default_strategy()
    if default is None:
        default = context.default_factory()()
        context.set_default_strategy(default)
    return default


def has_strategy() -> bool:
    """Returns whether a keras_dist strategy scope is active."""
    return context.current_strategy() is not None

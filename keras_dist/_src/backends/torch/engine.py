"""torch's one execution model: a process per device, the glue of every plan.

Every torch strategy with several devices runs one process (rank) per
device in a `torch.distributed` job (see `runtime`). `TorchEngine` holds
what is the same whatever the plan: this rank's device and auxiliary
process group, the chief's random generators at the start of every call
(`sync_rng_state`), the chief's values for new state
(`broadcast_from_chief`; in `scope`, for each variable as it is made),
naming another rank's failure instead of this rank's consequent error,
what each call in progress knows for its steps (a `CallState`: whether it
reads metric values every step, its inputs' local batches), and the
collectives of custom loops (`run`/`reduce`/`gather`/`distribute_dataset`).

A plan's *policy* is a subclass that installs its step functions on a
model (`attach`, with `steps.ModelSteps`) and, where it needs to, rewrites
the input of a call (`prepare_call`) or limits custom loops
(`check_custom_loop`): `data_parallel.MirroredEngine` (replicated
variables, DDP) and `sharded.DTensorEngine` (DTensors over a device mesh).
`backends/torch/__init__.py`'s `ENGINES` chooses the policy by plan type.
One device without a job runs Keras's own step (`OneDeviceEngine`).
"""

from __future__ import annotations

import contextlib
import time

import numpy as np
import torch
import torch.distributed as dist
from keras import tree

from keras_dist._src import context
from keras_dist._src.backends.contract import EngineDefaults
from keras_dist._src.backends.torch import devices as torch_devices
from keras_dist._src.backends.torch.devices import torch_device
from keras_dist._src.backends.torch.inputs import distribute_dataset
from keras_dist._src.backends.torch.job import (
    RankFailedError,
    collective_timeout,
)
from keras_dist._src.backends.torch.step_context import CallState
from keras_dist._src.cluster import supervision
from keras_dist._src.core.rng import replicate_chief_generators
from keras_dist._src.keras_glue import torch_variables
from keras_dist._src.options import InputOptions
from keras_dist._src.values import PerReplica, ReduceOp, local_results


def sync_rng_state(runtime) -> None:
    """Gives every rank the chief's global random generators.

    Keras's torch data loader (and a torch `DataLoader(shuffle=True)`)
    shuffles with torch's global generator, `PyDataset` with Python's
    `random`, NumPy input pipelines with NumPy's: with the chief's states
    (broadcast at the start of every call) every rank draws what the chief
    draws, which is what one device draws after the same
    `keras.utils.set_random_seed`. The chief's generators are left as
    plain Keras leaves them (nothing is drawn from them here).
    """
    replicate_chief_generators(
        runtime,
        get_extra=lambda: torch.get_rng_state().numpy(),
        set_extra=lambda v: torch.set_rng_state(
            torch.from_numpy(v.astype(np.uint8))
        ),
    )


def _flat_groups(tensors):
    groups = {}
    for t in tensors:
        key = t.dtype if t.dtype.is_floating_point else torch.int64
        groups.setdefault(key, []).append(t)
    return groups


def broadcast_from_chief(group, variables) -> None:
    """Overwrites `variables` with rank 0's values (one collective a dtype,
    over the process group `group`)."""
    tensors = [v.value for v in variables]
    with torch.no_grad():
        for dtype, members in _flat_groups(tensors).items():
            flat = torch.cat(
                [t.detach().reshape(-1).to(dtype) for t in members]
            )
            dist.broadcast(flat, 0, group=group)
            offset = 0
            for t in members:
                n = t.numel()
                t.copy_(flat[offset : offset + n].view_as(t).to(t.dtype))
                offset += n


def _chief_initial_value(original):
    def _initialize(variable, value):
        original(variable, value)
        # Made in a multi-rank torch scope, outside any `fit`/`evaluate`/
        # `predict` (whose policy syncs new state itself; a chief-only
        # callback may open the scope there): the chief's value, as under
        # tf.distribute's multi-worker strategies. Every rank creates the
        # same variables in the same order, as it builds the same model.
        engine = getattr(context.current_strategy(), "extended", None)
        if isinstance(engine, TorchEngine) and not context.call_stack():
            engine.adopt_new_variable(variable)

    return _initialize


class TorchEngine(EngineDefaults):
    """One rank of a job with a process per device; a policy subclass
    installs the steps.

    Args:
        devices: the strategy's devices (one per rank).
        runtime: this process's `TorchRuntime`.
        input_options: how input is sharded between ranks.
    """

    def __init__(self, devices, runtime, input_options=None):
        self.devices = tuple(devices)
        self.runtime = runtime
        self.job = runtime.job
        self.input_options = input_options or InputOptions()
        if self.devices[0].startswith("cpu"):
            torch_devices.claim_cpu_devices(len(self.devices))
        index = min(self.job.local_rank, len(self.devices) - 1)
        self.device = torch_device(self.devices[index])
        if self.device.type == "cuda":
            self.device = torch.device("cuda", torch.cuda.current_device())
        # Collectives of keras_dist's own (metrics, BatchNorm, the chief's
        # values, custom loops) use their own group, so that their order
        # can never interleave with DDP's asynchronous bucket all-reduces.
        # Like the job's own group, it waits for a hung rank at most the
        # liveness timeout (a new group's default is 30 minutes).
        self.aux_group = dist.new_group(
            backend="nccl" if self.device.type == "cuda" else "gloo",
            timeout=collective_timeout(),
        )
        # Variables made in this engine's scope take the chief's values.
        torch_variables.replace_torch_variable_initialize(_chief_initial_value)
        # One state per call in progress, innermost last; the first serves
        # custom loops, outside any call.
        self._calls = [CallState()]

    def adopt_new_variable(self, variable) -> None:
        """Gives `variable`, just made in this engine's scope outside any
        call, the chief's value (one broadcast)."""
        broadcast_from_chief(self.aux_group, [variable])

    @property
    def rank(self) -> int:
        """This process's rank."""
        return self.job.rank

    @property
    def world_size(self) -> int:
        """Number of ranks."""
        return self.job.world_size

    @property
    def num_replicas_in_sync(self) -> int:
        """Replicas of the model: one per rank unless a policy says."""
        return self.job.world_size

    @property
    def is_chief(self) -> bool:
        """Whether this is rank 0, the one that prints and writes files."""
        return self.job.rank == 0

    # -- calls ----------------------------------------------------------------
    def scope(self):
        """Variables are created as Keras creates them (on this rank's
        device), each with the chief's value (one broadcast a variable,
        `_chief_initial_value`), so that a custom loop starts every rank
        from the same weights however each is seeded; a policy takes them
        over when a model is attached."""
        return contextlib.nullcontext()

    @contextlib.contextmanager
    def call_scope(self):
        """A fresh `CallState` for the call; the chief's random generators
        (same shuffling on every rank); another rank's failure is named."""
        self._calls.append(CallState())
        try:
            sync_rng_state(self.runtime)
            yield
        except BaseException as error:
            self._check_other_ranks(error)
            raise
        finally:
            self._calls.pop()

    @property
    def call_state(self) -> CallState:
        """The state of the innermost call in progress (outside any call:
        the custom loops' state)."""
        return self._calls[-1]

    @property
    def caller_state(self) -> CallState:
        """The state of the call that made the call in progress (`fit`, for
        its validation's `evaluate`), or the custom loops' state."""
        return self._calls[-2] if len(self._calls) > 2 else self._calls[0]

    @property
    def defer_metric_sync(self) -> bool:
        """Whether the call in progress reads metric values only at its end."""
        return self.call_state.defer_metrics

    def prepare_call(self, name, method, args, kwargs):
        """Every rank reads the whole input (global batches)."""
        del name, method
        return args, kwargs

    def _check_other_ranks(self, error) -> None:
        """Turns `error` into `RankFailedError` if another rank failed.

        An exception of this rank's own is not reported here: the caller may
        catch it (``try: model.fit(...) except ...``) and go on, so only an
        uncaught exception (the excepthook) stops the job. If another rank
        has already reported a failure (or a started child died), this
        rank's error is a consequence of it and says so.
        """
        if isinstance(error, RankFailedError):
            return
        supervisor = self.job.supervisor
        # A collective that failed because another rank died or failed:
        # wait briefly for that failure to be reported, to name it.
        polls = 4 if isinstance(error, (RuntimeError, OSError)) else 1
        first = None
        for attempt in range(polls):
            if supervisor is not None:
                for rank, proc in supervisor.children.items():
                    code = proc.poll()
                    if supervision.is_failure(code):
                        supervisor.fail(
                            f"rank {rank} {supervision.describe_exit(code)}"
                        )
            first = self._reported_failure()
            if first or attempt + 1 == polls:
                break
            time.sleep(supervision.POLL_SECONDS)
        if first:
            self.job.mute()
            raise RankFailedError(
                f"Rank {self.rank} stops because another rank failed: "
                f"{first.rstrip('.')}. Fix the error of that rank (its "
                "traceback is in its output)."
            ) from error

    def _reported_failure(self) -> str | None:
        """The failure a rank reported to the job's store, if any."""
        job = self.job
        try:
            if job._report_store is None:
                job._report_store = job._client()
            store = job._report_store
            if store is None or not store.check([supervision.ERROR_KEY]):
                return None
            return store.get(supervision.ERROR_KEY).decode() or None
        except Exception:  # noqa: BLE001 - store gone: rank 0 died.
            return "rank 0 is gone (its rendezvous store is unreachable)"

    def attach(self, model) -> None:
        """Installs the policy's step functions on `model`."""
        raise NotImplementedError(type(self).__name__)

    # -- collectives on per-rank values ---------------------------------------
    def check_custom_loop(self, what: str) -> None:
        """Raises if `strategy.<what>` cannot run under this policy."""
        del what

    def run(self, fn, args, kwargs):
        """Calls `fn` on this rank's part (one replica per rank)."""
        self.check_custom_loop("run")
        return fn(*_select_local(args), **_select_local(kwargs))

    def reduce(self, op, value, axis):
        """Combines a per-replica value across ranks."""
        self.check_custom_loop("reduce")
        x = _as_tensor(local_results(value)[0]).to(self.device).detach()
        if axis is None:
            kept, count = tuple(x.shape), 1
        else:
            axis = axis % max(x.dim(), 1)
            kept = tuple(x.shape[:axis] + x.shape[axis + 1 :])
            count = int(x.shape[axis])
        # Every rank's part must have the shape the others have (but for
        # `axis`): parts of other sizes would pair up wrong elements in the
        # all-reduce, or hang it. The check also sums the counts along
        # `axis`.
        count = _same_shape_everywhere(
            kept, count, self.aux_group, self.device, "reduce", axis
        )
        # Sums keep the parts' dtype (integers stay exact); half-precision
        # floats are summed in float32. Means are floating point.
        exact = x.dtype in (torch.float32, torch.float64, torch.int32)
        exact = exact or x.dtype == torch.int64
        total = x.clone() if exact else x.float()
        if axis is not None:
            total = total.sum(axis)
        dist.all_reduce(total, group=self.aux_group)
        if op is ReduceOp.MEAN:
            if not total.dtype.is_floating_point:
                total = total.float()
            return total / max(count, 1)
        return total.to(x.dtype)

    def gather(self, value, axis):
        """Concatenates each rank's value along `axis`."""
        self.check_custom_loop("gather")
        x = _as_tensor(local_results(value)[0]).to(self.device)
        axis = axis % max(x.dim(), 1)
        kept = tuple(x.shape[:axis] + x.shape[axis + 1 :])
        _same_shape_everywhere(
            kept, 0, self.aux_group, self.device, "gather", axis
        )
        return all_gather_concat(x, axis, self.aux_group, self.world_size)

    def local_results(self, value):
        """The per-replica parts of `value` (this rank's)."""
        return local_results(value)

    def placement(self, variable):
        """Replicated (a policy may say otherwise)."""
        return replicated_placement(variable)

    def distribute_dataset(self, dataset):
        """This rank's per-replica batches (one replica per rank)."""
        self.check_custom_loop("distribute_dataset")
        return distribute_dataset(dataset, self.rank, self.world_size)


class OneDeviceEngine(EngineDefaults):
    """Keras's own torch step on one device, no process group."""

    is_chief = True

    def __init__(self, device: str):
        self.devices = (device,)
        self._device = torch_device(device)

    @property
    def num_replicas_in_sync(self) -> int:
        """One replica."""
        return 1

    def scope(self):
        """Keras's device scope of the strategy's device: variables go
        there, not to Keras's default (the first GPU where there is one)."""
        return _device_scope(self._device)

    def call_scope(self):
        """The same device scope: batches and step results go there too."""
        return _device_scope(self._device)

    def prepare_call(self, name, method, args, kwargs):
        """The call's arguments, unchanged."""
        return args, kwargs

    def attach(self, model) -> None:
        """Keras's own steps: nothing to install."""
        del model

    def run(self, fn, args, kwargs):
        """Calls `fn`."""
        return fn(*args, **kwargs)

    def reduce(self, op, value, axis):
        """The one replica's value (reduced along `axis`)."""
        x = _as_tensor(local_results(value)[0])
        if axis is None:
            return x
        return x.sum(axis) if op is ReduceOp.SUM else x.mean(axis)

    def gather(self, value, axis):
        """The one replica's value."""
        return _as_tensor(local_results(value)[0])

    def local_results(self, value):
        """The one replica's part of `value`."""
        return local_results(value)

    def placement(self, variable):
        """Replicated: the one device holds the whole variable."""
        return replicated_placement(variable)

    def distribute_dataset(self, dataset):
        """Every batch whole."""
        return distribute_dataset(dataset, 0, 1)


def _device_scope(device: torch.device):
    """Keras's scope of `device`, or nothing when Keras places tensors there
    already (its default: the current GPU where there is one, else the CPU,
    or ``KERAS_TORCH_DEVICE``)."""
    import keras

    from keras_dist._src.keras_glue.internals import torch_device_name

    if _plain(torch.device(torch_device_name())) == _plain(device):
        return contextlib.nullcontext()
    # "cpu", not "cpu:0": Keras moves each new variable's parameter
    # `.to(get_device())`, and a CPU tensor moved to "cpu:0" comes back as
    # a copy that is no longer a leaf, so it would get no gradients.
    name = "cpu" if device.type == "cpu" else f"gpu:{device.index}"
    return keras.device(name)


def _plain(device: torch.device) -> torch.device:
    """`device` with its index made explicit (a GPU's) or dropped (CPU)."""
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    if device.type == "cpu":
        return torch.device("cpu")
    return device


def replicated_placement(variable):
    """``(layout, shard shape)`` of a variable every device holds whole."""
    shape = tuple(variable.shape)
    return (None,) * len(shape), shape


_MAX_RANK = 16


def _same_shape_everywhere(shape, count, group, device, what, axis) -> int:
    """Raises on every rank unless all ranks' `shape` is the same (one
    small all-reduce); returns the sum of every rank's `count`.

    The ranks sum (h, h*h) of their header h = (rank, dims...): h is the
    same everywhere exactly when n * sum(h*h) == sum(h)**2 element-wise.
    """
    if len(shape) > _MAX_RANK:
        raise ValueError(
            f"strategy.{what} takes values of at most {_MAX_RANK} "
            f"dimensions; got shape {shape}."
        )
    header = torch.zeros(_MAX_RANK + 1, dtype=torch.int64)
    header[0] = len(shape)
    header[1 : len(shape) + 1] = torch.tensor(shape, dtype=torch.int64)
    packed = torch.cat([header, header * header, torch.tensor([count, 1])])
    packed = packed.to(device)
    dist.all_reduce(packed, group=group)
    packed = packed.cpu()
    size = _MAX_RANK + 1
    sums, squares = packed[:size], packed[size : 2 * size]
    ranks = int(packed[-1])
    if not bool(torch.equal(squares * ranks, sums * sums)):
        where = "every dimension" if axis is None else f"all but axis {axis}"
        raise ValueError(
            f"strategy.{what}: the replicas' parts differ in shape ({where} "
            f"must match; this rank's is {tuple(shape)}). A batch split "
            "over replicas has parts of different sizes: reduce a "
            "per-replica scalar (e.g. the part's loss sum), or along the "
            "batch axis (axis=0)."
        )
    return int(packed[-2])


def all_gather_concat(x, axis, group, world_size):
    """Concatenates each rank's `x` along `axis` (sizes may differ)."""
    x = torch.movedim(x.detach(), axis, 0).contiguous()
    size = torch.tensor([x.shape[0]], device=x.device)
    sizes = [torch.zeros_like(size) for _ in range(world_size)]
    dist.all_gather(sizes, size, group=group)
    sizes = [int(s) for s in sizes]
    longest = max(sizes)
    padded = x.new_zeros((longest,) + tuple(x.shape[1:]))
    padded[: x.shape[0]] = x
    parts = [torch.empty_like(padded) for _ in range(world_size)]
    dist.all_gather(parts, padded, group=group)
    out = torch.cat([p[:n] for p, n in zip(parts, sizes, strict=True)])
    return torch.movedim(out, 0, axis)


def _as_tensor(x):
    if isinstance(x, torch.Tensor):
        return x
    return torch.as_tensor(np.asarray(x))


def _select_local(structure):
    def pick(x):
        if isinstance(x, PerReplica):
            if len(x) != 1:
                raise ValueError(
                    "On torch each process holds one replica; a per-replica "
                    f"value with {len(x)} parts cannot be used here. Pass "
                    "this process's own part."
                )
            return x.values[0]
        return x

    if not structure:
        return structure
    return tree.map_structure(pick, structure, none_is_leaf=True)

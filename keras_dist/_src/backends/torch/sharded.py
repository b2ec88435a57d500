"""torch layouts over a mesh (DTensor): `ModelParallel` and
`ShardedDataParallel`.

One process per device, as under `MirroredStrategy` (the strategy starts
the other ranks, or joins a torchrun / ``keras-dist launch`` job), and a
`torch.distributed` device mesh over the ranks with the plan's shape and
axis names (gloo on CPU, NCCL on GPU). Every Keras variable — trainable,
non-trainable, optimizer slots and metrics — holds a Parameter wrapping a
DTensor with the placements of its layout: the plan's layout for the
model's variables (checked by `plan.check_variable_layout`), the layout of
their variable for optimizer slots, replicated for metrics and for every
other optimizer variable. Values are the chief's.

Each rank receives the global batch (Keras's torch trainer with the
chief's generators); it becomes a DTensor split over the batch axis
(``DTensor.from_local`` of this rank's contiguous part, replicated over
the other axes), or replicated when the batch axis does not divide it, so
every sample counts once. Keras's own `train_step` then runs unchanged
(installed by `layout_steps.LayoutSteps`, with the layer calls below):
DTensor's operators insert the collectives (all-gathers of sharded
weights, reductions of gradients and of the loss, metric statistics over
the global batch). The exceptions: the broadcast of the chief's initial
values; a training BatchNormalization of a batch split over the batch
axis, which runs as one function over that axis's process group with the
global batch's moments (`batch_norm.sharded_call`: one all-gather forward,
one all-reduce backward, where DTensor's operators take about six small
collectives and two reduce-scatters of the activation's gradient); under
`ShardedDataParallel`, each layer's split variables, gathered in one
all-gather a pass (`layer_gather`); and the gradients' reduction before
the update (`shard_update`).
Keras's channels-last convolutions and pooling run without their layout
copies (`channels_last`), as under `MirroredStrategy`.
`Dropout` draws each mask for the global batch as one device does
(`layout_steps._draw_global_mask`). Convolution kernels stay whole:
torch's DTensor convolution follows its input's placements only.

Keras's torch trainer computes with the tensors inside its own variables,
so wrapping the model with `fully_shard` or `parallelize_module` would be
bypassed; the variables' own tensors are replaced instead
(`keras_glue.torch_variables`).
"""

from __future__ import annotations

import dataclasses
import itertools
import weakref

import keras
import numpy as np
import torch
from keras import tree
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import (
    DTensor,
    Replicate,
    Shard,
    distribute_tensor,
)

from keras_dist._src import plan as plan_lib
from keras_dist._src.backends.torch import layouts
from keras_dist._src.backends.torch.engine import (
    OneDeviceEngine,
    TorchEngine,
    broadcast_from_chief,
)
from keras_dist._src.backends.torch.layout_steps import (
    LayoutSteps,
    base_call,
    direct_call,
)
from keras_dist._src.backends.torch.runtime import TorchRuntime
from keras_dist._src.devices import normalize_device
from keras_dist._src.errors import LayoutError, UnsupportedBackendError
from keras_dist._src.framework_glue import torch_private
from keras_dist._src.keras_glue import internals as glue
from keras_dist._src.keras_glue import torch_variables
from keras_dist._src.options import InputOptions, ShardPolicy


class DTensorEngine(TorchEngine):
    """One rank of a job whose variables are DTensors over a device mesh.

    Args:
        plan: a `LayoutPlan` or `ShardedPlan` (its mesh None: 1-D over the
            job, named by the batch axis).
        runtime: this process's `TorchRuntime`.
        input_options: how input is sharded between workers.
    """

    def __init__(self, plan, runtime, input_options=None):
        if not plan.sync_batch_norm:
            raise LayoutError(
                "sync_batch_norm=False is not available with layouts over a "
                "mesh on torch (the step computes on the global batch). Use "
                "MirroredStrategy(sync_batch_norm=False) for per-replica "
                "BatchNormalization statistics."
            )
        world = runtime.world_size
        mesh = plan.mesh
        if mesh is None:
            mesh = plan_lib.DeviceMesh((world,), (plan.batch_axis,))
            plan = dataclasses.replace(plan, mesh=mesh)
        if mesh.size != world:
            raise LayoutError(
                f"The mesh {mesh.shape} {mesh.axis_names} needs {mesh.size} "
                f"processes (one per device on torch), but the job has "
                f"{world}. Give a mesh whose shape multiplies to {world}, or "
                f"start {mesh.size} processes."
            )
        policy = (input_options or InputOptions()).shard_policy
        if policy in (ShardPolicy.FILE, ShardPolicy.OFF):
            raise UnsupportedBackendError(
                f"{policy} is not available with layouts over a mesh on "
                "torch: every rank reads the whole input and the batch "
                "axis splits each global batch (ShardPolicy.DATA). Use "
                "InputOptions(shard_policy=ShardPolicy.DATA) or AUTO."
            )
        devices = [normalize_device(d) for d in plan.devices]
        super().__init__(devices, runtime, input_options)
        self.plan = plan
        self.mesh = mesh
        self.torch_mesh = init_device_mesh(
            self.device.type, mesh.shape, mesh_dim_names=mesh.axis_names
        )
        flatten_axes(self.torch_mesh, mesh)
        self.batch_axis = plan.batch_axis
        self.batch_parts = mesh.axis_size(self.batch_axis)
        self.batch_index = self.torch_mesh.get_local_rank(self.batch_axis)
        split = [Replicate()] * len(mesh.shape)
        split[mesh.axis_names.index(self.batch_axis)] = Shard(0)
        self.batch_placements = tuple(split)
        self.replicated = (Replicate(),) * len(mesh.shape)
        torch_variables.replace_torch_variable_methods(
            layouts.dtensor_assign,
            layouts.dtensor_array,
            layouts.dtensor_update,
        )
        # Models checked once (weakly: a new model may reuse an old id,
        # on some ranks only, and the check is a collective).
        self._checked = weakref.WeakSet()

    @property
    def num_replicas_in_sync(self) -> int:
        """Replicas of the model: the size of the batch axis."""
        return self.batch_parts

    # -- variables ------------------------------------------------------------
    def adopt_new_variable(self, variable) -> None:
        """The chief's value (one broadcast); then a layer's variable that
        its layout splits is split at once, so that building a model in
        the scope holds its shares and at most one whole variable, never
        the whole model. The layer, called by hand before `fit`
        (``model(x)``, Keras's shape inference), then runs as after it
        (`layout_steps.direct_call`). Left whole until `lay_out`: a
        metric's, an optimizer's (its slots follow their variables,
        `shard_optimizer_slots`), a convolution's, a variable made
        outside any layer, and one Keras initializes after its layer's
        build (a subclassed model built by a symbolic run)."""
        super().adopt_new_variable(variable)
        layer = glue.name_scope_owner()
        if (
            not isinstance(layer, keras.layers.Layer)
            or isinstance(layer, layouts.CONVOLUTIONS)
            # Initialized later than made (Keras builds a subclassed model
            # by a symbolic run, then initializes its variables under the
            # model's scope): the innermost layer is not its owner.
            or variable.path.rpartition("/")[0] != glue.current_path()
        ):
            return
        shape = tuple(variable.shape)
        layout = plan_lib.check_variable_layout(
            self.plan,
            variable.path,
            shape,
            self.plan.variable_layout(variable.path, shape),
        )
        if not any(layout):
            return
        self._keep_shard(variable, layouts.placements(self.mesh, layout))
        if not hasattr(layer.__dict__.get("call"), "_keras_dist_outer_inner"):
            layer.__dict__["call"] = direct_call(self, layer, base_call(layer))

    def lay_out(self, model) -> None:
        """Makes every variable of `model` (optimizer and metrics included)
        a DTensor with its layout, from the chief's values; checks that
        every rank lays out the same variables alike and, once, that every
        LayoutMap key matches a variable."""
        if not getattr(model, "built", False) or not model.variables:
            return
        pairs = layouts.variable_layouts(self.plan, model)
        pending = [
            (v, layout)
            for v, layout in pairs
            if not isinstance(glue.variable_value(v), DTensor)
        ]
        first = model not in self._checked
        if pending or first:  # first, so that every rank fails alike
            plan_lib.check_same_on_every_process(
                self.runtime,
                [
                    (v.path, v.shape, lay)
                    for v, lay in (pairs if first else pending)
                ],
                f"model {model.name!r}",
            )
        if first:
            paths = [v.path for v in model.variables]
            plan_lib.check_unmatched(self.plan, paths, f"model {model.name!r}")
            self._checked.add(model)
        if not pending:
            return
        # The chief's values, a bucket of variables at a time (no bigger
        # than the largest variable), and each rank keeps its part at once:
        # beyond the variables as they are, a rank holds at most one
        # bucket twice, never a flat copy of the whole model.
        for bucket in _buckets(pending):
            broadcast_from_chief(self.aux_group, [v for v, _ in bucket])
            for variable, layout in bucket:
                placements = layouts.placements(self.mesh, layout)
                self._keep_shard(variable, placements)
        torch_variables.retrack_torch_parameters(
            glue.flatten_layers(model, include_self=True)
        )

    def _keep_shard(self, variable, placements) -> None:
        """Replaces `variable`'s whole value (alike on every rank) with this
        rank's part of it, as a DTensor with `placements`."""
        tensor = glue.variable_value(variable).detach().to(self.device)
        value = distribute_tensor(
            tensor, self.torch_mesh, placements, src_data_rank=None
        )
        del tensor
        glue.set_variable_value(
            variable,
            torch.nn.Parameter(value, requires_grad=bool(variable.trainable)),
        )

    def shard_optimizer_slots(self, optimizer) -> None:
        """Makes `optimizer` (and the optimizer it wraps) split each new
        slot as its model variable is split, as soon as it is made: a slot
        is whole only while it is created (zeros, or another constant,
        alike on every rank), never all of them at once."""
        engine = self

        def wrap(target):
            cls_method = type(target).add_variable_from_reference
            earlier = target.__dict__.get("add_variable_from_reference")
            if getattr(earlier, "_keras_dist_engine", None) is engine:
                return  # wrapped by an earlier compile

            def add_variable_from_reference(reference_variable, *args, **kw):
                variable = cls_method(target, reference_variable, *args, **kw)
                value = glue.variable_value(reference_variable)
                if (
                    isinstance(value, DTensor)
                    and not isinstance(glue.variable_value(variable), DTensor)
                    and tuple(variable.shape) == tuple(value.shape)
                    and value.device_mesh is engine.torch_mesh
                ):
                    engine._keep_shard(variable, tuple(value.placements))
                return variable

            add_variable_from_reference.__doc__ = cls_method.__doc__
            add_variable_from_reference._keras_dist_engine = engine
            target.__dict__["add_variable_from_reference"] = (
                add_variable_from_reference
            )

        for target in (optimizer, getattr(optimizer, "inner_optimizer", None)):
            if target is not None and hasattr(
                type(target), "add_variable_from_reference"
            ):
                wrap(target)

    def placement(self, variable):
        """The variable's layout (from its DTensor placements) and the
        shape of this rank's shard."""
        return layouts.layout_of(self.mesh, variable)

    # -- batches --------------------------------------------------------------
    def place_batch(self, data):
        """The global batch as DTensors: split along the batch axis, or
        replicated where the axis does not divide it."""

        def place(x):
            if x is None or isinstance(x, DTensor):
                return x
            if not isinstance(x, torch.Tensor):
                x = torch.as_tensor(np.asarray(x))
            x = x.to(self.device)
            # A batch axis of one device splits nothing: replicated, so
            # that DTensor does not turn each gradient into a `Partial`
            # sum over that one device (a collective per gradient).
            if (
                self.batch_parts > 1
                and x.ndim
                and (x.shape[0] % self.batch_parts == 0)
            ):
                size = x.shape[0] // self.batch_parts
                start = self.batch_index * size
                local = x[start : start + size].contiguous()
                return DTensor.from_local(
                    local,
                    self.torch_mesh,
                    self.batch_placements,
                    run_check=False,
                    shape=x.shape,
                    stride=x.contiguous().stride(),
                )
            return DTensor.from_local(
                x.contiguous(),
                self.torch_mesh,
                self.replicated,
                run_check=False,
            )

        return tree.map_structure(place, data, none_is_leaf=True)

    def attach(self, model) -> None:
        """Lays out a built model's variables; installs the step
        functions; optimizer slots are split as they are made."""
        LayoutSteps(self, model).install()
        optimizer = getattr(model, "optimizer", None)
        if optimizer is not None:
            self.shard_optimizer_slots(optimizer)
        self.lay_out(model)

    def check_custom_loop(self, what: str) -> None:
        """Custom loops run one replica per process."""
        if self.batch_parts != self.world_size:
            raise NotImplementedError(
                f"strategy.{what} on torch runs one replica per process; "
                f"this mesh {self.mesh.shape} {self.mesh.axis_names} has "
                f"{self.batch_parts} replicas over {self.world_size} "
                "processes. Use model.fit/evaluate/predict."
            )


_MIN_BUCKET = 1 << 20  # elements: small models in one collective


def _buckets(pending):
    """`pending` ``[(variable, layout)]`` in consecutive groups of at most
    the largest variable's size (or `_MIN_BUCKET` elements)."""
    limit = max([_MIN_BUCKET] + [int(np.prod(v.shape)) for v, _ in pending])
    bucket, size = [], 0
    for pair in pending:
        n = int(np.prod(pair[0].shape))
        if bucket and size + n > limit:
            yield bucket
            bucket, size = [], 0
        bucket.append(pair)
        size += n
    if bucket:
        yield bucket


def flatten_axes(torch_mesh, mesh) -> None:
    """Gives DTensor a process group for each set of two or more of the
    mesh's axes (those longer than 1).

    A tensor partial over several axes (a table split over both axes of a
    2x2 mesh, then tied: its scores) is otherwise reduced by one all-reduce
    per axis in turn, which torch warns "may give inconsistent results
    between ranks due to different reduction orders"; DTensor merges them
    into one all-reduce where such a flattened mesh exists. Collective:
    every rank creates the same groups in the same order.
    """
    axes = [n for n, k in zip(mesh.axis_names, mesh.shape) if k > 1]
    for size in range(2, len(axes) + 1):
        for names in itertools.combinations(axes, size):
            torch_private.flatten_mesh(torch_mesh[names])


class _OneProcessEngine(OneDeviceEngine):
    """A mesh of one device in one process: Keras's own step, with the
    plan's layouts checked."""

    def __init__(self, plan, device):
        super().__init__(device)
        self.plan = plan

    def attach(self, model) -> None:
        """Checks the layouts of a built model."""
        if getattr(model, "built", False) and model.variables:
            layouts.check_layouts(self.plan, model)


def create_engine(plan, runtime, input_options):
    """The engine of a `LayoutPlan` or a `ShardedPlan` on torch."""
    if not isinstance(runtime, TorchRuntime):
        mesh = plan.mesh or plan_lib.DeviceMesh((1,), (plan.batch_axis,))
        if mesh.size != 1:
            raise LayoutError(
                f"The mesh {mesh.shape} {mesh.axis_names} needs {mesh.size} "
                "processes, but this one runs alone."
            )
        plan = dataclasses.replace(plan, mesh=mesh)
        return _OneProcessEngine(plan, normalize_device(plan.devices[0]))
    check_dtensor_version(torch.__version__)
    return DTensorEngine(plan, runtime, input_options)


#: The oldest torch whose DTensor runs Keras's layers: the version CI tests.
#: torch 2.11 was seen failing on a GPU machine (4 Dec. 2026): its DTensor
#: has no sharding rule for ``aten.squeeze.dims`` (BatchNormalization) and
#: refuses a convolution whose kernel width differs from its stride, even
#: with nothing but the batch sharded. 2.12 was not tried.
MIN_DTENSOR_TORCH = (2, 13)


def dtensor_runs_on(version: str) -> bool:
    """Whether torch `version` (``torch.__version__``) is at least
    `MIN_DTENSOR_TORCH`."""
    release = tuple(int(p) for p in version.split("+")[0].split(".")[:2])
    return release >= MIN_DTENSOR_TORCH


def check_dtensor_version(version: str) -> None:
    """Raises `UnsupportedBackendError` for a torch too old for the layouts'
    DTensor steps (before a process group's first step fails in a layer).

    Args:
        version: ``torch.__version__``.
    """
    if not dtensor_runs_on(version):
        need = ".".join(map(str, MIN_DTENSOR_TORCH))
        raise UnsupportedBackendError(
            f"ModelParallel and ShardedDataParallel on torch run DTensor "
            f"steps, which need torch {need} or newer; this is torch "
            f"{version}, whose DTensor cannot run BatchNormalization or "
            f"most convolutions. Upgrade torch (pip install -U "
            f"'torch>={need}'), or train with MirroredStrategy."
        )

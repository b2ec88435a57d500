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
every sample counts once. Keras's own `train_step` then runs unchanged:
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
(`_draw_global_mask`). Convolution kernels stay whole: torch's DTensor
convolution follows its input's placements only.

Keras's torch trainer computes with the tensors inside its own variables,
so wrapping the model with `fully_shard` or `parallelize_module` would be
bypassed; the variables' own tensors are replaced instead
(`keras_glue.torch_variables`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import threading

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
from torch.distributed.tensor.experimental import implicit_replication
from torch.nn.attention import SDPBackend, sdpa_kernel

from keras_dist._src import plan as plan_lib
from keras_dist._src.backends.torch import (
    batch_norm,
    channels_last,
    layer_gather,
    layouts,
    shard_update,
)
from keras_dist._src.backends.torch.engine import (
    OneDeviceEngine,
    TorchEngine,
    broadcast_from_chief,
)
from keras_dist._src.backends.torch.runtime import TorchRuntime
from keras_dist._src.backends.torch.steps import (
    ModelSteps,
    install_global_dropout,
)
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
        self._checked = set()

    @property
    def num_replicas_in_sync(self) -> int:
        """Replicas of the model: the size of the batch axis."""
        return self.batch_parts

    # -- variables ------------------------------------------------------------
    def lay_out(self, model) -> None:
        """Makes every variable of `model` (optimizer and metrics included)
        a DTensor with its layout, from the chief's values; checks that
        every rank lays out the same variables alike and, once, that every
        LayoutMap key matches a variable."""
        if not getattr(model, "built", False) or not model.variables:
            return
        pending = [
            (v, layout)
            for v, layout in layouts.variable_layouts(self.plan, model)
            if not isinstance(glue.variable_value(v), DTensor)
        ]
        if pending:  # first, so that every rank fails alike
            plan_lib.check_same_on_every_process(
                self.runtime,
                [(v.path, v.shape, layout) for v, layout in pending],
                f"model {model.name!r}",
            )
        if id(model) not in self._checked:
            paths = [v.path for v in model.variables]
            plan_lib.check_unmatched(self.plan, paths, f"model {model.name!r}")
            self._checked.add(id(model))
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
        _StepFunctions(self, model).install()
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


def _draw_global_mask(engine):
    """Dropout's mask on a DTensor batch: drawn with the layer's own call
    on a plain tensor of ones of the global shape (the chief's generators
    on every rank: the draw of one device), replicated, and applied to the
    (split) batch."""

    def draw(layer, original, inputs):
        if not isinstance(inputs, DTensor) or layer.rate <= 0:
            return None
        probe = torch.ones(
            tuple(inputs.shape), dtype=inputs.dtype, device=engine.device
        )
        return DTensor.from_local(
            original(probe, training=True),
            inputs.device_mesh,
            (Replicate(),) * inputs.device_mesh.ndim,
            run_check=False,
        )

    return draw


def _install_reduced_lookups(model) -> None:
    """An `Embedding` whose table is split by rows returns, under DTensor,
    each rank's rows as a "masked partial" sum, whose mask keeps the shape
    of the ids; a later reshape of the output (a `Dense` or `EinsumDense`
    on a sequence: ``[B, L, D]`` to ``[B * L, D]``) leaves the mask behind,
    and reducing it fails (torch 2.13: ``IndexError`` in ``apply_mask``).
    The lookup's output is reduced right away instead (one all-reduce over
    the table's axis, as torch's `RowwiseParallel` embedding replicates
    its output)."""
    glue.wrap_layer_calls(
        model, lambda layer: isinstance(layer, keras.layers.Embedding),
        _reduced_lookup,
    )  # fmt: skip


def _reduced_lookup(layer, original):
    def call(*args, **kwargs):
        ids = None
        if args and not (kwargs.get("reverse") or args[1:2] == (True,)):
            ids = args[0]
            args = (_ids_whole_where_table_split(layer, ids),) + args[1:]
        outputs = original(*args, **kwargs)
        if isinstance(outputs, DTensor) and any(
            p.is_partial() for p in outputs.placements
        ):
            mesh = outputs.device_mesh
            placements = tuple(
                Replicate() if p.is_partial() else p for p in outputs.placements
            )
            # Through a plain tensor, so that the backward hands the
            # lookup a gradient with these placements: a partial gradient
            # (a later sum over the batch axis) cannot be redistributed to
            # the masked partial placement (torch 2.13 refuses).
            local = outputs.redistribute(mesh, placements).to_local(
                grad_placements=placements
            )
            outputs = DTensor.from_local(
                local, mesh, placements, run_check=False
            )
            outputs = _split_as_ids(outputs, ids)
        return outputs

    call.__doc__ = getattr(original, "__doc__", None)
    return call


def _split_as_ids(outputs, ids):
    """A reduced lookup's output split again by batch rows over each mesh
    axis that split the ids by rows (and that the output is whole on): the
    ids were gathered for the lookup (`_ids_whole_where_table_split`), and
    without this every later layer computes the whole global batch on every
    rank of that axis (``ShardedDataParallel``, whose table is split by
    rows over the batch axis: no data parallelism after an `Embedding`,
    and each `Dense` then splits its input by features and all-reduces its
    whole output). A local slice; its backward gathers the gradient."""
    if not isinstance(ids, DTensor) or ids.ndim < 1:
        return outputs
    placements = tuple(
        Shard(0) if p.is_shard(0) and o.is_replicate() else o
        for p, o in zip(ids.placements, outputs.placements)
    )
    if placements == tuple(outputs.placements):
        return outputs
    return outputs.redistribute(outputs.device_mesh, placements)


def _ids_whole_where_table_split(layer, ids):
    """The ids of a lookup, gathered over each mesh axis that splits both
    them (the batch) and the table (KerasHub's Gemma map splits the
    embeddings' width over "batch"). DTensor would move the ids itself,
    but its masked partial output then keeps a mask of the split ids'
    shape, and reducing it fails (torch 2.13: ``IndexError`` in
    ``apply_mask``)."""
    table = getattr(layer, "embeddings", None)
    table = getattr(table, "value", table)
    if not (isinstance(ids, DTensor) and isinstance(table, DTensor)):
        return ids
    placements = tuple(
        Replicate() if p.is_shard() and not t.is_replicate() else p
        for p, t in zip(ids.placements, table.placements)
    )
    if placements == tuple(ids.placements):
        return ids
    return ids.redistribute(ids.device_mesh, placements)


def _install_split_inputs(model) -> None:
    """A `Dense` whose kernel is split by rows (its input features) over a
    mesh axis on which its input is whole: the input is split by features
    explicitly before the call. DTensor would split it inside the matmul
    all the same, but then hands back the input's gradient split by
    features, and a later layer's backward may re-split it by batch rows
    instead: with a batch the axis does not divide (an odd last batch),
    torch 2.13 then fails to reshape the uneven rows (``RuntimeError:
    shape '[1, 15, 8]' is invalid``, a LayerNormalization and a
    MultiHeadAttention before such a `Dense`). The explicit split's backward
    gathers the gradient back to the input's own placement instead."""
    glue.wrap_layer_calls(
        model, lambda layer: isinstance(layer, keras.layers.Dense),
        _split_input_call,
    )  # fmt: skip


def _split_input_call(layer, original):
    def call(inputs, *args, **kwargs):
        kernel = getattr(layer, "_kernel", None)
        kernel = glue.variable_value(kernel) if kernel is not None else None
        if isinstance(inputs, DTensor) and isinstance(kernel, DTensor):
            placements = list(inputs.placements)
            for axis, placement in enumerate(kernel.placements):
                if placement.is_shard(0) and placements[axis].is_replicate():
                    placements[axis] = Shard(inputs.ndim - 1)
            if placements != list(inputs.placements):
                inputs = inputs.redistribute(inputs.device_mesh, placements)
        return original(inputs, *args, **kwargs)

    call.__doc__ = getattr(original, "__doc__", None)
    return call


#: ``depth``: how many steps (or calls by hand) this thread is inside.
_IN_STEP = threading.local()


class _StepFunctions(ModelSteps):
    """Keras's own steps on DTensor batches and variables."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        # Whether Keras's symbolic build of the model is running.
        self.building = [False]

    def install(self) -> None:
        """Replaces the step factories, metric reads and Dropout calls."""
        model = self.model
        cls = type(model)

        def get_metrics_result():
            # Replicated DTensors: their local values, on every rank.
            return layouts.to_plain(cls.get_metrics_result(model))

        get_metrics_result.__doc__ = cls.get_metrics_result.__doc__
        model.__dict__["get_metrics_result"] = get_metrics_result
        layers = glue.flatten_layers(model)
        for layer in layers:
            if isinstance(
                layer, keras.layers.BatchNormalization
            ) and batch_norm.fusable(layer):
                glue.replace_batch_norm_call(
                    layer,
                    batch_norm.sharded_call(
                        self.engine,
                        layer,
                        glue.original_batch_norm_call(layer),
                    ),
                )
        # Keras's channels-last convolutions and pooling without their
        # layout copies (Keras's results: see `channels_last`).
        channels_last.install(layers)
        install_global_dropout(model, _draw_global_mask(self.engine))
        _install_reduced_lookups(model)
        _install_split_inputs(model)
        engine = self.engine
        if isinstance(engine.plan, plan_lib.ShardedPlan):
            # Each layer's split variables in one all-gather a pass.
            layer_gather.install(
                model, engine.mesh.axis_names.index(engine.batch_axis)
            )
        self._install_direct_calls()
        super().install()

    def _install_direct_calls(self) -> None:
        """A layer of the model called by hand, outside the steps (`model(x)`
        for inference, a sampler's ``model.get_layer("embedding")(ids)``,
        a sublayer of a backbone): see `_direct_call`. Keras's symbolic
        build of the model calls it as one device does. Also the plan's
        ``"…/output"`` keys (`_output_layout_call`)."""
        building = self.building

        @contextlib.contextmanager
        def build_scope():
            building[0] = True
            try:
                yield
            finally:
                building[0] = False

        glue.symbolic_build_in(self.model, build_scope)
        plan = self.engine.plan
        outputs = isinstance(plan, plan_lib.LayoutPlan) and plan.output_keys()
        if outputs:
            plan_lib.check_unmatched(
                plan,
                plan_lib.layer_output_paths(self.model, glue.flatten_layers),
                f"model {self.model.name!r}",
            )
        for layer in glue.flatten_layers(self.model, include_self=True):
            # Installed again (a recompile): around what is under it now.
            base = layer_gather.peel(layer.__dict__.get("call"))
            if base is None:
                base = type(layer).call.__get__(layer)
            inner = self._output_layout_call(base) if outputs else base
            call = self._direct_call(layer, inner)
            call._keras_dist_outer_inner = base
            layer.__dict__["call"] = call

    def _output_layout_call(self, inner):
        """`inner` (a layer's call) whose outputs, in a step or a call by
        hand, take the layout of the plan's ``"…/output"`` key that their
        path matches (Keras's path: `glue.current_path` + ``"/output"``),
        as DTensor redistributions (autograd moves the gradient back)."""
        plan, mesh = self.engine.plan, self.engine.mesh

        def relayout(path, layout, x):
            if not isinstance(x, DTensor):
                return x
            if len(layout) != x.ndim:
                raise LayoutError(
                    f"The layout {layout} for layer output {path!r} has "
                    f"{len(layout)} entries, but the output has shape "
                    f"{tuple(x.shape)} ({x.ndim} dimensions). Give one "
                    "entry per dimension (None for a whole one)."
                )
            placements = layouts.placements(mesh, layout)
            if tuple(x.placements) == placements:
                return x
            return x.redistribute(x.device_mesh, placements)

        def call(*args, **kwargs):
            outputs = inner(*args, **kwargs)
            if not getattr(_IN_STEP, "depth", 0) or glue.in_symbolic_scope():
                return outputs
            path = glue.current_path() + plan_lib.OUTPUT_SUFFIX
            layout = plan.output_layout(path)
            if layout is None:
                return outputs
            return tree.map_structure(
                lambda x: relayout(path, layout, x), outputs
            )

        call.__doc__ = getattr(inner, "__doc__", None)
        return call

    def _direct_call(self, layer, inner):
        """`inner` (the call of `layer`) that, called by hand with plain
        tensors on a layer whose variables are DTensors, runs as a step
        does: every rank passes the same whole inputs, which go in
        replicated, and the outputs come back whole, as plain tensors (in
        Keras's symbolic shape inference they stay DTensors: only their
        shapes are read, and gathering them would be a collective). Inside
        a step or a call by hand (nested layers), with DTensor inputs, in
        Keras's symbolic build, or before the variables are laid out, the
        call is `inner` itself."""
        engine = self.engine
        building = self.building

        def replicated(x):
            if isinstance(x, torch.Tensor) and not isinstance(x, DTensor):
                return DTensor.from_local(
                    x.to(engine.device),
                    engine.torch_mesh,
                    engine.replicated,
                    run_check=False,
                )
            return x

        def call(*args, **kwargs):
            if (
                getattr(_IN_STEP, "depth", 0)
                or building[0]
                or not any(
                    isinstance(glue.variable_value(v), DTensor)
                    for v in layer.weights
                )
                or any(
                    isinstance(x, DTensor) for x in tree.flatten((args, kwargs))
                )
            ):
                return inner(*args, **kwargs)
            args, kwargs = tree.map_structure(replicated, (args, kwargs))
            with self._dtensor_ops():
                outputs = inner(*args, **kwargs)
            if glue.in_symbolic_scope():
                return outputs
            return layouts.to_plain(outputs)

        call.__doc__ = getattr(inner, "__doc__", None)
        return call

    def prepare(self) -> None:
        """The model's variables as DTensors."""
        self.engine.lay_out(self.model)

    @contextlib.contextmanager
    def _dtensor_ops(self):
        """Inside a step, a plain tensor that Keras makes (a recurrent
        layer's zero state, a metric's constants, an optimizer's scalars)
        is the same on every rank: DTensor treats it as replicated
        (`implicit_replication`) instead of refusing the mix. On CPUs,
        scaled dot-product attention (MultiHeadAttention's) runs torch's
        math kernel: DTensor has no sharding rule for the CPU flash
        kernel's backward (torch 2.13), and the math kernel's ops all have
        one."""
        with contextlib.ExitStack() as stack:
            stack.enter_context(implicit_replication())
            if self.engine.device.type == "cpu":
                stack.enter_context(sdpa_kernel([SDPBackend.MATH]))
            _IN_STEP.depth = getattr(_IN_STEP, "depth", 0) + 1
            try:
                yield
            finally:
                _IN_STEP.depth -= 1

    def train_step(self, data):
        """Keras's `train_step` on a DTensor batch."""
        batch = self.engine.place_batch(data)
        shard_update.install(self.model.optimizer)
        with self._dtensor_ops():
            return layouts.to_plain(self.model.train_step(batch))

    def test_step(self, data):
        """Keras's `test_step` on a DTensor batch."""
        batch = self.engine.place_batch(data)
        with self._dtensor_ops():
            return layouts.to_plain(self.model.test_step(batch))

    def predict_step(self, data):
        """Keras's `predict_step`; the whole batch's outputs on every
        rank."""
        batch = self.engine.place_batch(data)
        with self._dtensor_ops():
            return layouts.to_plain(self.model.predict_step(batch))


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

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
weights, reductions of gradients and of the loss, metric and
BatchNormalization statistics over the global batch). Nothing here writes
a collective, except the broadcast of the chief's initial values.
`Dropout` draws each mask for the global batch as one device does
(`_global_dropout`). Convolution kernels stay whole: torch's DTensor
convolution follows its input's placements only.

Keras's torch trainer computes with the tensors inside its own variables,
so wrapping the model with `fully_shard` or `parallelize_module` would be
bypassed; the variables' own tensors are replaced instead
(`keras_glue.torch_variables`).
"""

from __future__ import annotations

import contextlib
import dataclasses

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
from keras_dist._src.backends.torch import data_parallel
from keras_dist._src.backends.torch import devices as torch_devices
from keras_dist._src.backends.torch.devices import torch_device
from keras_dist._src.backends.torch.inputs import distribute_dataset
from keras_dist._src.backends.torch.runtime import TorchRuntime
from keras_dist._src.devices import normalize_device
from keras_dist._src.errors import LayoutError, UnsupportedBackendError
from keras_dist._src.keras_glue import internals as glue
from keras_dist._src.keras_glue import torch_variables
from keras_dist._src.options import InputOptions, ShardPolicy
from keras_dist._src.values import local_results

#: Keras's convolution layers (their kernels stay whole on torch).
_CONVOLUTIONS = (
    keras.layers.Conv1D,
    keras.layers.Conv2D,
    keras.layers.Conv3D,
    keras.layers.Conv1DTranspose,
    keras.layers.Conv2DTranspose,
    keras.layers.Conv3DTranspose,
    keras.layers.DepthwiseConv1D,
    keras.layers.DepthwiseConv2D,
    keras.layers.SeparableConv1D,
    keras.layers.SeparableConv2D,
)


# -- variables as DTensors ---------------------------------------------------
def _to_plain(x):
    """`x` with every DTensor replaced by its whole value (a collective
    only for a value that is not replicated)."""

    def plain(t):
        if isinstance(t, DTensor):
            return t.full_tensor()
        return t

    return tree.map_structure(plain, x)


def _assign(original):
    def _direct_assign(variable, value):
        target = glue.variable_value(variable)
        if isinstance(target, DTensor) and not isinstance(value, DTensor):
            # A whole value (set_weights, a checkpoint restore) given on
            # every rank: each keeps its part, no collective.
            local = target.to_local()
            value = torch.as_tensor(value).to(local.device, local.dtype)
            value = distribute_tensor(
                value,
                target.device_mesh,
                target.placements,
                src_data_rank=None,
            )
        return original(variable, value)

    return _direct_assign


def _array(original):
    def __array__(variable, dtype=None, *args, **kwargs):
        value = glue.variable_value(variable)
        if not isinstance(value, DTensor):
            return original(variable, dtype, *args, **kwargs)
        # A sharded variable is gathered: every rank must read it alike.
        whole = value.full_tensor().detach().cpu()
        if whole.dtype == torch.bfloat16:
            whole = whole.float()
        # A copy: a replicated DTensor's whole value is its local tensor.
        return np.array(whole.numpy(), dtype=dtype)

    return __array__


class DTensorEngine:
    """One rank of a job whose variables are DTensors over a device mesh.

    Args:
        plan: a `LayoutPlan` or `ShardedPlan` (its mesh None: 1-D over the
            job, named by the batch axis).
        runtime: this process's `TorchRuntime`.
        input_options: how input is sharded between workers.
    """

    # The Mirrored engine's failure naming (another rank's error) applies
    # as it is: it reads only the job.
    _check_other_ranks = data_parallel.MirroredEngine._check_other_ranks
    _reported_failure = data_parallel.MirroredEngine._reported_failure

    def __init__(self, plan, runtime, input_options=None):
        if not plan.sync_batch_norm:
            raise LayoutError(
                "sync_batch_norm=False is not available with layouts over a "
                "mesh on torch (the step computes on the global batch). Use "
                "MirroredStrategy(sync_batch_norm=False) for per-replica "
                "BatchNormalization statistics."
            )
        self.runtime = runtime
        self.job = runtime.job
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
        self.plan = plan
        self.mesh = mesh
        self.input_options = input_options or InputOptions()
        policy = self.input_options.shard_policy
        if policy in (ShardPolicy.FILE, ShardPolicy.OFF):
            raise UnsupportedBackendError(
                f"{policy} is not available with layouts over a mesh on "
                "torch: every rank reads the whole input and the batch "
                "axis splits each global batch (ShardPolicy.DATA). Use "
                "InputOptions(shard_policy=ShardPolicy.DATA) or AUTO."
            )
        self.devices = tuple(normalize_device(d) for d in plan.devices)
        if self.devices[0].startswith("cpu"):
            torch_devices.claim_cpu_devices(len(self.devices))
        index = min(self.job.local_rank, len(self.devices) - 1)
        self.device = torch_device(self.devices[index])
        if self.device.type == "cuda":
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.torch_mesh = init_device_mesh(
            self.device.type, mesh.shape, mesh_dim_names=mesh.axis_names
        )
        # Host-side collectives of custom loops and the chief broadcast.
        self.aux_group = torch.distributed.new_group(
            backend="nccl" if self.device.type == "cuda" else "gloo"
        )
        self.batch_axis = plan.batch_axis
        self.batch_parts = mesh.axis_size(self.batch_axis)
        self.batch_index = self.torch_mesh.get_local_rank(self.batch_axis)
        split = [Replicate()] * len(mesh.shape)
        split[mesh.axis_names.index(self.batch_axis)] = Shard(0)
        self.batch_placements = tuple(split)
        self.replicated = (Replicate(),) * len(mesh.shape)
        torch_variables.replace_torch_variable_methods(_assign, _array)
        self._checked = set()

    # -- properties -----------------------------------------------------------
    @property
    def rank(self) -> int:
        """This process's rank."""
        return self.job.rank

    @property
    def world_size(self) -> int:
        """Number of ranks (devices of the mesh)."""
        return self.job.world_size

    @property
    def num_replicas_in_sync(self) -> int:
        """Replicas of the model: the size of the batch axis."""
        return self.batch_parts

    @property
    def is_chief(self) -> bool:
        """Whether this is rank 0, the one that prints and writes files."""
        return self.job.rank == 0

    # -- scopes ---------------------------------------------------------------
    def scope(self):
        """Variables are created as Keras creates them; they become
        DTensors when the model is attached or a step function is made."""
        return contextlib.nullcontext()

    @contextlib.contextmanager
    def call_scope(self):
        """The chief's random generators (same shuffling on every rank);
        another rank's failure is named."""
        try:
            data_parallel.sync_rng_state(self)
            yield
        except BaseException as error:
            self._check_other_ranks(error)
            raise

    def prepare_call(self, name, method, args, kwargs):
        """Every rank reads the whole input (global batches)."""
        del name, method
        return args, kwargs

    # -- layouts --------------------------------------------------------------
    def placements(self, layout) -> tuple:
        """DTensor placements (one per mesh axis) of a full-rank layout."""
        out = list(self.replicated)
        for dim, entry in enumerate(layout):
            names = (entry,) if isinstance(entry, str) else entry or ()
            for name in names:
                out[self.mesh.axis_names.index(name)] = Shard(dim)
        return tuple(out)

    def layouts(self, model) -> list:
        """``[(variable, layout)]`` for every variable of `model`, its
        optimizer and its metrics (checked against the mesh)."""
        plan = self.plan
        pairs, by_id = [], {}
        convolutions = {
            id(v)
            for layer in glue.flatten_layers(model, include_self=True)
            if isinstance(layer, _CONVOLUTIONS)
            for v in layer.variables
        }
        for variable in model.variables:
            shape = tuple(variable.shape)
            layout = plan_lib.check_variable_layout(
                plan,
                variable.path,
                shape,
                plan.variable_layout(variable.path, shape),
            )
            if id(variable) in convolutions and any(layout):
                layout = self._convolution_layout(variable, layout)
            by_id[id(variable)] = layout
            pairs.append((variable, layout))
        optimizer = getattr(model, "optimizer", None)
        if optimizer is not None and getattr(optimizer, "built", False):
            references = sorted(
                model.trainable_variables,
                key=lambda v: -len(v.path),
            )
            for variable in optimizer.variables:
                if id(variable) in by_id:
                    continue
                layout = self._slot_layout(variable, references, by_id)
                by_id[id(variable)] = layout
                pairs.append((variable, layout))
        for variable in getattr(model, "metrics_variables", []):
            if id(variable) not in by_id:
                by_id[id(variable)] = (None,) * len(variable.shape)
                pairs.append((variable, by_id[id(variable)]))
        return pairs

    def _convolution_layout(self, variable, layout):
        """torch's DTensor convolution follows its input's placements and
        needs whole kernels: ZeRO keeps them replicated; a LayoutMap that
        splits one is an error."""
        if isinstance(self.plan, plan_lib.ShardedPlan):
            return (None,) * len(layout)
        raise LayoutError(
            f"The layout {layout} of variable {variable.path!r} (shape "
            f"{tuple(variable.shape)}) splits a convolution's weights, which "
            "torch's DTensor convolution does not support (it needs whole "
            "kernels and biases). Leave convolution variables out of the "
            "LayoutMap on torch (or use KERAS_BACKEND=jax)."
        )

    def _slot_layout(self, variable, references, layouts):
        """An optimizer variable's layout: its model variable's (Keras names
        a slot ``<variable path with _>_<slot>``), else replicated (ZeRO:
        split by size, as a model variable)."""
        shape = tuple(variable.shape)
        for reference in references:
            prefix = reference.path.replace("/", "_") + "_"
            if variable.name.startswith(prefix) and shape == tuple(
                reference.shape
            ):
                return layouts[id(reference)]
        if isinstance(self.plan, plan_lib.ShardedPlan):
            return plan_lib.check_variable_layout(
                self.plan,
                variable.path,
                shape,
                self.plan.variable_layout(variable.path, shape),
            )
        return (None,) * len(shape)

    def lay_out(self, model) -> None:
        """Makes every variable of `model` (optimizer and metrics included)
        a DTensor with its layout, from the chief's values; checks once
        that every LayoutMap key matches a variable."""
        if not getattr(model, "built", False) or not model.variables:
            return
        if id(model) not in self._checked:
            paths = [v.path for v in model.variables]
            plan_lib.check_unmatched(self.plan, paths, f"model {model.name!r}")
            self._checked.add(id(model))
        pending = [
            (v, layout)
            for v, layout in self.layouts(model)
            if not isinstance(glue.variable_value(v), DTensor)
        ]
        if not pending:
            return
        # The chief's values everywhere (one collective a dtype), then
        # each rank keeps its part.
        data_parallel.broadcast_from_chief(self, [v for v, _ in pending])
        for variable, layout in pending:
            tensor = glue.variable_value(variable).detach().to(self.device)
            value = distribute_tensor(
                tensor,
                self.torch_mesh,
                self.placements(layout),
                src_data_rank=None,
            )
            parameter = torch.nn.Parameter(
                value, requires_grad=bool(variable.trainable)
            )
            glue.set_variable_value(variable, parameter)
        torch_variables.retrack_torch_parameters(
            glue.flatten_layers(model, include_self=True)
        )

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
            if x.ndim and x.shape[0] % self.batch_parts == 0:
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

    # -- models ---------------------------------------------------------------
    def attach(self, model) -> None:
        """Lays out a built model's variables; installs the step
        functions."""
        _StepFunctions(self, model).install()
        self.lay_out(model)

    # -- custom loops ---------------------------------------------------------
    def _check_replicas_are_ranks(self, what):
        if self.batch_parts != self.world_size:
            raise NotImplementedError(
                f"strategy.{what} on torch runs one replica per process; "
                f"this mesh {self.mesh.shape} {self.mesh.axis_names} has "
                f"{self.batch_parts} replicas over {self.world_size} "
                "processes. Use model.fit/evaluate/predict."
            )

    def run(self, fn, args, kwargs):
        """Calls `fn` on this rank's part (one replica per rank)."""
        self._check_replicas_are_ranks("run")
        return data_parallel.MirroredEngine.run(self, fn, args, kwargs)

    def reduce(self, op, value, axis):
        """Combines a per-replica value across ranks."""
        self._check_replicas_are_ranks("reduce")
        return data_parallel.MirroredEngine.reduce(self, op, value, axis)

    def gather(self, value, axis):
        """Concatenates each rank's value along `axis`."""
        self._check_replicas_are_ranks("gather")
        return data_parallel.MirroredEngine.gather(self, value, axis)

    def local_results(self, value):
        """The per-replica parts of `value` (this rank's)."""
        return local_results(value)

    def placement(self, variable):
        """The variable's layout (from its DTensor placements) and the
        shape of this rank's shard."""
        value = glue.variable_value(variable)
        shape = tuple(variable.shape)
        if not isinstance(value, DTensor):
            return (None,) * len(shape), shape
        layout = [[] for _ in shape]
        for axis, placement in zip(self.mesh.axis_names, value.placements):
            if isinstance(placement, Shard):
                layout[placement.dim].append(axis)
        layout = tuple(
            None if not names else names[0] if len(names) == 1 else tuple(names)
            for names in layout
        )
        return layout, tuple(value.to_local().shape)

    def distribute_dataset(self, dataset):
        """This rank's per-replica batches (one replica per rank)."""
        self._check_replicas_are_ranks("distribute_dataset")
        return distribute_dataset(dataset, self.rank, self.world_size)


def _global_dropout(engine, layer, original):
    """A `Dropout.call` that drops what one device drops.

    On a DTensor batch in training, the mask is drawn with the layer's own
    call on a plain tensor of ones of the global shape (the chief's
    generators on every rank: the draw of one device), replicated, and
    applied to the (split) batch. Elsewhere it is Keras's call.
    """

    def call(inputs, training=False):
        if not training or not isinstance(inputs, DTensor) or layer.rate <= 0:
            return original(inputs, training=training)
        probe = torch.ones(
            tuple(inputs.shape), dtype=inputs.dtype, device=engine.device
        )
        kept = DTensor.from_local(
            original(probe, training=True),
            inputs.device_mesh,
            (Replicate(),) * inputs.device_mesh.ndim,
            run_check=False,
        )
        seeded = (
            layer.noise_shape is not None
            or glue.seed_generator_initial_seed(layer.seed_generator)
            is not None
        )
        if seeded:
            # Keras's seeded path: where(mask, inputs / keep_prob, 0).
            return torch.where(
                kept != 0, inputs / (1.0 - layer.rate), torch.zeros_like(inputs)
            )
        return inputs * kept  # torch's dropout: inputs * (mask / keep_prob)

    return call


class _StepFunctions:
    """Keras's own steps on DTensor batches and variables."""

    def __init__(self, engine, model):
        self.engine = engine
        self.model = model

    def install(self) -> None:
        model = self.model
        cls = type(model)

        def get_metrics_result():
            # Replicated DTensors: their local values, on every rank.
            return _to_plain(cls.get_metrics_result(model))

        get_metrics_result.__doc__ = cls.get_metrics_result.__doc__
        model.__dict__["get_metrics_result"] = get_metrics_result
        for layer in glue.flatten_layers(model):
            if type(layer) is keras.layers.Dropout:
                original = type(layer).call.__get__(layer)
                layer.__dict__["call"] = _global_dropout(
                    self.engine, layer, original
                )
        model.__dict__["make_train_function"] = self.make_train_function
        model.__dict__["make_test_function"] = self.make_test_function
        model.__dict__["make_predict_function"] = self.make_predict_function
        model.train_function = None
        model.test_function = None
        model.predict_function = None

    def _prepare(self):
        model = self.model
        if model.steps_per_execution > 1:
            raise ValueError(
                "`steps_per_execution` must be 1 with the PyTorch backend; "
                f"got {model.steps_per_execution}. Compile with "
                "steps_per_execution=1."
            )
        self.engine.lay_out(model)

    def make_train_function(self, force=False):
        """Keras's `train_step` on DTensor batches."""
        model = self.model
        if model.train_function is not None and not force:
            return model.train_function
        self._prepare()
        engine = self.engine

        def one_step_on_data(data):
            return _to_plain(model.train_step(engine.place_batch(data[0])))

        model.train_function = one_step_on_data
        return one_step_on_data

    def make_test_function(self, force=False):
        """Keras's `test_step` on DTensor batches."""
        model = self.model
        if model.test_function is not None and not force:
            return model.test_function
        self._prepare()
        engine = self.engine

        def one_step_on_data(data):
            with torch.no_grad():
                logs = model.test_step(engine.place_batch(data[0]))
            return _to_plain(logs)

        model.test_function = one_step_on_data
        return one_step_on_data

    def make_predict_function(self, force=False):
        """Keras's `predict_step`; the whole batch's outputs on every
        rank."""
        model = self.model
        if model.predict_function is not None and not force:
            return model.predict_function
        self._prepare()
        engine = self.engine

        def one_step_on_data(data):
            with torch.no_grad():
                outputs = model.predict_step(engine.place_batch(data[0]))
            return _to_plain(outputs)

        model.predict_function = one_step_on_data
        return one_step_on_data


class _OneProcessEngine(data_parallel.OneDeviceEngine):
    """A mesh of one device in one process: Keras's own step, with the
    plan's layouts checked."""

    def __init__(self, plan, device):
        super().__init__(device)
        self.plan = plan

    def attach(self, model) -> None:
        """Checks the layouts of a built model."""
        if getattr(model, "built", False) and model.variables:
            for variable in model.variables:
                shape = tuple(variable.shape)
                plan_lib.check_variable_layout(
                    self.plan,
                    variable.path,
                    shape,
                    self.plan.variable_layout(variable.path, shape),
                )
            paths = [v.path for v in model.variables]
            plan_lib.check_unmatched(self.plan, paths, f"model {model.name!r}")


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
    return DTensorEngine(plan, runtime, input_options)

"""JAX layouts over a mesh: the policy of `ModelParallel` and
`ShardedDataParallel`.

Each variable gets the `NamedSharding` its plan gives it (a `LayoutMap`
entry, or ZeRO-3's split along the batch axis); optimizer slots follow
their variable (Keras creates them with the variable's layout); metrics
are replicated. The one JAX engine (`engine.SPMDEngine`) jits Keras's own
steps with those shardings, so XLA's SPMD partitioner inserts the
all-gathers, reduce-scatters and all-reduces: no collective is written
here. Batches are split along the plan's batch axis (replicated over the
other axes), or replicated when the axis does not divide them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import weakref

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec
from keras import distribution as keras_distribution
from keras import tree

from keras_dist._src import plan as plan_lib
from keras_dist._src.backends.jax.devices import devices_by_name
from keras_dist._src.backends.jax.engine import SPMDEngine
from keras_dist._src.errors import LayoutError, VariablesOutsideScopeError
from keras_dist._src.keras_glue import internals as glue


class _TensorLayout(keras_distribution.TensorLayout):
    """Keras's `TensorLayout`, also for an entry that names several mesh
    axes (a dimension split over their product): JAX's `PartitionSpec`
    takes one, Keras's check of the axis names does not. The layout was
    checked already (`plan.check_variable_layout`, axis names included)."""

    def _validate_axes(self):
        pass


class _PlanDistribution(keras_distribution.ModelParallel):
    """A Keras distribution that lays out variables by a keras_dist plan
    and checks each layout before Keras places the variable (Keras exports
    no `Distribution` base; its `ModelParallel` is the nearest)."""

    def __init__(self, device_mesh, plan, replicate_data=False):
        super().__init__(
            layout_map=keras_distribution.LayoutMap(device_mesh),
            batch_dim_name=plan.batch_axis,
            auto_shard_dataset=False,
        )
        self._plan = plan
        #: The distribution of Keras's symbolic build: its sample batch (of
        #: any size) is replicated, not split.
        self._replicate_data = bool(replicate_data)

    def get_data_layout(self, data_shape):
        if self._replicate_data:
            return keras_distribution.TensorLayout(
                [None] * len(data_shape), self.device_mesh
            )
        return keras_distribution.TensorLayout(
            self._plan.data_layout(len(data_shape)), self.device_mesh
        )

    def get_variable_layout(self, variable):
        if getattr(variable, "_layout", None) is not None:
            return variable._layout  # given by Keras (optimizer slots)
        shape = tuple(variable.shape)
        layout = self._plan.variable_layout(variable.path, shape)
        layout = plan_lib.check_variable_layout(
            self._plan, variable.path, shape, layout
        )
        return _TensorLayout(layout, self.device_mesh)

    def get_tensor_layout(self, path):
        # Keras's own `Layer.__call__` asks this only while a distribution
        # is active: in the strategy's scope, not in keras_dist's steps
        # (which apply the "/output" keys themselves:
        # `ShardedEngine._install_output_layouts`).
        del path
        return None

    def distribute_dataset(self, dataset):
        return dataset


class LayoutPolicy:
    """Variables laid out by the plan over its mesh."""

    def __init__(self, plan, runtime):
        if not plan.sync_batch_norm:
            raise LayoutError(
                "sync_batch_norm=False is not available with layouts over a "
                "mesh on JAX (the step computes on the global batch). Use "
                "MirroredStrategy(sync_batch_norm=False) for per-replica "
                "BatchNormalization statistics."
            )
        if plan.mesh is None:  # 1-D over every device of the job
            plan = dataclasses.replace(
                plan,
                mesh=plan_lib.DeviceMesh(
                    (len(jax.devices()),), (plan.batch_axis,)
                ),
            )
        self.plan = plan
        self.runtime = runtime
        self.batch_axis = plan.batch_axis
        mesh = plan.mesh
        by_name = devices_by_name()
        names = mesh.devices or tuple(
            f"{d.platform}:{d.id}" for d in jax.devices()
        )
        if len(names) != mesh.size:
            raise LayoutError(
                f"The mesh {mesh.shape} {mesh.axis_names} needs {mesh.size} "
                f"devices, but the job has {len(names)}. Give a mesh shape "
                f"whose product is {len(names)}, or pass devices=[...]."
            )
        missing = [n for n in names if n not in by_name]
        if missing:
            raise LayoutError(
                f"The mesh names devices this job does not have: {missing}. "
                f"Devices here: {sorted(by_name)}. Leave the mesh's devices "
                "out (keras_dist.DeviceMesh(shape, axis_names)): it then "
                "spans the job's devices, every process's included. A "
                "KerasHub map (made over a keras.distribution.DeviceMesh) "
                "can be copied into a keras_dist.LayoutMap over such a "
                "mesh: layout_map[key] = published[key].axes."
            )
        self.devices = tuple(names)
        self.mesh = Mesh(
            np.array([by_name[n] for n in names]).reshape(mesh.shape),
            mesh.axis_names,
        )
        device_mesh = keras_distribution.DeviceMesh(
            shape=mesh.shape,
            axis_names=list(mesh.axis_names),
            devices=list(names),
        )
        self.distribution = _PlanDistribution(device_mesh, plan)
        self.build_distribution = _PlanDistribution(
            device_mesh, plan, replicate_data=True
        )
        # Models checked once (weakly: a new model may reuse an old id,
        # on some processes only, and the check is a collective).
        self._checked = weakref.WeakSet()

    def check_variables(self, model) -> None:
        """Every variable lies on the mesh with its plan's layout; every
        LayoutMap key matches a variable."""
        for variable in model.variables:
            if not self._on_mesh(getattr(variable.value, "sharding", None)):
                raise VariablesOutsideScopeError(
                    f"Variable {variable.path!r} of model {model.name!r} is "
                    f"not laid out on the strategy's mesh: it was created "
                    "outside strategy.scope(). Build (and load weights into) "
                    "the model inside `with strategy.scope():`."
                )
        if getattr(model, "built", False) and model.variables:
            self.check_built(model)

    def _on_mesh(self, sharding) -> bool:
        """Whether an array with `sharding` lies on the strategy's mesh. On a
        one-device mesh (a script sized by its device count, run on one GPU)
        Keras keeps an array already on that device as it is: its
        `SingleDeviceSharding` is the mesh's layout."""
        if getattr(sharding, "mesh", None) == self.mesh:
            return True
        return self.mesh.size == 1 and getattr(
            sharding, "device_set", None
        ) == set(self.mesh.devices.flat)

    def check_built(self, model) -> None:
        """Once the model has its variables: every process lays out the
        same variables alike (`plan.check_same_on_every_process`), and
        every LayoutMap key matches one of them (a key that matches
        nothing shards nothing)."""
        if model in self._checked:
            return
        # First, so that every process fails alike.
        plan_lib.check_same_on_every_process(
            self.runtime,
            [
                (v.path, v.shape, self.plan.variable_layout(v.path, v.shape))
                for v in model.variables
            ],
            f"model {model.name!r}",
        )
        paths = [v.path for v in model.variables]
        plan_lib.check_unmatched(self.plan, paths, f"model {model.name!r}")
        self._checked.add(model)


class ShardedEngine(SPMDEngine):
    """The SPMD engine with variables laid out over a mesh."""

    def __init__(self, plan, runtime, input_options=None):
        policy = LayoutPolicy(plan, runtime)
        super().__init__(policy, policy.plan, runtime, input_options)
        self._build_distribution = policy.build_distribution

    def attach(self, model) -> None:
        """Also: a model that its first `fit` or `evaluate` builds (one
        made in the scope without an input shape) creates its variables,
        and its optimizer's, with their layouts; `fit` itself runs with no
        Keras distribution active (see `SPMDEngine.call_scope`)."""
        super().attach(model)
        glue.symbolic_build_in(model, self._build_scope)
        self._install_output_layouts(model)

    def _install_output_layouts(self, model) -> None:
        """Honors the plan's ``"…/output"`` keys as Keras's `ModelParallel`
        does: each matching layer's output gets a sharding constraint
        (`jax.lax.with_sharding_constraint`) inside the step. Keras applies
        them in `Layer.__call__` while a distribution is active, which it
        is not during keras_dist's steps; here each layer's call applies
        them, with the path Keras would give (`glue.current_path`)."""
        plan = self.plan
        if not isinstance(plan, plan_lib.LayoutPlan) or not (
            plan.output_keys()
        ):
            return
        plan_lib.check_unmatched(
            plan,
            plan_lib.layer_output_paths(model, glue.flatten_layers),
            f"model {model.name!r}",
        )
        for layer in glue.flatten_layers(model, include_self=True):
            current = layer.__dict__.get("call")
            inner = getattr(current, "_keras_dist_output_inner", current)
            if inner is None:
                inner = type(layer).call.__get__(layer)
            layer.__dict__["call"] = self._output_layout_call(inner)
            glue.remat_fresh_calls(layer)  # RematScope, keras.remat

    def _output_layout_call(self, inner):
        """`inner` (a layer's call) whose outputs take the layout of the
        ``"/output"`` key that their path matches, if any."""
        plan, mesh = self.plan, self.mesh

        def constrain(path, layout, x):
            if not isinstance(x, jax.Array):  # tracers are jax.Arrays
                return x
            if len(layout) != x.ndim:
                raise LayoutError(
                    f"The layout {layout} for layer output {path!r} has "
                    f"{len(layout)} entries, but the output has shape "
                    f"{tuple(x.shape)} ({x.ndim} dimensions). Give one "
                    "entry per dimension (None for a whole one)."
                )
            sharding = NamedSharding(mesh, PartitionSpec(*layout))
            return jax.lax.with_sharding_constraint(x, sharding)

        def call(*args, **kwargs):
            outputs = inner(*args, **kwargs)
            if glue.in_symbolic_scope():
                return outputs
            path = glue.current_path() + plan_lib.OUTPUT_SUFFIX
            layout = plan.output_layout(path)
            if layout is None:
                return outputs
            return tree.map_structure(
                lambda x: constrain(path, layout, x), outputs
            )

        call.__doc__ = getattr(inner, "__doc__", None)
        call._keras_dist_output_inner = inner
        return call

    @contextlib.contextmanager
    def _build_scope(self):
        """The strategy's scope for Keras's symbolic build: variables get
        their layouts; the sample batch is replicated (a batch the batch
        axis does not divide would not split)."""
        with self.distribution_scope(self._build_distribution):
            yield

    def check_built(self, model) -> None:
        """Lays out, with the plan's layout, every weight of `model` created
        without one (by a first `predict`, which builds the model outside
        Keras's symbolic build, or by a call outside the scope), so that
        nothing the plan shards stays whole on every device; then the
        policy's checks."""
        for variable in model.weights:
            if glue.variable_layout(variable) is not None:
                continue
            layout = self.distribution.get_variable_layout(variable)
            sharding = layout.backend_layout
            value = self.relocate(variable.value, sharding)
            glue.set_variable_value(variable, value)
            glue.set_variable_layout(variable, sharding)
        super().check_built(model)


def create_engine(plan, runtime, input_options):
    """The engine of a `LayoutPlan` or a `ShardedPlan`."""
    return ShardedEngine(plan, runtime, input_options)

"""`ModelParallel` and `ShardedDataParallel`: variables laid out over a
mesh of every device of every process."""

from __future__ import annotations

from keras_dist._src import backends as backend_lib
from keras_dist._src.cluster.environments import (
    detect_environment,
    environment_from,
)
from keras_dist._src.errors import LayoutError
from keras_dist._src.options import InputOptions
from keras_dist._src.plan import (
    DeviceMesh,
    LayoutMap,
    LayoutPlan,
    ShardedPlan,
    Topology,
)
from keras_dist._src.strategy import Strategy


class _MeshStrategy(Strategy):
    """A strategy over a `DeviceMesh` spanning every process of the job."""

    def __init__(self, mesh, batch_axis, input_options, cluster_resolver):
        """`mesh` None: a 1-D mesh named "batch" over every device of the
        job (resolved by the backend once the job is joined)."""
        # The backend's clear error, before any runtime starts.
        backend_lib.refuse_unsupported(self._plan_type)
        if mesh is None:
            batch_axis = batch_axis or "batch"
        elif batch_axis is None:
            batch_axis = mesh.axis_names[0]
        if mesh is not None and batch_axis not in mesh.axis_names:
            raise LayoutError(
                f"batch_dim_name {batch_axis!r} is not an axis of the mesh "
                f"(its axes: {mesh.axis_names})."
            )
        self._mesh = mesh
        self._batch_axis = batch_axis
        self._many_devices_meant = mesh is None  # found, not named
        environment = (
            environment_from(cluster_resolver)
            if cluster_resolver is not None
            else detect_environment()
        )
        if environment.is_distributed:
            # A job of workers: the mesh spans the devices of all of them,
            # listed once this process has joined.
            self.topology = Topology.MULTI_WORKER
            devices = None
        else:
            self.topology = Topology.MIRRORED
            if mesh is None:
                devices = list(backend_lib.get().default_devices())
                mesh = DeviceMesh((len(devices),), (batch_axis,), devices)
                self._mesh = mesh
            devices = _local_devices(mesh)
            self._mesh = mesh.with_devices(devices)
            environment = None
        super().__init__(
            devices,
            sync_batch_norm=True,
            input_options=input_options,
            environment=environment,
        )

    @property
    def mesh(self) -> DeviceMesh:
        """The device mesh the variables are laid out over."""
        return self._plan.mesh

    def _mesh_for(self, devices):
        del devices  # the mesh spans the job, not only this process
        return self._mesh

    def __repr__(self):
        mesh = self._plan.mesh
        shape = "job" if mesh is None else f"{mesh.shape} {mesh.axis_names}"
        return (
            f"{type(self).__name__}(mesh={shape}, "
            f"batch_axis={self._batch_axis!r})"
        )


class ModelParallel(_MeshStrategy):
    """Variables laid out over a device mesh by a `LayoutMap`.

    Each variable whose path matches a key of `layout_map` is split over
    the mesh axes its layout names; others are replicated. Each global
    batch is split along `batch_dim_name` (exactly as under
    `MirroredStrategy`: global-batch loss, metrics and BatchNormalization).
    JAX lays variables out with `jax.jit` shardings; torch holds every
    variable as a DTensor; TensorFlow raises `UnsupportedBackendError`.

    Args:
        layout_map: a `keras_dist.LayoutMap` or a `keras.distribution.
            LayoutMap` (KerasHub's published maps work as they are).
        batch_dim_name: the mesh axis that splits the batch; defaults to the
            mesh's first axis.
        input_options: how input is sharded between workers.
        cluster_resolver: where this process stands in a job of several
            workers (read from the launcher's variables when None).

    Raises:
        LayoutError: for a layout that cannot hold (unknown axis, an
            indivisible dimension, a key that matches no variable).
    """

    _plan_type = LayoutPlan

    def __init__(
        self,
        layout_map,
        batch_dim_name: str | None = None,
        input_options: InputOptions | None = None,
        cluster_resolver=None,
        **kwargs,
    ):
        kwargs.pop("device_mesh", None)  # Keras's signature accepts it
        if kwargs:
            raise TypeError(f"Unexpected arguments: {sorted(kwargs)}.")
        self._layout_map = LayoutMap.from_any(layout_map)
        super().__init__(
            self._layout_map.device_mesh,
            batch_dim_name,
            input_options,
            cluster_resolver,
        )

    def _make_plan(self, devices):
        mesh = self._mesh_for(devices)
        layout_map = self._layout_map
        if mesh is not layout_map.device_mesh:
            rebuilt = LayoutMap(mesh, layout_map.allow_unmatched)
            for key in layout_map:
                rebuilt[key] = layout_map[key]
            layout_map = rebuilt
        return LayoutPlan(
            topology=self.topology,
            devices=tuple(devices),
            mesh=mesh,
            batch_axis=self._batch_axis,
            layout_map=layout_map,
        )


class ShardedDataParallel(_MeshStrategy):
    """ZeRO-3 / FSDP: data parallel with every large variable sharded.

    Each variable of at least `min_size` elements is split over the batch
    axis along its largest dimension that the axis size divides (its
    optimizer slots follow it); smaller variables are replicated. The
    backend all-gathers a variable for compute and reduce-scatters its
    gradient, so each device holds about 1/N of the state that
    `MirroredStrategy` holds, with the same results.

    Args:
        device_mesh: a mesh (ours or Keras's); None for a 1-D mesh named
            ``"batch"`` over every device of every process.
        min_size: variables with fewer elements are replicated.
        batch_dim_name: the axis that splits batches and variables;
            defaults to the mesh's first axis.
        input_options: how input is sharded between workers.
        cluster_resolver: where this process stands in a job.
    """

    _plan_type = ShardedPlan

    def __init__(
        self,
        device_mesh=None,
        min_size: int = 1024,
        batch_dim_name: str | None = None,
        input_options: InputOptions | None = None,
        cluster_resolver=None,
    ):
        self._min_size = int(min_size)
        if self._min_size < 0:
            raise LayoutError(f"min_size must be >= 0; got {min_size}.")
        super().__init__(
            None if device_mesh is None else DeviceMesh.from_any(device_mesh),
            batch_dim_name,
            input_options,
            cluster_resolver,
        )

    def _make_plan(self, devices):
        return ShardedPlan(
            topology=self.topology,
            devices=tuple(devices),
            mesh=self._mesh_for(devices),
            batch_axis=self._batch_axis,
            min_size=self._min_size,
        )


def _local_devices(mesh: DeviceMesh) -> list[str]:
    """This host's devices for a one-host mesh: the mesh's own, or the
    first `mesh.size` devices of the default type."""
    if mesh.devices is not None:
        return list(mesh.devices)
    module = backend_lib.get()
    defaults = module.default_devices()
    kind = defaults[0].split(":")[0]
    candidates = defaults if len(defaults) >= mesh.size else []
    if not candidates:
        candidates = module.nameable_devices(kind)
    if len(candidates) < mesh.size:
        raise LayoutError(
            f"The mesh {mesh.shape} {mesh.axis_names} needs {mesh.size} "
            f"devices; this host has {len(candidates)} ({kind}). Use a "
            "smaller mesh, or keras_dist.simulate_cpu_devices(N) on a CPU."
        )
    return list(candidates[: mesh.size])

"""JAX on TPUs: joining a Cloud TPU job and a topology-aware mesh.

`jax.distributed.initialize()` with no arguments finds the coordinator,
the process count and this process's index on a Cloud TPU VM (or a GKE TPU
node pool) by itself; `join_tpu_job` calls it there. The mesh follows the
chips' physical torus (`jax.experimental.mesh_utils.create_device_mesh`)
instead of a reshape of the device list, and over several slices
(`create_hybrid_device_mesh`) its first axis, the data axis, spans the
slices (DCN, the slow network) while every other axis stays inside a slice
(ICI). The engine is the one JAX SPMD engine with a `LayoutPlan` over that
mesh: data parallel (every variable replicated) without a layout map.
"""

from __future__ import annotations

import math

import jax
import numpy as np
from jax.experimental import mesh_utils

from keras_dist._src.backends.jax import sharded
from keras_dist._src.cluster.environments import ClusterEnvironment
from keras_dist._src.errors import LayoutError, TPUNotFoundError
from keras_dist._src.framework_glue import jax_private
from keras_dist._src.plan import DeviceMesh, LayoutMap, LayoutPlan

_INSTALL = (
    "On a Cloud TPU VM install JAX's TPU runtime (pip install 'jax[tpu]') "
    "and run the same script on every host of the slice (e.g. gcloud "
    "compute tpus tpu-vm ssh NAME --worker=all --command='python "
    "train.py'). Without a TPU, use keras_dist.MirroredStrategy()."
)


def join_tpu_job() -> ClusterEnvironment | None:
    """Joins the job of every host of a Cloud TPU slice (or slices).

    Returns:
        This process's place in the job, or None for one process (no Cloud
        TPU VM, or a single host).

    Raises:
        TPUNotFoundError: when `jax.distributed.initialize` fails.
    """
    if jax_private.distributed_client() is None:
        if not _on_cloud_tpu_vm():
            return None
        from keras_dist._src.backends.jax.devices import backends_initialized

        if backends_initialized():
            if jax.process_count() == 1 and _multi_host_hint():
                raise TPUNotFoundError(
                    "TPUStrategy on a multi-host TPU must be created before "
                    "JAX starts computing (jax.distributed.initialize has "
                    "to run first): create it at the top of the program."
                )
        else:
            try:
                jax.distributed.initialize()
            except Exception as error:  # JAX raises several kinds
                raise TPUNotFoundError(
                    "Could not join the Cloud TPU job "
                    f"(jax.distributed.initialize(): {error}). {_INSTALL}"
                ) from error
    if jax.process_count() == 1:
        return None
    address = jax_private.coordinator_address() or ""
    host, _, port = address.rpartition(":")
    return ClusterEnvironment(
        source="cloud_tpu",
        rank=jax.process_index(),
        world_size=jax.process_count(),
        coordinator_host=host or None,
        coordinator_port=int(port) if port.isdigit() else None,
    )


def connect_tpu(tpu=None):
    """`TPUStrategy`'s connection on JAX: joins the job of every host of
    a Cloud TPU slice, if any (`tpu` is TensorFlow's; unused here).

    Returns:
        ``(environment, devices)``: this process's place in the job and
        None (every chip of every host), or None and this host's chips.
    """
    del tpu
    environment = join_tpu_job()
    devices = [f"{d.platform}:{d.id}" for d in tpu_devices()]
    if environment is not None:
        devices = None  # every chip of every host, once joined
    return environment, devices


def _on_cloud_tpu_vm() -> bool:
    return jax_private.running_in_cloud_tpu_vm()


def _multi_host_hint() -> bool:
    import os

    hosts = os.environ.get("TPU_WORKER_HOSTNAMES", "")
    return "," in hosts


def tpu_devices() -> list:
    """Every TPU device of the job, in JAX's order.

    Raises:
        TPUNotFoundError: when JAX sees no TPU.
    """
    try:
        devices = jax.devices("tpu")
    except RuntimeError as error:
        platforms = sorted({d.platform for d in jax.devices()})
        raise TPUNotFoundError(
            "TPUStrategy found no TPU: JAX sees only "
            f"{platforms} devices ({error}). {_INSTALL}"
        ) from None
    return list(devices)


def topology_mesh(mesh_shape, devices) -> np.ndarray:
    """`devices` arranged as `mesh_shape` along the physical topology.

    One slice: `mesh_utils.create_device_mesh`. Several (devices with
    distinct ``slice_index``): `create_hybrid_device_mesh` with the first
    axis split over the slices (DCN) and the rest inside each slice (ICI).

    Raises:
        LayoutError: when the shape does not fit the devices or slices.
    """
    shape = tuple(int(s) for s in mesh_shape)
    if math.prod(shape) != len(devices):
        raise LayoutError(
            f"The TPU mesh shape {shape} needs {math.prod(shape)} devices; "
            f"the job has {len(devices)}."
        )
    slices = sorted({getattr(d, "slice_index", 0) for d in devices})
    if len(slices) == 1:
        return mesh_utils.create_device_mesh(shape, devices)
    if shape[0] % len(slices):
        raise LayoutError(
            f"The job spans {len(slices)} TPU slices, so the first (data) "
            f"axis of the mesh, which runs across them over DCN, must be a "
            f"multiple of {len(slices)}; got the mesh shape {shape}."
        )
    ici = (shape[0] // len(slices),) + shape[1:]
    dcn = (len(slices),) + (1,) * (len(shape) - 1)
    return mesh_utils.create_hybrid_device_mesh(ici, dcn, devices)


def default_axis_names(rank: int) -> tuple:
    """``("batch",)``, ``("batch", "model")``, then numbered axes."""
    names = ("batch", "model")
    if rank <= 2:
        return names[:rank]
    return names + tuple(f"axis{i}" for i in range(2, rank))


def layout_plan(plan, devices) -> LayoutPlan:
    """The `LayoutPlan` of a `TPUPlan` over `devices` (JAX devices)."""
    shape = tuple(plan.mesh_shape or (len(devices),))
    axis_names = tuple(plan.axis_names or default_axis_names(len(shape)))
    array = topology_mesh(shape, devices)
    names = [f"{d.platform}:{d.id}" for d in array.flat]
    mesh = DeviceMesh(shape, axis_names, names)
    layout_map = LayoutMap(mesh, allow_unmatched=True)
    if plan.layout_map is not None:
        layout_map = LayoutMap(mesh, plan.layout_map.allow_unmatched)
        for key in plan.layout_map:
            layout_map[key] = plan.layout_map[key]
    return LayoutPlan(
        topology=plan.topology,
        devices=tuple(plan.devices),
        mesh=mesh,
        batch_axis=axis_names[0],
        sync_batch_norm=True,
        layout_map=layout_map,
    )


def create_engine(plan, runtime, input_options):
    """The engine of a `TPUPlan`: the SPMD engine over a topology mesh."""
    return sharded.ShardedEngine(
        layout_plan(plan, tpu_devices()), runtime, input_options
    )

"""`TPUStrategy`: data parallel (or laid out) over TPU chips."""

from __future__ import annotations

from collections.abc import Sequence

from keras_dist._src import backends as backend_lib
from keras_dist._src.errors import LayoutError
from keras_dist._src.plan import LayoutMap, Topology, TPUPlan
from keras_dist._src.strategy import Strategy


class TPUStrategy(Strategy):
    """Synchronous training on the TPU chips of a VM, a slice or slices.

    * JAX: on a Cloud TPU VM the job of every host is joined with
      `jax.distributed.initialize()` (which finds the coordinator itself);
      the mesh follows the chips' physical torus
      (`mesh_utils.create_device_mesh`), and over several slices its first
      (data) axis spans the slices over DCN while the others stay inside a
      slice (`create_hybrid_device_mesh`). Data parallel by default (the
      exact SPMD step of `ModelParallel`); `layout_map` lays variables out
      over the mesh.
    * TensorFlow: tf.distribute's `TPUStrategy` with a `TPUClusterResolver`
      and Keras's own steps (data parallel only).
    * torch: not available (no torch_xla for this torch).

    Without a reachable TPU every backend raises `TPUNotFoundError` (torch:
    `UnsupportedBackendError`).

    Args:
        tpu: TensorFlow only: the TPU's name or ``grpc://`` address; None
            (or "local") for this VM's.
        mesh_shape: the size of each mesh axis, e.g. ``(4, 2)``; None for
            one data axis over every chip of the job.
        axis_names: one name per axis; defaults to ``("batch",)`` or
            ``("batch", "model")``. The first axis splits the batch.
        layout_map: a `LayoutMap` (JAX only) whose keys give variable
            layouts over the mesh; its own mesh is replaced by the TPU's.

    Raises:
        TPUNotFoundError: when no TPU can be reached.
        UnsupportedBackendError: on torch.
        LayoutError: for a mesh shape that does not fit the chips.
    """

    def __init__(
        self,
        tpu: str | None = None,
        mesh_shape: Sequence[int] | None = None,
        axis_names: Sequence[str] | None = None,
        layout_map=None,
    ):
        backend_lib.refuse_unsupported(TPUPlan)
        self._tpu = tpu
        self._mesh_shape = _check_shape(mesh_shape, axis_names)
        self._axis_names = None if axis_names is None else tuple(axis_names)
        self._layout_map = (
            None if layout_map is None else LayoutMap.from_any(layout_map)
        )
        connect = backend_lib.capabilities().connect_tpu
        environment, devices = connect(tpu)
        self.topology = (
            Topology.MIRRORED if environment is None else Topology.MULTI_WORKER
        )
        super().__init__(devices, sync_batch_norm=True, environment=environment)

    def _make_plan(self, devices):
        return TPUPlan(
            topology=self.topology,
            devices=tuple(devices),
            tpu=self._tpu,
            mesh_shape=self._mesh_shape,
            axis_names=self._axis_names,
            layout_map=self._layout_map,
        )

    @property
    def mesh(self):
        """The engine's device mesh (JAX), or None (TensorFlow)."""
        return self._engine.mesh

    def __repr__(self):
        return (
            f"TPUStrategy(mesh_shape={self._mesh_shape}, "
            f"replicas={self.num_replicas_in_sync})"
        )


def _check_shape(mesh_shape, axis_names):
    if mesh_shape is None:
        if axis_names is not None and len(tuple(axis_names)) != 1:
            raise LayoutError(
                "axis_names without mesh_shape must name one axis (the "
                f"data axis over every chip); got {tuple(axis_names)}."
            )
        return None
    shape = tuple(int(s) for s in mesh_shape)
    if not shape or any(s < 1 for s in shape):
        raise LayoutError(f"mesh_shape must be sizes >= 1; got {mesh_shape}.")
    if axis_names is not None and len(tuple(axis_names)) != len(shape):
        raise LayoutError(
            f"mesh_shape {shape} needs {len(shape)} axis names; got "
            f"{tuple(axis_names)}."
        )
    return shape

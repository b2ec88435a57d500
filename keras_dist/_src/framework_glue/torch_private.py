"""Every private torch name keras_dist reaches, by use.

torch 2.13's DTensor keeps some of what keras_dist needs private: the
global offset of a rank's shard over a multi-axis mesh, a DTensor's local
tensor without an autograd op, and a flattened sub-mesh for a reduction
over several axes at once. Each reach is a function here.
"""

from __future__ import annotations


def local_shape_and_global_offset(global_shape, device_mesh, placements):
    """The shape of this rank's shard of a DTensor and its offset in the
    global tensor.

    Reaches ``torch.distributed.tensor._utils
    .compute_local_shape_and_global_offset``: the public
    ``Shard.local_shard_size_and_offset`` gives one mesh axis's split of
    one dimension, not the composition over a mesh (several axes sharding
    one dimension, uneven shards) that DTensor itself uses.
    """
    from torch.distributed.tensor._utils import (
        compute_local_shape_and_global_offset,
    )

    return compute_local_shape_and_global_offset(
        global_shape, device_mesh, placements
    )


def dtensor_local_tensor(tensor):
    """A DTensor's local tensor itself, with no autograd op.

    Reaches ``DTensor._local_tensor``: the public ``DTensor.to_local()``
    goes through an autograd function (a new tensor object, recorded in
    the graph), which a saved-tensor hook must not run.
    """
    return tensor._local_tensor  # noqa: SLF001 - see the docstring


def flatten_mesh(device_mesh) -> None:
    """Creates (collectively) the flattened process group of a sub-mesh of
    several axes, so that DTensor reduces over them in one all-reduce.

    Reaches ``DeviceMesh._flatten``: torch 2.13 has no public way to
    flatten mesh axes.
    """
    device_mesh._flatten()  # noqa: SLF001 - see the docstring

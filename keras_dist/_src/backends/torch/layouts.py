"""Layouts of Keras variables as torch DTensors (`sharded.DTensorEngine`).

Which placements each variable takes on the mesh: the plan's layout for
the model's variables (checked by `plan.check_variable_layout`), the
layout of their variable for optimizer slots, replicated for metrics and
for every other optimizer variable (ZeRO: split by size, as a model
variable); convolution kernels stay whole (torch's DTensor convolution
follows its input's placements only). And the two methods of Keras's torch
`Variable` that must accept a DTensor (`dtensor_assign`,
`dtensor_update`, `dtensor_array`).
"""

from __future__ import annotations

import keras
import numpy as np
import torch
from keras import tree
from torch.distributed.tensor import (
    DTensor,
    Replicate,
    Shard,
    distribute_tensor,
)

from keras_dist._src import plan as plan_lib
from keras_dist._src.errors import LayoutError
from keras_dist._src.keras_glue import internals as glue

#: Keras's convolution layers (their kernels stay whole on torch).
CONVOLUTIONS = (
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
def to_plain(x):
    """`x` with every DTensor replaced by its whole value (a collective
    only for a value that is not replicated)."""

    def plain(t):
        if isinstance(t, DTensor):
            return t.full_tensor()
        return t

    return tree.map_structure(plain, x)


def _split_like(target, value):
    """A whole `value` (the same on every rank; broadcast to `target`'s
    shape) as a DTensor of `target`'s placements: each rank keeps its
    part, no collective."""
    local = target.to_local()
    value = torch.as_tensor(value).to(local.device, local.dtype)
    value = torch.broadcast_to(value, tuple(target.shape))
    return distribute_tensor(
        value, target.device_mesh, target.placements, src_data_rank=None
    )


def dtensor_assign(original):
    """The assignment of Keras's torch `Variable` (replaced through
    `keras_glue.torch_variables`) that splits a whole value into a DTensor
    variable's placements (each rank keeps its part, no collective) and
    copies it into the variable's own DTensor. Keras 3.16's assignment
    redistributes a DTensor value by the variable's Keras layout, which
    keras_dist's variables do not have (``'NoneType' object has no
    attribute 'device_mesh'``); 3.15's copies into `variable.value`, a
    cast copy under an `AutocastScope`."""

    def _direct_assign(variable, value):
        target = glue.variable_value(variable)
        if not isinstance(target, DTensor):
            return original(variable, value)
        if not isinstance(value, DTensor):
            # A whole value (set_weights, a checkpoint restore) given on
            # every rank.
            value = _split_like(target, value)
        with torch.no_grad():
            target.copy_(value)

    return _direct_assign


def dtensor_update(original):
    """`assign_add` / `assign_sub` of Keras's torch `Variable` that take a
    whole value (a NumPy array, a plain tensor) for a DTensor variable:
    split like the variable first, as `assign` does (torch refuses to mix
    a tensor and a DTensor). Python numbers pass as they are."""

    def update(variable, value):
        target = glue.variable_value(variable)
        if isinstance(value, keras.Variable):
            value = glue.variable_value(value)
        if (
            isinstance(target, DTensor)
            and not isinstance(value, (DTensor, int, float, bool))
            and value is not None
        ):
            value = _split_like(target, value)
        return original(variable, value)

    return update


def dtensor_array(original):
    """`Variable.__array__` that gathers a DTensor variable's value."""

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


def placements(mesh, layout) -> tuple:
    """DTensor placements (one per axis of `mesh`) of a full-rank layout."""
    out = [Replicate()] * len(mesh.shape)
    for dim, entry in enumerate(layout):
        names = (entry,) if isinstance(entry, str) else entry or ()
        for name in names:
            out[mesh.axis_names.index(name)] = Shard(dim)
    return tuple(out)


def layout_of(mesh, variable):
    """A variable's layout (from its DTensor placements) and the shape of
    this rank's shard."""
    value = glue.variable_value(variable)
    shape = tuple(variable.shape)
    if not isinstance(value, DTensor):
        return (None,) * len(shape), shape
    layout = [[] for _ in shape]
    for axis, placement in zip(mesh.axis_names, value.placements):
        if isinstance(placement, Shard):
            layout[placement.dim].append(axis)
    layout = tuple(
        None if not names else names[0] if len(names) == 1 else tuple(names)
        for names in layout
    )
    return layout, tuple(value.to_local().shape)


def variable_layouts(plan, model) -> list:
    """``[(variable, layout)]`` for every variable of `model`, its
    optimizer and its metrics (checked against the plan's mesh)."""
    pairs, by_id = [], {}
    convolutions = {
        id(v)
        for layer in glue.flatten_layers(model, include_self=True)
        if isinstance(layer, CONVOLUTIONS)
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
            layout = _convolution_layout(plan, variable, layout)
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
            layout = _slot_layout(plan, variable, references, by_id)
            by_id[id(variable)] = layout
            pairs.append((variable, layout))
    for variable in getattr(model, "metrics_variables", []):
        if id(variable) not in by_id:
            by_id[id(variable)] = (None,) * len(variable.shape)
            pairs.append((variable, by_id[id(variable)]))
    return pairs


def _convolution_layout(plan, variable, layout):
    """torch's DTensor convolution follows its input's placements and
    needs whole kernels: ZeRO keeps them replicated; a LayoutMap that
    splits one is an error."""
    if isinstance(plan, plan_lib.ShardedPlan):
        return (None,) * len(layout)
    raise LayoutError(
        f"The layout {layout} of variable {variable.path!r} (shape "
        f"{tuple(variable.shape)}) splits a convolution's weights, which "
        "torch's DTensor convolution does not support (it needs whole "
        "kernels and biases). Leave convolution variables out of the "
        "LayoutMap on torch (or use KERAS_BACKEND=jax)."
    )


def _slot_layout(plan, variable, references, layouts):
    """An optimizer variable's layout: its model variable's (Keras names
    a slot ``<variable path with _>_<slot>``), else replicated (ZeRO:
    split by size, as a model variable)."""
    shape = tuple(variable.shape)
    for reference in references:
        prefix = reference.path.replace("/", "_") + "_"
        if variable.name.startswith(prefix) and shape == tuple(reference.shape):
            return layouts[id(reference)]
    if isinstance(plan, plan_lib.ShardedPlan):
        return plan_lib.check_variable_layout(
            plan,
            variable.path,
            shape,
            plan.variable_layout(variable.path, shape),
        )
    return (None,) * len(shape)


def check_layouts(plan, model) -> None:
    """Checks every variable's layout of a built `model` and that every
    LayoutMap key matches one of its variables."""
    for variable in model.variables:
        shape = tuple(variable.shape)
        plan_lib.check_variable_layout(
            plan,
            variable.path,
            shape,
            plan.variable_layout(variable.path, shape),
        )
    paths = [v.path for v in model.variables]
    plan_lib.check_unmatched(plan, paths, f"model {model.name!r}")

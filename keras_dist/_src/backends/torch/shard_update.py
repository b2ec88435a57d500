"""Optimizer updates on each rank's shards (`sharded.DTensorEngine`).

Keras's torch optimizers update every variable with `torch._foreach_*`
operators. On DTensors each of those dispatches through DTensor's
sharding propagation, per tensor and per operator, and a gradient that
arrives with other placements than its variable (a `Partial` sum, say) is
redistributed again by every operator that reads it: measured on the
ModelParallel benchmark, Adam's update was more than half of the step.

For the optimizers whose update is elementwise (`ELEMENTWISE`), with no
norm clipping and no loss scaling, the result on each shard is the result
of the DTensor operators on that shard. So `apply` first redistributes
each gradient once to its variable's placements (the reduction DTensor's
operators would do), then runs Keras's own `apply` with every variable of
the update holding its local tensor (the DTensor's own storage: in-place
updates land in it, and the variable's shape the shard's, which Keras's
`assign` checks), and puts the DTensors back. Any other optimizer, a
clipping norm, or an optimizer not built yet runs on the DTensors as
before.

The gradients that arrive as `Partial` sums over a 1-D mesh (every one
under `ShardedDataParallel`) are reduced together first
(`_reduce_together`): one all-reduce for the replicated variables' and
one reduce-scatter for the split ones', where redistributing each took a
collective per gradient (a small transformer over 2 gloo processes,
under cProfile: 34 waits on a collective a step became 18, and the step
took 0.70 of its time).
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor, Partial

from keras_dist._src.keras_glue import internals as glue

#: Keras's torch optimizers whose update is elementwise in every variable
#: (their `_parallel_update_step`), by class name.
ELEMENTWISE = frozenset(
    {
        "SGD",
        "Adam",
        "AdamW",
        "RMSprop",
        "Adagrad",
        "Adadelta",
        "Adamax",
        "Nadam",
        "Lion",
    }
)


def updates_on_shards(optimizer) -> bool:
    """Whether `optimizer`'s update may run on each rank's shards: one of
    Keras's own elementwise torch optimizers (not a subclass), with no
    norm clipping (a norm spans every shard)."""
    return (
        glue.keras_torch_optimizer_name(optimizer) in ELEMENTWISE
        and getattr(optimizer, "clipnorm", None) is None
        and getattr(optimizer, "global_clipnorm", None) is None
    )


def install(optimizer) -> None:
    """Makes `optimizer.apply` update on the shards where it is exact
    (idempotent; nothing for other optimizers)."""
    if optimizer is None or "apply" in vars(optimizer):
        return
    if not updates_on_shards(optimizer):
        return
    original = optimizer.apply

    def apply(grads, trainable_variables=None):
        if trainable_variables is None or not optimizer.built:
            return original(grads, trainable_variables)
        variables = list(trainable_variables)
        grads = _reduce_together(list(grads), variables)
        grads = [_like(g, v) for g, v in zip(grads, variables)]
        swapped = _swap_in_locals([*variables, *optimizer.variables])
        try:
            return original(grads, variables)
        finally:
            _swap_back(swapped)

    apply.__doc__ = original.__doc__
    optimizer.__dict__["apply"] = apply


def _bucket_of(grad, variable):
    """``(group, dtype, "all_reduce" | "reduce_scatter"), dim`` for a
    gradient that is a plain `Partial` sum (not a masked one, whose local
    values are not yet the shares) over a 1-D mesh whose variable is
    replicated or evenly split on that mesh; None for any other."""
    target = glue.variable_value(variable)
    if not (isinstance(grad, DTensor) and isinstance(target, DTensor)):
        return None
    mesh = grad.device_mesh
    if mesh.ndim != 1 or target.device_mesh != mesh:
        return None
    (placement,) = grad.placements
    (wanted,) = target.placements
    if type(placement) is not Partial or placement.reduce_op != "sum":
        return None
    key = (mesh.get_group(), grad.dtype)
    if wanted.is_replicate():
        return (*key, "all_reduce"), None
    if wanted.is_shard() and grad.shape[wanted.dim] % mesh.size() == 0:
        return (*key, "reduce_scatter"), wanted.dim
    return None


# torch 2.13 renamed `reduce_scatter_tensor` (which now warns).
_reduce_scatter = getattr(
    torch.distributed,
    "reduce_scatter_single",
    getattr(torch.distributed, "reduce_scatter_tensor", None),
)


def _reduce_together(grads, variables):
    """The `Partial` gradients over a 1-D mesh (every one under
    `ShardedDataParallel`) reduced in one all-reduce (those of replicated
    variables) and one reduce-scatter (those of split ones) per mesh and
    dtype, instead of one collective each; returns `grads` with those
    entries replaced by this rank's local tensors (the others as they
    were).

    The sums are the same elementwise sums DTensor's redistribution takes
    (of the same two partial values on 2 ranks; on more, gloo's ring may
    add the ranks' values in another order)."""
    buckets = {}
    for i, (grad, variable) in enumerate(zip(grads, variables)):
        bucket = _bucket_of(grad, variable)
        if bucket is not None:
            key, dim = bucket
            buckets.setdefault(key, []).append((i, dim))
    for (group, _, kind), entries in buckets.items():
        world = torch.distributed.get_world_size(group)
        with torch.no_grad():
            locals_ = [grads[i].to_local() for i, _ in entries]
            if kind == "all_reduce":
                flat = torch.cat([t.reshape(-1) for t in locals_])
                torch.distributed.all_reduce(flat, group=group)
                parts = flat.split([t.numel() for t in locals_])
                for (i, _), t, part in zip(entries, locals_, parts):
                    grads[i] = part.view_as(t)
                continue
            # Rank r's row: the r-th chunk of every gradient, flattened.
            chunks = [
                t.chunk(world, dim) for t, (_, dim) in zip(locals_, entries)
            ]
            rows = torch.stack(
                [
                    torch.cat([c[r].reshape(-1) for c in chunks])
                    for r in range(world)
                ]
            )
            mine = torch.empty_like(rows[0])
            _reduce_scatter(mine, rows.reshape(-1), group=group)
            parts = mine.split([c[0].numel() for c in chunks])
            for (i, _), c, part in zip(entries, chunks, parts):
                grads[i] = part.view(c[0].shape)
    return grads


def _like(grad, variable):
    """`grad` with its variable's placements, as this rank's local
    tensor (one redistribution where they differ)."""
    if not isinstance(grad, DTensor):
        return grad
    target = glue.variable_value(variable)
    if isinstance(target, DTensor) and grad.placements != target.placements:
        grad = grad.redistribute(target.device_mesh, target.placements)
    with torch.no_grad():
        return grad.to_local()


def _swap_in_locals(variables) -> list:
    """Sets each DTensor variable's value to its local tensor; returns
    ``[(variable, dtensor, local, shape)]`` to put back."""
    swapped = []
    seen = set()
    for variable in variables:
        if id(variable) in seen:
            continue
        seen.add(id(variable))
        value = glue.variable_value(variable)
        if isinstance(value, DTensor):
            with torch.no_grad():  # the DTensor's own storage, no view
                local = value.to_local()
            glue.set_variable_value(variable, local)
            # Keras checks an assigned value against the variable's shape.
            shape = glue.set_variable_shape(variable, local.shape)
            swapped.append((variable, value, local, shape))
    return swapped


def _swap_back(swapped) -> None:
    """Puts the DTensors back. An update that replaced a value instead of
    writing into it is copied into the DTensor's storage."""
    for variable, value, local, shape in swapped:
        current = glue.variable_value(variable)
        if current is not local:
            with torch.no_grad():
                local.copy_(current)
        glue.set_variable_value(variable, value)
        glue.set_variable_shape(variable, shape)

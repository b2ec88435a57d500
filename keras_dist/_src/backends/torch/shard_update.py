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
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor

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
        grads = [_like(g, v) for g, v in zip(grads, variables)]
        swapped = _swap_in_locals([*variables, *optimizer.variables])
        try:
            return original(grads, variables)
        finally:
            _swap_back(swapped)

    apply.__doc__ = original.__doc__
    optimizer.__dict__["apply"] = apply


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

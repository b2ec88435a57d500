"""Optimizer updates from global gradients, replica by replica, on TF.

Used by the exact replica step (`replica_step`) and by a model's own
`train_step` (`overrides`): the gradients are all-reduced first, then each
replica runs the whole optimizer on its own copy of the variables.
"""

from __future__ import annotations

import tensorflow as tf

from keras_dist._src.keras_glue import internals as glue
from keras_dist._src.patching import InstancePatches


def apply_global_gradients(
    context, optimizer, gradients, weights, apply=None, extra=()
):
    """Applies the all-reduced `gradients` on every replica, as one device.

    Keras's TF optimizer clips (``clipnorm``, ``global_clipnorm``,
    ``clipvalue``) each replica's own gradient before tf.distribute sums
    them, and its gradient accumulation and EMA overwrite put a `merge_call`
    inside `tf.cond` (which tf.distribute refuses). Here the gradients are
    summed first; every replica then holds the global gradient and runs the
    whole optimizer (loss-scale unscaling and finite check, clipping,
    accumulation, weight decay, update, EMA, constraints) on its own copy
    of each mirrored variable, with no further collective: the copies
    receive identical updates and stay equal, as tf.distribute's own update
    keeps them. `apply` is the optimizer's `apply` to call (default: the
    optimizer's own). `extra` tensors are summed across replicas in the
    same collective; returns their sums (None if nothing was reduced).
    """
    apply = apply or optimizer.apply
    extra = list(extra)
    present = [i for i, g in enumerate(gradients) if g is not None]
    if not present:  # Keras's optimizer raises its own error
        apply(gradients, weights)
        return None
    values = [gradients[i] for i in present]
    # One collective where the dtypes agree (tf.distribute's collectives
    # concatenate what they batch).
    together = len({v.dtype for v in values + extra}) == 1
    reduced = context.all_reduce(
        tf.distribute.ReduceOp.SUM, values + extra if together else values
    )
    gradients = list(gradients)
    for i, g in zip(present, reduced):
        gradients[i] = g
    summed = list(reduced[len(present) :])
    if extra and not together:
        summed = context.all_reduce(tf.distribute.ReduceOp.SUM, extra)
    with LocalOptimizer(context, optimizer, weights):
        apply(gradients, weights)
    return summed


class LocalOptimizer:
    """Points variables at this replica's copies and the optimizer at its
    non-distributed (backend-neutral) update paths, for the duration."""

    def __init__(self, context, optimizer, weights):
        self._context = context
        self._optimizer = optimizer
        self._weights = weights

    def __enter__(self):
        self._swapped = []
        self._patches = InstancePatches()
        optimizers = [self._optimizer]
        inner = getattr(self._optimizer, "inner_optimizer", None)
        if inner is not None:
            optimizers.append(inner)
        variables = list(self._weights)
        for opt in optimizers:
            variables.extend(opt.variables)
            for name, method in glue.replica_local_optimizer_methods(opt):
                self._patches.set(opt, name, method)
        seen = set()
        for variable in variables:
            value = glue.variable_value(variable)
            if id(variable) in seen or not isinstance(
                value, tf.distribute.DistributedValues
            ):
                continue
            seen.add(id(variable))
            self._swapped.append((variable, value))
            glue.set_variable_value(variable, value._get_on_device_or_primary())

        def no_merge_call(*args, **kwargs):
            raise RuntimeError(
                "keras_dist internal error: a collective inside the "
                "replica-local optimizer update."
            )

        self._patches.set(self._context, "merge_call", no_merge_call)
        return self

    def __exit__(self, *exc):
        for variable, value in reversed(self._swapped):
            glue.set_variable_value(variable, value)
        self._patches.restore()
        return False

"""Synchronised BatchNormalization on torch: moments of the global batch."""

from __future__ import annotations

import torch
import torch.distributed as dist

from keras_dist._src.core.batch_norm import global_moments
from keras_dist._src.keras_glue import internals as glue


# -- synchronised BatchNormalization -------------------------------------------
class _AllReduceSum(torch.autograd.Function):
    """Differentiable sum over ranks (its gradient is summed too)."""

    @staticmethod
    def forward(ctx, tensor, group):
        ctx.group = group
        out = tensor.clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


def sync_moments(engine, layer, original):
    """Returns `layer`'s moments function (Keras's `original` replaced, see
    `keras_glue.internals.replace_batch_norm_moments`) with global-batch
    statistics across ranks.

    The formula is `core.batch_norm.global_moments` (two passes, the one TF
    uses too), over the rank's auxiliary process group. A rank that runs a
    stand-in sample for an empty shard (``engine.phantom_shard``) counts for
    nothing. Masked calls and steps outside training keep Keras's own.
    """

    def all_reduce_sum(value):
        return _AllReduceSum.apply(value, engine.aux_group)

    def moments(inputs, mask):
        if not engine.bn_sync_active or mask is not None:
            return original(inputs, mask)
        weight = 0.0 if getattr(engine, "phantom_shard", False) else None
        return global_moments(
            inputs,
            list(glue.batch_norm_reduction_axes(layer)),
            all_reduce_sum,
            weight,
        )

    return moments

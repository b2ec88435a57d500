"""BatchNormalization across torch ranks.

Synchronised (`sync_moments`): the moments of the global batch in the
training forward pass. Not synchronised (``sync_batch_norm=False``):
each rank normalises with its shard's moments and the moving statistics
become their mean over the ranks that had samples
(`average_moving_statistics`), as on JAX and TF.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from keras_dist._src.core.batch_norm import gathered_moments
from keras_dist._src.keras_glue import internals as glue


# -- synchronised BatchNormalization -------------------------------------------
class _AllGather(torch.autograd.Function):
    """Differentiable all-gather: every rank's tensor stacked on a new first
    axis; each rank's gradient is the sum over ranks of the gradient of its
    own part."""

    @staticmethod
    def forward(ctx, tensor, group):
        ctx.group = group
        ctx.rank = dist.get_rank(group)
        parts = [
            torch.empty_like(tensor) for _ in range(dist.get_world_size(group))
        ]
        dist.all_gather(parts, tensor.contiguous(), group=group)
        return torch.stack(parts)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad[ctx.rank], None


def sync_moments(group, slot, layer, original):
    """Returns `layer`'s moments function (Keras's `original` replaced, see
    `keras_glue.internals.replace_batch_norm_moments`) with global-batch
    statistics across ranks.

    The formula is `core.batch_norm.gathered_moments` (each rank's two-pass
    moments, combined exactly after one all-gather; one all-reduce in the
    backward pass), over the process group `group` (the engine's auxiliary
    one). It applies while `slot` (a `step_context.StepSlot`) holds the
    step's context, i.e. in a training forward pass; a rank that runs a
    stand-in sample for an empty shard (``context.phantom``) counts for
    nothing. Masked calls and steps outside training keep Keras's own.
    """

    def all_gather(value):
        return _AllGather.apply(value, group)

    def moments(inputs, mask):
        context = slot.context
        if context is None or mask is not None:
            return original(inputs, mask)
        return gathered_moments(
            inputs,
            list(glue.batch_norm_reduction_axes(layer)),
            all_gather,
            0.0 if context.phantom else None,
        )

    return moments


def average_over_ranks(engine, variables, participate: bool) -> None:
    """Sets floating `variables` to their mean over the participating ranks.

    A rank with no samples in the step (an empty shard) does not take part;
    one collective in all.
    """
    tensors = [v.value for v in variables]
    weight = 1.0 if participate else 0.0
    with torch.no_grad():
        flat = torch.cat(
            [t.detach().reshape(-1).to(torch.float64) * weight for t in tensors]
            + [
                torch.tensor(
                    [weight], dtype=torch.float64, device=engine.device
                )
            ]
        )
        dist.all_reduce(flat, group=engine.aux_group)
        count = flat[-1]
        if count == 0:
            return
        flat = flat[:-1] / count
        offset = 0
        for t in tensors:
            n = t.numel()
            t.copy_(flat[offset : offset + n].view_as(t).to(t.dtype))
            offset += n


def average_moving_statistics(engine, model, context) -> None:
    """After a training step without synchronised BatchNorm: `model`'s
    floating non-trainable variables (moving statistics; not seed
    generators) averaged over the ranks with samples in the step
    (`context`, a `StepContext`)."""
    variables = [
        v
        for v in model.non_trainable_variables
        if "seed_generator" not in v.path and v.value.dtype.is_floating_point
    ]
    if variables:
        average_over_ranks(engine, variables, context.n_local > 0)

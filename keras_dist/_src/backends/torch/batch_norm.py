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

from keras_dist._src.core.batch_norm import combine_moments, gathered_moments
from keras_dist._src.keras_glue import internals as glue


# -- synchronised BatchNormalization -------------------------------------------
class _AllGather(torch.autograd.Function):
    """Differentiable all-gather: every rank's tensor stacked on a new first
    axis; each rank's gradient is the sum over ranks of the gradient of its
    own part."""

    @staticmethod
    def forward(ctx, tensor, group, rank, world_size):
        ctx.group = group
        ctx.rank = rank
        parts = [torch.empty_like(tensor) for _ in range(world_size)]
        dist.all_gather(parts, tensor.contiguous(), group=group)
        return torch.stack(parts)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad[ctx.rank], None, None, None


class _LocalMoments(torch.autograd.Function):
    """This rank's per-channel ``(mean, M2)`` of a float32 `x` over `axes`:
    the two passes of `core.batch_norm.gathered_moments` (``sum(x) / n``,
    then ``sum((x - mean)^2)``), with a backward of two elementwise passes
    (``(g_mean - 2 g_M2 sum(x - mean)) / n + 2 g_M2 (x - mean)``, autograd's
    formula) where autograd takes about six over the same tensor."""

    @staticmethod
    def forward(ctx, x, axes):
        flat = _channels_last_view(x, axes)
        if flat is not None:
            total = flat.sum(0)
            keep = flat
            count = flat.shape[0]
        else:
            total = x.sum(axes, keepdim=True)
            keep = x
            count = x.numel() // max(total.numel(), 1)
        mean = total / max(count, 1)
        centered = keep - mean
        dims = 0 if flat is not None else axes
        # Zero but for the rounding of `mean`: autograd's gradient has it.
        residual = centered.sum(dims, keepdim=True)
        m2 = centered.square_().sum(dims)
        ctx.save_for_backward(x, mean, residual)
        ctx.flat = flat is not None
        ctx.count = count
        counts = total.new_full((total.numel(),), float(count))
        ctx.mark_non_differentiable(counts)
        return mean.reshape(-1), m2.reshape(-1), counts

    @staticmethod
    def backward(ctx, grad_mean, grad_m2, grad_count):
        del grad_count
        x, mean, residual = ctx.saved_tensors
        shape = mean.shape
        if grad_mean is None:
            grad_mean = torch.zeros_like(mean)
        if grad_m2 is None:
            grad_m2 = torch.zeros_like(mean)
        scale = (2.0 * grad_m2).reshape(shape)
        # d M2 / d mean = -2 sum(x - mean), through mean = sum(x) / n.
        shift = (grad_mean.reshape(shape) - scale * residual) / max(
            ctx.count, 1
        )
        keep = x.reshape(-1, shape[-1]) if ctx.flat else x
        grad = torch.addcmul(shift, keep - mean, scale)
        return grad.view_as(x), None


def _channels_last_view(x, axes):
    """`x` as ``(samples, channels)`` (a view) when `axes` are all its axes
    but the last and it is contiguous; else None."""
    rank = x.dim()
    if rank < 2 or not x.is_contiguous():
        return None
    if sorted(a % rank for a in axes) != list(range(rank - 1)):
        return None
    return x.view(-1, x.shape[-1])


def local_gathered_moments(x, axes, all_gather):
    """`core.batch_norm.gathered_moments` without weights, this rank's
    moments taken by `_LocalMoments`.

    Returns:
        ``(mean, variance)`` of all ranks' samples, in `x`'s dtype.
    """
    dtype = x.dtype
    mean, m2, count = _LocalMoments.apply(x.float(), tuple(axes))
    gathered = all_gather(torch.stack([count, mean, m2]))
    return combine_moments(
        gathered[:, 0], gathered[:, 1], gathered[:, 2], dtype
    )


def sync_moments(group, slot, layer, original):
    """Returns `layer`'s moments function (Keras's `original` replaced, see
    `keras_glue.internals.replace_batch_norm_moments`) with global-batch
    statistics across ranks.

    The formula is `core.batch_norm.gathered_moments` (each rank's two-pass
    moments, combined exactly after one all-gather; one all-reduce in the
    backward pass; this rank's moments by `_LocalMoments`, a stand-in's
    through autograd), over the process group `group` (the engine's
    auxiliary one). It applies while `slot` (a `step_context.StepSlot`)
    holds the step's context, i.e. in a training forward pass; a rank that
    runs a stand-in sample for an empty shard (``context.phantom``) counts
    for nothing. Masked calls and steps outside training keep Keras's own.
    """
    rank, world_size = dist.get_rank(group), dist.get_world_size(group)

    def all_gather(value):
        return _AllGather.apply(value, group, rank, world_size)

    def moments(inputs, mask):
        context = slot.context
        if context is None or mask is not None:
            return original(inputs, mask)
        axes = list(glue.batch_norm_reduction_axes(layer))
        if context.phantom:
            return gathered_moments(inputs, axes, all_gather, 0.0)
        return local_gathered_moments(inputs, axes, all_gather)

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

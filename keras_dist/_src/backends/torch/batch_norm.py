"""Synchronised BatchNormalization on torch: moments of the global batch."""

from __future__ import annotations

import torch
import torch.distributed as dist


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
    def moments(inputs, mask):
        if not engine.bn_sync_active or mask is not None:
            return original(inputs, mask)
        axes = list(layer._reduction_axes)
        x = inputs
        low = x.dtype in (torch.float16, torch.bfloat16)
        if low:
            x = x.float()
        count = 1
        for a in axes:
            count *= x.shape[a]
        local_sum = torch.sum(x, dim=axes)
        local_sq = torch.sum(torch.square(x), dim=axes)
        if getattr(engine, "phantom_shard", False):
            # A stand-in sample for an empty shard counts for nothing.
            local_sum, local_sq, count = local_sum * 0, local_sq * 0, 0
        packed = torch.cat(
            [
                local_sum.reshape(-1),
                local_sq.reshape(-1),
                x.new_tensor([float(count)]),
            ]
        )
        packed = _AllReduceSum.apply(packed, engine.aux_group)
        c = local_sum.numel()
        n = packed[-1].clamp_min(1.0)
        mean = (packed[:c] / n).reshape(local_sum.shape)
        variance = (packed[c : 2 * c] / n).reshape(local_sum.shape)
        variance = variance - torch.square(mean)
        if low:
            mean, variance = mean.to(inputs.dtype), variance.to(inputs.dtype)
        return mean, variance

    return moments

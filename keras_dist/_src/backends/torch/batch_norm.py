"""BatchNormalization across torch ranks.

Synchronised (`sync_moments`): the moments of the global batch in the
training forward pass. Not synchronised (``sync_batch_norm=False``):
each rank normalises with its shard's moments and the moving statistics
become their mean over the ranks that had samples
(`average_moving_statistics`), as on JAX and TF. Either way a training
forward of Keras's own layer on a float32 channels-last input runs as one
autograd function (`sync_call`, `_SyncNormalization`). Under layouts
over a mesh (DTensor) the same function normalises a batch split over
the batch axis (`sharded_call`).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Partial, Replicate

from keras_dist._src.core.batch_norm import gathered_moments
from keras_dist._src.keras_glue import internals as glue


# -- synchronised BatchNormalization -------------------------------------------
def _gather(tensor, group, world_size):
    """Every rank's `tensor` stacked on a new first axis (one all-gather)."""
    parts = [torch.empty_like(tensor) for _ in range(world_size)]
    dist.all_gather(parts, tensor.contiguous(), group=group)
    return torch.stack(parts)


class _AllGather(torch.autograd.Function):
    """Differentiable all-gather: every rank's tensor stacked on a new first
    axis; each rank's gradient is the sum over ranks of the gradient of its
    own part, each rank's term weighted by its ``weight`` and the sum
    divided by this rank's (`StepContext.gradient_weight`; 0: no part)."""

    @staticmethod
    def forward(ctx, tensor, group, rank, world_size, weight):
        ctx.group = group
        ctx.rank = rank
        ctx.weight = weight
        return _gather(tensor, group, world_size)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous() * ctx.weight
        dist.all_reduce(grad, group=ctx.group)
        mine = grad[ctx.rank]
        if ctx.weight:
            mine = mine / ctx.weight
        return mine, None, None, None, None


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


def combine_moments(counts, means, m2s, dtype):
    """`core.batch_norm.combine_moments` in torch's own operations: the same
    operations in the same order (the same bits, the same gradients),
    without the dispatch of a dozen Keras ops (about 0.2 ms of Python per
    layer and step, which a GPU step pays in full).

    Args:
        counts, means, m2s: float32 ``(ranks, channels)`` tensors.
        dtype: the torch dtype of the results.

    Returns:
        ``(mean, variance)``; 0 for both where no rank has a sample.
    """
    count = counts.sum(0)
    empty = count == 0
    safe = torch.where(empty, torch.ones_like(count), count)
    mean = torch.where(empty, 0, torch.divide((counts * means).sum(0), safe))
    spread = (counts * torch.square(means - mean[None])).sum(0)
    variance = torch.where(empty, 0, torch.divide(m2s.sum(0) + spread, safe))
    return mean.to(dtype), variance.to(dtype)


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
        weight = slot.context.gradient_weight
        return _AllGather.apply(value, group, rank, world_size, weight)

    def moments(inputs, mask):
        context = slot.context
        if context is None or mask is not None:
            return original(inputs, mask)
        axes = list(glue.batch_norm_reduction_axes(layer))
        if context.phantom:
            return gathered_moments(inputs, axes, all_gather, 0.0)
        return local_gathered_moments(inputs, axes, all_gather)

    return moments


class _SyncNormalization(torch.autograd.Function):
    """A training-mode BatchNormalization of a channels-last float32 `x`
    with the global batch's moments, forward and backward in one function.

    Forward: this rank's two-pass ``(count, mean, M2)``, one all-gather,
    `combine_moments`, then Keras's own normalisation
    (``(x - mean) * (rsqrt(variance + epsilon) * gamma) + beta``, the same
    operations in the same order as Keras's torch `batch_normalization`):
    the values of `local_gathered_moments` followed by Keras's op.

    Backward: the analytic gradient of that function (as
    `torch.nn.SyncBatchNorm` takes it), with one all-reduce of the
    per-channel ``sum(g)`` and ``sum(g * (x - mean))``::

        dx = k * (g - sum(g) / n
                  - (x - mean) * sum(g * (x - mean)) / (n * (variance + eps)))

    with ``k = gamma * rsqrt(variance + epsilon)``, sums and ``n`` over all
    ranks; ``dgamma`` and ``dbeta`` are this rank's own sums (DDP averages
    them as every other gradient). Each rank's sums enter the all-reduce
    times its `weight` (`StepContext.gradient_weight`) and the total is
    divided by this rank's, so the cross-rank terms carry the weights the
    rest of the gradient gets; a weight of 0 (a stand-in sample) adds
    nothing, forward or backward. Autograd through the moments and Keras's
    normalisation makes about twice as many full-size passes for the same
    values, up to rounding.
    """

    @staticmethod
    def forward(ctx, x, gamma, beta, epsilon, group, world_size, weight):
        channels = x.shape[-1]
        x = x.contiguous()
        flat = x.view(-1, channels)
        count = flat.shape[0]
        total = flat.sum(0)
        local_mean = total / max(count, 1)
        m2 = (flat - local_mean).square_().sum(0)
        sizes = total.new_full((channels,), float(count))
        mine = torch.stack([sizes, local_mean, m2])
        if not weight:  # a stand-in sample: it meets the others, adds 0
            mine = torch.zeros_like(mine)
        if world_size > 1:
            gathered = _gather(mine, group, world_size)
        else:
            gathered = mine[None]
        mean, variance = combine_moments(
            gathered[:, 0], gathered[:, 1], gathered[:, 2], x.dtype
        )
        inverse = variance.add(epsilon).rsqrt_()
        outputs = x.subtract(mean).mul_(inverse.mul(gamma)).add_(beta)
        ctx.save_for_backward(x, mean, inverse, gamma, gathered[:, 0].sum(0))
        ctx.group, ctx.world_size, ctx.weight = group, world_size, weight
        ctx.mark_non_differentiable(mean, variance)
        return outputs, mean, variance

    @staticmethod
    def backward(ctx, grad, grad_mean, grad_variance):
        del grad_mean, grad_variance  # the moving statistics' inputs
        x, mean, inverse, gamma, n = ctx.saved_tensors
        channels = x.shape[-1]
        grad = grad.reshape(-1, channels)
        centered = x.view(-1, channels) - mean
        product = grad * centered
        local = torch.stack([grad.sum(0), product.sum(0)])
        weight = ctx.weight
        if not weight:
            local = torch.zeros_like(local)
        sums = local * weight
        if ctx.world_size > 1:
            dist.all_reduce(sums, group=ctx.group)
        per_sample = sums / (n * weight) if weight else sums
        # k * (g - sum(g)/n - (x - mean) * sum(g (x - mean)) inverse^2 / n),
        # in two passes written over `product` (a fresh tensor costs more).
        k = inverse * gamma
        grad_x = torch.addcmul(-per_sample[0] * k, grad, k, out=product)
        grad_x.addcmul_(centered, -(per_sample[1] * inverse * inverse * k))
        return (
            grad_x.view_as(x),
            local[1] * inverse,
            local[0],
            None,
            None,
            None,
            None,
        )


def fusable(layer) -> bool:
    """Whether `layer` can ever take `_SyncNormalization`: Keras's own
    BatchNormalization call (not a subclass's), no renorm, a scale and a
    center. `sync_call` is installed on such layers only."""
    return bool(
        glue.batch_norm_call_is_keras(layer)
        and not layer.renorm
        and layer.scale
        and layer.center
    )


def _normalises_fused(layer, inputs, training, mask, context) -> bool:
    """Whether this call of a `fusable` layer takes `_SyncNormalization`:
    a training forward (`context` set) on a float32 channels-last input,
    without a mask.

    Every condition is the same on every rank (the layer, the dtype, the
    rank of the input; not its size, contiguity or whether this rank's
    shard is empty), so all ranks meet in the same collectives."""
    return context is not None and _fused_form(layer, inputs, training, mask)


def _fused_form(layer, inputs, training, mask) -> bool:
    """`_normalises_fused` but for the step context."""
    return bool(
        training
        and mask is None
        and layer.trainable
        and isinstance(inputs, torch.Tensor)
        and inputs.dtype == torch.float32
        and layer.compute_dtype == "float32"
        and inputs.dim() >= 2
        and layer.axis % inputs.dim() == inputs.dim() - 1
    )


def sync_call(group, world_size, slot, layer, original):
    """Returns `layer`'s call (Keras's `original` replaced, see
    `keras_glue.internals.replace_batch_norm_call`) that runs a training
    forward as one `_SyncNormalization` over the process group `group` (of
    `world_size` ranks; with ``world_size=1`` this rank's own moments and
    no collective, as ``sync_batch_norm=False`` wants) and updates the
    moving statistics as Keras's `call` does; a rank's stand-in sample for
    an empty shard (weight 0) takes part in the collectives and counts for
    nothing. For `fusable` layers only; every other call (inference, a
    mask, other dtypes or layouts) goes to `original` (with synchronised
    BatchNorm, whose moments `sync_moments` replaces), on every rank alike."""

    def call(inputs, training=None, mask=None):
        if not _normalises_fused(layer, inputs, training, mask, slot.context):
            return original(inputs, training=training, mask=mask)
        moving_mean = layer.moving_mean.value
        moving_variance = layer.moving_variance.value
        context = slot.context
        outputs, mean, variance = _SyncNormalization.apply(
            inputs,
            layer.gamma.value,
            layer.beta.value,
            layer.epsilon,
            group,
            world_size,
            # One rank normalises its own samples, a stand-in one too.
            context.gradient_weight if world_size > 1 else 1.0,
        )
        _update_moving_statistics(
            layer, moving_mean, moving_variance, mean, variance
        )
        return outputs

    return call


def _update_moving_statistics(layer, moving_mean, moving_variance, mean, var):
    """Keras's update of `layer`'s moving statistics (its `call`'s)."""
    momentum = layer.momentum
    layer.moving_mean.assign(moving_mean * momentum + mean * (1.0 - momentum))
    layer.moving_variance.assign(
        moving_variance * momentum + var * (1.0 - momentum)
    )


class _Whole(torch.autograd.Function):
    """A DTensor variable's whole value as a plain tensor (gathered where
    it is split); its gradient goes back as this rank's share with the
    `partial` placements as it is, for the optimizer step to reduce with
    the other gradients (`shard_update`), where a redistribution's
    backward would reduce it alone."""

    @staticmethod
    def forward(ctx, value, partial):
        ctx.mesh, ctx.partial = value.device_mesh, partial
        return value.full_tensor()

    @staticmethod
    def backward(ctx, grad):
        share = DTensor.from_local(grad, ctx.mesh, ctx.partial, run_check=False)
        return share, None


def sharded_call(engine, layer, original):
    """Returns `layer`'s call (Keras's `original` replaced) for layouts over
    a mesh (`sharded.DTensorEngine` `engine`): a training forward on a
    float32 channels-last DTensor split over the batch axis (the engine's
    `batch_placements`) runs as one `_SyncNormalization` on this rank's
    part, over the batch axis's process group: one all-gather forward, one
    all-reduce backward.

    Keras's op on the DTensor takes the same global moments through
    DTensor's operators, at about six small collectives a layer and step
    and, in the backward pass, two reduce-scatters of a whole batch's
    activation (its gradient comes back as a ``Partial`` sum of the global
    batch). ``gamma`` and ``beta`` enter whole (gathered as DTensor would
    for the op) and their gradients leave as this rank's ``Partial`` sums
    (`_Whole`), which the optimizer step reduces with the others. Every
    other call (inference, a mask, another dtype, a batch not split, a
    channel axis split over another mesh axis) goes to `original`, on
    every rank alike."""
    mesh = engine.torch_mesh
    group = mesh.get_group(engine.batch_axis)
    parts = engine.batch_parts
    batch_dim = engine.mesh.axis_names.index(engine.batch_axis)
    partial = tuple(
        Partial() if i == batch_dim else Replicate() for i in range(mesh.ndim)
    )

    def whole(variable):
        value = variable.value
        if not isinstance(value, DTensor):
            return value
        return _Whole.apply(value, partial)

    def replicated(tensor):
        return DTensor.from_local(
            tensor, mesh, engine.replicated, run_check=False
        )

    def call(inputs, training=None, mask=None):
        if not (
            parts > 1
            and isinstance(inputs, DTensor)
            and tuple(inputs.placements) == engine.batch_placements
            and _fused_form(layer, inputs, training, mask)
        ):
            return original(inputs, training=training, mask=mask)
        outputs, mean, variance = _SyncNormalization.apply(
            inputs.to_local(),
            whole(layer.gamma),
            whole(layer.beta),
            layer.epsilon,
            group,
            parts,
            1.0,  # every part holds real samples: the batch splits evenly
        )
        _update_moving_statistics(
            layer,
            layer.moving_mean.value,
            layer.moving_variance.value,
            replicated(mean),
            replicated(variance),
        )
        return DTensor.from_local(
            outputs,
            mesh,
            inputs.placements,
            run_check=False,
            shape=inputs.shape,
            stride=inputs.stride(),
        )

    return call


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
    (`context`, a `StepContext`). A one-rank job has nothing to average
    (and skips the all-reduce and the host sync it costs on a GPU)."""
    if engine.world_size == 1:
        return
    variables = [
        v
        for v in model.non_trainable_variables
        if "seed_generator" not in v.path and v.value.dtype.is_floating_point
    ]
    if variables:
        average_over_ranks(engine, variables, context.n_local > 0)

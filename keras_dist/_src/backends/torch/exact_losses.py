"""Losses and metrics of a rank's shard as exact parts of the global batch's.

A rank computes Keras's loss on its shard; the steps weight it by the
shard's part of the global batch (``n_local / n_global``). That is exact
for a mean over samples. `global_loss_denominators` rescales the other
reductions (a masked mean to the global batch's unmasked count, from
`global_mask_counts`; a ``"sum"``), and `weighted_scalar_means` weights
the scalars a user's step feeds to `Mean` trackers.
"""

from __future__ import annotations

import contextlib
import warnings

import keras
import numpy as np
import torch
import torch.distributed as dist
from keras import tree

from keras_dist._src.keras_glue import internals as glue
from keras_dist._src.patching import InstancePatches


def global_mask_counts(engine, y_pred, has_samples: bool):
    """Each masked output's count of unmasked elements over all ranks.

    One collective after the forward pass (every rank, an empty shard
    included, has the same outputs and masks); none when no output of
    `y_pred` has a Keras mask.

    Returns:
        ``{id(mask): global count}`` (tensors on this rank's device).
    """
    masks = [glue.keras_mask(t) for t in tree.flatten(y_pred) if t is not None]
    masks = [m for m in masks if m is not None]
    if not masks:
        return {}
    with torch.no_grad():
        counts = torch.stack(
            [m.detach().to(torch.float64).sum() for m in masks]
        ).to(engine.device)
        if not has_samples:
            counts = torch.zeros_like(counts)
        dist.all_reduce(counts, group=engine.aux_group)
    return {id(m): counts[i] for i, m in enumerate(masks)}


_UNMATCHED_MASK_WARNED = set()


@contextlib.contextmanager
def global_loss_denominators(engine, n_local, n_global, counts=None):
    """Keras's loss reductions of this rank's shard, rescaled so that
    weighting the shard's loss by ``n_local / n_global`` (as the steps do)
    gives this rank's exact part of the global batch's loss.

    A masked mean (Keras divides by the unmasked count) is rescaled to
    divide by the global batch's unmasked count instead of this shard's;
    a ``"sum"`` reduction by ``n_global / n_local``. Means over samples or
    elements (``"sum_over_batch_size"`` without a mask) are exact as they
    are and unchanged.

    Args:
        engine: the rank's engine.
        n_local: samples in this rank's shard (0: a stand-in that counts
            for nothing).
        n_global: samples in the global batch.
        counts: ``{id(mask): global count}`` from `global_mask_counts`; None
            (a user's step, which every rank runs alike) all-reduces each
            masked loss's count where it is reduced.
    """
    original = glue.loss_reduction()
    scale = n_global / max(n_local, 1)

    def reduce_weighted_values(
        values,
        sample_weight=None,
        mask=None,
        reduction="sum_over_batch_size",
        dtype=None,
    ):
        def plain():
            return original(
                values,
                sample_weight=sample_weight,
                mask=mask,
                reduction=reduction,
                dtype=dtype,
            )

        if tuple(np.shape(values)) in ((), (0,)):
            return plain()  # Keras returns such values unreduced
        if reduction == "sum":
            return plain() * scale
        if mask is None or reduction not in ("mean", "sum_over_batch_size"):
            return plain()
        if counts is not None and id(mask) not in counts:
            _warn_unmatched_mask()
            return plain()
        # Keras multiplies a float tensor of sample weights in place by the
        # normalised mask (`apply_mask`), and weighted metrics then read it:
        # Keras gets a copy, the caller's tensor what one device leaves.
        given = sample_weight
        if isinstance(given, torch.Tensor):
            sample_weight = given.clone()
        version = getattr(sample_weight, "_version", None)
        loss = plain()
        with torch.no_grad():
            valid = torch.as_tensor(mask).detach().to(torch.float64).sum()
            if counts is None:
                total = valid * (1.0 if n_local > 0 else 0.0)
                total = total.to(engine.device)
                dist.all_reduce(total, group=engine.aux_group)
            else:
                total = counts[id(mask)]
            factor = torch.where(
                total > 0, valid.to(total.device) * scale / total, 0.0
            )
            if version is not None and sample_weight._version != version:
                # Normalised with this shard's count: the global batch's.
                given.copy_(sample_weight * factor.to(sample_weight.dtype))
        return loss * factor.to(loss.device, loss.dtype)

    glue.set_loss_reduction(reduce_weighted_values)
    try:
        yield
    finally:
        glue.set_loss_reduction(original)


def _warn_unmatched_mask() -> None:
    if "mask" in _UNMATCHED_MASK_WARNED:
        return
    _UNMATCHED_MASK_WARNED.add("mask")
    warnings.warn(
        "A loss is masked with a mask that is not a model output's Keras "
        "mask (a loss that masks its own values): keras_dist divides it by "
        "this replica's unmasked count, so with several replicas it may "
        "differ from one device's. Mask through the model's outputs "
        "(`compute_mask`) or with sample weights instead.",
        stacklevel=3,
    )


class weighted_scalar_means:  # noqa: N801 - used as a context manager
    """In a user's step: a scalar fed to a `keras.metrics.Mean` without a
    sample weight (``tracker.update_state(loss)``) counts with weight
    ``n_local / n_global``, its shard's part of the global batch.

    Summed over ranks (the metric all-reduce) the weights add up to one a
    step, as on one device, and a batch mean (a loss) to the global batch's
    mean, also for unequal shards.
    """

    def __init__(self, metrics, share: float):
        self._metrics = metrics
        self._share = share

    def __enter__(self):
        self._patches = InstancePatches()
        seen = set()
        for metric in self._metrics:
            if id(metric) in seen or not isinstance(metric, keras.metrics.Mean):
                continue
            if isinstance(metric, keras.metrics.MeanMetricWrapper):
                continue  # per-sample values, summed exactly already
            seen.add(id(metric))
            original = metric.update_state

            def update_state(
                values, sample_weight=None, original=original, **kwargs
            ):
                if sample_weight is None and np.ndim(values) == 0:
                    sample_weight = self._share
                return original(values, sample_weight=sample_weight, **kwargs)

            self._patches.set(metric, "update_state", update_state)
        return self

    def __exit__(self, *exc):
        self._patches.restore()
        return False

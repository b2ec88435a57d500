"""One device's loss semantics inside a tf.distribute replica's step.

Keras's losses under tf.distribute divide by the replica count, weigh each
replica's per-output loss alike, divide a masked mean by the replica's own
count of unmasked entries and read `model.losses` shared by the replicas'
threads. The scopes here give `model.compute_loss`, run on one replica's
part of the global batch, the part's one-device loss, which the replica
step (`replica_step`) weights by the part's share of the global batch.
"""

from __future__ import annotations

import threading

import tensorflow as tf
from keras import tree

from keras_dist._src.keras_glue import internals as glue
from keras_dist._src.patching import InstancePatches

MEAN_REDUCTIONS = ("sum_over_batch_size", "mean")

_MISSING = object()


def first_rows(structure, rows, keep_masks=False):
    """The first `rows` rows of each tensor of `structure` (None stays
    None); with `keep_masks`, each tensor's Keras mask (from
    `Embedding(mask_zero=True)`, `Masking`, `compute_mask`) sliced alike:
    a slice is a new tensor, which Keras's losses and metrics would see
    unmasked.

    The slice's end is built once for the whole structure (``t[:rows]``
    builds it per tensor): fewer ops in every step, the same values."""
    end = tf.reshape(tf.cast(rows, "int32"), [1])

    def cut(t):
        if t is None:
            return None
        if not isinstance(t, tf.Tensor):  # ragged, sparse: their own slice
            part = t[:rows]
        else:
            part = tf.strided_slice(t, [0], end)
        mask = glue.keras_mask(t) if keep_masks else None
        if mask is not None:
            glue.set_keras_mask(part, tf.strided_slice(mask, [0], end))
        return part

    return tree.map_structure(cut, structure)


def slice_keeping_masks(structure, rows):
    """The first `rows` rows of each tensor, Keras masks sliced alike
    (`first_rows`)."""
    return first_rows(structure, rows, keep_masks=True)


class MaskedMeans:
    """One device's masked mean for Keras's losses over masked outputs.

    With a mask on the prediction, Keras's mean losses divide by the
    count of its unmasked entries: on a replica, its own count. Weighted
    by the replica's share of the rows, the parts would add up to one
    device's loss only if every part had as many unmasked entries per
    row. Here each loss over a masked output of the model is rescaled so
    that, times the share, it is the part's weighted sum over the
    global count of unmasked entries (one all-reduce of the counts, made
    before the loss, since no collective may run while Keras's loss
    functions are replaced). Exact on any split; other losses as before.
    """

    _REDUCTIONS = ("sum_over_batch_size", "mean")

    def __init__(self, context, y_pred, local_count, share):
        self._share = share
        self._masks = []
        for leaf in tree.flatten(y_pred):
            mask = None if leaf is None else glue.keras_mask(leaf)
            if mask is not None:
                self._masks.append(mask)
        self._totals = []
        if self._masks:
            counts = tf.stack(
                [
                    tf.reduce_sum(tf.cast(m[:local_count], "float32"))
                    for m in self._masks
                ]
            )
            totals = context.all_reduce(tf.distribute.ReduceOp.SUM, counts)
            self._totals = tf.unstack(totals, num=len(self._masks))

    def __enter__(self):
        self._original = glue.loss_reduction()
        if not self._masks:
            return self
        original, masks, totals = self._original, self._masks, self._totals
        share = self._share

        def reduce_weighted_values(
            values,
            sample_weight=None,
            mask=None,
            reduction="sum_over_batch_size",
            dtype=None,
        ):
            loss = original(
                values,
                sample_weight=sample_weight,
                mask=mask,
                reduction=reduction,
                dtype=dtype,
            )
            index = next((i for i, m in enumerate(masks) if m is mask), None)
            if index is None or reduction not in self._REDUCTIONS:
                return loss
            # Keras's value: the part's weighted sum / its own count.
            own = tf.reduce_sum(tf.cast(mask, "float32"))
            factor = tf.math.divide_no_nan(own, totals[index] * share)
            return loss * tf.cast(factor, loss.dtype)

        glue.set_loss_reduction(reduce_weighted_values)
        return self

    def __exit__(self, *exc):
        glue.set_loss_reduction(self._original)
        return False


class NoReplicaLossScaling:
    """One-device loss semantics while `compute_loss` runs.

    Keras's losses divide by the replica count under tf.distribute
    (`scale_loss_for_distribution`), and its per-output loss trackers
    multiply back and weight each replica's value by its static batch size
    (unknown in a traced step, so every replica weighs 1). Both are
    switched off. On one device Keras's TF trainer weighs each batch's
    per-output loss by that same static batch size, which is unknown for
    batches from `tf.data` (arrays included): every batch weighs 1, and
    the logged per-output loss is the mean of the batches' means (its
    total `loss`, weighted by `tf.shape`, is not). Here each part's mean
    weighs its share of the global batch (the shares add up to 1), so
    each global batch weighs 1 as on one device.

    Those tracker updates are recorded in the scope and made when it
    ends, after every patch is undone: the trackers are shared by the
    replicas' threads, and an update can be a collective (under
    `CentralStorageStrategy` a variable on the central device aggregates
    with a ``merge_call``), where tf.distribute runs another replica's
    thread, which would patch on top of this one's.
    """

    def __init__(self, model, share):
        self._model = model
        self._share = share

    def __enter__(self):
        self._scale, self._unscale = glue.loss_distribution_scaling()
        glue.set_loss_distribution_scaling(_identity, _identity)
        self._patches = InstancePatches()
        self._updates = []
        compile_loss = glue.compile_loss(self._model)
        for metric in getattr(compile_loss, "metrics", None) or []:
            if metric is None:
                continue

            def update_state(value, sample_weight=None, metric=metric):
                del sample_weight  # the share instead
                self._updates.append((metric, tf.cast(value, "float32")))

            self._patches.set(metric, "update_state", update_state)
        return self

    def __exit__(self, *exc):
        glue.set_loss_distribution_scaling(self._scale, self._unscale)
        self._patches.restore()
        updates, self._updates = self._updates, []
        if exc[0] is None:
            for metric, value in updates:
                metric.update_state(value, sample_weight=self._share)
        return False


class PerThreadLosses:
    """A layer's `add_loss` values, one list per thread.

    tf.distribute runs each replica's step in a thread of its own. Keras
    keeps `add_loss` values in one list per layer, which the outermost
    call clears: with cross-replica BatchNormalization, whose collective
    lets another replica's forward pass run in between, the other replica
    cleared this one's activity-regularizer values and put its own there
    (the loss then had one replica's term on every replica, and missed it
    from the others' gradients). Here each thread has its own list. Copied
    or pickled, it is a plain list (this thread's values).
    """

    def __init__(self, values=()):
        self._local = threading.local()
        self._local.values = list(values)

    @property
    def _values(self) -> list:
        values = getattr(self._local, "values", None)
        if values is None:
            values = self._local.values = []
        return values

    def extend(self, values) -> None:
        self._values.extend(values)

    def append(self, value) -> None:
        self._values.append(value)

    def clear(self) -> None:
        self._values.clear()

    def __getitem__(self, index):
        return self._values[index]

    def __iter__(self):
        return iter(list(self._values))

    def __len__(self) -> int:
        return len(self._values)

    def __bool__(self) -> bool:
        return bool(self._values)

    def __reduce__(self):
        return (list, (list(self._values),))


def keep_losses_per_thread(model) -> None:
    """Gives every layer of `model` a `PerThreadLosses` (once)."""
    for layer in glue.flatten_layers(model, include_self=True):
        losses = glue.layer_losses(layer)
        if not isinstance(losses, PerThreadLosses):
            glue.set_layer_losses(layer, PerThreadLosses(losses))


class OwnLosses:
    """`model.losses` restricted to this replica's own.

    Keras keeps `add_loss` values in one list per layer, shared by the
    replicas' threads: when a collective (cross-replica BatchNormalization)
    lets another replica's forward pass run in between, this replica's
    `model.losses` also holds the other's values (not on this replica's
    tape: the gradients stay right, the logged loss does not). Each
    replica's ops are placed on its device, which tells them apart.
    """

    def __init__(self, model, y_pred):
        self._model = model
        leaves = [t for t in tree.flatten(y_pred) if t is not None]
        self._device = getattr(leaves[0], "device", "") if leaves else ""

    def __enter__(self):
        self._old = glue.own_losses_override(self._model, _MISSING)
        if not self._device:
            return self
        losses = self._model.losses
        own = [
            v for v in losses if getattr(v, "device", "") in ("", self._device)
        ]
        if own and len(own) != len(losses):
            glue.set_losses_override(self._model, own)
        return self

    def __exit__(self, *exc):
        if self._old is _MISSING:
            glue.clear_losses_override(self._model)
        else:
            glue.set_losses_override(self._model, self._old)
        return False


def _identity(value):
    return value


def check_mean_reductions(model):
    for entry in glue.compiled_loss_entries(model):
        reduction = getattr(entry.loss, "reduction", "sum_over_batch_size")
        if reduction not in MEAN_REDUCTIONS:
            raise ValueError(
                f"Loss {entry.name or entry.loss!r} uses reduction "
                f"{reduction!r}; keras_dist's exact replicated step supports "
                f"losses with reduction in {MEAN_REDUCTIONS} (the Keras "
                "default). Use the default reduction, or override "
                "`compute_loss` to compute the loss yourself."
            )

"""The state of one replicated torch step, in one object.

A step of the replicated engine runs this rank's shard of the global batch
(or, with the FILE and OFF shard policies, its own local batch). What the
code called during the step needs to know of that shard — synchronised
BatchNormalization (`batch_norm.sync_moments`), the global dropout mask
(`steps.install_global_dropout`), the loss and metric weights — is one
`StepContext`, made by the step for that step and passed on explicitly;
during the training forward pass it is also held in the model's
`StepSlot`, where the layers' replaced calls read it (a slot holding a
context is what turns synchronised BatchNormalization and the global
dropout mask on). Nothing of a step is left on the engine.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses

from keras import tree

from keras_dist._src.core.shards import shard_bounds


class LocalBatchTracker:
    """Tells each step whether its batch is local, and its `n_global`.

    The input offers one count per batch it yields, in order; each step
    takes the oldest. With `steps_per_execution` > 1, Keras reads a group
    of batches before it runs their steps, so the counts queue up.
    """

    def __init__(self):
        self._counts = collections.deque()

    def clear(self) -> None:
        """Forgets counts no step took (a new call or a new epoch)."""
        self._counts.clear()

    def offer(self, n_global: int) -> None:
        """Marks the next batch as local, with `n_global` samples in all."""
        self._counts.append(int(n_global))

    def take(self):
        """Returns `n_global` of the oldest local batch not yet stepped on,
        or None (a global batch: the DATA policy)."""
        return self._counts.popleft() if self._counts else None


@dataclasses.dataclass
class CallState:
    """What one `fit`, `evaluate` or `predict` call in progress knows for
    the steps it runs: made as the call begins (`TorchEngine.call_scope`)
    and dropped as it ends, so that a call inside another (`fit`'s
    validation) has its own; the engine's outermost state serves custom
    loops, outside any call.

    Attributes:
        defer_metrics: nothing reads the per-step metric values, so their
            all-reduce waits until they are read (decided from the
            caller's arguments, alike on every rank).
        validation_reads: (`fit`) whether its validation reads batch logs.
        local_batches: the `n_global` of each local batch (FILE and OFF
            policies) the input yielded and no step has taken yet.
    """

    defer_metrics: bool = False
    validation_reads: bool = True
    local_batches: LocalBatchTracker = dataclasses.field(
        default_factory=LocalBatchTracker
    )


@dataclasses.dataclass(slots=True)
class StepContext:
    """One step of this rank.

    Attributes:
        n_local: samples of this rank's shard (0: an empty shard).
        n_global: samples of the global batch.
        offset: where this rank's shard starts in the global batch; None
            when the batch is this rank's own (FILE/OFF input).
        phantom: the step runs on a stand-in sample for an empty shard (a
            user's step): it counts for nothing (no BatchNormalization
            statistics, zero gradient share, metric updates undone).
        gradient_weight: what this rank's gradients are multiplied by when
            they are summed over ranks after the backward pass. Keras's
            step through DDP: 1 (its loss already carries the rank's
            share); a user's step: ``n_local / n_global`` (0 for a
            stand-in sample), applied at `optimizer.apply`.
            BatchNormalization's backward collectives weight each rank's
            part by it, so that its cross-rank terms get the same weights
            as the rest of the gradient.
    """

    n_local: int
    n_global: int
    offset: int | None = None
    phantom: bool = False
    gradient_weight: float = 1.0


class StepSlot:
    """Where a training forward pass keeps its step's `StepContext` (None
    outside one), for the layer calls keras_dist replaced to read."""

    __slots__ = ("context",)

    def __init__(self):
        self.context = None

    @contextlib.contextmanager
    def training_forward(self, context: StepContext):
        """Holds `context` during the forward pass."""
        self.context = context
        try:
            yield
        finally:
            self.context = None


def _first_leaf(x):
    return next(t for t in tree.flatten(x) if t is not None)


def shard_context(x, local_n_global, rank: int, world_size: int):
    """The `StepContext` of a step on batch inputs `x`.

    Args:
        x: the batch's inputs as Keras passes them.
        local_n_global: None when `x` is the global batch (every rank
            keeps its `numpy.array_split` part); else `x` is this rank's
            own batch (FILE/OFF input) and this the global batch's size.
        rank: this rank.
        world_size: the number of ranks.
    """
    if local_n_global is not None:
        n_local = int(_first_leaf(x).shape[0]) if tree.flatten(x) else 0
        return StepContext(n_local, local_n_global)
    total = int(_first_leaf(x).shape[0])
    start, stop = shard_bounds(total, rank, world_size)
    return StepContext(stop - start, total, start)


def slice_batch(structure, start: int, stop: int):
    """Rows ``start:stop`` of every tensor of `structure`."""
    return tree.map_structure(
        lambda t: None if t is None else t[start:stop],
        structure,
        none_is_leaf=True,
    )

"""The state of one replica's run of keras_dist's exact step on TF.

A `StepContext` holds what the replica step's helpers need to know about
the part of the global batch this replica holds: its sample count and the
global one, where its rows lie in the global batch (for Dropout's mask),
which rows are real (for BatchNormalization's moments) and, in a model's
own `train_step`, the share its gradients and loss are weighted by. The
step creates one per replica (`StepContext.enter`) and ends it when the
replica's function returns.

Most of the state is passed explicitly, but three readers are called deep
inside Keras, with Keras's arguments only: BatchNormalization's moments,
`Dropout.call` and the replaced loss scaling, metrics and optimizer apply
of an overridden step (`overrides`). They find the context with `current`,
keyed by `tf.distribute.get_replica_context()`: tf.distribute's
MirroredStrategy (and the multi-worker and central-storage strategies
built on the same runner) runs each replica's function in its own thread
with its own `ReplicaContext` object, and switches threads at every
collective, so a process-wide value set and restored around the call
would be read by the wrong replica. The replica context is the same
object in every graph the replica traces (tf.function and `tf.cond`
branches copy the strategy stack), and there is none in a cross-replica
context, where nothing is found. The lookup runs while the step is traced
(once per step function), never per step.
"""

from __future__ import annotations

import tensorflow as tf

# id(replica context) -> the StepContext of that replica's running step.
_ACTIVE: dict[int, StepContext] = {}


class StepContext:
    """One replica's step: counts, row position and masks of its part.

    Attributes:
        replica: this replica's `tf.distribute.ReplicaContext`.
        local_count: this part's real sample count (int32 tensor).
        global_count: the global batch's sample count (float32 tensor).
        valid: per-row float mask of real samples for BatchNormalization's
            moments, or None (every row real, or outside the forward pass).
        dropout: (first row, row count, global count) of the part in the
            global batch while the training forward pass runs, else None.
        override_share: the part's share of the global batch while a
            model's own `train_step`/`test_step` runs, else None.
    """

    def __init__(self, replica, local_count, global_count):
        self.replica = replica
        self.local_count = local_count
        self.global_count = global_count
        self.valid = None
        self.dropout = None
        self.override_share = None

    @classmethod
    def enter(cls, local_count, global_count):
        """A new context for the current replica, made current until
        `exit`. Raises if the replica already has one (a step inside a
        step)."""
        replica = tf.distribute.get_replica_context()
        key = id(replica)
        running = _ACTIVE.get(key)
        if running is not None and running.replica is replica:
            raise RuntimeError(
                "keras_dist internal error: a replica step started inside "
                "another one on the same replica."
            )
        context = cls(replica, local_count, global_count)
        _ACTIVE[key] = context
        return context

    def exit(self) -> None:
        """Ends this context (the replica's step returned or failed)."""
        if _ACTIVE.get(id(self.replica)) is self:
            del _ACTIVE[id(self.replica)]

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.exit()
        return False


def current():
    """The `StepContext` of the replica step running in this replica
    context, or None (no keras_dist step, or a cross-replica context)."""
    if not _ACTIVE:
        return None
    replica = tf.distribute.get_replica_context()
    if replica is None:
        return None
    context = _ACTIVE.get(id(replica))
    if context is None or context.replica is not replica:
        return None
    return context

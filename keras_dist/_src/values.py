"""Per-replica values and reduction ops shared by every backend."""

from __future__ import annotations

import enum


class ReduceOp(enum.Enum):
    """How `Strategy.reduce` combines values across replicas."""

    SUM = "SUM"
    MEAN = "MEAN"

    @classmethod
    def from_any(cls, op) -> ReduceOp:
        """Accepts a `ReduceOp`, its name (``"sum"``) or a `tf.distribute`
        `ReduceOp`."""
        if isinstance(op, cls):
            return op
        name = getattr(op, "value", op)
        if isinstance(name, str) and name.upper() in cls.__members__:
            return cls[name.upper()]
        raise ValueError(
            f"Unknown reduce op {op!r}; use keras_dist.ReduceOp.SUM or "
            "keras_dist.ReduceOp.MEAN."
        )


class PerReplica:
    """One value per replica, in replica order (like `tf.distribute`'s).

    Returned by `Strategy.run` and yielded by distributed datasets on backends
    whose engine has no per-replica type of its own (JAX, PyTorch).
    """

    __slots__ = ("values",)

    def __init__(self, values):
        self.values = tuple(values)

    def __len__(self):
        return len(self.values)

    def __repr__(self):
        return f"PerReplica({list(self.values)!r})"


def local_results(value):
    """Returns the tuple of per-replica parts of `value` (1-tuple if plain).

    A nested structure with `PerReplica` leaves (a batch of a distributed
    dataset that is a dict, what `Strategy.run` returns for a dict) gives
    one structure per replica, as in `tf.distribute`."""
    if isinstance(value, PerReplica):
        return value.values
    from keras import tree

    counts = {
        len(leaf)
        for leaf in tree.flatten(value)
        if isinstance(leaf, PerReplica)
    }
    if not counts:
        return (value,)
    if len(counts) > 1:
        raise ValueError(
            "The per-replica values in this structure have different "
            f"numbers of replicas ({sorted(counts)}); they must come from "
            "one strategy."
        )
    return tuple(
        tree.map_structure(
            lambda leaf, i=i: (
                leaf.values[i] if isinstance(leaf, PerReplica) else leaf
            ),
            value,
        )
        for i in range(counts.pop())
    )

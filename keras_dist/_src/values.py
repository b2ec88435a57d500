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
    """Returns the tuple of per-replica parts of `value` (1-tuple if plain)."""
    if isinstance(value, PerReplica):
        return value.values
    return (value,)

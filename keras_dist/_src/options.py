"""Input distribution options: how input is sharded between workers."""

from __future__ import annotations

import dataclasses
import enum


class ShardPolicy(enum.Enum):
    """How the input of `fit`/`evaluate`/`predict` is split between workers.

    A *worker* is a process (the torch backend runs one per device; JAX and
    TensorFlow run one per host). Within a worker, each global batch is
    always split across that worker's replicas, sample by sample.

    * ``AUTO`` — ``FILE`` for a file-backed `tf.data.Dataset`, else ``DATA``
      (the choice is logged once).
    * ``FILE`` — each worker reads a disjoint subset of the input files.
    * ``DATA`` — every worker reads the whole input and keeps its own
      contiguous part of every global batch (exactly once, any input type).
    * ``OFF`` — the input is already sharded: each worker's input is its own
      share of the data, batched with this worker's `numpy.array_split`
      share of ``batch_size`` (which stays the global batch). Workers agree
      on a common step count; a worker that runs out first takes part in the
      remaining steps with empty batches, so nothing is dropped or repeated.
    """

    AUTO = "auto"
    FILE = "file"
    DATA = "data"
    OFF = "off"


@dataclasses.dataclass(frozen=True)
class InputOptions:
    """How input is distributed: `MirroredStrategy(input_options=...)`.

    Args:
        shard_policy: a `ShardPolicy` (or its name, e.g. ``"data"``).
    """

    shard_policy: ShardPolicy = ShardPolicy.AUTO

    def __post_init__(self):
        policy = self.shard_policy
        if not isinstance(policy, ShardPolicy):
            try:
                policy = ShardPolicy(str(policy).lower())
            except ValueError:
                raise ValueError(
                    f"Unknown shard_policy {self.shard_policy!r}; use one of "
                    f"{[p.name for p in ShardPolicy]}."
                ) from None
            object.__setattr__(self, "shard_policy", policy)

"""Input distribution of `fit`/`evaluate`/`predict` on torch (shard policies).

Every rank runs Keras's own torch input pipeline. What each rank is given
depends on the strategy's `InputOptions` (see `keras_dist.ShardPolicy`):

* ``DATA``: the input is left as it is. Every rank iterates the same global
  batches (shuffling is seeded from rank 0) and the replicated step keeps
  this rank's contiguous `numpy.array_split` part of each one.
* ``FILE``: a file-backed `tf.data.Dataset` (batched with the global batch
  size B) is sharded by files with tf.distribute's own
  ``input_ops.auto_shard_dataset`` and re-batched to this rank's share of B
  (``numpy.array_split`` sizes). Any other input falls back to ``DATA``
  (logged once).
* ``OFF``: each rank's input is its own share of the data. Arrays are
  batched with this rank's share of ``batch_size`` (the global batch B: rank
  r gets ``B // W + (r < B % W)``); already batched inputs (datasets,
  generators, `DataLoader`, `PyDataset`) must yield local batches.
* ``AUTO``: ``FILE`` for a file-backed `tf.data.Dataset`, else ``DATA``
  (logged once).

With ``FILE`` and ``OFF`` each rank's batches are local, and ranks may hold
different numbers of them. The input is then wrapped in `AgreedAdapter`:
before every step the ranks all-reduce whether they still have a batch and
how many samples it holds; a rank that has run out takes part with an empty
batch (zero gradient, no metric update) until every rank is done, so every
sample is used exactly once and no collective is left unmatched. The step
(`keras_dist._src.backends.torch.data_parallel`) then does not slice, and
weights the local mean loss with ``n_local * world / n_global``.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.distributed as dist
from keras import tree

from keras_dist._src.core import policies
from keras_dist._src.core.inputs import DistributedDataset
from keras_dist._src.core.lockstep import LockstepAdapter


# -- agreement on the step count ----------------------------------------------
def _empty_like(batch):
    return tree.map_structure(
        lambda t: None if t is None else t[:0], batch, none_is_leaf=True
    )


def _num_samples(batch) -> int:
    leaves = [t for t in tree.flatten(batch) if t is not None]
    return int(leaves[0].shape[0]) if leaves else 0


class _AgreedIterable(torch.utils.data.IterableDataset):
    def __init__(self, adapter):
        super().__init__()
        self.adapter = adapter

    def __iter__(self):
        return self.adapter.agreed_batches()


class AgreedAdapter(LockstepAdapter):
    """A Keras data adapter over this rank's local batches, in lockstep.

    Wraps the Keras adapter of this rank's own input. Before each step the
    ranks all-reduce ``[has_batch, n_local, needs_template]``; when no rank
    has a batch, iteration stops on every rank at once. A rank without a
    batch yields an empty one (its structure taken from its own earlier
    batches or, if it had none, from another rank).

    Args:
        engine: the rank's `MirroredEngine`.
        inner: the Keras `DataAdapter` of this rank's input.
        what: what the input is for, used in error messages.
    """

    def __init__(self, engine, inner, what: str):
        self.engine = engine
        self._template = None
        counts = inner.num_batches
        known = torch.tensor(
            [0 if counts is None else 1, counts or 0],
            dtype=torch.int64,
            device=engine.device,  # NCCL groups take device tensors only
        )
        flags = known.clone()
        dist.all_reduce(flags, op=dist.ReduceOp.MIN, group=engine.aux_group)
        most = known.clone()
        dist.all_reduce(most, op=dist.ReduceOp.MAX, group=engine.aux_group)
        super().__init__(
            inner, what, int(most[1]) if int(flags[0]) == 1 else None
        )

    def agreed_batches(self):
        """Yields this rank's batches (or empty ones) in lockstep."""
        engine = self.engine
        tracker = engine.call_state.local_batches
        tracker.clear()
        iterator = iter(self.inner.get_torch_dataloader())
        exhausted = False
        first = True
        while True:
            batch = None
            if not exhausted:
                try:
                    batch = next(iterator)
                except StopIteration:
                    exhausted = True
            if batch is not None and self._template is None:
                self._template = _empty_like(batch)
            n_local = 0 if batch is None else _num_samples(batch)
            state = torch.tensor(
                [
                    0 if batch is None else 1,
                    n_local,
                    1 if self._template is None else 0,
                ],
                dtype=torch.int64,
                device=engine.device,
            )
            dist.all_reduce(state, group=engine.aux_group)
            has, n_global, lacking = (int(v) for v in state)
            if has == 0:
                if first:
                    raise ValueError(
                        f"The input of {self.what} yielded no batch on any "
                        "rank (an empty data set). Pass at least one sample."
                    )
                return
            first = False
            if lacking:
                templates = [None] * engine.world_size
                dist.all_gather_object(
                    templates, self._template, group=engine.aux_group
                )
                if self._template is None:
                    self._template = next(t for t in templates if t is not None)
            if batch is None:
                batch = self._template
            tracker.offer(n_global)
            yield batch

    def get_numpy_iterator(self):
        for batch in self.agreed_batches():
            yield tree.map_structure(
                lambda t: None if t is None else np.asarray(t.cpu()),
                batch,
                none_is_leaf=True,
            )

    def get_torch_dataloader(self):
        return torch.utils.data.DataLoader(
            _AgreedIterable(self), batch_size=None
        )

    def get_tf_dataset(self):
        raise NotImplementedError("AgreedAdapter is for the torch backend.")

    def get_jax_iterator(self, super_batch=None):
        raise NotImplementedError("AgreedAdapter is for the torch backend.")


# -- rewriting the arguments of fit/evaluate/predict --------------------------
def prepare_arguments(engine, name, method, args, kwargs):
    """Applies the shard policy to the input arguments of `name`.

    `core.policies.prepare_arguments` with this rank's `AgreedAdapter`.

    Returns:
        The new ``(args, kwargs)``.
    """
    return policies.prepare_arguments(
        name,
        method,
        args,
        kwargs,
        engine.input_options.shard_policy,
        engine.rank,
        engine.world_size,
        lambda inner, what: AgreedAdapter(engine, inner, what),
        engine.runtime,
    )


def distribute_dataset(dataset, rank, world_size):
    """`core.inputs.DistributedDataset`: this rank's part of every batch."""

    def place(parts):
        return tree.map_structure(
            lambda x: None if x is None else torch.as_tensor(x),
            parts[0],
            none_is_leaf=True,
        )

    return DistributedDataset(dataset, world_size, [rank], place)

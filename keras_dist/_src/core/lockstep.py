"""Global batches from every process's local batches, in lockstep.

Under shard policies FILE and OFF (`core.policies`) each process reads its
own share and processes may hold different numbers of batches. On JAX and
TensorFlow the replicated step wants the global batch on every process (as
under DATA), so `GatheredAdapter` assembles it: before each step the
processes gather how many samples each holds; when none has a batch the
iteration ends on every process at once. Each local batch is padded to the
largest, gathered with the backend's collective, and the padding dropped,
so step ``k``'s global batch is every process's ``k``-th local batch in
process order (a process that ran out adds nothing). torch steps on local
batches instead (`backends/torch/inputs.AgreedAdapter`).
"""

from __future__ import annotations

import base64
import pickle

import numpy as np
from keras import tree

from keras_dist._src.core.policies import num_samples
from keras_dist._src.keras_glue import internals as glue


def _as_numpy(batch):
    return tree.map_structure(
        lambda x: None if x is None else np.asarray(x), batch, none_is_leaf=True
    )


def _pad(batch, rows: int):
    """`batch` with `rows` zero samples appended to every leaf."""

    def pad(x):
        if x is None or rows == 0:
            return x
        return np.concatenate([x, np.zeros((rows,) + x.shape[1:], x.dtype)])

    return tree.map_structure(pad, batch, none_is_leaf=True)


def _empty_like(batch):
    return tree.map_structure(
        lambda x: None if x is None else x[:0], batch, none_is_leaf=True
    )


class LockstepAdapter(glue.DataAdapter):
    """Base of the adapters that keep processes in step over their shares.

    Holds Keras's adapter of this process's share (`inner`) and the batch
    count the processes agreed on (the largest, or None when any is
    unknown); subclasses yield the batches. torch's `AgreedAdapter` and
    `GatheredAdapter` below build on it.

    Args:
        inner: the Keras `DataAdapter` of this process's share.
        what: what the input is for, used in error messages.
        num_batches: the agreed number of batches, or None.
    """

    def __init__(self, inner, what: str, num_batches):
        self.inner = inner
        self.what = what
        self._num_batches = num_batches

    @property
    def num_batches(self):
        return self._num_batches

    @property
    def batch_size(self):
        return self.inner.batch_size

    @property
    def has_partial_batch(self):
        return None

    @property
    def partial_batch_size(self):
        return None

    def on_epoch_begin(self):
        self.inner.on_epoch_begin()

    def on_epoch_end(self):
        self.inner.on_epoch_end()


def agreed_num_batches(counts) -> int | None:
    """The batch count of processes whose shares hold `counts` batches
    (None where unknown): the largest, or None if any is unknown."""
    counts = list(counts)
    return None if None in counts else max(counts)


class GatheredAdapter(LockstepAdapter):
    """A Keras data adapter yielding global batches built from every
    process's local batches (see the module docstring).

    Args:
        inner: the Keras `DataAdapter` of this process's share.
        what: what the input is for, used in error messages.
        runtime: the job's Runtime (gives a process that has had no batch
            the others' structure).
        gather: the backend's collective: takes a list of NumPy arrays of
            the same shapes on every process and returns every process's
            list, in process order.
    """

    def __init__(self, inner, what: str, runtime, gather):
        count = inner.num_batches
        known = [
            p[0] for p in gather([np.array([count is not None, count or 0])])
        ]
        super().__init__(
            inner,
            what,
            agreed_num_batches(int(n) if k else None for k, n in known),
        )
        self.runtime = runtime
        self.gather = gather
        self._template = None

    def _global_batches(self):
        iterator = iter(self.inner.get_numpy_iterator())
        exhausted, first = False, True
        while True:
            batch = None
            if not exhausted:
                try:
                    batch = _as_numpy(next(iterator))
                except StopIteration:
                    exhausted = True
            if batch is not None and self._template is None:
                self._template = _empty_like(batch)
            n_local = 0 if batch is None else num_samples(batch)
            state = np.array([n_local, self._template is None], np.int64)
            sizes, lacking = np.stack([p[0] for p in self.gather([state])]).T
            if not sizes.any():
                if first:
                    raise ValueError(
                        f"The input of {self.what} yielded no batch on any "
                        "worker (an empty data set). Pass at least one "
                        "sample."
                    )
                return
            first = False
            if lacking.any():
                self._share_template()
            local = self._template if batch is None else batch
            padded = _pad(local, int(sizes.max()) - n_local)
            leaves = tree.flatten(padded)
            arrays = [x for x in leaves if x is not None]
            parts = self.gather(arrays)
            joined = iter(
                np.concatenate([p[i][:n] for p, n in zip(parts, sizes)])
                for i in range(len(arrays))
            )
            yield tree.pack_sequence_as(
                padded, [None if x is None else next(joined) for x in leaves]
            )

    def _share_template(self):
        """Gives a process that has had no batch the others' structure."""
        mine = "" if self._template is None else _encode(self._template)
        theirs = [t for t in self.runtime.all_gather(mine) if t]
        if self._template is None:
            self._template = pickle.loads(base64.b64decode(theirs[0]))

    def get_numpy_iterator(self):
        """Yields the global batches (NumPy), the same on every process."""
        return self._global_batches()

    def get_jax_iterator(self, super_batch=None):
        """Yields the global batches (NumPy; the engine places them),
        grouped by `super_batch` as Keras asks (Keras 3.16 and later)."""
        if super_batch:
            return glue.stack_steps(self._global_batches(), super_batch)
        return self._global_batches()

    def get_tf_dataset(self):
        """The global batches as a `tf.data.Dataset` (from a generator)."""
        import tensorflow as tf

        spec = self.inner.get_tf_dataset().element_spec

        def unbatched(s):
            return tf.TensorSpec([None, *s.shape[1:]], s.dtype)

        return tf.data.Dataset.from_generator(
            self._global_batches,
            output_signature=tree.map_structure(unbatched, spec),
        )

    def get_torch_dataloader(self):
        raise NotImplementedError(
            "GatheredAdapter is for JAX and TensorFlow; torch steps on local "
            "batches (AgreedAdapter)."
        )


def _encode(template) -> str:
    return base64.b64encode(pickle.dumps(template)).decode("ascii")

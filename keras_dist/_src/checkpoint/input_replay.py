"""A resumed run's input draws the interrupted epoch's shuffle.

Two inputs draw their order from random state of their own, which the
restored global generators (`state.capture_rng`) do not cover:

* a `tf.data` shuffle with ``reshuffle_each_iteration=True`` (its default)
  draws a new order each time an iterator is made from the dataset, and
  Keras makes one or two each epoch. A resumed run re-creates the dataset,
  so its first iterator would draw the *first* epoch's order again.
  Instead, a backup records how many iterators `fit` had made of its input
  when the saved epoch began, and the resumed run makes (and drops) as
  many before the resumed epoch's own: making one reads nothing, and the
  dataset's seeds then stand where the interrupted run's stood;
* a torch `DataLoader` given a ``generator=`` of its own draws its shuffle
  (and its workers' base seed) from that generator: a backup holds its
  state when the saved epoch began, and the resumed run sets it back;
* arrays (NumPy, tensors) under Keras 3.16 and later: Keras's adapter
  draws each epoch's shuffle from a count of the epochs it has seen (not
  from the global generators), which starts again at each `fit`: a backup
  holds the count when the saved epoch began, and the resumed run sets it
  back.

The iterators are counted where they are made, which differs:

* Keras on TensorFlow makes one at once each time its epoch iterator asks
  for one: when an epoch begins, and again when it ends if the number of
  batches is known;
* under a keras_dist strategy on TensorFlow the distributed input makes
  them at their first use and counts them itself (`iterators_made`);
* on JAX and torch the epoch iterator gets a generator that makes the
  dataset's iterator when the epoch reads its first batch: one an epoch.

Only where Keras makes a new iterator each epoch (no ``steps_per_epoch``):
a stream read across epochs is the user's to position.
"""

from __future__ import annotations

import sys

import numpy as np

from keras_dist._src import backends as backend_lib
from keras_dist._src.keras_glue import internals as glue


class InputPosition:
    """Where one `fit`'s input stands in its random orders.

    Args:
        epoch_iterator: the Keras `EpochIterator` of the running `fit`
            (None: nothing to follow).
    """

    def __init__(self, epoch_iterator):
        self.backend = backend_lib.name()  # recorded: counts stay per backend
        self._native_tf_data = backend_lib.capabilities().native_tf_data
        self.at_epoch_begin = 0
        self._made = 0  # where this object counts
        self._lazy = None  # keras_dist's distributed input, which counts
        self._per_epoch = False
        self._make = None  # makes (and drops) one tf.data iterator
        self._generators = []  # torch generators of DataLoaders
        self._states_at_epoch_begin = {}
        self._counters = []  # adapters counting epochs (Keras 3.16+)
        self._counts_at_epoch_begin = []
        if epoch_iterator is None or getattr(
            epoch_iterator, "steps_per_epoch", None
        ):
            return
        self._counters = glue.input_epoch_counters(epoch_iterator)
        sources = glue.epoch_iterator_inputs(epoch_iterator)
        self._generators = _loader_generators(sources)
        datasets = [s for s in sources if glue.is_tf_dataset(s)]
        if datasets:
            self._follow_dataset(epoch_iterator, datasets[0])

    def _follow_dataset(self, epoch_iterator, dataset) -> None:
        if not self._native_tf_data:
            self._per_epoch = True
            self._make = lambda: iter(dataset)
            return
        request = glue.input_request(epoch_iterator)
        source = request()  # what Keras iterates, the same each epoch
        if hasattr(source, "iterators_made"):
            self._lazy = source
            self._make = source.make_iterator
        else:
            glue.count_input_iterators(epoch_iterator, self._made_one)
            self._make = lambda: iter(request())

    def _made_one(self) -> None:
        self._made += 1

    @property
    def made(self) -> int:
        """tf.data iterators made so far, as in an uninterrupted run."""
        if self._lazy is not None:
            return int(self._lazy.iterators_made)
        return self._made

    def _generator_states(self) -> dict:
        return {
            str(i): g.get_state().numpy().copy()
            for i, g in enumerate(self._generators)
        }

    def epoch_begins(self) -> None:
        """Called when an epoch begins (before Keras makes its iterator)."""
        self.at_epoch_begin = self.made
        if self._per_epoch:
            self._made += 1  # the epoch's generator makes one when read
        self._states_at_epoch_begin = self._generator_states()
        self._counts_at_epoch_begin = self._counts()

    def _counts(self) -> list:
        return [glue.input_epoch(a) for a in self._counters]

    def saved(self, mid_epoch: bool):
        """What a backup records, as of the saved epoch's start
        (`mid_epoch`) or of now (at an epoch's end, the next one's start):
        the tf.data count (a dict; None without a tf.data input) and the
        DataLoaders' generator states (arrays by index)."""
        if mid_epoch:
            made, states = self.at_epoch_begin, self._states_at_epoch_begin
            counts = self._counts_at_epoch_begin
        else:
            made, states = self.made, self._generator_states()
            counts = self._counts()
        count = None
        if self._make is not None:
            count = {"backend": self.backend, "made": made}
        if counts:
            count = {"backend": self.backend, **(count or {})}
            count["adapter_epochs"] = list(counts)
        return count, dict(states)

    def replay(self, saved, arrays) -> None:
        """Before the resumed epoch begins: makes the tf.data iterators the
        interrupted run had made (`saved`: the count of `InputPosition.saved`;
        none across backends, a different computation anyway) and sets
        the DataLoaders' generators to their saved states (`arrays`)."""
        counts = (saved or {}).get("adapter_epochs")
        if counts and len(counts) == len(self._counters):
            for adapter, count in zip(self._counters, counts):
                glue.set_input_epoch(adapter, count)
        if self._make is not None and saved:
            if saved.get("backend") == self.backend:
                target = int(saved.get("made", 0))
                while self.made < target:
                    self._make()
                    if self._lazy is None:
                        self._made += 1
        if self._generators and arrays:
            import torch

            for i, generator in enumerate(self._generators):
                if str(i) in arrays:
                    state = np.ascontiguousarray(arrays[str(i)], np.uint8)
                    generator.set_state(torch.from_numpy(state))


def _loader_generators(sources) -> list:
    """The distinct torch generators of the `DataLoader`s in `sources`
    (its own, its sampler's), in a fixed order."""
    torch = sys.modules.get("torch")
    if torch is None:
        return []
    found = []
    for source in sources:
        if not isinstance(source, torch.utils.data.DataLoader):
            continue
        batch_sampler = getattr(source, "batch_sampler", None)
        for owner in (
            source,
            getattr(source, "sampler", None),
            getattr(batch_sampler, "sampler", None),
        ):
            generator = getattr(owner, "generator", None)
            if isinstance(generator, torch.Generator) and not any(
                generator is g for g in found
            ):
                found.append(generator)
    return found

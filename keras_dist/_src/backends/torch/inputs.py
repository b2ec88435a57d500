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

import inspect
import re

import keras
import numpy as np
import torch
import torch.distributed as dist
from keras import tree

from keras_dist._src.cluster import supervision
from keras_dist._src.core.inputs import DistributedDataset
from keras_dist._src.core.shards import shard_size
from keras_dist._src.keras_glue import internals as glue
from keras_dist._src.options import ShardPolicy

_FILE_READERS = re.compile(
    rb"TFRecordDataset|TextLineDataset|FixedLengthRecordDataset"
)
_logged: set = set()


def _log_once(message: str) -> None:
    if message not in _logged:
        _logged.add(message)
        if not dist.is_initialized() or dist.get_rank() == 0:  # chief only
            supervision.log(message)


# -- classification -----------------------------------------------------------
def is_tf_dataset(x) -> bool:
    """Whether `x` is a `tf.data.Dataset` (without importing TensorFlow)."""
    return glue.is_tf_dataset(x)


def is_file_dataset(dataset) -> bool:
    """Whether a `tf.data.Dataset` reads records from files."""
    import tensorflow as tf

    try:
        graph = tf.raw_ops.DatasetToGraphV2(
            input_dataset=dataset._variant_tensor
        )
    except Exception:  # noqa: BLE001 - not serialisable: not file-backed.
        return False
    return bool(_FILE_READERS.search(graph.numpy()))


def resolve_policy(policy: ShardPolicy, x) -> ShardPolicy:
    """Returns the policy applied to input `x` (``AUTO``/``FILE`` resolved).

    Args:
        policy: the strategy's `ShardPolicy`.
        x: the ``x`` argument of `fit`/`evaluate`/`predict`.
    """
    if policy in (ShardPolicy.DATA, ShardPolicy.OFF):
        return policy
    file_backed = is_tf_dataset(x) and is_file_dataset(x)
    if file_backed:
        if policy is ShardPolicy.AUTO:
            _log_once(
                "ShardPolicy.AUTO: the tf.data.Dataset reads files, so each "
                "rank reads its own files (FILE)."
            )
        return ShardPolicy.FILE
    if policy is ShardPolicy.FILE:
        _log_once(
            f"ShardPolicy.FILE: the input ({type(x).__name__}) is not a "
            "file-backed tf.data.Dataset; falling back to DATA (every rank "
            "reads all of it and keeps its part of each global batch)."
        )
    elif policy is ShardPolicy.AUTO:
        _log_once(
            "ShardPolicy.AUTO: sharding the input by DATA (every rank reads "
            "all of it and keeps its part of each global batch)."
        )
    return ShardPolicy.DATA


def local_batch_size(global_batch: int, rank: int, world: int) -> int:
    """This rank's share of a global batch (``numpy.array_split`` sizes)."""
    return shard_size(int(global_batch), rank, world)


# -- agreement on the step count ----------------------------------------------
class LocalBatchTracker:
    """Tells the step that the batch it gets is local, and `n_global`."""

    def __init__(self):
        self.pending = None

    def offer(self, n_global: int) -> None:
        """Marks the next batch as local, with `n_global` samples in all."""
        self.pending = int(n_global)

    def take(self):
        """Returns `n_global` of the current local batch, or None (DATA)."""
        pending, self.pending = self.pending, None
        return pending


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


class AgreedAdapter(glue.DataAdapter):
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
        self.inner = inner
        self.what = what
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
        self._num_batches = int(most[1]) if int(flags[0]) == 1 else None

    def agreed_batches(self):
        """Yields this rank's batches (or empty ones) in lockstep."""
        engine = self.engine
        tracker = engine.local_batches
        tracker.pending = None
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
                tracker.pending = None
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

    def get_jax_iterator(self):
        raise NotImplementedError("AgreedAdapter is for the torch backend.")

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


# -- rewriting the arguments of fit/evaluate/predict --------------------------
def _global_batch_size(dataset):
    """The global batch of a batched `tf.data.Dataset`.

    The static batch size tf.distribute computes from the dataset's graph;
    else the size of its first batch.
    """
    from tensorflow.python.data.experimental.ops import distribute

    try:
        size = int(distribute.compute_batch_size(dataset))
    except Exception:  # noqa: BLE001 - not computable statically.
        size = -1
    if size > 0:
        return size
    for batch in dataset.take(1):
        return _num_samples(batch)
    return 1


def _file_shard(engine, dataset):
    from tensorflow.python.distribute import input_ops

    world, rank = engine.world_size, engine.rank
    global_batch = _global_batch_size(dataset)
    sharded = input_ops.auto_shard_dataset(dataset, world, rank, world)
    local = local_batch_size(global_batch, rank, world)
    if local == 0:
        raise ValueError(
            f"ShardPolicy.FILE: the global batch ({global_batch}) is smaller "
            f"than the number of ranks ({world}). Batch the dataset with at "
            "least one sample per rank."
        )
    return sharded.rebatch(local)


def _local_input(engine, policy, x, y, sample_weight, batch_size, what, **kw):
    """Returns an `AgreedAdapter` over this rank's input under `policy`."""
    if policy is ShardPolicy.FILE:
        # Keras ignores `batch_size` for datasets: they are batched.
        x = _file_shard(engine, x)
    elif glue.can_convert_arrays((x, y, sample_weight)):
        global_batch = batch_size or 32
        batch_size = local_batch_size(
            global_batch, engine.rank, engine.world_size
        )
        if batch_size == 0:
            raise ValueError(
                f"ShardPolicy.OFF: batch_size={global_batch} is the global "
                f"batch and must be at least the number of ranks "
                f"({engine.world_size}). Pass a larger batch_size."
            )
    inner = glue.get_data_adapter(
        x=x,
        y=y,
        sample_weight=sample_weight,
        batch_size=batch_size,
        **kw,
    )
    return AgreedAdapter(engine, inner, what)


def prepare_arguments(engine, name, method, args, kwargs):
    """Applies the shard policy to the input arguments of `name`.

    For ``FILE``/``OFF``, replaces ``x`` (and ``validation_data``) with an
    `AgreedAdapter` over this rank's share; ``DATA`` input is passed through
    unchanged. (The input was checked before, by
    `keras_dist._src.core.inputs.check_call_inputs`.)

    Args:
        engine: the rank's `MirroredEngine`.
        name: ``"fit"``, ``"evaluate"`` or ``"predict"``.
        method: the model's bound method (for its signature).
        args: positional arguments of the call.
        kwargs: keyword arguments of the call.

    Returns:
        The new ``(args, kwargs)``.
    """
    options = getattr(engine, "input_options", None)
    base = options.shard_policy if options is not None else ShardPolicy.DATA
    signature = inspect.signature(method)
    bound = signature.bind(*args, **kwargs)
    arguments = bound.arguments
    x = arguments.get("x")
    y = arguments.get("y")
    sample_weight = arguments.get("sample_weight")
    if isinstance(x, glue.DataAdapter):
        return args, kwargs
    policy = resolve_policy(base, x)
    if policy is not ShardPolicy.DATA:
        if name == "fit":
            extra = {
                "shuffle": arguments.get("shuffle", True),
                "class_weight": arguments.get("class_weight"),
                "steps_per_epoch": arguments.get("steps_per_epoch"),
            }
        else:
            extra = {"steps_per_epoch": arguments.get("steps")}
        arguments["x"] = _local_input(
            engine,
            policy,
            x,
            y,
            sample_weight,
            arguments.get("batch_size"),
            name,
            **extra,
        )
        for key in ("y", "sample_weight", "class_weight"):
            if key in arguments and arguments[key] is not None:
                arguments[key] = None
    validation = arguments.get("validation_data") if name == "fit" else None
    if validation is not None and not isinstance(validation, glue.DataAdapter):
        vx, vy, vw = keras.utils.unpack_x_y_sample_weight(validation)
        vpolicy = resolve_policy(base, vx)
        if vpolicy is not ShardPolicy.DATA:
            arguments["validation_data"] = _local_input(
                engine,
                vpolicy,
                vx,
                vy,
                vw,
                arguments.get("validation_batch_size")
                or arguments.get("batch_size"),
                "validation_data",
                steps_per_epoch=arguments.get("validation_steps"),
            )
    return bound.args, bound.kwargs


def distribute_dataset(dataset, rank, world_size):
    """`core.inputs.DistributedDataset`: this rank's part of every batch."""

    def place(parts):
        return tree.map_structure(
            lambda x: None if x is None else torch.as_tensor(x),
            parts[0],
            none_is_leaf=True,
        )

    return DistributedDataset(dataset, world_size, [rank], place)

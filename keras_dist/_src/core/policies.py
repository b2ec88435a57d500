"""Shard policies between processes (`keras_dist.ShardPolicy`), once.

What each process is given for `fit`/`evaluate`/`predict`:

* ``DATA``: the input is left as it is. Every process iterates the same
  global batches (shuffling follows the chief's generator states) and keeps
  its part of each one; nothing here is involved.
* ``FILE``: a file-backed `tf.data.Dataset` (batched with the global batch
  size B) is sharded by files with tf.distribute's own
  ``input_ops.auto_shard_dataset`` and re-batched to this process's share of
  B (``numpy.array_split`` sizes). Any other input falls back to ``DATA``
  (logged once).
* ``OFF``: each process's input is its own share of the data. Arrays are
  batched with this process's share of ``batch_size`` (the global batch B:
  process r gets ``B // W + (r < B % W)``); already batched inputs
  (datasets, generators, `DataLoader`, `PyDataset`) must yield local
  batches.
* ``AUTO``: ``FILE`` for a file-backed `tf.data.Dataset`, else ``DATA``
  (logged once).

With ``FILE`` and ``OFF`` each process's batches are local and processes may
hold different numbers of them. `prepare_arguments` builds Keras's own data
adapter over this process's share and hands it to the backend's `wrap`,
which keeps the processes in lockstep (torch: `AgreedAdapter`, every rank
steps on its local batch; JAX: `GatheredAdapter`, the local batches are
gathered into the global one). Step ``k``'s global batch is every process's
``k``-th local batch, in process order.
"""

from __future__ import annotations

import inspect
import re

import keras

from keras_dist._src.cluster import supervision
from keras_dist._src.core.shards import shard_size
from keras_dist._src.keras_glue import internals as glue
from keras_dist._src.options import ShardPolicy

_FILE_READERS = re.compile(
    rb"TFRecordDataset|TextLineDataset|FixedLengthRecordDataset"
)
_logged: set = set()


def _log_once(message: str, is_chief: bool) -> None:
    if message not in _logged:
        _logged.add(message)
        if is_chief:
            supervision.log(message)


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


def resolve_policy(policy: ShardPolicy, x, is_chief: bool = True):
    """Returns the policy applied to input `x` (``AUTO``/``FILE`` resolved).

    Args:
        policy: the strategy's `ShardPolicy`.
        x: the ``x`` argument of `fit`/`evaluate`/`predict`.
        is_chief: whether this process logs the choice.
    """
    if policy in (ShardPolicy.DATA, ShardPolicy.OFF):
        return policy
    if glue.is_tf_dataset(x) and is_file_dataset(x):
        if policy is ShardPolicy.AUTO:
            _log_once(
                "ShardPolicy.AUTO: the tf.data.Dataset reads files, so each "
                "rank reads its own files (FILE).",
                is_chief,
            )
        return ShardPolicy.FILE
    if policy is ShardPolicy.FILE:
        _log_once(
            f"ShardPolicy.FILE: the input ({type(x).__name__}) is not a "
            "file-backed tf.data.Dataset; falling back to DATA (every rank "
            "reads all of it and keeps its part of each global batch).",
            is_chief,
        )
    elif policy is ShardPolicy.AUTO:
        _log_once(
            "ShardPolicy.AUTO: sharding the input by DATA (every rank reads "
            "all of it and keeps its part of each global batch).",
            is_chief,
        )
    return ShardPolicy.DATA


def local_batch_size(global_batch: int, rank: int, world: int) -> int:
    """This process's share of a global batch (``numpy.array_split`` sizes)."""
    return shard_size(int(global_batch), rank, world)


def num_samples(batch) -> int:
    """Samples in a (nested) batch: the first dimension of its first leaf."""
    from keras import tree

    leaves = [t for t in tree.flatten(batch) if t is not None]
    return int(leaves[0].shape[0]) if leaves else 0


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
        return num_samples(batch)
    return 1


def _file_shard(dataset, rank, world):
    from tensorflow.python.distribute import input_ops

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


def _local_input(
    policy, x, y, sample_weight, batch_size, what, rank, world, wrap, **kw
):
    """Returns `wrap(adapter, what)` over this process's input."""
    if policy is ShardPolicy.FILE:
        # Keras ignores `batch_size` for datasets: they are batched.
        x = _file_shard(x, rank, world)
    elif glue.can_convert_arrays((x, y, sample_weight)):
        global_batch = batch_size or 32
        batch_size = local_batch_size(global_batch, rank, world)
        if batch_size == 0:
            raise ValueError(
                f"ShardPolicy.OFF: batch_size={global_batch} is the global "
                f"batch and must be at least the number of ranks ({world}). "
                "Pass a larger batch_size."
            )
    inner = glue.get_data_adapter(
        x=x,
        y=y,
        sample_weight=sample_weight,
        batch_size=batch_size,
        **kw,
    )
    return wrap(inner, what)


def prepare_worker_call(engine, name, method, args, kwargs, wrap):
    """`prepare_arguments` for a multi-worker engine: its strategy's
    `InputOptions` (``engine.input_options``) and its Runtime's rank and
    world size (``engine.runtime``)."""
    return prepare_arguments(
        name,
        method,
        args,
        kwargs,
        engine.input_options.shard_policy,
        engine.runtime.rank,
        engine.runtime.world_size,
        wrap,
    )


def prepare_arguments(name, method, args, kwargs, policy, rank, world, wrap):
    """Applies the shard policy to the input arguments of `name`.

    For ``FILE``/``OFF``, replaces ``x`` (and ``validation_data``) with
    ``wrap(adapter, what)``, where `adapter` is Keras's data adapter over
    this process's share; ``DATA`` input is passed through unchanged. (The
    input was checked before, by `core.inputs.check_call_inputs`.)

    Args:
        name: ``"fit"``, ``"evaluate"`` or ``"predict"``.
        method: the model's bound method (for its signature).
        args: positional arguments of the call.
        kwargs: keyword arguments of the call.
        policy: the strategy's `ShardPolicy`.
        rank: this process's index.
        world: the number of processes.
        wrap: the backend's lockstep adapter: ``wrap(inner, what)``.

    Returns:
        The new ``(args, kwargs)``.
    """
    bound = inspect.signature(method).bind(*args, **kwargs)
    arguments = bound.arguments
    x = arguments.get("x")
    if isinstance(x, glue.DataAdapter):
        return args, kwargs
    where = dict(rank=rank, world=world, wrap=wrap)
    chief = rank == 0
    x_policy = resolve_policy(policy, x, chief)
    if x_policy is not ShardPolicy.DATA:
        if name == "fit":
            extra = {
                "shuffle": arguments.get("shuffle", True),
                "class_weight": arguments.get("class_weight"),
                "steps_per_epoch": arguments.get("steps_per_epoch"),
            }
        else:
            extra = {"steps_per_epoch": arguments.get("steps")}
        arguments["x"] = _local_input(
            x_policy,
            x,
            arguments.get("y"),
            arguments.get("sample_weight"),
            arguments.get("batch_size"),
            name,
            **where,
            **extra,
        )
        for key in ("y", "sample_weight", "class_weight"):
            if key in arguments and arguments[key] is not None:
                arguments[key] = None
    validation = arguments.get("validation_data") if name == "fit" else None
    if validation is not None and not isinstance(validation, glue.DataAdapter):
        vx, vy, vw = keras.utils.unpack_x_y_sample_weight(validation)
        v_policy = resolve_policy(policy, vx, chief)
        if v_policy is not ShardPolicy.DATA:
            arguments["validation_data"] = _local_input(
                v_policy,
                vx,
                vy,
                vw,
                arguments.get("validation_batch_size")
                or arguments.get("batch_size"),
                "validation_data",
                steps_per_epoch=arguments.get("validation_steps"),
                **where,
            )
    return bound.args, bound.kwargs

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

import hashlib
import inspect
import re
import warnings
import weakref

import keras
import numpy as np
from keras import tree

from keras_dist._src import output
from keras_dist._src.core.shards import shard_size
from keras_dist._src.keras_glue import internals as glue
from keras_dist._src.options import ShardPolicy

_FILE_READERS = re.compile(
    rb"TFRecordDataset|TextLineDataset|FixedLengthRecordDataset"
)
_logged: set = set()


def _log_once(message: str, is_chief: bool, level: str = "debug") -> None:
    """Logs `message` once per process, from the chief: at DEBUG what
    keras_dist chose by itself (``KERAS_DIST_VERBOSE=2`` shows it), at
    WARNING what differs from what the user asked for."""
    if message not in _logged:
        _logged.add(message)
        if is_chief:
            getattr(output.logger(), level)(message)


def _serialized_graph(dataset) -> bytes | None:
    """`dataset`'s graph, serialized (a GraphDef), or None when it cannot
    be serialized."""
    import tensorflow as tf

    try:
        return tf.raw_ops.DatasetToGraphV2(
            input_dataset=dataset._variant_tensor
        ).numpy()
    except Exception:  # noqa: BLE001 - TF raises its own error types
        return None


def is_file_dataset(dataset) -> bool:
    """Whether a `tf.data.Dataset` reads records from files."""
    serialized = _serialized_graph(dataset)
    return serialized is not None and bool(_FILE_READERS.search(serialized))


_SHUFFLES = re.compile(r"^Shuffle(AndRepeat)?Dataset(V\d)?$")
#: dataset -> the dataset `agree_on_order` gave for it: its rebuild (whose
#: shuffles then reshuffle on from one call to the next), or `_ITSELF` (a
#: value that refers to the key would keep it alive for ever).
_AGREED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_ITSELF = object()


def _dataset_graph(dataset):
    """`dataset`'s graph as a GraphDef, or None."""
    import tensorflow as tf

    serialized = _serialized_graph(dataset)
    if serialized is None:
        return None
    graph = tf.compat.v1.GraphDef()
    graph.ParseFromString(serialized)
    return graph


def _shuffle_seed_nodes(graph) -> list:
    """``(seed Const node or None, seed2 Const node or None, shuffle node,
    nodes by name)`` for every shuffle of `graph` and its functions, in
    graph order."""
    bodies = [list(graph.node)]
    bodies += [list(f.node_def) for f in graph.library.function]
    found = []
    for nodes in bodies:
        by_name = {node.name: node for node in nodes}
        for node in nodes:
            if _SHUFFLES.match(node.op) and len(node.input) >= 4:
                consts = []
                for name in node.input[2:4]:
                    source = by_name.get(name.lstrip("^").split(":")[0])
                    ok = source is not None and source.op == "Const"
                    ok = ok and len(source.attr["value"].tensor.int64_val) == 1
                    consts.append(source if ok else None)
                found.append((*consts, node, by_name))
    return found


def _seeds_of(graph) -> list:
    """The ``[seed, seed2]`` of every shuffle in a dataset's GraphDef and
    its functions, in graph order (a seed that is not a constant is -1;
    None, a graph that could not be read: empty). ``[0, 0]`` is a shuffle
    without a seed (neither its own nor TensorFlow's global one): it draws
    a new order in every process."""
    if graph is None:
        return []
    return [
        [-1 if c is None else int(c.attr["value"].tensor.int64_val[0])
         for c in (seed, seed2)]
        for seed, seed2, _, _ in _shuffle_seed_nodes(graph)
    ]  # fmt: skip


def _reseeded(dataset, graph, seeds):
    """`dataset` rebuilt from its GraphDef `graph` (changed in place) with
    its shuffles' seeds set to `seeds` (pairs, in `_seeds_of`' order),
    each with a seed generator of its own made from them (as
    ``Dataset.shuffle`` makes one)."""
    import tensorflow as tf

    for (seed, seed2, node, by_name), pair in zip(
        _shuffle_seed_nodes(graph), seeds
    ):
        for const, value in zip((seed, seed2), pair):
            const.attr["value"].tensor.int64_val[0] = int(value)
        if len(node.input) > 4:
            # An eager shuffle's serialized seed generator is a handle to
            # this process's own resource: a new one, from the new seeds.
            source = by_name.get(node.input[4].lstrip("^").split(":")[0])
            if source is not None and source.op == "Const":
                source.op = "DummySeedGenerator"
                source.ClearField("attr")
    variant = tf.raw_ops.DatasetFromGraph(graph_def=graph.SerializeToString())
    return tf.data.experimental.from_variant(variant, dataset.element_spec)


def agree_on_order(dataset, what: str, runtime):
    """`dataset`, shuffling in the same order on every process.

    With ``DATA`` each process reads the whole dataset and keeps its part
    of every global batch, so processes whose orders differ assemble
    batches no device would see: an epoch uses some samples twice and
    others never. That is what a ``Dataset.shuffle`` without a seed does
    (the official multi-worker tutorials' datasets), and one seeded
    differently on each process. Such a dataset is rebuilt on every
    process from its graph with the chief's seeds (a shuffle the chief
    made without one gets a pair drawn now, at random); a dataset whose
    shuffles already agree is returned as it is. The outcome is kept for
    the dataset's next calls (when every process has it). Collective.

    Raises:
        ValueError: on every process, when the processes' datasets have
            different numbers of shuffles or seeds that are not constants,
            or the graph cannot be rebuilt; the message says what to do.
    """
    import random
    import zlib

    import numpy as np

    known = _AGREED.get(dataset)
    hits = runtime.all_gather(np.asarray([known is not None], np.int64))
    if all(int(hit[0]) for hit in hits):
        return dataset if known is _ITSELF else known
    graph = _dataset_graph(dataset)
    seeds = _seeds_of(graph)
    unseeded = any(pair == [0, 0] for pair in seeds)
    unknown = any(-1 in pair for pair in seeds)
    summary = [zlib.crc32(repr(seeds).encode()), len(seeds)]
    summary += [int(unseeded), int(unknown)]
    everyone = runtime.all_gather(np.asarray(summary, np.int64))
    digests = {int(v[0]) for v in everyone}
    if len(digests) == 1 and not any(int(v[2]) for v in everyone):
        _AGREED[dataset] = _ITSELF
        return dataset
    advice = (
        "Give `Dataset.shuffle` the same `seed=` on every process, or call "
        "`keras.utils.set_random_seed(s)` with the same s on every process "
        "before building the dataset; or give each process its own data "
        "with `InputOptions(ShardPolicy.OFF)` (FILE for files)."
    )
    counts = {int(v[1]) for v in everyone}
    if len(counts) > 1 or any(int(v[3]) for v in everyone):
        raise ValueError(
            f"The tf.data.Dataset passed as {what} shuffles differently on "
            "different processes, and keras_dist cannot give them one order "
            "(the processes' datasets differ, or a shuffle's seed is not a "
            "constant). Each process reads the whole dataset "
            "(ShardPolicy.DATA) and keeps its part of every global batch, "
            "so the processes would assemble batches no device would see. "
            + advice
        )
    draw = random.SystemRandom()
    mine = np.asarray(
        [
            pair if pair != [0, 0] else [draw.randrange(1, 2**31)] * 2
            for pair in seeds
        ],
        np.int64,
    ).reshape(-1, 2)
    chosen = runtime.broadcast(mine, 0)
    try:
        rebuilt = _reseeded(dataset, graph, chosen.tolist())
        failure = ""
    except Exception as error:  # noqa: BLE001 - reported on every process
        rebuilt, failure = None, f"{type(error).__name__}: {error}"
    failures = runtime.all_gather(failure)
    failed = next((f for f in failures if f), "")
    if failed:
        raise ValueError(
            f"The tf.data.Dataset passed as {what} shuffles differently on "
            "different processes, and rebuilding it with the chief's seeds "
            f"failed ({failed}). " + advice
        )
    # Keras's fit hands the rebuilt validation dataset to its nested
    # evaluate calls: known there too.
    _AGREED[dataset] = rebuilt
    _AGREED[rebuilt] = _ITSELF
    return rebuilt


def _fingerprint(arrays) -> np.ndarray:
    """A digest of the shapes, dtypes and a strided sample of the values
    of `arrays` (about 4096 values each: cheap on large inputs)."""
    digest = hashlib.sha1()
    for a in tree.flatten(arrays):
        if a is None:
            continue
        a = np.asarray(a)
        digest.update(repr((a.shape, a.dtype.str)).encode())
        flat = a.reshape(-1)
        if flat.dtype == object:
            continue
        sample = flat[:: max(1, flat.size // 4096)]
        digest.update(np.ascontiguousarray(sample).tobytes())
    return np.frombuffer(digest.digest(), np.uint8).copy()


def warn_if_arrays_differ(name: str, arguments: dict, runtime) -> None:
    """Warns (on the chief) when the processes pass different arrays to
    `name` under ``ShardPolicy.DATA``, where each process takes its rows
    of one global array: data made before the strategy from an unseeded
    generator differs between processes (on torch the script runs once
    per device), and the job would train on a mix of them, silently. One
    small all-gather a call; nothing for input that is not arrays."""
    inputs = tuple(arguments.get(k) for k in ("x", "y", "sample_weight"))
    try:
        if not glue.can_convert_arrays(inputs):
            return
        mine = _fingerprint(inputs)
    except (TypeError, ValueError):
        return
    gathered = runtime.all_gather(mine)
    differ = [
        r
        for r, theirs in enumerate(gathered)
        if not np.array_equal(theirs, mine)
    ]
    if differ and runtime.is_chief:
        warnings.warn(
            f"`{name}`: process(es) {differ} pass different arrays than "
            "process 0. Each process takes its rows of the same global "
            "array, so the job would train on a mix of different data. "
            "Make the data the same everywhere (seed the generator before "
            "making it: np.random.default_rng(0), or load it from a file), "
            "or give each process its own share with "
            "InputOptions(ShardPolicy.OFF).",
            stacklevel=4,
        )


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
                "the tf.data.Dataset reads files, so each process reads "
                "its own files (ShardPolicy.FILE).",
                is_chief,
            )
        return ShardPolicy.FILE
    if policy is ShardPolicy.FILE:
        _log_once(
            f"ShardPolicy.FILE asked, but the input ({type(x).__name__}) is "
            "not a file-backed tf.data.Dataset: each process reads all of "
            "it and keeps its own part of every global batch "
            "(ShardPolicy.DATA).",
            is_chief,
            "warning",
        )
    elif policy is ShardPolicy.AUTO:
        _log_once(
            "each process reads all of the input and keeps its own part of "
            "every global batch (ShardPolicy.DATA).",
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
    from keras_dist._src.framework_glue import tensorflow_private

    try:
        size = int(tensorflow_private.static_batch_size(dataset))
    except Exception:  # noqa: BLE001 - not computable statically.
        size = -1
    if size > 0:
        return size
    for batch in dataset.take(1):
        return num_samples(batch)
    return 1


def _file_shard(dataset, rank, world):
    from keras_dist._src.framework_glue import tensorflow_private

    global_batch = _global_batch_size(dataset)
    sharded = tensorflow_private.auto_shard_dataset(dataset, world, rank, world)
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
        engine.runtime,
    )


def prepare_arguments(
    name, method, args, kwargs, policy, rank, world, wrap, runtime=None
):
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
        runtime: the processes' Runtime; with it, a `tf.data.Dataset` read
            by ``DATA`` shuffles alike on every process (`agree_on_order`).

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
    if x_policy is ShardPolicy.DATA and runtime is not None:
        if world > 1 and glue.is_tf_dataset(x):
            arguments["x"] = agree_on_order(x, "x", runtime)
        elif world > 1:
            warn_if_arrays_differ(name, arguments, runtime)
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
        if v_policy is ShardPolicy.DATA and runtime is not None:
            if world > 1 and glue.is_tf_dataset(validation):
                arguments["validation_data"] = agree_on_order(
                    validation, "validation_data", runtime
                )
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

"""The chief's `fit`/`evaluate`/`predict` under ParameterServerStrategy.

`fit` schedules Keras's own `train_step` on whichever worker is free
(`ClusterCoordinator.schedule`; `steps_per_execution` steps per closure)
and joins at the end of each epoch; batch callbacks are called at that
join point (``on_train_batch_begin(0)``
before the epoch's steps are scheduled, ``on_train_batch_end`` once, with
the last step's index and the epoch's logs), epoch callbacks as usual.
`evaluate` and `predict` run on the chief (Keras's `test_step` and
`predict_step` on the variables held by the ps tasks): exact.

Each worker reads its own part of the input (`_TrainInput`); a step's
batch is `batch_size` samples read by one worker (there is no global
batch across workers). `class_weight` and `validation_split` do what
Keras's `fit` does; a `BackupAndRestore` callback's restored epoch is
where `fit` starts.
"""

from __future__ import annotations

import functools
import math

import keras
import numpy as np
import tensorflow as tf
from keras import tree

from keras_dist._src.errors import KerasDistError
from keras_dist._src.keras_glue import internals as glue
from keras_dist._src.keras_glue.parameter_server import (
    make_metric_updates_atomic,
    make_updates_atomic,
)


def model_methods(engine, model) -> dict:
    """`fit`, `evaluate`, `predict` (and refusing `*_on_batch`) of `model`
    under `engine` (a `ParameterServerEngine`)."""
    loop = _Loop(engine, model)

    def refuse(name):
        def method(*args, **kwargs):
            raise NotImplementedError(
                f"`model.{name}` is not available under "
                "ParameterServerStrategy: use `fit` (which schedules steps "
                "on the workers), `evaluate` or `predict`."
            )

        return method

    return {
        "fit": loop.fit,
        "evaluate": loop.evaluate,
        "predict": loop.predict,
        "train_on_batch": refuse("train_on_batch"),
        "test_on_batch": refuse("test_on_batch"),
        "predict_on_batch": refuse("predict_on_batch"),
    }


# -- input -------------------------------------------------------------------
def _pack(x, y, sample_weight):
    if y is None and sample_weight is None:
        return (x,)
    if sample_weight is None:
        return (x, y)
    return (x, y, sample_weight)


def _count(data) -> int:
    return int(np.shape(tree.flatten(data)[0])[0])


def _refuse_python_iterators(x, method: str) -> None:
    """A generator, an iterator or a torch DataLoader is none of the inputs
    the ParameterServerStrategy loop takes: one clear error instead of an
    IndexError from counting its samples."""
    if isinstance(x, (tf.data.Dataset, keras.utils.PyDataset)) or (
        _is_dataset_function(x)
    ):
        return
    leaves = [t for t in tree.flatten(x) if t is not None]
    if leaves and all(np.ndim(t) > 0 for t in leaves):
        return
    if method == "fit":
        why = (
            "its Python code would run in the chief only, and the workers "
            "run TensorFlow graphs. Pass NumPy arrays, a tf.data.Dataset "
            "of TensorFlow ops (not from_generator), or a function that "
            "builds a tf.data.Dataset on each worker (e.g. from files)."
        )
    else:
        why = (
            "pass NumPy arrays, a tf.data.Dataset (tf.data.Dataset."
            "from_generator wraps a generator), a function that builds one, "
            "or a keras.utils.PyDataset."
        )
    raise ValueError(
        f"`{method}` under ParameterServerStrategy got a "
        f"{type(x).__name__}, which it cannot read: {why}"
    )


def _is_dataset_function(x) -> bool:
    return callable(x) and not isinstance(
        x, (tf.data.Dataset, keras.utils.PyDataset)
    )


def _call_dataset_function(fn, context=None):
    import inspect

    try:
        takes_context = bool(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        takes_context = False
    if not takes_context:
        return fn()
    return fn(context or tf.distribute.InputContext())


def _worker_index():
    """This worker's index, in a function that runs on a worker (a
    per-worker dataset function): a tensor, filled in at call time."""
    return tf.distribute.coordinator.experimental_get_current_worker_index()


def _class_weight_fn(class_weight):
    """Keras's `class_weight` as a `tf.data` map function: adds each
    sample's class weight as its `sample_weight` (as Keras's `fit` does:
    classes are ``argmax(y)`` for one-hot labels, else ``round(y)``)."""
    if not isinstance(class_weight, dict) or not class_weight:
        raise ValueError(
            "`class_weight` must be a non-empty dict mapping class indices "
            f"(int) to weights; got {class_weight!r}."
        )
    size = max(int(c) for c in class_weight) + 1
    table = tf.constant(
        [float(class_weight.get(c, 1.0)) for c in range(size)], "float32"
    )

    def add_weights(*data):
        x, y, sw = keras.utils.unpack_x_y_sample_weight(data)
        if sw is not None:
            raise ValueError(
                "`class_weight` and `sample_weight` cannot be used together "
                "(as in Keras's fit): fold the class weights into "
                "`sample_weight`."
            )
        if y is None or tree.is_nested(y):
            raise ValueError(
                "`class_weight` needs a single target `y` (a model with one "
                "output); use `sample_weight` otherwise."
            )
        if y.shape.rank >= 2 and (y.shape[-1] or 1) > 1:
            classes = tf.argmax(y, axis=-1, output_type=tf.int32)
        elif y.shape.rank >= 2:
            classes = tf.cast(tf.round(tf.squeeze(y, axis=-1)), tf.int32)
        else:
            classes = tf.cast(tf.round(y), tf.int32)
        return x, y, tf.gather(table, classes)

    return add_weights


def split_validation(x, y, sample_weight, validation_split):
    """Keras's `validation_split` on arrays: the last fraction of the
    samples (before any shuffling) is held out.

    Returns:
        ``((x, y, sample_weight), (vx, vy, vw))``.

    Raises:
        ValueError: for input that is not arrays, or a split that leaves
            no sample on one side.
    """
    if isinstance(x, (tf.data.Dataset, keras.utils.PyDataset)) or (
        _is_dataset_function(x)
    ):
        raise ValueError(
            "`validation_split` works with NumPy arrays (or tensors) only, "
            "as in Keras's fit: hold out the validation samples yourself "
            "and pass them as `validation_data`."
        )
    arrays = tree.map_structure(
        lambda t: None if t is None else np.asarray(t),
        (x, y, sample_weight),
    )
    count = _count(arrays[0])
    split_at = int(math.floor(count * (1.0 - validation_split)))
    if split_at == 0 or split_at == count:
        raise ValueError(
            f"`validation_split={validation_split}` of {count} samples "
            f"leaves {split_at} to train and {count - split_at} to "
            "validate: choose a split that keeps samples on both sides."
        )

    def cut(lo, hi):
        return tree.map_structure(
            lambda t: None if t is None else t[lo:hi], arrays
        )

    return cut(0, split_at), cut(split_at, count)


class _TrainInput:
    """What each worker reads: a per-worker dataset, its element spec and
    the steps of an epoch.

    Each worker reads its own part of the input (`num_workers` shards, by
    the worker's index): NumPy samples ``i`` with ``i % num_workers ==
    worker``, a `tf.data` dataset's elements (batches, if it is batched)
    likewise; a dataset function that takes an argument gets a
    `tf.distribute.InputContext` with ``num_input_pipelines`` the number
    of workers and ``input_pipeline_id`` this worker's index (a tensor) to
    shard with (`dataset.shard(ctx.num_input_pipelines,
    ctx.input_pipeline_id)`). Every per-worker dataset repeats.
    """

    def __init__(
        self,
        x,
        y,
        sample_weight,
        batch_size,
        shuffle,
        steps,
        num_workers=1,
        class_weight=None,
    ):
        self.num_workers = int(num_workers)
        weigh = None if class_weight is None else _class_weight_fn(class_weight)
        if isinstance(x, keras.utils.PyDataset):
            raise NotImplementedError(
                "A PyDataset cannot feed ParameterServerStrategy workers: "
                "its Python code (`__getitem__`) runs in the chief only, and "
                "the workers run TensorFlow graphs. Pass NumPy arrays, a "
                "tf.data.Dataset, or a function that builds a "
                "tf.data.Dataset on each worker (e.g. from files; it may "
                "take a tf.distribute.InputContext to shard by worker). "
                "`evaluate` and `predict` do accept a PyDataset (they run on "
                "the chief)."
            )
        _refuse_python_iterators(x, "fit")
        if isinstance(x, tf.data.Dataset):
            cardinality = int(x.cardinality())
            if steps is None:
                if cardinality < 0:
                    raise ValueError(
                        "`fit` under ParameterServerStrategy got a tf.data "
                        "dataset of "
                        + (
                            "infinite"
                            if cardinality == tf.data.INFINITE_CARDINALITY
                            else "unknown"
                        )
                        + " size: pass `steps_per_epoch` (the steps "
                        "scheduled per epoch, over all workers)."
                    )
                steps = cardinality
            if 0 <= cardinality < self.num_workers:
                raise ValueError(
                    f"The tf.data dataset has {cardinality} element(s) "
                    f"(batches), fewer than the {self.num_workers} workers, "
                    "and each worker reads its own elements: use smaller "
                    "batches, or fewer workers."
                )
            self.source = self._from_dataset(x, weigh)
            spec_dataset = x if weigh is None else x.map(weigh)
            self.spec = spec_dataset.element_spec
            self.steps = int(steps)
            self.batch_size = None
            return
        if _is_dataset_function(x):
            if steps is None:
                raise ValueError(
                    "`fit` under ParameterServerStrategy got a dataset "
                    "function: pass `steps_per_epoch` (the steps scheduled "
                    "per epoch, over all workers), since the size of what "
                    "each worker builds is not known on the chief."
                )
            workers = self.num_workers

            def dataset_fn():
                context = tf.distribute.InputContext(
                    num_input_pipelines=workers,
                    input_pipeline_id=_worker_index() if workers > 1 else 0,
                    num_replicas_in_sync=1,
                )
                dataset = _call_dataset_function(x, context)
                return dataset if weigh is None else dataset.map(weigh)

            spec_dataset = _call_dataset_function(x)
            if weigh is not None:
                spec_dataset = spec_dataset.map(weigh)
            self.spec = spec_dataset.element_spec
            self.source = dataset_fn
            self.steps = int(steps)
            self.batch_size = None
            return
        data = tree.map_structure(
            lambda t: None if t is None else np.asarray(t),
            _pack(x, y, sample_weight),
        )
        batch_size = int(batch_size or 32)
        count = _count(data)
        self.batch_size = batch_size
        self.steps = int(steps or max(1, math.ceil(count / batch_size)))
        workers = self.num_workers
        if count < workers:
            raise ValueError(
                f"`fit` got {count} sample(s) for {workers} workers, and "
                "each worker reads its own samples: pass at least one "
                "sample per worker."
            )
        shard_size = math.ceil(count / workers)

        def dataset_fn():
            # Worker w reads samples w, w + workers, ...: its own part, in
            # its own random order with `shuffle`.
            dataset = tf.data.Dataset.from_tensor_slices(data)
            if workers > 1:
                dataset = dataset.shard(workers, _worker_index())
            if shuffle:
                dataset = dataset.shuffle(
                    shard_size, reshuffle_each_iteration=True
                )
            # Batched, then repeated: every pass over this worker's part
            # ends with its own last (partial) batch, so one worker's
            # epoch is one device's (`steps` = ceil(count / batch_size)):
            # no batch runs across an epoch's end.
            dataset = dataset.batch(batch_size).repeat()
            return dataset if weigh is None else dataset.map(weigh)

        self.source = dataset_fn
        spec_dataset = tf.data.Dataset.from_tensor_slices(data).batch(
            batch_size
        )
        if weigh is not None:
            spec_dataset = spec_dataset.map(weigh)
        self.spec = spec_dataset.element_spec

    def _from_dataset(self, dataset, weigh):
        """A per-worker dataset function reading `dataset`'s elements of
        this worker (the dataset's graph is serialized to each worker, as
        `create_per_worker_dataset` does with a dataset)."""
        from keras_dist._src.framework_glue import tensorflow_private as tfp

        serialized = tfp.serialize_dataset_to_graph(dataset)
        spec = dataset.element_spec
        workers = self.num_workers

        def dataset_fn():
            restored = tfp.deserialize_dataset_from_graph(serialized, spec)
            if workers > 1:
                restored = restored.shard(workers, _worker_index())
            restored = restored.repeat()
            return restored if weigh is None else restored.map(weigh)

        return dataset_fn


def _local_batches(x, y, sample_weight, batch_size, steps):
    """The chief's own batches (evaluate/predict): a finite iterable."""
    if isinstance(x, tf.data.Dataset):
        dataset = x if steps is None else x.take(steps)
        if steps is None and int(x.cardinality()) < 0:
            raise ValueError(
                "evaluate/predict got a tf.data dataset of infinite or "
                "unknown size: pass `steps`."
            )
        return dataset
    if _is_dataset_function(x):
        dataset = _call_dataset_function(x)
        return _local_batches(dataset, None, None, None, steps)
    if isinstance(x, keras.utils.PyDataset):
        return (x[i] for i in range(steps or len(x)))
    _refuse_python_iterators(x, "evaluate/predict")
    data = _pack(x, y, sample_weight)
    data = tree.map_structure(
        lambda t: None if t is None else np.asarray(t), data
    )
    dataset = tf.data.Dataset.from_tensor_slices(data).batch(
        int(batch_size or 32)
    )
    return dataset if steps is None else dataset.take(steps)


def _lost_ps_is_clear(method):
    """A lost ps task (TensorFlow's UnavailableError, from any call that
    reaches the variables) becomes one clear `KerasDistError`."""

    @functools.wraps(method)
    def wrapper(*args, **kwargs):
        try:
            return method(*args, **kwargs)
        except (tf.errors.UnavailableError, tf.errors.AbortedError) as error:
            raise KerasDistError(
                "ParameterServerStrategy lost a ps task (or the chief's "
                "connection to it): the variables it held are gone, so "
                "training cannot continue. Restart every task of the job "
                "and resume from your last checkpoint. TensorFlow's "
                f"error: {str(error).splitlines()[0]}"
            ) from error

    return wrapper


# -- the loop ----------------------------------------------------------------
class _Loop:
    def __init__(self, engine, model):
        self.engine = engine
        self.model = model
        self._train_step = None
        self._test_step = None
        self._predict_step = None

    def _atomic(self):
        model = self.model
        variables = list(model.variables) + list(model.metrics_variables)
        if model.optimizer is not None:
            variables += list(model.optimizer.variables)
        make_updates_atomic(variables)
        make_metric_updates_atomic(model.metrics)

    def _build(self, spec):
        model = self.model
        if not (model.built and model.optimizer.built and model.compiled):
            with self.engine.tf_strategy.scope():
                glue.symbolic_build(model, spec)
        check_not_sharded(model)
        self._atomic()

    def _schedule_fn(self):
        """``(one step, several steps)``: the closures `fit` schedules."""
        if self._train_step is None:
            model = self.model
            strategy = self.engine.tf_strategy

            @tf.function
            def train_step(iterator):
                # One step of Keras's own train_step: no loop in the
                # graph (a `tf.range` loop of one step cost 31 % more
                # per step on the workers, benchmarks/bench_family.py).
                strategy.run(model.train_step, args=(next(iterator),))

            @tf.function
            def train_steps(iterator, steps):
                # `steps` of Keras's own train_step in one closure (the
                # model's `steps_per_execution`; the last closure of an
                # epoch may run fewer).
                for _ in tf.range(steps):
                    data = next(iterator)
                    strategy.run(model.train_step, args=(data,))

            self._train_step = (train_step, train_steps)
        return self._train_step

    def _logs(self):
        logs = self.model.get_metrics_result()
        return {k: float(np.asarray(v)) for k, v in logs.items()}

    @_lost_ps_is_clear
    def fit(
        self,
        x=None,
        y=None,
        batch_size=None,
        epochs=1,
        verbose="auto",
        callbacks=None,
        validation_split=0.0,
        validation_data=None,
        shuffle=True,
        class_weight=None,
        sample_weight=None,
        initial_epoch=0,
        steps_per_epoch=None,
        validation_steps=None,
        validation_batch_size=None,
        validation_freq=1,
    ):
        """Keras's `fit`, steps scheduled on the workers (module doc)."""
        model = self.model
        _refuse_step_level_backup(callbacks)
        if validation_split and validation_data is None:
            (x, y, sample_weight), validation_data = split_validation(
                x, y, sample_weight, validation_split
            )
        source = _TrainInput(
            x,
            y,
            sample_weight,
            batch_size,
            shuffle,
            steps_per_epoch,
            num_workers=len(self.engine.plan.cluster["worker"]),
            class_weight=class_weight,
        )
        self._build(source.spec)
        coordinator = self.engine.coordinator
        per_worker = coordinator.create_per_worker_dataset(source.source)
        iterator = iter(per_worker)
        one_step, several_steps = self._schedule_fn()
        if not isinstance(callbacks, keras.callbacks.CallbackList):
            callbacks = keras.callbacks.CallbackList(
                callbacks,
                add_history=True,
                add_progbar=verbose != 0,
                verbose=1 if verbose == "auto" else verbose,
                epochs=epochs,
                steps=source.steps,
                model=model,
            )
        model.stop_training = False
        callbacks.on_train_begin()
        logs = {}
        # A BackupAndRestore callback restored an epoch in on_train_begin.
        initial_epoch = glue.initial_epoch(model) or initial_epoch
        for epoch in range(initial_epoch, epochs):
            model.reset_metrics()
            callbacks.on_epoch_begin(epoch)
            callbacks.on_train_batch_begin(0)
            per_closure = max(1, int(model.steps_per_execution or 1))
            for first in range(0, source.steps, per_closure):
                steps = min(per_closure, source.steps - first)
                if steps == 1:
                    coordinator.schedule(one_step, args=(iterator,))
                else:
                    coordinator.schedule(
                        several_steps,
                        args=(iterator, tf.constant(steps, "int32")),
                    )
            _join(coordinator)
            logs = self._logs()
            callbacks.on_train_batch_end(source.steps - 1, logs)
            epoch_logs = dict(logs)
            if validation_data is not None and (
                (epoch + 1) % validation_freq == 0
            ):
                vx, vy, vw = (
                    keras.utils.unpack_x_y_sample_weight(validation_data)
                    if isinstance(validation_data, (tuple, list))
                    else (
                        validation_data,
                        None,
                        None,
                    )
                )
                val = self.evaluate(
                    vx,
                    vy,
                    batch_size=validation_batch_size or batch_size,
                    sample_weight=vw,
                    steps=validation_steps,
                    verbose=0,
                    return_dict=True,
                )
                epoch_logs.update({f"val_{k}": v for k, v in val.items()})
            callbacks.on_epoch_end(epoch, epoch_logs)
            logs = epoch_logs
            if model.stop_training:
                break
        callbacks.on_train_end(logs)
        return model.history

    @_lost_ps_is_clear
    def evaluate(
        self,
        x=None,
        y=None,
        batch_size=None,
        verbose="auto",
        sample_weight=None,
        steps=None,
        callbacks=None,
        return_dict=False,
        **kwargs,
    ):
        """Keras's `evaluate`, run on the chief (exact)."""
        model = self.model
        batches = _local_batches(x, y, sample_weight, batch_size, steps)
        if self._test_step is None:
            self._test_step = tf.function(model.test_step)
        first = True
        model.reset_metrics()
        for batch in batches:
            if first:
                self._build(tree.map_structure(_spec_of, batch))
                first = False
            self._test_step(batch)
        if first:
            raise ValueError("`evaluate` got an input with no batch.")
        logs = self._logs()
        if return_dict:
            return logs
        names = [m.name for m in model.metrics]
        values = [logs[n] for n in names if n in logs]
        values += [v for k, v in logs.items() if k not in names]
        return values[0] if len(values) == 1 else values

    @_lost_ps_is_clear
    def predict(
        self, x, batch_size=None, verbose="auto", steps=None, callbacks=None
    ):
        """Keras's `predict`, run on the chief."""
        model = self.model
        batches = _local_batches(x, None, None, batch_size, steps)
        if self._predict_step is None:
            self._predict_step = tf.function(model.predict_step)
        outputs = []
        for batch in batches:
            if not isinstance(batch, tuple):
                batch = (batch,)
            outputs.append(
                tree.map_structure(np.asarray, self._predict_step(batch))
            )
        if not outputs:
            raise ValueError("`predict` got an input with no batch.")
        return tree.map_structure_up_to(
            outputs[0], lambda *parts: np.concatenate(parts), *outputs
        )


def _refuse_step_level_backup(callbacks) -> None:
    """keras_dist's own BackupAndRestore resumes mid-epoch by replaying
    Keras's fit loop, which this loop is not: refused, pointing to
    Keras's epoch-level BackupAndRestore (verified here)."""
    listed = getattr(callbacks, "callbacks", callbacks) or ()
    for callback in listed:
        kind = type(callback)
        if kind.__name__ == "BackupAndRestore" and kind.__module__.startswith(
            "keras_dist."
        ):
            raise NotImplementedError(
                "keras_dist.callbacks.BackupAndRestore (exact mid-epoch "
                "resume) does not work under ParameterServerStrategy, whose "
                "steps run asynchronously on the workers. Use "
                "keras.callbacks.BackupAndRestore(backup_dir): it saves at "
                "each epoch's end and a restarted job resumes at the next "
                "epoch (guides/parameter_server.md, Faults)."
            )


def _spec_of(t):
    if t is None:
        return None
    t = tf.convert_to_tensor(t)
    return tf.TensorSpec([None] + list(t.shape)[1:], t.dtype)


def _join(coordinator):
    """`ClusterCoordinator.join`, its errors said plainly."""
    try:
        coordinator.join()
    except tf.errors.OutOfRangeError as error:
        raise ValueError(
            "A worker's dataset ran out before the epoch's steps were "
            "scheduled: make the dataset (function) repeat, e.g. "
            "`dataset.repeat()`, and set `steps_per_epoch`."
        ) from error


def check_not_sharded(model) -> None:
    """Refuses variables that the partitioner split (`ShardedVariable`).

    Keras's `train_step` takes the gradient of each whole variable (it
    reads ``variable.handle``, which a ShardedVariable lacks: "'Sharded
    Variable' object has no attribute 'handle'"), and Keras's Embedding
    concatenates the whole table before each lookup, which defeats the
    sharding.

    Raises:
        KerasDistError: naming the variables and what to do.
    """
    variables = list(model.variables)
    if model.optimizer is not None:
        variables += list(model.optimizer.variables)
    sharded = [
        v.path
        for v in variables
        if len(getattr(glue.variable_value(v), "variables", ()) or ()) > 1
    ]
    if not sharded:
        return
    embeddings = [
        layer.name
        for layer in glue.flatten_layers(model)
        if isinstance(layer, keras.layers.Embedding)
    ]
    hint = (
        f" (Embedding layers {embeddings}: Keras's Embedding gathers the "
        "whole table before each lookup, so sharding it saves nothing)"
        if embeddings
        else ""
    )
    raise KerasDistError(
        "keras_dist's ParameterServerStrategy cannot train variables that "
        f"the variable_partitioner split over the ps tasks: {sharded}"
        f"{hint}. Keras's train_step takes the gradient of each whole "
        "variable, which a ShardedVariable does not have. Pass "
        "variable_partitioner=None (variables are then placed whole, "
        "round-robin over the ps tasks), or a partitioner that leaves these "
        "variables whole (e.g. MinSizePartitioner with a larger "
        "min_shard_bytes). For a large embedding table use "
        "keras_dist.layers.ShardedEmbedding (same arguments as Embedding, "
        "no partitioner needed): its rows are split over the ps tasks and "
        "each lookup gathers only the rows it uses."
    )

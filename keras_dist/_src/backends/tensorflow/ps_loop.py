"""The chief's `fit`/`evaluate`/`predict` under ParameterServerStrategy.

`fit` schedules Keras's own `train_step` on whichever worker is free
(`ClusterCoordinator.schedule`; `steps_per_execution` steps per closure)
and joins at the end of each epoch; batch callbacks are called at that
join point (``on_train_batch_begin(0)``
before the epoch's steps are scheduled, ``on_train_batch_end`` once, with
the last step's index and the epoch's logs), epoch callbacks as usual.
`evaluate` and `predict` run on the chief (Keras's `test_step` and
`predict_step` on the variables held by the ps tasks): exact.

Each worker reads its own part of the input (`ps_inputs.TrainInput`); a
step's batch is `batch_size` samples read by one worker (there is no
global batch across workers). `class_weight` and `validation_split` do what
Keras's `fit` does; a `BackupAndRestore` callback's restored epoch is
where `fit` starts.
"""

from __future__ import annotations

import functools

import keras
import numpy as np
import tensorflow as tf
from keras import tree

from keras_dist._src.backends.tensorflow.ps_inputs import (
    TrainInput,
    local_batches,
    split_validation,
)
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
        source = TrainInput(
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
        batches = local_batches(x, y, sample_weight, batch_size, steps)
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
        batches = local_batches(x, None, None, batch_size, steps)
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

"""The TensorFlow engine: keras_dist's exact step over any tf.distribute
strategy that runs one replica per device (Mirrored, MultiWorkerMirrored,
CentralStorage).

`ReplicaEngine` extends the glue every TF engine shares
(`strategy_engine.StrategyEngine`: `run`, `reduce`, `gather` on its
`tf.distribute` strategy) with distributed datasets split exactly, the
check that each of the model's variables was created in the scope, and
the step functions it installs on the model: Keras's TF trainer's
`make_train_function`/`make_test_function` replaced by keras_dist's exact
per-replica step (`replica_step`: global loss denominators, masked means,
own losses, one device's Dropout, the optimizer on global gradients),
`steps_per_execution` run step by step with the random generators' states
kept, `train_on_batch`/`predict_on_batch` batches split like global ones,
and Keras's symbolic build read from the input's element spec.

A policy is a subclass that builds its strategy and says what its layers
see (`prepare_layer`): `mirrored.MirroredEngine` (BatchNormalization over
the global batch), `multi_worker.MultiWorkerEngine`,
`central_storage.CentralStorageEngine`; `one_device.OneDeviceEngine`
keeps Keras's own step.
"""

from __future__ import annotations

import keras
import numpy as np
import tensorflow as tf
from keras import tree

from keras_dist._src.backends.tensorflow.inputs import (
    BATCH_KEY,
    GLOBAL_COUNT_KEY,
    LOCAL_COUNT_KEY,
    LazyIterator,
    distribute_iterable,
)
from keras_dist._src.backends.tensorflow.replica_step import (
    exact_step,
    global_dropout,
    override_step,
)
from keras_dist._src.backends.tensorflow.strategy_engine import (
    StrategyEngine,
)
from keras_dist._src.errors import VariablesOutsideScopeError
from keras_dist._src.keras_glue import internals as glue


class ReplicaEngine(StrategyEngine):
    """keras_dist's exact step on the tf.distribute strategy `tf_strategy`.

    Args:
        devices: this process's devices (keras_dist names), one replica
            each.
        tf_strategy: the `tf.distribute.Strategy` the replicas run on.
    """

    def prepare_layer(self, layer) -> None:
        """A policy's hook: configures one layer of an attached model."""

    def attach(self, model) -> None:
        """Checks that `model` was built in the scope; installs the steps."""
        self.check_model_strategy(model)
        # Saving builds reference objects with variables: made distributed
        # here, they would need a collective that a chief-only save (a
        # callback's) makes alone.
        glue.cache_saving_attr_skipsets()
        outside = self.first_outside_scope(model.variables)
        if outside is not None:
            raise VariablesOutsideScopeError(
                f"Variable {outside.path!r} of model {model.name!r} was "
                "created outside strategy.scope(). Build the model and all "
                "its layers inside the scope."
            )
        for layer in glue.flatten_layers(model):
            self.prepare_layer(layer)
            if type(layer) is keras.layers.Dropout:
                if "call" not in layer.__dict__:
                    layer.__dict__["call"] = global_dropout(layer)
                model.__dict__["_keras_dist_dropout"] = True
        self._install_steps(model)

    def first_outside_scope(self, variables):
        """The first of the Keras `variables` not created in the
        strategy's scope, or None."""
        extended = self.tf_strategy.extended
        for variable in variables:
            if not extended.variable_created_in_scope(variable.value):
                return variable
        return None

    def check_metric_variables(self, model) -> None:
        """Hook before a train/test function is built: one host's replicas
        share a metric created outside the scope (a variable they all
        update), which keras_dist reads exactly; nothing to check here."""

    def distribute_dataset(self, dataset):
        """`dataset` split across the replicas, each global batch exactly."""
        if isinstance(dataset, tf.data.Dataset):
            return self.tf_strategy.experimental_distribute_dataset(dataset)
        return distribute_iterable(self, dataset)

    def _install_steps(self, model) -> None:
        cls = type(model)
        trainer = glue.tensorflow_trainer()
        custom_train = cls.train_step is not trainer.train_step
        custom_test = cls.test_step is not trainer.test_step
        engine = self

        def make_step_function(attribute, training, custom):
            def make(force=False):
                if getattr(model, attribute) is not None and not force:
                    return getattr(model, attribute)
                engine.check_metric_variables(model)

                def step(data):
                    if custom:  # the model's own train_step or test_step
                        return override_step(model, data, training)
                    return exact_step(model, data, training=training)

                function = _split_single_batches(
                    engine, model, _make_function(model, step)
                )
                setattr(model, attribute, function)
                return function

            return make

        make_train_function = make_step_function(
            "train_function", True, custom_train
        )
        make_test_function = make_step_function(
            "test_function", False, custom_test
        )

        def make_predict_function(force=False):
            if model.predict_function is not None and not force:
                return model.predict_function
            model.predict_function = _predict_function(engine, model)
            return model.predict_function

        def maybe_symbolic_build(iterator=None, data_batch=None):
            # Keras builds metrics and optimizer variables here, from shapes
            # only. Its own version takes a batch from the distributed input
            # (consuming batches of a generator, and losing those the
            # iterator had prefetched) and sums the replicas' parts (which
            # fails when they differ in size). The input's element spec has
            # all the shapes and dtypes needed, without reading any data.
            if iterator is not None:
                data_batch = glue.epoch_iterator_element_spec(iterator)
            with engine.tf_strategy.scope():
                if not (custom_train or custom_test):
                    glue.symbolic_build(model, data_batch)
                    return
                # An overridden step's batch need not be the model's input
                # (a GAN's real samples and noise): build what Keras builds
                # if the batch fits, else the optimizer (its variables may
                # not be created inside the replicated step).
                try:
                    glue.symbolic_build(model, data_batch)
                except (ValueError, TypeError):
                    optimizer = model.optimizer
                    if optimizer is not None and not optimizer.built:
                        optimizer.build(model.trainable_variables)

        model.__dict__["make_train_function"] = make_train_function
        model.__dict__["make_test_function"] = make_test_function
        model.__dict__["make_predict_function"] = make_predict_function
        model.predict_function = None
        glue.replace_maybe_symbolic_build(model, maybe_symbolic_build)
        model.train_function = None
        model.test_function = None

    def _distribute_counted_batch(self, batch):
        """Per-replica parts of a global `batch` in the padded form of
        keras_dist's own split (`distribute_global_batches`): each part
        with the global and its own sample count, an empty part as one
        zero sample."""
        from keras_dist._src.core.shards import split_batch

        batch = tree.map_structure(
            lambda t: None if t is None else np.asarray(t), batch
        )
        first = next(t for t in tree.flatten(batch) if t is not None)
        count = np.int32(np.shape(first)[0])
        parts = []
        for part in split_batch(batch, self.num_replicas_in_sync):
            leaves = [t for t in tree.flatten(part) if t is not None]
            local = np.int32(np.shape(leaves[0])[0])
            if local == 0:
                part = tree.map_structure(
                    lambda t: (
                        None
                        if t is None
                        else np.zeros((1,) + t.shape[1:], t.dtype)
                    ),
                    part,
                )
            parts.append(
                {
                    BATCH_KEY: part,
                    GLOBAL_COUNT_KEY: count,
                    LOCAL_COUNT_KEY: local,
                }
            )
        return self.tf_strategy.experimental_distribute_values_from_function(
            lambda ctx: tree.map_structure(
                lambda t: None if t is None else tf.convert_to_tensor(t),
                parts[ctx.replica_id_in_sync_group],
            )
        )

    def _distribute_batch(self, batch):
        """Per-replica parts of a global `batch`; distributed input as is."""
        leaves = tf.nest.flatten(batch)
        if any(isinstance(t, tf.distribute.DistributedValues) for t in leaves):
            return batch
        from keras_dist._src.core.shards import split_batch

        batch = tree.map_structure(
            lambda t: None if t is None else np.asarray(t), batch
        )
        parts = split_batch(batch, self.num_replicas_in_sync)
        return self.tf_strategy.experimental_distribute_values_from_function(
            lambda ctx: tree.map_structure(
                lambda t: None if t is None else tf.convert_to_tensor(t),
                parts[ctx.replica_id_in_sync_group],
            )
        )


def _predict_function(engine, model):
    """Keras's TF predict function, with the replicas' outputs put back in
    the order of the input's rows.

    keras_dist gives replica ``i`` (counted over all workers) the ``i``-th
    part of each global batch, so a gather in replica order is that order.
    Keras's own predict reorders a multi-worker job's outputs for
    tf.distribute's split of the input instead, which permuted the rows of
    an uneven batch (2 workers × 2 replicas, 11 rows in batches of 3:
    ``0 2 1 3 5 4 ...``). `predict_on_batch` passes ``[(x,)]`` with the
    whole batch, which tf.distribute would hand to every replica (N times
    the rows): it is split like a global batch first.
    """
    strategy = engine.tf_strategy
    concat, autoconvert_optionals = glue.tensorflow_predict_helpers()
    multi_worker = strategy.extended._in_multi_worker_mode()

    def one_step(data):
        return model.predict_step(data)

    if not model.run_eagerly and model.jit_compile:
        one_step = tf.function(
            one_step, reduce_retracing=True, jit_compile=True
        )
    one_step = autoconvert_optionals(model, one_step)

    def in_order(value):
        if multi_worker:  # every worker gets every row
            return strategy.gather(value, axis=0)
        parts = strategy.experimental_local_results(value)
        return concat(list(parts))

    def distributed(data):
        outputs = strategy.run(one_step, args=(data,))
        return tree.map_structure(in_order, outputs)

    def steps(data):
        outputs = distributed(data[0])
        for single_step_data in data[1:]:
            outputs = tree.map_structure(
                lambda a, b: concat([a, b]),
                outputs,
                distributed(single_step_data),
            )
        return outputs

    if not model.run_eagerly:
        steps = tf.function(steps, reduce_retracing=True)

    def predict_function(data):
        return steps([engine._distribute_batch(d) for d in data])

    return predict_function


def _split_single_batches(engine, model, function):
    """`train_on_batch` and `test_on_batch` hand Keras's step function a
    generator of one whole batch, which tf.distribute would give to every
    replica (N copies of the batch: exact for the gradient of a mean loss,
    but not for Dropout's mask, drawn for N times the rows): split it like
    a global batch of `fit` first.

    The step's logs are then one replica's view of the metrics (its own
    part's); Keras resets the metrics before these calls, so the metrics'
    results read here, summed over replicas, are the batch's logs.

    Being every step function's entry, it also starts a `LazyIterator`
    (`inputs.for_keras`) before the step traces it."""

    def split(iterator):
        if isinstance(iterator, LazyIterator):
            iterator = iterator.resolve()
        if isinstance(
            iterator, (tf.data.Iterator, tf.distribute.DistributedIterator)
        ):
            return function(iterator)
        iterator = iter([engine._distribute_counted_batch(d) for d in iterator])
        logs = function(iterator)
        if not isinstance(logs, dict):
            return logs
        results = model.get_metrics_result()
        return {key: results.get(key, value) for key, value in logs.items()}

    return split


def _make_function(model, step):
    """Keras's step function; with `steps_per_execution` > 1, one traced
    step called that many times.

    Keras runs several steps in one `tf.while_loop` whose body reads the
    next input with `get_next_as_optional` inside a `tf.cond`; with a
    distributed iterator of tf.distribute's rebatched input the traced
    graph leaves a placeholder unfed ("You must feed a value for
    placeholder tensor 'while/cond/Placeholder'"). Here each step is its
    own call (a host round trip per step instead of per execution).
    """
    executions = model.steps_per_execution
    if executions <= 1:
        return glue.make_function(model, step)
    traced = glue.make_function(model, step)

    def single(iterator):
        # Keras reads `steps_per_execution` when it traces the function.
        model.steps_per_execution = 1
        try:
            return traced(iterator)
        finally:
            model.steps_per_execution = executions

    def function(iterator):
        if not isinstance(
            iterator, (tf.data.Iterator, tf.distribute.DistributedIterator)
        ):  # train_on_batch and test_on_batch: one batch
            return single(iterator)
        outputs = None
        for _ in range(executions):
            # A call past the input's end still runs the step's ops that
            # do not wait for data: the random generators' advance (the
            # epochs after a shorter last execution drew other Dropout
            # masks than one device) and the optimizer's step count (one
            # more Adam step than Keras's own loop, which checks for data
            # first). Their states are put back then.
            saved = _data_free_states(model)
            try:
                outputs = single(iterator)
            except (StopIteration, tf.errors.OutOfRangeError):
                for variable, value in saved:
                    variable.assign(value)
                if outputs is None:
                    raise
                break
        return outputs

    return function


def _data_free_states(model):
    """(variable, value) of what a step of `model` changes without reading
    data: every random generator's state (its layers' and Keras's global
    one) and the optimizer's step count."""
    states = []
    optimizer = getattr(model, "optimizer", None)
    if optimizer is not None and getattr(optimizer, "built", False):
        iterations = optimizer.iterations
        states.append((iterations, tf.identity(iterations.value)))
    generators = []
    for layer in glue.flatten_layers(model, include_self=True):
        generators.extend(glue.layer_seed_generators(layer))
    generators.append(glue.global_seed_generator())
    seen = set()
    for generator in generators:
        state = getattr(generator, "state", None)
        if state is None or id(state) in seen:
            continue
        seen.add(id(state))
        states.append((state, tf.identity(glue.variable_value(state))))
    return states

"""Keras's own JAX steps, jitted with the engine's shardings
(`engine.SPMDEngine`).

`StepFunctions` replaces a model's `make_train_function`,
`make_test_function` and `make_predict_function`: each jits Keras's
stateless step with the state's shardings (the engine's) and feeds it
batches placed by the engine, one batch a step. Keras 3.16 and later
read groups of `steps_per_execution` batches stacked on a new leading
axis: in one process, a training or evaluation group whose batches the
batch axis divides runs as one `jax.lax.scan` over its steps, each step's batch
split over the replicas (one dispatch a group, as Keras's own trainer);
any other group is taken apart and stepped one batch at a time. With
`sync_batch_norm=False` the train step runs per replica under
`shard_map` (each device's BatchNormalization sees its own shard;
gradients averaged with `pmean`). On CPU devices the number of steps in
flight is bounded (`SPMDEngine.max_in_flight`).
"""

from __future__ import annotations

import jax
import keras
import numpy as np
from jax.sharding import PartitionSpec
from keras import tree

from keras_dist._src.backends.jax.batch_norm import average_moving_statistics
from keras_dist._src.core.inputs import check_batch_consistency
from keras_dist._src.keras_glue import internals as glue


class StepFunctions:
    """The distributed train/test/predict functions of one model."""

    def __init__(self, engine, model):
        self.engine = engine
        self.model = model
        self._first_batch = None
        self._batch_index = 0
        self._iterator = None

    def install(self) -> None:
        model = self.model
        model.__dict__["make_train_function"] = self.make_train_function
        model.__dict__["make_test_function"] = self.make_test_function
        model.__dict__["make_predict_function"] = self.make_predict_function
        model.train_function = None
        model.test_function = None
        model.predict_function = None

    def _compile(self, step, out_shardings):
        model = self.model
        if model.run_eagerly or not model.jit_compile:
            return step
        return jax.jit(step, donate_argnums=0, out_shardings=out_shardings)

    def _wrap(self, step, shardings, concatenate_outputs=False, scan=None):
        engine = self.engine
        # With steps_per_execution > 1, predict's outputs of the steps of one
        # call must be concatenated (Keras's own predict function does so).
        placed_step = _iterator_step(
            self.model, step, concatenate_outputs=concatenate_outputs
        )
        if scan is None:

            def iterator_step(state, iterator):
                return placed_step(state, self._placed(iterator))

        else:
            iterator_step = self._group_step(placed_step, scan)
        last_state = [None]

        def function(state, iterator):
            # On CPU devices, at most `max_in_flight` steps run at once (see
            # `SPMDEngine`): wait for the oldest before dispatching another.
            bound = engine.max_in_flight
            if bound is not None:
                engine.wait_for_last_step(keep=bound - 1)
            if state is not last_state[0]:
                state = engine.place_state(state, shardings)
            outputs, state = iterator_step(state, iterator)
            if bound is not None:
                # One output of the step's executable is ready when all
                # are: waiting on one leaf costs less than on every leaf.
                leaves = jax.tree_util.tree_leaves(outputs)
                if leaves:
                    engine.in_flight.append(leaves[:1])
                else:
                    # Only the state: it is donated to the next step, so it
                    # cannot be waited on later; wait now.
                    jax.block_until_ready(state)
            last_state[0] = state
            return outputs, state

        return function

    def _placed(self, iterator, groups=None):
        """Places each batch of `iterator` (or of `groups`, read from it);
        checks it matches the first batch's shapes."""
        self._track(iterator)
        source = iterator if groups is None else groups
        for batch in _one_batch_at_a_time(self.model, source):
            self._check(batch)
            yield self.engine.place_batch(batch)

    def _track(self, iterator):
        """Checks start again with a new epoch or a new input."""
        if iterator is not self._iterator:
            self._iterator = iterator
            self._first_batch = None

    def _check(self, batch):
        if self._first_batch is None:
            self._first_batch = batch
            self._batch_index = 1
        else:
            self._batch_index += 1
            check_batch_consistency(self._first_batch, batch, self._batch_index)

    def _group_step(self, placed_step, scan):
        """`(state, iterator) -> (logs, state)` for Keras's stacked groups:
        a full group whose batches the batch axis divides goes to `scan` in
        one dispatch; any other group is stepped a batch at a time."""
        engine = self.engine
        n = engine.num_replicas_in_sync

        def divides(x):
            return x is None or (np.ndim(x) >= 2 and np.shape(x)[1] % n == 0)

        def group_step(state, iterator):
            self._track(iterator)
            group = next(iterator)
            if not glue.is_partial_step_group(group) and all(
                divides(x) for x in tree.flatten(group)
            ):
                for batch in _one_batch_at_a_time(self.model, [group]):
                    self._check(batch)
                return scan(state, engine.place_group(group))
            return placed_step(state, self._placed(iterator, [group]))

        return group_step

    def make_train_function(self, force=False):
        """Jits the model's `train_step` with the state's shardings."""
        model = self.model
        if model.train_function is not None and not force:
            return model.train_function
        self.engine.check_built(model)
        state = self.engine.state_shardings(model)
        replicated = self.engine.replicated
        scan = None
        if self.engine.sync_batch_norm:
            step = self._compile(model.train_step, (replicated, state))
            if self._scans_groups():
                scan = self._compile(
                    _scanned(model.train_step), (replicated, state)
                )
        else:
            step = self._per_replica_train_step()
        model.train_function = self._wrap(step, state, scan=scan)
        return model.train_function

    def _scans_groups(self) -> bool:
        """Whether groups of steps run as one scan: Keras stacks
        them (3.16+), the steps are jitted, and one process places them
        (several processes place each batch from their own parts)."""
        model = self.model
        return (
            model.steps_per_execution > 1
            and glue.keras_stacks_jax_steps()
            and model.jit_compile
            and not model.run_eagerly
            and not self.engine.multi_process
        )

    def _per_replica_train_step(self):
        """Each device trains on its shard (so BatchNormalization sees only
        that shard's statistics); gradients are averaged with `pmean` before
        the optimizer applies them, metric updates are summed with `psum`
        and BatchNormalization's moving statistics are averaged."""
        model = self.model
        engine = self.engine
        axis = engine.batch_axis
        compiled = {}

        def local_step(state, data):
            _, _, _, old_metrics = state
            optimizer = model.optimizer
            apply = type(optimizer).stateless_apply.__get__(optimizer)

            def averaged_apply(optimizer_variables, grads, trainable):
                grads = jax.lax.pmean(grads, axis)
                return apply(optimizer_variables, grads, trainable)

            optimizer.__dict__["stateless_apply"] = averaged_apply
            try:
                _, new_state = model.train_step(state, data)
            finally:
                optimizer.__dict__.pop("stateless_apply", None)
            trainable, non_trainable, opt_vars, metrics = new_state
            non_trainable = average_moving_statistics(non_trainable, axis)
            metrics = [
                old + jax.lax.psum(new - old, axis)
                for old, new in zip(old_metrics, metrics)
            ]
            mapping = list(zip(model.metrics_variables, metrics))
            with keras.StatelessScope(state_mapping=mapping):
                logs = model.get_metrics_result()
            return logs, (trainable, non_trainable, opt_vars, metrics)

        def step(state, data):
            sharded = all(
                x is None or engine.sharded == x.sharding
                for x in tree.flatten(data)
            )
            if sharded not in compiled:
                spec = PartitionSpec(axis) if sharded else PartitionSpec()
                mapped = jax.shard_map(
                    local_step,
                    mesh=engine.mesh,
                    in_specs=(PartitionSpec(), spec),
                    out_specs=PartitionSpec(),
                    check_vma=False,
                )
                compiled[sharded] = self._compile(
                    mapped, (engine.replicated, engine.replicated)
                )
            return compiled[sharded](state, data)

        return step

    def make_test_function(self, force=False):
        """Jits the model's `test_step` with the state's shardings."""
        model = self.model
        if model.test_function is not None and not force:
            return model.test_function
        self.engine.check_built(model)
        trainable, non_trainable, _, metrics = self.engine.state_shardings(
            model
        )
        state = (trainable, non_trainable, metrics)
        out = (self.engine.replicated, state)
        step = self._compile(model.test_step, out)
        scan = None
        if self._scans_groups():
            scan = self._compile(_scanned(model.test_step), out)
        model.test_function = self._wrap(step, state, scan=scan)
        return model.test_function

    def make_predict_function(self, force=False):
        """Jits the model's `predict_step`; outputs stay batch-sharded."""
        model = self.model
        if model.predict_function is not None and not force:
            return model.predict_function
        self.engine.check_built(model)
        trainable, non_trainable, _, _ = self.engine.state_shardings(model)
        state = (trainable, non_trainable)

        def predict_step(state, data):
            outputs, non_trainable = model.predict_step(state, data)
            return outputs, (state[0], non_trainable)

        out = self.engine.predict_out_shardings
        if out is None:
            out = (None, state)
        else:
            out = (out[0], state)
        step = self._compile(predict_step, out)
        model.predict_function = self._wrap(
            step, state, concatenate_outputs=True
        )
        return model.predict_function


def _one_batch_at_a_time(model, iterator):
    """The batches of Keras's JAX epoch iterator one by one.

    With `steps_per_execution` > 1, Keras 3.16 and later read groups of
    that many batches stacked on a new leading axis (a partial group at
    an epoch's end as a list): each step here splits its own batch over
    the replicas, so a group is taken apart first (else its step axis
    would be split as if it were the batch)."""
    # `for`, not `yield from`: the caller makes a generator of this one
    # per call and drops it after a few batches, and `yield from` would
    # close Keras's iterator with it.
    if model.steps_per_execution <= 1 or not glue.keras_stacks_jax_steps():
        for batch in iterator:  # noqa: UP028 - see above
            yield batch
        return
    for group in iterator:
        if glue.is_partial_step_group(group):
            yield from group
            continue
        leaves = [x for x in tree.flatten(group) if x is not None]
        for i in range(np.shape(leaves[0])[0] if leaves else 0):
            yield tree.map_structure(
                lambda x, i=i: None if x is None else x[i],
                group,
                none_is_leaf=True,
            )


def _scanned(train_step):
    """`(state, group) -> (logs, state)`: `train_step` (or a test step)
    over each batch of a stacked group in turn (`jax.lax.scan`); the logs
    are the last step's."""

    def scanned(state, group):
        def body(state, batch):
            logs, state = train_step(state, batch)
            return state, logs

        state, logs = jax.lax.scan(body, state, group)
        return tree.map_structure(lambda x: x[-1], logs), state

    return scanned


def _iterator_step(model, step, concatenate_outputs=False):
    """`step(state, batch)` as a function of `(state, iterator)` that runs
    up to `model.steps_per_execution` batches, as Keras 3.15's JAX
    trainer does: one batch a step, the outputs of the steps concatenated
    when `concatenate_outputs` (predict), else the last step's."""
    steps = model.steps_per_execution
    if steps <= 1:
        return lambda state, iterator: step(state, next(iterator))

    def concatenate(outputs):
        return tree.map_structure(
            lambda *parts: jax.numpy.concatenate(parts), *outputs
        )

    if not model.run_eagerly and model.jit_compile:
        concatenate = jax.jit(concatenate)

    def iterator_step(state, iterator):
        outputs, state = step(state, next(iterator))
        collected = [outputs]
        for _ in range(steps - 1):
            try:
                data = next(iterator)
            except StopIteration:
                break
            outputs, state = step(state, data)
            collected.append(outputs)
        if concatenate_outputs:
            return concatenate(collected), state
        return outputs, state

    return iterator_step

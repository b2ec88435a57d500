"""TensorFlow CentralStorage: one copy of each variable, replicas compute.

tf.distribute's `CentralStorageStrategy` keeps every variable once, on the
parameter device (the CPU when there are several compute devices), and
runs each replica on its own compute device. Keras 3 creates most
non-trainable variables (BatchNormalization's moving statistics, seed
generator states) with aggregation "none", which such an
`AggregatingVariable` refuses to update in a replica ("You must specify an
aggregation method to update a AggregatingVariable in Replica Context").
Here a variable creator sets one where Keras leaves none: MEAN for
floating-point variables, ONLY_FIRST_REPLICA for the others (integer
counters and seed states, which every replica updates alike).

The step is MirroredStrategy's exact one (`mirrored.MirroredEngine`:
each replica's loss weighted by its share of the global batch, gradients
all-reduced, global-batch BatchNormalization): once gradients are summed,
every replica holds the same global gradient, so the first replica alone
runs the optimizer on the central variables (the others skip it): one
update, as on one device.
"""

from __future__ import annotations

import contextlib

import tensorflow as tf

from keras_dist._src.backends.tensorflow.devices import tf_device_name
from keras_dist._src.backends.tensorflow.inputs import (
    distribute_global_batches,
)
from keras_dist._src.backends.tensorflow.mirrored import MirroredEngine
from keras_dist._src.devices import normalize_device
from keras_dist._src.keras_glue import internals as glue
from keras_dist._src.keras_glue.parameter_server import (
    make_metric_updates_atomic,
    make_updates_atomic,
)


def aggregation_creator(next_creator, **kwargs):
    """A `tf.variable_creator_scope` creator that gives each variable
    created with aggregation "none" one that a replica may update: MEAN
    for floating-point variables, ONLY_FIRST_REPLICA for the others."""
    aggregation = kwargs.get("aggregation")
    if aggregation in (None, tf.VariableAggregation.NONE):
        dtype = kwargs.get("dtype")
        if dtype is None:
            initial = kwargs.get("initial_value")
            dtype = getattr(initial, "dtype", None)
        floating = dtype is not None and tf.as_dtype(dtype).is_floating
        kwargs["aggregation"] = (
            tf.VariableAggregation.MEAN
            if floating
            else tf.VariableAggregation.ONLY_FIRST_REPLICA
        )
    return next_creator(**kwargs)


def _new_central_storage_strategy(compute_devices, parameter_device):
    """tf.distribute's CentralStorageStrategy with keras_dist's exact split
    of each global batch (`inputs.distribute_global_batches`)."""
    base = tf.distribute.experimental.CentralStorageStrategy
    cls = type(
        "CentralStorageStrategy",
        (base,),
        {
            "_keras_dist": True,
            "_native_distribute": base.experimental_distribute_dataset,
            "experimental_distribute_dataset": distribute_global_batches,
        },
    )
    return cls(
        compute_devices=list(compute_devices),
        parameter_device=parameter_device,
    )


class CentralStorageEngine(MirroredEngine):
    """`MirroredEngine`'s exact step on tf.distribute's CentralStorage.

    Args:
        devices: the compute devices (one replica each).
        parameter_device: where the variables live; None for tf.distribute's
            choice (the one compute device, or the CPU).
    """

    def __init__(self, devices, parameter_device=None):
        super().__init__(devices, sync_batch_norm=True)
        compute = [tf_device_name(d) for d in self.devices]
        if parameter_device is None:
            parameter_device = compute[0] if len(compute) == 1 else "/cpu:0"
        else:
            parameter_device = tf_device_name(
                normalize_device(parameter_device)
            )
        self.parameter_device = parameter_device
        self.tf_strategy = _new_central_storage_strategy(
            compute, parameter_device
        )

    @contextlib.contextmanager
    def scope(self):
        """The strategy's scope; variables get an aggregation."""
        with self.tf_strategy.scope():
            with tf.variable_creator_scope(aggregation_creator):
                yield

    def call_scope(self):
        """fit/evaluate/predict (variables they create get one too)."""
        return self.scope()

    def attach(self, model) -> None:
        """Validates and installs the steps; the optimizer runs once."""
        super().attach(model)
        optimizer = getattr(model, "optimizer", None)
        if optimizer is not None and "apply" not in optimizer.__dict__:
            optimizer.__dict__["apply"] = _first_replica_apply(optimizer)
        for name in ("make_train_function", "make_test_function"):
            make = model.__dict__.get(name)
            if make is not None:
                model.__dict__[name] = _with_summed_updates(model, make)


def _with_summed_updates(model, make):
    """`make` (a step-function factory) that first makes the replicas'
    metric updates add up, as on parameter servers
    (`keras_glue.parameter_server`).

    Keras's `assign_add` is ``assign(self + value)``, and its
    confusion-matrix metrics (`Precision`, `AUC`, `MeanIoU`, ...) update
    with ``variable.assign(variable + increment)``: a SUM-aggregated
    central variable sums what each replica assigns, N times the old total
    (the logged loss was wrong from the second step on; those metrics
    drifted until 5 Dec. 2026). So each such variable's `assign_add` is the
    aggregating variable's own (it sums the replicas' increments), and each
    such metric adds the difference of its stateless update."""

    def make_function(force=False):
        make_updates_atomic(
            v
            for v in model.variables + model.metrics_variables
            if _is_aggregating(value := glue.variable_value(v))
            and value.aggregation == tf.VariableAggregation.SUM
        )
        make_metric_updates_atomic(model.metrics)
        return make(force=force)

    return make_function


def _first_replica_apply(optimizer):
    """`optimizer.apply` run by the first replica only, on the central
    variables themselves (each replica holds the same all-reduced
    gradients, so one update is the update of one device)."""
    original = type(optimizer).apply.__get__(optimizer)

    def apply(grads, trainable_variables=None):
        context = tf.distribute.get_replica_context()
        if context is None or context.num_replicas_in_sync == 1:
            return original(grads, trainable_variables)
        replica = tf.get_static_value(context.replica_id_in_sync_group)
        if replica != 0:
            return None
        variables = list(trainable_variables or [])
        inner = getattr(optimizer, "inner_optimizer", None)
        for opt in (optimizer, inner):
            if opt is not None:
                variables.extend(opt.variables)
        with _CentralValues(variables):
            return original(grads, trainable_variables)

    return apply


class _CentralValues:
    """Points Keras variables at the single variable under each
    `AggregatingVariable`, for the duration (a replica-context update of
    the aggregating variable would need a collective)."""

    def __init__(self, variables):
        self._variables = variables
        self._swapped = []

    def __enter__(self):
        seen = set()
        for variable in self._variables:
            value = glue.variable_value(variable)
            if id(variable) in seen or not _is_aggregating(value):
                continue
            seen.add(id(variable))
            self._swapped.append((variable, value))
            glue.set_variable_value(variable, value.get())
        return self

    def __exit__(self, *exc):
        for variable, value in reversed(self._swapped):
            glue.set_variable_value(variable, value)
        self._swapped = []
        return False


def _is_aggregating(value) -> bool:
    from keras_dist._src.framework_glue import tensorflow_private

    return tensorflow_private.is_aggregating_variable(value)


def create_engine(plan, runtime, input_options):
    """The engine of a `CentralStoragePlan` on this process's devices."""
    del input_options
    if runtime.world_size > 1:
        from keras_dist._src.errors import UnsupportedBackendError

        raise UnsupportedBackendError(
            "CentralStorageStrategy runs on the devices of one host; this "
            f"job has {runtime.world_size} workers. Use "
            "MultiWorkerMirroredStrategy for several hosts."
        )
    devices = [normalize_device(d) for d in plan.devices]
    return CentralStorageEngine(devices, plan.parameter_device)

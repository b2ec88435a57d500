"""torch data parallelism: the policy of replicated variables (DDP).

`MirroredStrategy` on torch runs one process (rank) per device
(`engine.TorchEngine`). Run plainly (``python train.py``), the strategy's
constructor starts the other ranks by re-running the same program (see
`keras_dist._src.cluster.launcher`); started by torchrun, or with a
process group already initialised, it joins instead. GPUs use NCCL, CPUs
gloo.

Every rank receives the same global batch from Keras's torch trainer (with
the chief's generators) and keeps its contiguous shard (`numpy.array_split`
order; with FILE/OFF input its own batch, see `inputs`). What this policy
adds to the engine's glue:

* Training runs the model through `torch.nn.parallel.DistributedDataParallel`,
  so gradients are summed by DDP's bucketed all-reduce (a communication
  hook that sums where DDP's own averages), overlapped with the backward
  pass. Each rank's local mean loss is multiplied by ``n_local / n_global``
  first, so the sum is the gradient of the global-batch mean (also when
  shards differ in size or are empty), and each sample's gradient has the
  magnitude it has on one device: under ``mixed_float16`` the loss scale
  overflows float16 where one device's does. A Keras loss that is not a
  mean over samples is rescaled before that
  (`exact_losses.global_loss_denominators`). A user's own `train_step` has
  its gradients all-reduced at `optimizer.apply` (`reduced_gradients`).
* Metric state is all-reduced as deltas (`metrics_sync.MetricSync`), so
  logs are exact and equal on all ranks.
* BatchNormalization layers compute global moments from all-reduced sums
  and counts (differentiable, like `torch.nn.SyncBatchNorm`) unless the
  strategy has ``sync_batch_norm=False``, in which case the moving
  statistics become their mean over the ranks that had samples in the step
  (as on JAX and TF). Both run Keras's own layer's training forward as one
  autograd function where they can (`batch_norm.sync_call`).
* Dropout draws the global batch's mask and keeps this shard's rows.
* Keras's channels-last 2D/3D convolutions and pooling run on a permuted
  view instead of two transposing copies (`channels_last`): Keras's
  outputs bit for bit (a bias gradient may round in its last bit), a
  faster step.

Each step's shard (sizes, offset, whether it is a stand-in) is one
`step_context.StepContext`.
"""

from __future__ import annotations

import contextlib
import warnings

import keras
import torch
from keras import tree

from keras_dist._src.backends.torch import channels_last, inputs
from keras_dist._src.backends.torch.batch_norm import (
    average_moving_statistics,
    fusable,
    sync_call,
    sync_moments,
)
from keras_dist._src.backends.torch.engine import (
    OneDeviceEngine,
    TorchEngine,
    all_gather_concat,
    broadcast_from_chief,
)
from keras_dist._src.backends.torch.exact_losses import (
    global_loss_denominators,
    global_mask_counts,
)
from keras_dist._src.backends.torch.metrics_sync import (
    MetricSync,
    is_fit_validation_call,
    reads_batch_logs,
    validation_reads_batch_logs,
)
from keras_dist._src.backends.torch.runtime import TorchRuntime
from keras_dist._src.backends.torch.step_context import (
    StepSlot,
    shard_context,
    slice_batch,
)
from keras_dist._src.backends.torch.steps import (
    ModelSteps,
    install_global_dropout,
    over_batches,
)
from keras_dist._src.backends.torch.user_steps import UserSteps
from keras_dist._src.devices import normalize_device
from keras_dist._src.errors import VariablesOutsideScopeError
from keras_dist._src.keras_glue import internals as glue
from keras_dist._src.keras_glue.dropout import draws_per_sample_mask
from keras_dist._src.keras_glue.losses import (
    warn_user_losses,
    watch_user_losses,
)


def check_variables(engine, model) -> None:
    """Raises if a variable is not on this rank's device."""
    if engine.device.type != "cuda":
        return
    for variable in model.variables:
        device = variable.value.device
        if device != engine.device:
            raise VariablesOutsideScopeError(
                f"Variable {variable.path!r} of model {model.name!r} lives "
                f"on {device}, not on this rank's {engine.device}: it was "
                "created before the strategy. Create the strategy first and "
                "build the model inside `with strategy.scope():`."
            )


def _draw_shard_mask(slot):
    """Dropout's mask for a shard of the global batch: drawn for the global
    batch's shape with the layer's own call (same generator, seed and
    shape as on one device: every rank has the chief's generators), this
    rank keeping its rows. Only in a training forward on a slice of the
    global batch (not FILE/OFF input)."""

    def draw(layer, original, inputs):
        context = slot.context
        if (
            context is None
            or context.offset is None
            or not draws_per_sample_mask(layer)
        ):
            return None
        start = context.offset
        probe = torch.ones(
            (context.n_global, *inputs.shape[1:]),
            dtype=inputs.dtype,
            device=inputs.device,
        )
        return original(probe, training=True)[start : start + inputs.shape[0]]

    return draw


class StepFunctions(ModelSteps, UserSteps):
    """The replicated steps of one model (Keras's, or the user's own).

    Args:
        engine: the rank's `MirroredEngine`.
        model: the Keras model compiled in the strategy's scope.
    """

    def __init__(self, engine, model):
        super().__init__(engine, model)
        self.ddp = None
        self._synced = set()
        self._losses_checked = False  # looked for the model's own add_loss
        self.metrics = MetricSync(engine, model)
        self.slot = StepSlot()  # the step context of a training forward

    def install(self) -> None:
        """Replaces the model's step-function factories, its BatchNorm
        moments, Dropout calls and metric reads (on the instance)."""
        model, engine = self.model, self.engine
        self.init_user_steps()
        sync = engine.sync_batch_norm
        # The fused BatchNorm's ranks: all of them, or (without sync) this
        # one alone: its own moments, no collective; the moving statistics
        # are averaged after the step (`after_train_step`).
        group, world_size = (
            (engine.aux_group, engine.world_size) if sync else (None, 1)
        )
        for layer in glue.flatten_layers(model):
            if not isinstance(layer, keras.layers.BatchNormalization):
                continue
            if sync:
                original = glue.original_batch_norm_moments(layer)
                glue.replace_batch_norm_moments(
                    layer,
                    sync_moments(engine.aux_group, self.slot, layer, original),
                )
            if fusable(layer):
                glue.replace_batch_norm_call(
                    layer,
                    sync_call(
                        group,
                        world_size,
                        self.slot,
                        layer,
                        glue.original_batch_norm_call(layer),
                    ),
                )
        # Keras's channels-last convolutions and pooling without their
        # layout copies (Keras's results: see `channels_last`).
        channels_last.install(glue.flatten_layers(model))
        install_global_dropout(model, _draw_shard_mask(self.slot))
        self.metrics.install()
        super().install()
        if model.built:
            self.sync_state()

    # -- state ----------------------------------------------------------------
    def _state_variables(self):
        model = self.model
        variables = list(model.variables)
        optimizer = getattr(model, "optimizer", None)
        if optimizer is not None and getattr(optimizer, "built", False):
            variables += list(optimizer.variables)
        seen, unique = set(), []
        for v in variables:
            # Seed generators included: with the chief's states every rank
            # draws the global batch's dropout mask.
            if id(v) in seen:
                continue
            seen.add(id(v))
            unique.append(v)
        return unique

    def sync_state(self) -> None:
        """Broadcasts variables rank 0 has and this rank has not synced."""
        variables = self._state_variables()
        if all(id(v) in self._synced for v in variables):
            return
        broadcast_from_chief(self.engine.aux_group, variables)
        self._synced = {id(v) for v in variables}

    prepare = sync_state

    # -- shards ---------------------------------------------------------------
    def context_of(self, data):
        """The `StepContext` of this rank's shard of `data`."""
        x, _, _ = keras.utils.unpack_x_y_sample_weight(data)
        engine = self.engine
        return shard_context(
            x,
            engine.call_state.local_batches.take(),
            engine.rank,
            engine.world_size,
        )

    def _shard(self, data):
        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
        engine = self.engine
        context = shard_context(
            x,
            engine.call_state.local_batches.take(),
            engine.rank,
            engine.world_size,
        )
        if context.offset is not None:
            start = context.offset
            x, y, sample_weight = slice_batch(
                (x, y, sample_weight), start, start + context.n_local
            )
        return x, y, sample_weight, context

    def _call(self, module, x, training):
        if glue.call_has_training_arg(self.model):
            return module(x, training=training)
        return module(x)

    # -- train ----------------------------------------------------------------
    def train_function(self):
        """The user's `train_step` on the shard, or Keras's through DDP."""
        model = self.model
        self.ddp = None
        if self.custom["train_step"]:
            self.check_weights_agree = True
            step = self.user_train_step
        else:
            if any(v.trainable for v in model.trainable_weights):
                device = self.engine.device
                # Gradients as views of DDP's all-reduce buckets: DDP
                # copies each new gradient into its bucket and the reduced
                # bucket is the gradient (no copy back out, no second
                # gradient kept); `zero_grad` sets them to None, which DDP
                # supports, and the values are the same.
                glue.order_torch_parameters(model)
                self.ddp = torch.nn.parallel.DistributedDataParallel(
                    model,
                    device_ids=[device.index]
                    if device.type == "cuda"
                    else None,
                    init_sync=False,
                    gradient_as_bucket_view=True,
                )
                self.ddp.register_comm_hook(None, _sum_gradients)
            step = self.train_step

        return over_batches(step)

    def train_step(self, data):
        """One exact step of this rank on its shard of the global batch."""
        model, engine = self.model, self.engine
        x, y, sample_weight, context = self._shard(data)
        n_local, n_global = context.n_local, context.n_global
        before = self.metrics.before_step()
        model.zero_grad()
        module = self.ddp if self.ddp is not None else model
        # The first step looks for the model's own `add_loss` terms (a sum
        # over the batch cannot be made exact: warn once).
        watch = (
            contextlib.nullcontext()
            if self._losses_checked
            else watch_user_losses(model)
        )
        with self.slot.training_forward(context), watch:
            y_pred = self._call(module, x, training=True)
        if not self._losses_checked:
            self._losses_checked = True
            if watch.found:
                warn_user_losses(model, watch.layers)
        counts = global_mask_counts(engine, y_pred, n_local > 0)
        if n_local > 0:
            with global_loss_denominators(engine, n_local, n_global, counts):
                loss = glue.compute_loss(
                    model,
                    x=x,
                    y=y,
                    y_pred=y_pred,
                    sample_weight=sample_weight,
                    training=True,
                )
            glue.loss_tracker(model).update_state(
                loss.detach(), sample_weight=n_local
            )
            # This shard's part of the global-batch mean; DDP sums the
            # parts (`_sum_gradients`).
            scaled = loss * (n_local / n_global)
        else:
            # Still take part in DDP's all-reduce, with zero gradients.
            scaled = sum(
                t.sum() * 0.0 for t in tree.flatten(y_pred) if t is not None
            )
        if model.optimizer is not None:
            scaled = model.optimizer.scale_loss(scaled)
        if model.trainable_weights:
            if self.ddp is not None:
                scaled.backward()
            weights = model.trainable_weights[:]
            gradients = [v.value.grad for v in weights]
            with torch.no_grad():
                model.optimizer.apply(gradients, weights)
        else:
            warnings.warn(
                "The model does not have any trainable weights.", stacklevel=2
            )
        self.after_train_step(context)
        logs = None
        if n_local > 0:
            logs = model.compute_metrics(
                x, y, y_pred, sample_weight=sample_weight
            )
        return self._step_logs(before, logs)

    def after_train_step(self, context) -> None:
        """Without synchronised BatchNorm: moving statistics averaged over
        the ranks that had samples."""
        if not self.engine.sync_batch_norm:
            average_moving_statistics(self.engine, self.model, context)

    # -- test and predict -----------------------------------------------------
    def test_step(self, data):
        """Evaluates this rank's shard; metric state summed over ranks."""
        if self.custom["test_step"]:
            return self.user_test_step(data)
        model, engine = self.model, self.engine
        x, y, sample_weight, context = self._shard(data)
        n_local = context.n_local
        before = self.metrics.before_step()
        y_pred = self._call(model, x, training=False)
        counts = global_mask_counts(engine, y_pred, n_local > 0)
        logs = None
        if n_local > 0:
            with global_loss_denominators(
                engine, n_local, context.n_global, counts
            ):
                loss = glue.compute_loss(
                    model,
                    x=x,
                    y=y,
                    y_pred=y_pred,
                    sample_weight=sample_weight,
                    training=False,
                )
            glue.loss_tracker(model).update_state(loss, sample_weight=n_local)
            logs = model.compute_metrics(
                x, y, y_pred, sample_weight=sample_weight
            )
        return self._step_logs(before, logs)

    def _step_logs(self, before, logs):
        """A step's logs after its metric updates: `logs`, the results
        `compute_metrics` read, while the all-reduce waits (they are this
        rank's, which is what a deferred step returns); read again after
        an all-reduce made now, or where the rank had no sample."""
        self.metrics.after_step(before)
        if logs is None or not self.engine.defer_metric_sync:
            return self.metrics.local_result()
        return logs

    def predict_step(self, data):
        """Predicts this rank's shard; returns the whole batch's outputs."""
        if self.custom["predict_step"]:
            y_pred = self.user_predict_step(data)
        else:
            x = self._shard(data)[0]
            y_pred = self._call(self.model, x, training=False)
        engine = self.engine
        return tree.map_structure(
            lambda t: all_gather_concat(
                t, 0, engine.aux_group, engine.world_size
            ),
            y_pred,
        )


class MirroredEngine(TorchEngine):
    """One rank of a DDP job: exact replicated steps over all ranks.

    Args:
        devices: the strategy's devices (one per rank).
        sync_batch_norm: global-batch BatchNormalization statistics.
        runtime: this process's `TorchRuntime`.
        input_options: how input is sharded between ranks.
    """

    def __init__(self, devices, sync_batch_norm, runtime, input_options=None):
        super().__init__(devices, runtime, input_options)
        self.sync_batch_norm = bool(sync_batch_norm)

    def prepare_call(self, name, method, args, kwargs):
        """Decides the metric deferral and applies the shard policy."""
        if name not in ("fit", "evaluate", "predict"):
            return args, kwargs
        # Decided on the caller's arguments, before rank 0's callbacks are
        # gated: every rank must make the same collectives. `fit`'s
        # validation gets `fit`'s callbacks, gated on the other ranks:
        # its decision is made by `fit`, on the caller's.
        state = self.call_state
        if name == "fit":
            state.validation_reads = validation_reads_batch_logs(
                method, args, kwargs
            )
        if name == "evaluate" and is_fit_validation_call(method, args, kwargs):
            reads = self.caller_state.validation_reads
        else:
            reads = reads_batch_logs(name, method, args, kwargs)
        state.defer_metrics = not reads
        return inputs.prepare_arguments(self, name, method, args, kwargs)

    def attach(self, model) -> None:
        """Checks the variables' device; installs the replicated steps."""
        check_variables(self, model)
        StepFunctions(self, model).install()


def create_engine(plan, runtime, input_options):
    """This process's engine for a `ReplicatedPlan`.

    A one-process runtime (a one-device strategy, or one device outside a
    launched job) gets Keras's own step; otherwise this process is one rank
    of a torch.distributed job with one process per device.
    """
    devices = [normalize_device(d) for d in plan.devices]
    if not isinstance(runtime, TorchRuntime):
        return OneDeviceEngine(devices[0])
    return MirroredEngine(devices, plan.sync_batch_norm, runtime, input_options)


def _sum_gradients(state, bucket):
    """DDP communication hook: sums a gradient bucket over the ranks
    (DDP's default averages; keras_dist scales each rank's loss by its
    share of the global batch instead)."""
    del state  # the default process group
    work = torch.distributed.all_reduce(bucket.buffer(), async_op=True)
    return work.get_future().then(lambda done: done.value()[0])

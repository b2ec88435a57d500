"""PyTorch backend: one process per device, `torch.distributed` + DDP.

`MirroredStrategy` on torch runs one process (rank) per device. Run plainly
(``python train.py``), the strategy's constructor starts the other ranks by
re-running the same program (see `keras_dist._src.cluster.launcher`); started by
torchrun, or with a process group already initialised, it joins instead.
GPUs use NCCL, CPUs gloo.

Every rank iterates the same global batches (Keras's torch trainer, with
identical shuffling); the replicated step takes this rank's contiguous shard
(`numpy.array_split` order), runs forward/backward through
`DistributedDataParallel` (bucketed gradient all-reduce overlapped with the
backward pass), weights the local mean loss by its share of the global batch,
and all-reduces metric state so that logs are exact and equal on all ranks.
Every rank receives the same global batch from Keras's torch trainer and
keeps its contiguous shard (`numpy.array_split` order). Training runs the
model through `torch.nn.parallel.DistributedDataParallel`, so gradients are
averaged by DDP's bucketed all-reduce, overlapped with the backward pass.
Each rank's local mean loss is multiplied by ``n_local * world / n_global``
first, which turns DDP's average into the gradient of the global-batch mean
(also when shards differ in size or are empty). A Keras loss that is not a
mean over samples is rescaled before that (`global_loss_denominators`): a
masked mean to divide by the global batch's unmasked count (all-reduced
after the forward pass), a ``"sum"`` by ``n_global / n_local``.

Metric state is made exact by all-reducing, in one collective, how much
each rank's metric variables changed during the step (numerators and
denominators add up), so logs equal single-device ones on every rank.
BatchNormalization layers compute global moments from all-reduced sums and
counts (differentiable, like `torch.nn.SyncBatchNorm`) unless the strategy
has ``sync_batch_norm=False``, in which case the moving statistics become
their mean over the ranks that had samples in the step (as on JAX and TF).
"""

from __future__ import annotations

import contextlib
import inspect
import time
import warnings

import keras
import numpy as np
import torch
import torch.distributed as dist
from keras import tree

from keras_dist._src.backends.torch import devices as torch_devices
from keras_dist._src.backends.torch.batch_norm import sync_moments
from keras_dist._src.backends.torch.devices import torch_device
from keras_dist._src.backends.torch.inputs import distribute_dataset
from keras_dist._src.backends.torch.runtime import RankFailedError, TorchRuntime
from keras_dist._src.cluster import supervision
from keras_dist._src.core.rng import replicate_chief_generators
from keras_dist._src.core.shards import shard_bounds
from keras_dist._src.devices import normalize_device
from keras_dist._src.errors import VariablesOutsideScopeError
from keras_dist._src.keras_glue import internals as glue
from keras_dist._src.keras_glue.dropout import draws_per_sample_mask
from keras_dist._src.keras_glue.losses import (
    warn_user_losses,
    watch_user_losses,
)
from keras_dist._src.options import InputOptions
from keras_dist._src.patching import InstancePatches
from keras_dist._src.values import PerReplica, ReduceOp, local_results


# -- call scope helpers -------------------------------------------------------
def sync_rng_state(engine) -> None:
    """Gives every rank the chief's global random generators.

    Keras's torch data loader (and a torch `DataLoader(shuffle=True)`)
    shuffles with torch's global generator, `PyDataset` with Python's
    `random`, NumPy input pipelines with NumPy's: with the chief's states
    (broadcast at the start of every call) every rank draws what the chief
    draws, which is what one device draws after the same
    `keras.utils.set_random_seed`. The chief's generators are left as
    plain Keras leaves them (nothing is drawn from them here).
    """
    replicate_chief_generators(
        engine.runtime,
        get_extra=lambda: torch.get_rng_state().numpy(),
        set_extra=lambda v: torch.set_rng_state(
            torch.from_numpy(v.astype(np.uint8))
        ),
    )


_BATCH_HOOKS = {
    "fit": ("on_train_batch_begin", "on_train_batch_end"),
    "evaluate": ("on_test_batch_begin", "on_test_batch_end"),
}


def _implements(callback, hook) -> bool:
    # Keras marks its no-op hooks (as its CallbackList does to skip batch
    # hooks); anything else counts as implemented.
    method = getattr(callback, hook, None)
    return method is not None and not glue.is_default_callback_hook(method)


def reads_batch_logs(name, method, args, kwargs) -> bool:
    """Whether a `fit`/`evaluate` call reads metric values after each step.

    True when the progress bar updates every step (``verbose`` 1 or
    ``"auto"``, except in `fit`'s validation) or a callback other than
    `History` and the progress bar implements a batch hook (``on_batch_*``
    included). When False, keras_dist all-reduces metric updates once, when
    the values are read at the end of the epoch, instead of after every
    step. Computed from the caller's arguments, so it is the same on every
    rank.
    """
    hooks = _BATCH_HOOKS.get(name)
    if hooks is None:
        return True
    arguments = inspect.signature(method).bind(*args, **kwargs).arguments
    callbacks = arguments.get("callbacks") or []
    quiet = (keras.callbacks.History, keras.callbacks.ProgbarLogger)
    if isinstance(callbacks, keras.callbacks.CallbackList):
        if not glue.is_fit_validation(arguments.get("kwargs", {})):
            quiet = (keras.callbacks.History,)  # a caller's own list
        # In `fit`'s validation, fit's progress bar ignores the steps.
        callbacks = callbacks.callbacks
    elif arguments.get("verbose", "auto") in ("auto", 1):
        return True
    hooks = (*hooks, "on_batch_begin", "on_batch_end")
    return any(
        _implements(callback, hook)
        for callback in callbacks
        if not isinstance(callback, quiet)
        for hook in hooks
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


# -- state broadcast and metric all-reduce ------------------------------------
def _flat_groups(tensors):
    groups = {}
    for t in tensors:
        key = t.dtype if t.dtype.is_floating_point else torch.int64
        groups.setdefault(key, []).append(t)
    return groups


def broadcast_from_chief(engine, variables) -> None:
    """Overwrites `variables` with rank 0's values (one collective/dtype)."""
    tensors = [v.value for v in variables]
    with torch.no_grad():
        for dtype, group in _flat_groups(tensors).items():
            flat = torch.cat([t.detach().reshape(-1).to(dtype) for t in group])
            dist.broadcast(flat, 0, group=engine.aux_group)
            offset = 0
            for t in group:
                n = t.numel()
                t.copy_(flat[offset : offset + n].view_as(t).to(t.dtype))
                offset += n


def average_over_ranks(engine, variables, participate: bool) -> None:
    """Sets floating `variables` to their mean over the participating ranks.

    A rank with no samples in the step (an empty shard) does not take part;
    one collective in all.
    """
    tensors = [v.value for v in variables]
    weight = 1.0 if participate else 0.0
    with torch.no_grad():
        flat = torch.cat(
            [t.detach().reshape(-1).to(torch.float64) * weight for t in tensors]
            + [
                torch.tensor(
                    [weight], dtype=torch.float64, device=engine.device
                )
            ]
        )
        dist.all_reduce(flat, group=engine.aux_group)
        count = flat[-1]
        if count == 0:
            return
        flat = flat[:-1] / count
        offset = 0
        for t in tensors:
            n = t.numel()
            t.copy_(flat[offset : offset + n].view_as(t).to(t.dtype))
            offset += n


def _metric_snapshot(variables):
    if not variables:
        return None
    with torch.no_grad():
        return torch.cat(
            [v.value.detach().reshape(-1).to(torch.float64) for v in variables]
        )


def all_reduce_metric_deltas(engine, variables, before) -> None:
    """Adds up, across ranks, each metric variable's change since `before`."""
    if before is None:
        return
    with torch.no_grad():
        after = _metric_snapshot(variables)
        delta = after - before
        dist.all_reduce(delta, group=engine.aux_group)
        total = before + delta
        offset = 0
        for v in variables:
            t = v.value
            n = t.numel()
            t.copy_(total[offset : offset + n].view_as(t).to(t.dtype))
            offset += n


# -- losses and metrics of a shard as parts of the global batch's -------------
def global_mask_counts(engine, y_pred, has_samples: bool):
    """Each masked output's count of unmasked elements over all ranks.

    One collective after the forward pass (every rank, an empty shard
    included, has the same outputs and masks); none when no output of
    `y_pred` has a Keras mask.

    Returns:
        ``{id(mask): global count}`` (tensors on this rank's device).
    """
    masks = [glue.keras_mask(t) for t in tree.flatten(y_pred) if t is not None]
    masks = [m for m in masks if m is not None]
    if not masks:
        return {}
    with torch.no_grad():
        counts = torch.stack(
            [m.detach().to(torch.float64).sum() for m in masks]
        ).to(engine.device)
        if not has_samples:
            counts = torch.zeros_like(counts)
        dist.all_reduce(counts, group=engine.aux_group)
    return {id(m): counts[i] for i, m in enumerate(masks)}


_UNMATCHED_MASK_WARNED = set()


@contextlib.contextmanager
def global_loss_denominators(engine, n_local, n_global, counts=None):
    """Keras's loss reductions of this rank's shard, rescaled so that
    weighting the shard's loss by ``n_local / n_global`` (as the steps do)
    gives this rank's exact part of the global batch's loss.

    A masked mean (Keras divides by the unmasked count) is rescaled to
    divide by the global batch's unmasked count instead of this shard's;
    a ``"sum"`` reduction by ``n_global / n_local``. Means over samples or
    elements (``"sum_over_batch_size"`` without a mask) are exact as they
    are and unchanged.

    Args:
        engine: the rank's engine.
        n_local: samples in this rank's shard (0: a stand-in that counts
            for nothing).
        n_global: samples in the global batch.
        counts: ``{id(mask): global count}`` from `global_mask_counts`; None
            (a user's step, which every rank runs alike) all-reduces each
            masked loss's count where it is reduced.
    """
    original = glue.loss_reduction()
    scale = n_global / max(n_local, 1)

    def reduce_weighted_values(
        values,
        sample_weight=None,
        mask=None,
        reduction="sum_over_batch_size",
        dtype=None,
    ):
        def plain():
            return original(
                values,
                sample_weight=sample_weight,
                mask=mask,
                reduction=reduction,
                dtype=dtype,
            )

        if tuple(np.shape(values)) in ((), (0,)):
            return plain()  # Keras returns such values unreduced
        if reduction == "sum":
            return plain() * scale
        if mask is None or reduction not in ("mean", "sum_over_batch_size"):
            return plain()
        if counts is not None and id(mask) not in counts:
            _warn_unmatched_mask()
            return plain()
        # Keras multiplies a float tensor of sample weights in place by the
        # normalised mask (`apply_mask`), and weighted metrics then read it:
        # Keras gets a copy, the caller's tensor what one device leaves.
        given = sample_weight
        if isinstance(given, torch.Tensor):
            sample_weight = given.clone()
        version = getattr(sample_weight, "_version", None)
        loss = plain()
        with torch.no_grad():
            valid = torch.as_tensor(mask).detach().to(torch.float64).sum()
            if counts is None:
                total = valid * (1.0 if n_local > 0 else 0.0)
                total = total.to(engine.device)
                dist.all_reduce(total, group=engine.aux_group)
            else:
                total = counts[id(mask)]
            factor = torch.where(
                total > 0, valid.to(total.device) * scale / total, 0.0
            )
            if version is not None and sample_weight._version != version:
                # Normalised with this shard's count: the global batch's.
                given.copy_(sample_weight * factor.to(sample_weight.dtype))
        return loss * factor.to(loss.device, loss.dtype)

    glue.set_loss_reduction(reduce_weighted_values)
    try:
        yield
    finally:
        glue.set_loss_reduction(original)


def _warn_unmatched_mask() -> None:
    if "mask" in _UNMATCHED_MASK_WARNED:
        return
    _UNMATCHED_MASK_WARNED.add("mask")
    warnings.warn(
        "A loss is masked with a mask that is not a model output's Keras "
        "mask (a loss that masks its own values): keras_dist divides it by "
        "this replica's unmasked count, so with several replicas it may "
        "differ from one device's. Mask through the model's outputs "
        "(`compute_mask`) or with sample weights instead.",
        stacklevel=3,
    )


class weighted_scalar_means:  # noqa: N801 - used as a context manager
    """In a user's step: a scalar fed to a `keras.metrics.Mean` without a
    sample weight (``tracker.update_state(loss)``) counts with weight
    ``n_local / n_global``, its shard's part of the global batch.

    Summed over ranks (the metric all-reduce) the weights add up to one a
    step, as on one device, and a batch mean (a loss) to the global batch's
    mean, also for unequal shards.
    """

    def __init__(self, metrics, share: float):
        self._metrics = metrics
        self._share = share

    def __enter__(self):
        self._patches = InstancePatches()
        seen = set()
        for metric in self._metrics:
            if id(metric) in seen or not isinstance(metric, keras.metrics.Mean):
                continue
            if isinstance(metric, keras.metrics.MeanMetricWrapper):
                continue  # per-sample values, summed exactly already
            seen.add(id(metric))
            original = metric.update_state

            def update_state(
                values, sample_weight=None, original=original, **kwargs
            ):
                if sample_weight is None and np.ndim(values) == 0:
                    sample_weight = self._share
                return original(values, sample_weight=sample_weight, **kwargs)

            self._patches.set(metric, "update_state", update_state)
        return self

    def __exit__(self, *exc):
        self._patches.restore()
        return False


# -- the step functions -------------------------------------------------------
def _first_leaf(x):
    return next(t for t in tree.flatten(x) if t is not None)


def _slice(structure, start, stop):
    return tree.map_structure(
        lambda t: None if t is None else t[start:stop],
        structure,
        none_is_leaf=True,
    )


def global_dropout(engine, layer, original):
    """A `Dropout.call` that drops what one device drops.

    During a training step on a shard of the global batch
    (``engine.dropout_shard = (start, n_global)``), the mask is drawn for
    the global batch's shape with the layer's own call (same generator, same
    seed, same shape as on one device: seeded layers use their seed
    generator, whose state every rank has from the chief; unseeded ones
    torch's global generator, which every rank has from the chief too), and
    this rank keeps rows ``start:start + n_local``. Elsewhere (inference,
    ``training=True`` outside a step, FILE/OFF input) it is Keras's call.
    """

    def call(inputs, training=False):
        shard = engine.dropout_shard
        if not training or shard is None or not draws_per_sample_mask(layer):
            return original(inputs, training=training)
        start, n_global = shard
        n_local = inputs.shape[0]
        probe = torch.ones(
            (n_global, *inputs.shape[1:]),
            dtype=inputs.dtype,
            device=inputs.device,
        )
        kept = original(probe, training=True)[start : start + n_local]
        seeded = (
            layer.noise_shape is not None
            or glue.seed_generator_initial_seed(layer.seed_generator)
            is not None
        )
        if seeded:
            # Keras's seeded path: where(mask, inputs / keep_prob, 0).
            keep_prob = 1.0 - layer.rate
            return torch.where(
                kept != 0, inputs / keep_prob, torch.zeros_like(inputs)
            )
        # torch's dropout: inputs * (mask / keep_prob).
        return inputs * kept

    return call


class StepFunctions:
    """Installs the replicated step functions on one model.

    Args:
        engine: the rank's `MirroredEngine`.
        model: the Keras model compiled in the strategy's scope.
    """

    def __init__(self, engine, model):
        self.engine = engine
        self.model = model
        self.ddp = None
        self._synced = set()
        # Metric values before the first step whose all-reduce is deferred.
        self._unsynced_since = None
        self._in_step = False
        self._losses_checked = False  # looked for the model's own add_loss
        self.custom = {}
        self._check_weights_agree = False
        self._stand_in = None
        # While a user's step runs: its metric baselines (see
        # `_run_user_step`).
        self._user_step = None

    def install(self) -> None:
        """Replaces the model's step-function factories and its metric
        reads and resets (on the instance)."""
        model = self.model
        engine = self.engine
        engine.bn_sync_active = False
        trainer = glue.torch_trainer()

        cls = type(model)
        # The user's own steps run on this rank's shard (see `user_step`).
        self.custom = {
            name: getattr(cls, name) is not getattr(trainer, name)
            for name in ("train_step", "test_step", "predict_step")
        }
        if engine.sync_batch_norm:
            for layer in glue.flatten_layers(model):
                if isinstance(layer, keras.layers.BatchNormalization):
                    original = glue.original_batch_norm_moments(layer)
                    glue.replace_batch_norm_moments(
                        layer, sync_moments(engine, layer, original)
                    )
        for layer in glue.flatten_layers(model):
            if type(layer) is keras.layers.Dropout:
                original = type(layer).call.__get__(layer)
                layer.__dict__["call"] = global_dropout(engine, layer, original)

        def get_metrics_result():
            # Keras's `compute_metrics` reads the values inside the step:
            # those reads stay local (a rank with no samples skips them),
            # except in a user's step, which every rank runs alike.
            if self._user_step is not None:
                self._sync_in_user_step()
            elif not self._in_step:
                self.sync_metrics()
            return cls.get_metrics_result(model)

        def reset_metrics():
            self._unsynced_since = None
            self._in_step = False  # in case a step raised
            cls.reset_metrics(model)

        get_metrics_result.__doc__ = cls.get_metrics_result.__doc__
        reset_metrics.__doc__ = cls.reset_metrics.__doc__
        model.__dict__["get_metrics_result"] = get_metrics_result
        model.__dict__["reset_metrics"] = reset_metrics
        model.__dict__["make_train_function"] = self.make_train_function
        model.__dict__["make_test_function"] = self.make_test_function
        model.__dict__["make_predict_function"] = self.make_predict_function
        model.train_function = None
        model.test_function = None
        model.predict_function = None
        if model.built:
            self.sync_state()

    # -- metrics --------------------------------------------------------------
    def _metrics_before_step(self):
        """Snapshot of the metric variables before a step, unless the one
        taken before an earlier, still unsynced step covers it."""
        self._in_step = True
        if self._unsynced_since is not None:
            return None
        return _metric_snapshot(list(self.model.metrics_variables))

    def _metrics_after_step(self, before, now=False):
        """Sums the metric updates over ranks now, or defers that.

        `now`: always now (a user's step: Keras may keep its returned logs
        instead of reading the metrics at the end, so they must be global).
        """
        self._in_step = False
        if self._unsynced_since is None:
            self._unsynced_since = before
        if now or not self.engine.defer_metric_sync:
            self.sync_metrics()

    def sync_metrics(self) -> None:
        """All-reduces the metric updates deferred since the last read.

        Called (on every rank alike) when Keras reads the metric values at
        the end of an epoch or an evaluation.
        """
        if self._unsynced_since is None:
            return
        before, self._unsynced_since = self._unsynced_since, None
        variables = list(self.model.metrics_variables)
        all_reduce_metric_deltas(self.engine, variables, before)

    def _local_metrics_result(self):
        return type(self.model).get_metrics_result(self.model)

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
            # draws the global batch's dropout mask (see `global_dropout`).
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
        broadcast_from_chief(self.engine, variables)
        self._synced = {id(v) for v in variables}

    def _check_steps_per_execution(self):
        if self.model.steps_per_execution > 1:
            raise ValueError(
                "`steps_per_execution` must be 1 with the PyTorch backend; "
                f"got {self.model.steps_per_execution}. Compile with "
                "steps_per_execution=1."
            )

    def _shard(self, data):
        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)

        n_global = self.engine.local_batches.take()
        if n_global is not None:
            # FILE/OFF: this rank's own batch; the global batch is the union.
            n_local = int(_first_leaf(x).shape[0]) if tree.flatten(x) else 0
            self.engine.shard_offset = None
            return x, y, sample_weight, n_local, n_global
        total = int(_first_leaf(x).shape[0])
        start, stop = shard_bounds(
            total, self.engine.rank, self.engine.world_size
        )
        # Where this shard lies in the global batch (for `global_dropout`).
        self.engine.shard_offset = (start, total)
        x, y, sample_weight = _slice((x, y, sample_weight), start, stop)
        return x, y, sample_weight, stop - start, total

    def _call(self, module, x, training):
        if glue.call_has_training_arg(self.model):
            return module(x, training=training)
        return module(x)

    # -- train ----------------------------------------------------------------
    def make_train_function(self, force=False):
        """Builds the replicated train function (DDP over the model)."""
        model = self.model
        if model.train_function is not None and not force:
            return model.train_function
        self._check_steps_per_execution()
        self.sync_state()
        self.ddp = None
        if self.custom["train_step"]:
            self._check_weights_agree = True

            def user_step_on_data(data):
                return self.user_train_step(data[0])

            model.train_function = user_step_on_data
            return model.train_function
        if any(v.trainable for v in model.trainable_weights):
            device_ids = None
            if self.engine.device.type == "cuda":
                device_ids = [self.engine.device.index]
            self.ddp = torch.nn.parallel.DistributedDataParallel(
                model,
                device_ids=device_ids,
                init_sync=False,
            )

        def one_step_on_data(data):
            return self.train_step(data[0])

        model.train_function = one_step_on_data
        return model.train_function

    def train_step(self, data):
        """One exact step of this rank on its shard of the global batch."""
        model, engine = self.model, self.engine
        x, y, sample_weight, n_local, n_global = self._shard(data)
        before = self._metrics_before_step()
        model.zero_grad()
        module = self.ddp if self.ddp is not None else model
        # The first step looks for the model's own `add_loss` terms (a sum
        # over the batch cannot be made exact: warn once).
        watch = (
            contextlib.nullcontext()
            if self._losses_checked
            else watch_user_losses(model)
        )
        with self._training_forward(), watch:
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
            share = n_local * engine.world_size / n_global
            scaled = loss * share
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
        if not engine.sync_batch_norm:
            self._average_moving_statistics(n_local > 0)
        if n_local > 0:
            model.compute_metrics(x, y, y_pred, sample_weight=sample_weight)
        self._metrics_after_step(before)
        return self._local_metrics_result()

    @contextlib.contextmanager
    def _training_forward(self):
        """Synchronised BatchNorm moments and global dropout masks."""
        engine = self.engine
        engine.bn_sync_active = True
        engine.dropout_shard = engine.shard_offset
        try:
            yield
        finally:
            engine.bn_sync_active = False
            engine.dropout_shard = None

    # -- the user's own steps -------------------------------------------------
    def _local_data(self, data):
        """This rank's shard of `data`, in the structure Keras passed it,
        and ``(n_local, n_global)``."""
        _, _, _, n_local, n_global = self._shard(data)
        engine = self.engine
        offset = engine.shard_offset
        if offset is None:
            # FILE/OFF: a rank that has run out of batches gets an empty one;
            # it runs the step on a stand-in (its last batch's first sample)
            # that counts for nothing, as below.
            if n_local > 0:
                self._stand_in = _slice(data, 0, 1)
            elif self._stand_in is not None:
                engine.phantom_shard = True
                return self._stand_in, 0, n_global
            return data, n_local, n_global
        if n_local == 0:
            # An empty shard: the user's step may not handle an empty batch
            # (a loss of shape (0,)), so it runs on the global batch's first
            # sample as a phantom that counts for nothing: zero gradient
            # share, no BatchNorm statistics, metric updates undone.
            engine.shard_offset = (0, n_global)
            engine.phantom_shard = True
            return _slice(data, 0, 1), 0, n_global
        start = offset[0]
        return _slice(data, start, start + n_local), n_local, n_global

    def _optimizers(self):
        model = self.model
        found = [model.optimizer] if model.optimizer is not None else []
        for value in vars(model).values():
            if isinstance(value, keras.optimizers.Optimizer) and not any(
                value is o for o in found
            ):
                found.append(value)
        return found

    @contextlib.contextmanager
    def _reduced_gradients(self, share: float, has_samples: bool):
        """Makes every optimizer of the model all-reduce what it applies.

        Inside, ``optimizer.apply(gradients, variables)`` (also through
        `apply_gradients`) first sums ``share * gradient`` over ranks:
        with each rank's loss a mean over its shard and ``share`` its part
        of the global batch, that is the gradient of the global mean, as on
        one device (also for unequal shards). A rank without samples
        contributes zeros.
        """
        engine = self.engine
        patched = []

        def reducing(optimizer, original):
            def apply(grads, trainable_variables=None):
                grads = list(grads)
                live = [i for i, g in enumerate(grads) if g is not None]
                if live:
                    with torch.no_grad():
                        parts = [
                            grads[i].detach().reshape(-1).to(torch.float32)
                            for i in live
                        ]
                        flat = torch.cat(parts) * share
                        if not has_samples:
                            flat = torch.zeros_like(flat)
                        dist.all_reduce(flat, group=engine.aux_group)
                        offset = 0
                        for i in live:
                            g = grads[i]
                            n = g.numel()
                            grads[i] = (
                                flat[offset : offset + n].view_as(g).to(g.dtype)
                            )
                            offset += n
                return original(grads, trainable_variables)

            return apply

        for optimizer in self._optimizers():
            original = optimizer.__dict__.get("apply")
            patched.append((optimizer, original))
            optimizer.__dict__["apply"] = reducing(optimizer, optimizer.apply)
        try:
            yield
        finally:
            for optimizer, original in patched:
                if original is None:
                    optimizer.__dict__.pop("apply", None)
                else:
                    optimizer.__dict__["apply"] = original

    def _merge_logs(self, logs, local):
        """The user's step's logs, where a value is a metric's (local)
        result, replaced by that metric's result summed over ranks.

        Args:
            logs: what the user's step returned.
            local: this rank's metric results right after the step.
        """
        if not isinstance(logs, dict):
            return logs
        synced = self._local_metrics_result()

        def pick(key, value):
            if isinstance(value, dict):  # e.g. CompileMetrics's result
                return {k: pick(k, v) for k, v in value.items()}
            mine = local.get(key)
            if mine is None or key not in synced:
                return value
            try:
                same = bool(
                    torch.equal(
                        torch.as_tensor(value).detach().cpu(),
                        torch.as_tensor(mine).detach().cpu(),
                    )
                )
            except (TypeError, RuntimeError, ValueError):
                same = False
            return synced[key] if same else value

        return {key: pick(key, value) for key, value in logs.items()}

    def _mean_trackers(self):
        """The model's metrics and metric attributes (Mean trackers)."""
        model = self.model
        found = list(model.metrics) + [glue.loss_tracker(model)]
        found += [
            v
            for v in vars(model).values()
            if isinstance(v, keras.metrics.Metric)
        ]
        return [m for m in found if m is not None]

    def _restore_metrics(self, snapshot) -> None:
        """Undoes the metric updates of a step on an empty shard."""
        if snapshot is None:
            return
        variables = list(self.model.metrics_variables)
        with torch.no_grad():
            offset = 0
            for v in variables:
                t = v.value
                n = t.numel()
                t.copy_(snapshot[offset : offset + n].view_as(t).to(t.dtype))
                offset += n

    def _run_user_step(self, run, n_local, n_global):
        """Runs a user's step with exact metrics.

        Metric reads through `get_metrics_result` inside the step (Keras's
        `compute_metrics`, `super().test_step(...)`) return values summed
        over ranks, so logs derived from them are global; a rank on a
        stand-in sample (empty shard) has its metric updates undone.
        Scalars fed to `Mean` trackers count with the shard's share of the
        global batch (`weighted_scalar_means`), and Keras's masked losses
        divide by the global unmasked count (`global_loss_denominators`).

        Returns:
            ``(logs, this rank's metric results right after the step)``.
        """
        variables = list(self.model.metrics_variables)
        before = self._metrics_before_step()
        base = _metric_snapshot(variables) if n_local == 0 else None
        self._user_step = {"before": before, "base": base}
        engine = self.engine
        share = n_local / n_global
        try:
            with (
                weighted_scalar_means(self._mean_trackers(), share),
                global_loss_denominators(engine, n_local, n_global),
            ):
                logs = run()
        finally:
            self.engine.phantom_shard = False
            state, self._user_step = self._user_step, None
        local_results = self._local_metrics_result()
        if state["base"] is not None:
            self._restore_metrics(state["base"])
        self._metrics_after_step(state["before"], now=True)
        return logs, local_results

    def _sync_in_user_step(self) -> None:
        state = self._user_step
        if state["base"] is not None:
            self._restore_metrics(state["base"])
        if self._unsynced_since is None:
            self._unsynced_since = state["before"]
        self.sync_metrics()
        # Updates later in the step count from here.
        state["before"] = _metric_snapshot(list(self.model.metrics_variables))
        if state["base"] is not None:
            state["base"] = state["before"]

    def user_train_step(self, data):
        """Runs the model's own `train_step` on this rank's shard.

        Gradients are reduced at `optimizer.apply` (`_reduced_gradients`);
        BatchNormalization and dropout see the global batch as in Keras's
        step. A rank with an empty shard runs the step too (the same
        collectives) but contributes nothing, and its metric updates are
        undone.
        """
        model = self.model
        local, n_local, n_global = self._local_data(data)

        def run():
            with self._reduced_gradients(n_local / n_global, n_local > 0):
                with self._training_forward():
                    return model.train_step(local)

        logs, local_results = self._run_user_step(run, n_local, n_global)
        if not self.engine.sync_batch_norm:
            self._average_moving_statistics(n_local > 0)
        if self._check_weights_agree:
            self._check_weights_agree = False
            self._check_replicas_agree()
        return self._merge_logs(logs, local_results)

    def _check_replicas_agree(self) -> None:
        """After the first step of an overridden `train_step`: raises if the
        ranks' weights differ (the step updated them without an optimizer
        keras_dist reduces), instead of training diverged replicas."""
        sums = np.array(
            [
                float(v.value.detach().double().sum())
                for v in self.model.trainable_weights
            ]
            or [0.0]
        )
        low = self.engine.runtime.all_reduce(sums, "min")
        high = self.engine.runtime.all_reduce(sums, "max")
        if not np.allclose(low, high, rtol=1e-6, atol=1e-7):
            raise ValueError(
                f"The `train_step` of model {self.model.name!r} left "
                "different weights on different ranks. keras_dist all-reduces "
                "the gradients passed to `optimizer.apply` (or "
                "`apply_gradients`) of the model's optimizers; update weights "
                "through one of them (e.g. `self.optimizer.apply(gradients, "
                "self.trainable_weights)`)."
            )

    def _average_moving_statistics(self, has_samples: bool):
        variables = [
            v
            for v in self.model.non_trainable_variables
            if "seed_generator" not in v.path
            and v.value.dtype.is_floating_point
        ]
        if variables:
            average_over_ranks(self.engine, variables, has_samples)

    # -- test -----------------------------------------------------------------
    def make_test_function(self, force=False):
        """Builds the replicated test function (exact metrics)."""
        return self._make_inference_function(
            "test_function", self.test_step, force
        )

    def _make_inference_function(self, attribute, step, force):
        """Sets `model.<attribute>` to run `step` without gradients."""
        model = self.model
        if getattr(model, attribute) is not None and not force:
            return getattr(model, attribute)
        self._check_steps_per_execution()
        self.sync_state()

        def one_step_on_data(data):
            with torch.no_grad():
                return step(data[0])

        setattr(model, attribute, one_step_on_data)
        return one_step_on_data

    def test_step(self, data):
        """Evaluates this rank's shard; metric state summed over ranks."""
        model = self.model
        if self.custom["test_step"]:
            local, n_local, n_global = self._local_data(data)
            logs, local_results = self._run_user_step(
                lambda: model.test_step(local), n_local, n_global
            )
            return self._merge_logs(logs, local_results)
        x, y, sample_weight, n_local, n_global = self._shard(data)
        before = self._metrics_before_step()
        y_pred = self._call(model, x, training=False)
        counts = global_mask_counts(self.engine, y_pred, n_local > 0)
        if n_local > 0:
            with global_loss_denominators(
                self.engine, n_local, n_global, counts
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
            model.compute_metrics(x, y, y_pred, sample_weight=sample_weight)
        self._metrics_after_step(before)
        return self._local_metrics_result()

    # -- predict --------------------------------------------------------------
    def make_predict_function(self, force=False):
        """Builds the replicated predict function (gathered outputs)."""
        return self._make_inference_function(
            "predict_function", self.predict_step, force
        )

    def predict_step(self, data):
        """Predicts this rank's shard; returns the whole batch's outputs."""
        if self.custom["predict_step"]:
            local, n_local, _ = self._local_data(data)
            self.engine.phantom_shard = False
            y_pred = self.model.predict_step(local)
            if n_local == 0:  # drop the phantom sample's outputs
                y_pred = tree.map_structure(lambda t: t[:0], y_pred)
        else:
            x, _, _, _, _ = self._shard(data)
            y_pred = self._call(self.model, x, training=False)
        engine = self.engine
        return tree.map_structure(
            lambda t: all_gather_concat(
                t, 0, engine.aux_group, engine.world_size
            ),
            y_pred,
        )


# -- engines ------------------------------------------------------------------
class OneDeviceEngine:
    """Keras's own torch step on one device, no process group."""

    is_chief = True

    def __init__(self, device: str):
        self.devices = (device,)
        self._device = torch_device(device)

    @property
    def num_replicas_in_sync(self) -> int:
        return 1

    def scope(self):
        return contextlib.nullcontext()

    def call_scope(self):
        return contextlib.nullcontext()

    def prepare_call(self, name, method, args, kwargs):
        return args, kwargs

    def attach(self, model) -> None:
        del model

    def run(self, fn, args, kwargs):
        return fn(*args, **kwargs)

    def reduce(self, op, value, axis):
        x = _as_tensor(local_results(value)[0])
        if axis is None:
            return x
        return x.sum(axis) if op is ReduceOp.SUM else x.mean(axis)

    def gather(self, value, axis):
        return _as_tensor(local_results(value)[0])

    def local_results(self, value):
        return local_results(value)

    def placement(self, variable):
        """Replicated: every device holds the whole variable."""
        shape = tuple(variable.shape)
        return (None,) * len(shape), shape

    def distribute_dataset(self, dataset):
        return distribute_dataset(dataset, 0, 1)


class MirroredEngine:
    """One rank of a DDP job: exact replicated steps over all ranks.

    Args:
        devices: the strategy's devices (one per rank).
        sync_batch_norm: global-batch BatchNormalization statistics.
    """

    def __init__(self, devices, sync_batch_norm: bool, runtime):
        self.devices = tuple(devices)
        self.sync_batch_norm = bool(sync_batch_norm)
        self.runtime = runtime
        self.job = runtime.job
        if self.devices[0].startswith("cpu"):
            torch_devices.claim_cpu_devices(len(self.devices))
        index = min(self.job.local_rank, len(self.devices) - 1)
        self.device = torch_device(self.devices[index])
        if self.device.type == "cuda":
            self.device = torch.device("cuda", torch.cuda.current_device())
        # Collectives issued from inside forward/backward (BatchNorm) and
        # for metrics use their own group, so that their order can never
        # interleave with DDP's asynchronous bucket all-reduces.
        self.aux_group = dist.new_group(
            backend="nccl" if self.device.type == "cuda" else "gloo"
        )
        from keras_dist._src.backends.torch.inputs import LocalBatchTracker

        # Set by the input of FILE/OFF policies: the next batch is local.
        self.local_batches = LocalBatchTracker()
        self.input_options = InputOptions()
        # (start, n_global) of this rank's shard in the step in progress,
        # and the same during a training forward (for `global_dropout`).
        self.shard_offset = None
        self.dropout_shard = None
        self.bn_sync_active = False
        # Whether this rank's batch is a stand-in for an empty shard.
        self.phantom_shard = False
        # Per call in progress (innermost last): whether nothing reads the
        # per-step metric values, so their all-reduce can wait until read.
        self._defer_metrics = []

    @property
    def rank(self) -> int:
        """This process's rank."""
        return self.job.rank

    @property
    def world_size(self) -> int:
        """Number of ranks (replicas)."""
        return self.job.world_size

    @property
    def num_replicas_in_sync(self) -> int:
        return self.job.world_size

    @property
    def is_chief(self) -> bool:
        """Whether this is rank 0, the one that prints and writes files."""
        return self.job.rank == 0

    def scope(self):
        return contextlib.nullcontext()

    @contextlib.contextmanager
    def call_scope(self):
        self._defer_metrics.append(False)
        try:
            self.local_batches.pending = None
            sync_rng_state(self)
            yield
        except BaseException as error:
            self._check_other_ranks(error)
            raise
        finally:
            self._defer_metrics.pop()

    @property
    def defer_metric_sync(self) -> bool:
        """Whether the call in progress reads metric values only at its end."""
        return bool(self._defer_metrics) and self._defer_metrics[-1]

    def prepare_call(self, name, method, args, kwargs):
        from keras_dist._src.backends.torch import inputs

        if name not in ("fit", "evaluate", "predict"):
            return args, kwargs
        if self._defer_metrics:
            # Decided on the caller's arguments, before rank 0's callbacks
            # are gated: every rank must make the same collectives.
            self._defer_metrics[-1] = not reads_batch_logs(
                name, method, args, kwargs
            )
        args, kwargs = inputs.prepare_arguments(
            self, name, method, args, kwargs
        )
        return args, kwargs

    def _check_other_ranks(self, error) -> None:
        """Turns `error` into `RankFailedError` if another rank failed.

        An exception of this rank's own is not reported here: the caller may
        catch it (``try: model.fit(...) except ...``) and go on, so only an
        uncaught exception (the excepthook) stops the job. If another rank
        has already reported a failure (or a started child died), this
        rank's error is a consequence of it and says so.
        """
        if isinstance(error, RankFailedError):
            return
        supervisor = self.job.supervisor
        # A collective that failed because another rank died or failed:
        # wait briefly for that failure to be reported, to name it.
        polls = 4 if isinstance(error, (RuntimeError, OSError)) else 1
        first = None
        for attempt in range(polls):
            if supervisor is not None:
                for rank, proc in supervisor.children.items():
                    code = proc.poll()
                    if supervision.is_failure(code):
                        supervisor.fail(
                            f"rank {rank} {supervision.describe_exit(code)}"
                        )
            first = self._reported_failure()
            if first or attempt + 1 == polls:
                break
            time.sleep(supervision.POLL_SECONDS)
        if first:
            self.job.mute()
            raise RankFailedError(
                f"Rank {self.rank} stops because another rank failed: "
                f"{first}. Fix the error of that rank (its traceback is in "
                "its output)."
            ) from error

    def _reported_failure(self) -> str | None:
        """The failure a rank reported to the job's store, if any."""
        job = self.job
        try:
            if job._report_store is None:
                job._report_store = job._client()
            store = job._report_store
            if store is None or not store.check([supervision.ERROR_KEY]):
                return None
            return store.get(supervision.ERROR_KEY).decode() or None
        except Exception:  # noqa: BLE001 - store gone: rank 0 died.
            return "rank 0 is gone (its rendezvous store is unreachable)"

    def attach(self, model) -> None:
        check_variables(self, model)
        StepFunctions(self, model).install()

    # -- collectives on per-rank values ---------------------------------------
    def run(self, fn, args, kwargs):
        args = _select_local(args)
        kwargs = _select_local(kwargs)
        return fn(*args, **kwargs)

    def reduce(self, op, value, axis):
        x = _as_tensor(local_results(value)[0]).to(self.device)
        if axis is None:
            total = x.detach().clone().float()
            dist.all_reduce(total, group=self.aux_group)
            if op is ReduceOp.MEAN:
                total = total / self.world_size
            return total
        count = torch.tensor([float(x.shape[axis])], device=self.device)
        total = x.detach().float().sum(axis)
        packed = torch.cat([total.reshape(-1), count])
        dist.all_reduce(packed, group=self.aux_group)
        total = packed[:-1].reshape(total.shape)
        if op is ReduceOp.MEAN:
            total = total / packed[-1].clamp_min(1)
        return total

    def gather(self, value, axis):
        x = _as_tensor(local_results(value)[0]).to(self.device)
        return all_gather_concat(x, axis, self.aux_group, self.world_size)

    def local_results(self, value):
        return local_results(value)

    def placement(self, variable):
        """Replicated: every device holds the whole variable."""
        shape = tuple(variable.shape)
        return (None,) * len(shape), shape

    def distribute_dataset(self, dataset):
        return distribute_dataset(dataset, self.rank, self.world_size)


def all_gather_concat(x, axis, group, world_size):
    """Concatenates each rank's `x` along `axis` (sizes may differ)."""
    x = torch.movedim(x.detach(), axis, 0).contiguous()
    size = torch.tensor([x.shape[0]], device=x.device)
    sizes = [torch.zeros_like(size) for _ in range(world_size)]
    dist.all_gather(sizes, size, group=group)
    sizes = [int(s) for s in sizes]
    longest = max(sizes)
    padded = x.new_zeros((longest,) + tuple(x.shape[1:]))
    padded[: x.shape[0]] = x
    parts = [torch.empty_like(padded) for _ in range(world_size)]
    dist.all_gather(parts, padded, group=group)
    out = torch.cat([p[:n] for p, n in zip(parts, sizes, strict=True)])
    return torch.movedim(out, 0, axis)


def create_engine(plan, runtime, input_options):
    """This process's engine for a `ReplicatedPlan`.

    A one-process runtime (a one-device strategy, or one device outside a
    launched job) gets Keras's own step; otherwise this process is one rank
    of a torch.distributed job with one process per device.
    """
    devices = [normalize_device(d) for d in plan.devices]
    if not isinstance(runtime, TorchRuntime):
        return OneDeviceEngine(devices[0])
    engine = MirroredEngine(devices, plan.sync_batch_norm, runtime)
    engine.input_options = input_options or InputOptions()
    return engine


# -- helpers ------------------------------------------------------------------
def _as_tensor(x):
    if isinstance(x, torch.Tensor):
        return x
    return torch.as_tensor(np.asarray(x))


def _select_local(structure):
    def pick(x):
        if isinstance(x, PerReplica):
            if len(x) != 1:
                raise ValueError(
                    "On torch each process holds one replica; a per-replica "
                    f"value with {len(x)} parts cannot be used here. Pass "
                    "this process's own part."
                )
            return x.values[0]
        return x

    if not structure:
        return structure
    return tree.map_structure(pick, structure, none_is_leaf=True)

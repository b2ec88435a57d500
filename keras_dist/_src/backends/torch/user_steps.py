"""The model's own `train_step`/`test_step`/`predict_step` on a rank's shard.

A model that overrides Keras's steps runs its own code on this rank's
shard of the global batch, with exact metrics (reads inside the step
return values summed over ranks), Keras's masked losses divided by the
global unmasked count, scalars fed to `Mean` trackers weighted by the
shard's part of the batch, and gradients reduced where the step applies
them (`reduced_gradients`). A rank with an empty shard runs
the step too, on a stand-in sample that counts for nothing, so that every
rank makes the same collectives.

`UserSteps` is mixed into a policy's `steps.ModelSteps`, which provides
``context_of(data)`` (the step's `StepContext`), ``metrics`` (a
`metrics_sync.MetricSync`), ``slot`` (a `StepSlot`) and
``after_train_step(context)``.
"""

from __future__ import annotations

import contextlib

import keras
import numpy as np
import torch
import torch.distributed as dist
from keras import tree

from keras_dist._src.backends.torch.exact_losses import (
    global_loss_denominators,
    weighted_scalar_means,
)
from keras_dist._src.backends.torch.metrics_sync import metric_snapshot
from keras_dist._src.backends.torch.step_context import slice_batch
from keras_dist._src.keras_glue import internals as glue


class UserSteps:
    """The user's own steps of one model (a mixin of a policy's steps)."""

    def init_user_steps(self) -> None:
        """Notes which of Keras's steps the model's class overrides."""
        cls = type(self.model)
        trainer = glue.torch_trainer()
        self.custom = {
            name: getattr(cls, name) is not getattr(trainer, name)
            for name in ("train_step", "test_step", "predict_step")
        }
        # The last sample of this rank's own batches (FILE/OFF input): a
        # rank that has run out runs on it as a stand-in.
        self._stand_in = None
        self.check_weights_agree = False

    def local_data(self, data):
        """This rank's shard of `data`, in the structure Keras passed it,
        and the step's `StepContext`."""
        context = self.context_of(data)
        if context.offset is None:
            # FILE/OFF: a rank that has run out of batches gets an empty one;
            # it runs the step on a stand-in (its last batch's first sample)
            # that counts for nothing, as below.
            if context.n_local > 0:
                self._stand_in = slice_batch(data, 0, 1)
            elif self._stand_in is not None:
                context.phantom = True
                return self._stand_in, context
            return data, context
        if context.n_local == 0:
            # An empty shard: the user's step may not handle an empty batch
            # (a loss of shape (0,)), so it runs on the global batch's first
            # sample as a phantom that counts for nothing: zero gradient
            # share, no BatchNorm statistics, metric updates undone.
            context.offset = 0
            context.phantom = True
            return slice_batch(data, 0, 1), context
        start = context.offset
        return slice_batch(data, start, start + context.n_local), context

    def run_user_step(self, run, context):
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
        metrics = self.metrics
        n_local, n_global = context.n_local, context.n_global
        before = metrics.before_step()
        base = metric_snapshot(metrics.variables()) if n_local == 0 else None
        metrics.user_step = {"before": before, "base": base}
        try:
            with (
                weighted_scalar_means(
                    self._mean_trackers(), n_local / n_global
                ),
                global_loss_denominators(self.engine, n_local, n_global),
            ):
                logs = run()
        finally:
            state, metrics.user_step = metrics.user_step, None
        local_results = metrics.local_result()
        if state["base"] is not None:
            metrics.restore(state["base"])
        metrics.after_step(state["before"], now=True)
        return logs, local_results

    def user_train_step(self, data):
        """Runs the model's own `train_step` on this rank's shard.

        Gradients are reduced at `optimizer.apply` (`reduced_gradients`);
        BatchNormalization and dropout see the global batch as in Keras's
        step. A rank with an empty shard runs
        the step too (the same collectives) but contributes nothing, and
        its metric updates are undone.
        """
        model = self.model
        local, context = self.local_data(data)
        # What `reduced_gradients` weights this rank's gradients by (0 for a
        # stand-in sample: its n_local is 0).
        context.gradient_weight = context.n_local / context.n_global

        def run():
            with self.reduced_gradients(context):
                with self.slot.training_forward(context):
                    return model.train_step(local)

        logs, local_results = self.run_user_step(run, context)
        self.after_train_step(context)
        if self.check_weights_agree:
            self.check_weights_agree = False
            self._check_replicas_agree()
        return self._merge_logs(logs, local_results)

    def user_test_step(self, data):
        """Runs the model's own `test_step` on this rank's shard."""
        local, context = self.local_data(data)
        logs, local_results = self.run_user_step(
            lambda: self.model.test_step(local), context
        )
        return self._merge_logs(logs, local_results)

    def user_predict_step(self, data):
        """Runs the model's own `predict_step` on this rank's shard; the
        outputs of a stand-in sample are dropped."""
        local, context = self.local_data(data)
        y_pred = self.model.predict_step(local)
        if context.n_local == 0:
            y_pred = tree.map_structure(lambda t: t[:0], y_pred)
        return y_pred

    def optimizers(self) -> list:
        """The model's optimizer and any other optimizer attribute."""
        model = self.model
        found = [model.optimizer] if model.optimizer is not None else []
        for value in vars(model).values():
            if isinstance(value, keras.optimizers.Optimizer) and not any(
                value is o for o in found
            ):
                found.append(value)
        return found

    @contextlib.contextmanager
    def reduced_gradients(self, context):
        """Makes every optimizer of the model all-reduce what it applies.

        Inside, ``optimizer.apply(gradients, variables)`` (also through
        `apply_gradients`) first sums ``share * gradient`` over ranks:
        with each rank's loss a mean over its shard and ``share`` its part
        of the global batch (``n_local / n_global``), that is the gradient
        of the global mean, as on one device (also for unequal shards). A
        rank without samples contributes zeros. ``share`` is
        `context.gradient_weight`, which BatchNormalization's backward
        collectives read too.
        """
        group = self.engine.aux_group
        share = context.gradient_weight
        has_samples = context.n_local > 0
        patched = []

        def reducing(original):
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
                        dist.all_reduce(flat, group=group)
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

        for optimizer in self.optimizers():
            patched.append((optimizer, optimizer.__dict__.get("apply")))
            optimizer.__dict__["apply"] = reducing(optimizer.apply)
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
        synced = self.metrics.local_result()

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

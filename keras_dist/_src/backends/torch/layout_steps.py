"""Keras's own steps on a torch mesh's DTensors (`sharded.DTensorEngine`).

`LayoutSteps` installs, on a model laid out over a mesh, Keras's
`train_step`/`test_step`/`predict_step` on DTensor batches (inside
`implicit_replication`, and torch's math attention kernel on CPUs), the
layer calls DTensor needs beside them, and calls by hand:

- a training `BatchNormalization` of a batch split over the batch axis
  as one function with the global batch's moments (`batch_norm`);
- Keras's channels-last convolutions and pooling without their layout
  copies (`channels_last`);
- `Dropout` masks drawn for the global batch as one device draws them
  (`_draw_global_mask`);
- an `Embedding` whose table is split by rows: its lookup reduced at
  once (`_install_reduced_lookups`);
- a `Dense` whose kernel is split by rows: its input split by features
  first (`_install_split_inputs`);
- under `ShardedDataParallel`, each layer's split variables gathered in
  one all-gather a pass (`layer_gather`);
- a layer called by hand with plain tensors runs as a step does and
  returns plain tensors (`direct_call`); the plan's ``"…/output"`` keys
  relayout outputs (`_output_layout_call`).
"""

from __future__ import annotations

import contextlib
import threading

import keras
import torch
from keras import tree
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.experimental import implicit_replication
from torch.nn.attention import SDPBackend, sdpa_kernel

from keras_dist._src import plan as plan_lib
from keras_dist._src.backends.torch import (
    batch_norm,
    channels_last,
    layer_gather,
    layouts,
    shard_update,
)
from keras_dist._src.backends.torch.steps import (
    ModelSteps,
    install_global_dropout,
)
from keras_dist._src.errors import LayoutError
from keras_dist._src.keras_glue import internals as glue


def _draw_global_mask(engine):
    """Dropout's mask on a DTensor batch: drawn with the layer's own call
    on a plain tensor of ones of the global shape (the chief's generators
    on every rank: the draw of one device), replicated, and applied to the
    (split) batch."""

    def draw(layer, original, inputs):
        if not isinstance(inputs, DTensor) or layer.rate <= 0:
            return None
        probe = torch.ones(
            tuple(inputs.shape), dtype=inputs.dtype, device=engine.device
        )
        return DTensor.from_local(
            original(probe, training=True),
            inputs.device_mesh,
            (Replicate(),) * inputs.device_mesh.ndim,
            run_check=False,
        )

    return draw


def _install_reduced_lookups(model) -> None:
    """An `Embedding` whose table is split by rows returns, under DTensor,
    each rank's rows as a "masked partial" sum, whose mask keeps the shape
    of the ids; a later reshape of the output (a `Dense` or `EinsumDense`
    on a sequence: ``[B, L, D]`` to ``[B * L, D]``) leaves the mask behind,
    and reducing it fails (torch 2.13: ``IndexError`` in ``apply_mask``).
    The lookup's output is reduced right away instead (one all-reduce over
    the table's axis, as torch's `RowwiseParallel` embedding replicates
    its output)."""
    glue.wrap_layer_calls(
        model, lambda layer: isinstance(layer, keras.layers.Embedding),
        _reduced_lookup,
    )  # fmt: skip


def _reduced_lookup(layer, original):
    def call(*args, **kwargs):
        ids = None
        if args and not (kwargs.get("reverse") or args[1:2] == (True,)):
            ids = args[0]
            args = (_ids_whole_where_table_split(layer, ids),) + args[1:]
        outputs = original(*args, **kwargs)
        if isinstance(outputs, DTensor) and any(
            p.is_partial() for p in outputs.placements
        ):
            mesh = outputs.device_mesh
            placements = tuple(
                Replicate() if p.is_partial() else p for p in outputs.placements
            )
            # Through a plain tensor, so that the backward hands the
            # lookup a gradient with these placements: a partial gradient
            # (a later sum over the batch axis) cannot be redistributed to
            # the masked partial placement (torch 2.13 refuses).
            local = outputs.redistribute(mesh, placements).to_local(
                grad_placements=placements
            )
            outputs = DTensor.from_local(
                local, mesh, placements, run_check=False
            )
            outputs = _split_as_ids(outputs, ids)
        return outputs

    call.__doc__ = getattr(original, "__doc__", None)
    return call


def _split_as_ids(outputs, ids):
    """A reduced lookup's output split again by batch rows over each mesh
    axis that split the ids by rows (and that the output is whole on): the
    ids were gathered for the lookup (`_ids_whole_where_table_split`), and
    without this every later layer computes the whole global batch on every
    rank of that axis (``ShardedDataParallel``, whose table is split by
    rows over the batch axis: no data parallelism after an `Embedding`,
    and each `Dense` then splits its input by features and all-reduces its
    whole output). A local slice; its backward gathers the gradient."""
    if not isinstance(ids, DTensor) or ids.ndim < 1:
        return outputs
    placements = tuple(
        Shard(0) if p.is_shard(0) and o.is_replicate() else o
        for p, o in zip(ids.placements, outputs.placements)
    )
    if placements == tuple(outputs.placements):
        return outputs
    return outputs.redistribute(outputs.device_mesh, placements)


def _ids_whole_where_table_split(layer, ids):
    """The ids of a lookup, gathered over each mesh axis that splits both
    them (the batch) and the table (KerasHub's Gemma map splits the
    embeddings' width over "batch"). DTensor would move the ids itself,
    but its masked partial output then keeps a mask of the split ids'
    shape, and reducing it fails (torch 2.13: ``IndexError`` in
    ``apply_mask``)."""
    table = getattr(layer, "embeddings", None)
    table = getattr(table, "value", table)
    if not (isinstance(ids, DTensor) and isinstance(table, DTensor)):
        return ids
    placements = tuple(
        Replicate() if p.is_shard() and not t.is_replicate() else p
        for p, t in zip(ids.placements, table.placements)
    )
    if placements == tuple(ids.placements):
        return ids
    return ids.redistribute(ids.device_mesh, placements)


def _install_split_inputs(model) -> None:
    """A `Dense` whose kernel is split by rows (its input features) over a
    mesh axis on which its input is whole: the input is split by features
    explicitly before the call. DTensor would split it inside the matmul
    all the same, but then hands back the input's gradient split by
    features, and a later layer's backward may re-split it by batch rows
    instead: with a batch the axis does not divide (an odd last batch),
    torch 2.13 then fails to reshape the uneven rows (``RuntimeError:
    shape '[1, 15, 8]' is invalid``, a LayerNormalization and a
    MultiHeadAttention before such a `Dense`). The explicit split's backward
    gathers the gradient back to the input's own placement instead."""
    glue.wrap_layer_calls(
        model, lambda layer: isinstance(layer, keras.layers.Dense),
        _split_input_call,
    )  # fmt: skip


def _split_input_call(layer, original):
    def call(inputs, *args, **kwargs):
        kernel = getattr(layer, "_kernel", None)
        kernel = glue.variable_value(kernel) if kernel is not None else None
        if isinstance(inputs, DTensor) and isinstance(kernel, DTensor):
            placements = list(inputs.placements)
            for axis, placement in enumerate(kernel.placements):
                if placement.is_shard(0) and placements[axis].is_replicate():
                    placements[axis] = Shard(inputs.ndim - 1)
            if placements != list(inputs.placements):
                inputs = inputs.redistribute(inputs.device_mesh, placements)
        return original(inputs, *args, **kwargs)

    call.__doc__ = getattr(original, "__doc__", None)
    return call


#: ``depth``: how many steps (or calls by hand) this thread is inside.
_IN_STEP = threading.local()


@contextlib.contextmanager
def dtensor_ops(engine):
    """Inside a step, a plain tensor that Keras makes (a recurrent
    layer's zero state, a metric's constants, an optimizer's scalars)
    is the same on every rank: DTensor treats it as replicated
    (`implicit_replication`) instead of refusing the mix. On CPUs,
    scaled dot-product attention (MultiHeadAttention's) runs torch's
    math kernel: DTensor has no sharding rule for the CPU flash
    kernel's backward (torch 2.13), and the math kernel's ops all have
    one."""
    with contextlib.ExitStack() as stack:
        stack.enter_context(implicit_replication())
        if engine.device.type == "cpu":
            stack.enter_context(sdpa_kernel([SDPBackend.MATH]))
        _IN_STEP.depth = getattr(_IN_STEP, "depth", 0) + 1
        try:
            yield
        finally:
            _IN_STEP.depth -= 1


def base_call(layer):
    """The call of `layer` under the wrappers keras_dist installs around
    everything else (`layer_gather.peel`), or its class's call (bound)."""
    base = layer_gather.peel(layer.__dict__.get("call"))
    return type(layer).call.__get__(layer) if base is None else base


def direct_call(engine, layer, inner, building=(False,)):
    """`inner` (the call of `layer`) that, called by hand with plain
    tensors on a layer whose variables are DTensors, runs as a step
    does: every rank passes the same whole inputs, which go in
    replicated, and the outputs come back whole, as plain tensors (in
    Keras's symbolic shape inference they stay DTensors: only their
    shapes are read, and gathering them would be a collective). Inside
    a step or a call by hand (nested layers), with DTensor inputs, in
    Keras's symbolic build of a model (``building[0]``), or before the
    variables are laid out, the call is `inner` itself."""

    def replicated(x):
        if isinstance(x, torch.Tensor) and not isinstance(x, DTensor):
            return DTensor.from_local(
                x.to(engine.device),
                engine.torch_mesh,
                engine.replicated,
                run_check=False,
            )
        return x

    def call(*args, **kwargs):
        if (
            getattr(_IN_STEP, "depth", 0)
            or building[0]
            or not any(
                isinstance(glue.variable_value(v), DTensor)
                for v in layer.weights
            )
            or any(isinstance(x, DTensor) for x in tree.flatten((args, kwargs)))
        ):
            return inner(*args, **kwargs)
        args, kwargs = tree.map_structure(replicated, (args, kwargs))
        with dtensor_ops(engine):
            outputs = inner(*args, **kwargs)
        if glue.in_symbolic_scope():
            return outputs
        return layouts.to_plain(outputs)

    call.__doc__ = getattr(inner, "__doc__", None)
    call._keras_dist_outer_inner = inner
    return call


class LayoutSteps(ModelSteps):
    """Keras's own steps on DTensor batches and variables."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        # Whether Keras's symbolic build of the model is running.
        self.building = [False]

    def install(self) -> None:
        """Replaces the step factories, metric reads and Dropout calls."""
        model = self.model
        cls = type(model)

        def get_metrics_result():
            # Replicated DTensors: their local values, on every rank.
            return layouts.to_plain(cls.get_metrics_result(model))

        get_metrics_result.__doc__ = cls.get_metrics_result.__doc__
        model.__dict__["get_metrics_result"] = get_metrics_result
        layers = glue.flatten_layers(model)
        for layer in layers:
            if isinstance(
                layer, keras.layers.BatchNormalization
            ) and batch_norm.fusable(layer):
                glue.replace_batch_norm_call(
                    layer,
                    batch_norm.sharded_call(
                        self.engine,
                        layer,
                        glue.original_batch_norm_call(layer),
                    ),
                )
        # Keras's channels-last convolutions and pooling without their
        # layout copies (Keras's results: see `channels_last`).
        channels_last.install(layers)
        install_global_dropout(model, _draw_global_mask(self.engine))
        _install_reduced_lookups(model)
        _install_split_inputs(model)
        engine = self.engine
        if isinstance(engine.plan, plan_lib.ShardedPlan):
            # Each layer's split variables in one all-gather a pass.
            layer_gather.install(
                model, engine.mesh.axis_names.index(engine.batch_axis)
            )
        self._install_direct_calls()
        super().install()

    def _install_direct_calls(self) -> None:
        """A layer of the model called by hand, outside the steps (`model(x)`
        for inference, a sampler's ``model.get_layer("embedding")(ids)``,
        a sublayer of a backbone): see `direct_call`. Keras's symbolic
        build of the model calls it as one device does. Also the plan's
        ``"…/output"`` keys (`_output_layout_call`)."""
        building = self.building

        @contextlib.contextmanager
        def build_scope():
            building[0] = True
            try:
                yield
            finally:
                building[0] = False

        glue.symbolic_build_in(self.model, build_scope)
        plan = self.engine.plan
        outputs = isinstance(plan, plan_lib.LayoutPlan) and plan.output_keys()
        if outputs:
            plan_lib.check_unmatched(
                plan,
                plan_lib.layer_output_paths(self.model, glue.flatten_layers),
                f"model {self.model.name!r}",
            )
        for layer in glue.flatten_layers(self.model, include_self=True):
            # Installed again (a recompile): around what is under it now.
            base = base_call(layer)
            inner = self._output_layout_call(base) if outputs else base
            call = direct_call(self.engine, layer, inner, self.building)
            call._keras_dist_outer_inner = base
            layer.__dict__["call"] = call

    def _output_layout_call(self, inner):
        """`inner` (a layer's call) whose outputs, in a step or a call by
        hand, take the layout of the plan's ``"…/output"`` key that their
        path matches (Keras's path: `glue.current_path` + ``"/output"``),
        as DTensor redistributions (autograd moves the gradient back)."""
        plan, mesh = self.engine.plan, self.engine.mesh

        def relayout(path, layout, x):
            if not isinstance(x, DTensor):
                return x
            if len(layout) != x.ndim:
                raise LayoutError(
                    f"The layout {layout} for layer output {path!r} has "
                    f"{len(layout)} entries, but the output has shape "
                    f"{tuple(x.shape)} ({x.ndim} dimensions). Give one "
                    "entry per dimension (None for a whole one)."
                )
            placements = layouts.placements(mesh, layout)
            if tuple(x.placements) == placements:
                return x
            return x.redistribute(x.device_mesh, placements)

        def call(*args, **kwargs):
            outputs = inner(*args, **kwargs)
            if not getattr(_IN_STEP, "depth", 0) or glue.in_symbolic_scope():
                return outputs
            path = glue.current_path() + plan_lib.OUTPUT_SUFFIX
            layout = plan.output_layout(path)
            if layout is None:
                return outputs
            return tree.map_structure(
                lambda x: relayout(path, layout, x), outputs
            )

        call.__doc__ = getattr(inner, "__doc__", None)
        return call

    def prepare(self) -> None:
        """The model's variables as DTensors."""
        self.engine.lay_out(self.model)

    def train_step(self, data):
        """Keras's `train_step` on a DTensor batch."""
        batch = self.engine.place_batch(data)
        shard_update.install(self.model.optimizer)
        with dtensor_ops(self.engine):
            return layouts.to_plain(self.model.train_step(batch))

    def test_step(self, data):
        """Keras's `test_step` on a DTensor batch."""
        batch = self.engine.place_batch(data)
        with dtensor_ops(self.engine):
            return layouts.to_plain(self.model.test_step(batch))

    def predict_step(self, data):
        """Keras's `predict_step`; the whole batch's outputs on every
        rank."""
        batch = self.engine.place_batch(data)
        with dtensor_ops(self.engine):
            return layouts.to_plain(self.model.predict_step(batch))

"""A layer's sharded variables gathered in one collective
(`ShardedDataParallel` on torch, `sharded.DTensorEngine`).

Under `ShardedDataParallel` each large variable is a DTensor split over
the batch axis, and DTensor's operators gather it where an operator
reads it: one all-gather per variable in the forward pass, and one again
in the backward pass (autograd keeps the split DTensor, and each
backward operator gathers it anew). A small transformer took 12 such
gathers a step (2 gloo processes), where torch's `fully_shard` takes one
per module and pass.

`install` gives each top-level layer of a model (the layers of nested
Keras models, recursively) a call that first gathers, in one all-gather
per dtype over the batch axis, every trainable variable of that layer and
its sublayers that is split over the batch axis, and computes with the
whole values (replicated DTensors): FSDP's unit is the module, here the
layer. Memory stays ZeRO-3's: autograd keeps no whole value for the
backward pass (`torch.autograd.graph.saved_tensors_hooks`: a saved tensor
that is a whole value, or a view of one, is kept as a token), and the
backward pass gathers the layer again, once, at its first use of a whole
value, as FSDP reshards after the forward pass. The layer's gradients
(`Partial` sums over the batch axis) are reduce-scattered into each
rank's share as its backward pass ends, one collective per dtype, so that
no rank keeps whole gradients for the whole model until the update.

An `Embedding` gathers its table where the table is no larger than the
lookup's output (FSDP gathers every table); a larger table keeps its
lookup split by rows (`layout_steps._install_reduced_lookups`), which
all-reduces the output instead. On a small transformer, gathering the
table took the step from 0.97 to 0.85 of its time before this module.
The values are those of DTensor's own gather (the same shards, put
together in the same order), so results do not change. A layer with no
split trainable variable keeps its call.
"""

from __future__ import annotations

import dataclasses

import keras
import torch
from keras import tree
from torch.distributed.tensor import DTensor, Replicate

from keras_dist._src.framework_glue import torch_private
from keras_dist._src.keras_glue import internals as glue

# torch 2.13 renamed `all_gather_into_tensor` (which now warns).
_all_gather = getattr(
    torch.distributed,
    "all_gather_single",
    getattr(torch.distributed, "all_gather_into_tensor", None),
)


def install(model, mesh_dim: int) -> None:
    """Gives each top-level layer of `model` (recursing into nested Keras
    models) the gathering call (idempotent).

    Args:
        model: a Keras model whose variables are (or will be) DTensors.
        mesh_dim: the index of the batch axis in the mesh.
    """
    for layer in _units(model):
        current = peel(layer.__dict__.get("call"))
        inner = getattr(current, "_keras_dist_inner", None)
        if inner is None:
            inner = current or type(layer).call.__get__(layer)
        layer.__dict__["call"] = _gathering_call(layer, inner, mesh_dim)


def peel(call):
    """`call` (a layer's instance call, or None) without the wrappers that
    `sharded` installs around everything else (`_keras_dist_outer_inner`:
    calls by hand, output layouts), so that installing again wraps what
    is under them, once."""
    while hasattr(call, "_keras_dist_outer_inner"):
        call = call._keras_dist_outer_inner
    return call


def _units(model):
    """The layers that gather their variables together: the layers of
    `model`, those of a nested Keras model in its place."""
    for layer in getattr(model, "layers", ()):
        if isinstance(layer, keras.Model):
            yield from _units(layer)
        else:
            yield layer


def _gathers_table(layer, args, kwargs) -> bool:
    """Whether a call of an `Embedding` gathers its table: where the
    table has no more elements than the lookup's output (``input_dim`` at
    most the number of ids), whose split lookup all-reduces that output
    and gathers its gradient; and a reverse call (the table scoring
    vectors, as KerasHub's `ReversibleEmbedding` ties a language model's
    logits), which needs the whole table either way."""
    if kwargs.get("reverse") or args[1:2] == (True,):
        return True
    ids = args[0] if args else kwargs.get("inputs")
    return isinstance(ids, DTensor) and layer.input_dim <= ids.numel()


def _split_variables(layer, mesh_dim):
    """The trainable variables of `layer` (sublayers included, not the
    tables of embeddings inside it) whose value is a DTensor split over
    mesh axis `mesh_dim` alone, evenly."""
    lookups = {
        id(v)
        for sub in glue.flatten_layers(layer)
        if isinstance(sub, keras.layers.Embedding)
        for v in sub.variables
    }
    return [
        v
        for v in layer.trainable_variables
        if id(v) not in lookups and _split(glue.variable_value(v), mesh_dim)
    ]


def _split(value, mesh_dim) -> bool:
    """Whether `value` is a DTensor split over mesh axis `mesh_dim` alone,
    evenly."""
    if not isinstance(value, DTensor):
        return False
    placements = value.placements
    split = placements[mesh_dim]
    return (
        split.is_shard()
        and all(
            p.is_replicate() for i, p in enumerate(placements) if i != mesh_dim
        )
        and value.shape[split.dim] % value.device_mesh.size(mesh_dim) == 0
    )


def _gathering_call(layer, inner, mesh_dim):
    """`inner` (the layer's call) run with the layer's split variables
    gathered; the list of those variables is kept until one of them is no
    longer split."""
    cache = {}

    def call(*args, **kwargs):
        if not any(
            isinstance(x, DTensor) for x in tree.flatten((args, kwargs))
        ):
            # Keras's symbolic build (meta tensors): nothing to gather.
            return inner(*args, **kwargs)
        if isinstance(layer, keras.layers.Embedding) and not _gathers_table(
            layer, args, kwargs
        ):
            return inner(*args, **kwargs)  # a split lookup is cheaper
        variables = cache.get("variables")
        shards = [glue.variable_value(v) for v in variables or ()]
        if variables is None or not all(_split(s, mesh_dim) for s in shards):
            variables = _split_variables(layer, mesh_dim)
            cache["variables"] = variables
            shards = [glue.variable_value(v) for v in variables]
        if not shards:
            return inner(*args, **kwargs)
        group = _Group(shards, mesh_dim, variables)
        wholes = _Gather.apply(group, *shards)
        for variable, whole in zip(variables, wholes):
            glue.set_variable_value(variable, whole)
        try:
            if not torch.is_grad_enabled():
                return inner(*args, **kwargs)
            with torch.autograd.graph.saved_tensors_hooks(
                group.pack, group.unpack
            ):
                return inner(*args, **kwargs)
        finally:
            for variable, shard in zip(variables, shards):
                glue.set_variable_value(variable, shard)

    call.__doc__ = getattr(inner, "__doc__", None)
    call._keras_dist_inner = inner
    return call


@dataclasses.dataclass(frozen=True)
class _Saved:
    """A whole value (or a view of one) that autograd saved, as a token:
    which whole value, and the view's geometry."""

    index: int
    local_size: tuple
    local_stride: tuple
    local_offset: int
    placements: tuple
    shape: tuple
    stride: tuple


class _Group:
    """One call's gather of a layer's split variables: the gathers
    themselves, and the saved-tensor hooks that regather them once for
    the backward pass."""

    def __init__(self, shards, mesh_dim, variables=()):
        self.shards = shards
        self.variables = list(variables)
        self.mesh = shards[0].device_mesh
        self.mesh_dim = mesh_dim
        self.group = self.mesh.get_group(mesh_dim)
        self.replicated = (Replicate(),) * self.mesh.ndim
        self.storages = {}  # storage pointer -> (index, base offset)
        self.pending = 0
        self.regathered = None

    def gather(self):
        """The whole value of every shard (plain tensors): one
        all-gather per dtype over the batch axis."""
        world = self.mesh.size(self.mesh_dim)
        wholes = [None] * len(self.shards)
        by_dtype = {}
        for i, shard in enumerate(self.shards):
            by_dtype.setdefault(shard.dtype, []).append(i)
        with torch.no_grad():
            for indices in by_dtype.values():
                locals_ = [self.shards[i].to_local() for i in indices]
                flat = [t.reshape(-1) for t in locals_]
                # One variable: its own storage, no copy.
                flat = flat[0] if len(flat) == 1 else torch.cat(flat)
                out = flat.new_empty(world * flat.numel())
                _all_gather(out, flat, group=self.group)
                rows = out.view(world, -1)
                offset = 0
                for i, local in zip(indices, locals_):
                    n = local.numel()
                    dim = self.shards[i].placements[self.mesh_dim].dim
                    pieces = rows[:, offset : offset + n].reshape(
                        world, *local.shape
                    )
                    # Rank r's part is the r-th chunk along `dim`.
                    whole = pieces.movedim(0, dim).reshape(self.shards[i].shape)
                    wholes[i] = whole.contiguous()  # a view where it can
                    offset += n
        return wholes

    def wrap(self, wholes):
        """Replicated DTensors of `wholes`; remembers their storages."""
        out = []
        for i, whole in enumerate(wholes):
            key = whole.untyped_storage().data_ptr()
            self.storages[key] = (i, whole.storage_offset())
            out.append(
                DTensor.from_local(
                    whole, self.mesh, self.replicated, run_check=False
                )
            )
        return out

    def pack(self, tensor):
        """Saved-tensor hook: a whole value, or a view of one, becomes a
        token; any other tensor is kept."""
        if not isinstance(tensor, DTensor):
            return tensor
        local = torch_private.dtensor_local_tensor(tensor)
        found = self.storages.get(local.untyped_storage().data_ptr())
        if found is None:
            return tensor
        index, base = found
        self.pending += 1
        return _Saved(
            index,
            tuple(local.size()),
            tuple(local.stride()),
            local.storage_offset() - base,
            tuple(tensor.placements),
            tuple(tensor.shape),
            tuple(tensor.stride()),
        )

    def unpack(self, saved):
        """Saved-tensor hook: a token's view of the whole value, gathered
        again (once for the layer's backward pass)."""
        if not isinstance(saved, _Saved):
            return saved
        if self.regathered is None:
            self.regathered = self.gather()
        whole = self.regathered[saved.index]
        local = whole.as_strided(
            saved.local_size,
            saved.local_stride,
            whole.storage_offset() + saved.local_offset,
        )
        self.pending -= 1
        if self.pending <= 0:
            self.regathered = None
        return DTensor.from_local(
            local,
            self.mesh,
            saved.placements,
            run_check=False,
            shape=torch.Size(saved.shape),
            stride=saved.stride,
        )

    def reduce_grads(self, grads):
        """The layer's whole gradients (`Partial` sums over the batch
        axis) reduce-scattered at once, in one collective per dtype, into
        this rank's shares with their variables' placements (as FSDP
        reduce-scatters each unit's gradients in its backward pass), so
        that no rank keeps a whole gradient past its layer. Any other
        gradient passes as it came (the update reduces it)."""
        if not self.variables or self.mesh.ndim != 1:
            return grads
        from keras_dist._src.backends.torch import shard_update

        grads = list(grads)
        reduced = shard_update._reduce_together(list(grads), self.variables)
        for i, (before, after) in enumerate(zip(grads, reduced)):
            if after is before:
                continue
            target = self.shards[i]
            grads[i] = DTensor.from_local(
                after,
                self.mesh,
                target.placements,
                run_check=False,
                shape=target.shape,
                stride=target.stride(),
            )
        return grads


class _Gather(torch.autograd.Function):
    """Split DTensors in, replicated whole DTensors out; the gradients
    come back reduce-scattered into each rank's share where they are
    `Partial` sums over the batch axis (`_Group.reduce_grads`)."""

    @staticmethod
    def forward(ctx, group, *shards):
        # A variable the call did not use gets no gradient (None, as on
        # one device), not zeros: with zeros, momentum or weight decay
        # would still move it.
        ctx.set_materialize_grads(False)
        ctx.group = group
        return tuple(group.wrap(group.gather()))

    @staticmethod
    def backward(ctx, *grads):
        return (None, *ctx.group.reduce_grads(grads))

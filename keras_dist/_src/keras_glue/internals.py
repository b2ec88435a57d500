"""Every other private Keras name keras_dist reads or replaces, by name.

Keras has no public API for what keras_dist's backends do to a compiled
model (replacing its step functions, its BatchNormalization moments, its
losses' replica scaling...), so they reach into Keras's trainer, layers and
variables. Each such reach is a function here, named for what it does, with
the private Keras name it touches in its docstring: when a Keras release
renames one (`SUPPORTED_KERAS` lists the tested ones), this file and the
other `keras_glue` modules are the ones to change, and
`tests/test_contract.py` checks that no other module names them.

Importing this module imports no backend: the Keras modules of one backend
(`keras.src.backend.<name>`) are imported inside the function that needs
them.
"""

from __future__ import annotations

import keras
from keras.src.losses import loss as _loss_module
from keras.src.trainers import data_adapters as _data_adapters
from keras.src.trainers.data_adapters import (
    array_data_adapter as _array_data_adapter,
)
from keras.src.trainers.data_adapters import data_adapter as _data_adapter


# -- names that moved between Keras releases, found by what exists ------------
def _import_first(*names: str):
    """The first of the modules `names` that imports (Keras moves private
    modules between releases: 3.16 put each backend's `core` under
    `ops/`)."""
    import importlib

    for name in names:
        try:
            return importlib.import_module(name)
        except ModuleNotFoundError:
            continue
    raise ImportError(
        f"None of the Keras modules {', '.join(names)} exists in Keras "
        f"{keras.__version__}: keras_dist does not support this release."
    )


def base_trainer_class():
    """Keras's private backend-neutral trainer base class
    (`keras.src.trainers.trainer`: `BaseTrainer` since Keras 3.16,
    `Trainer` before), whose `compile` and `compute_loss` every model
    inherits."""
    from keras.src.trainers import trainer

    found = getattr(trainer, "BaseTrainer", None)
    return found if found is not None else trainer.Trainer


def backend_trainer_class(backend: str):
    """Keras's private trainer class of `backend`
    (`keras.src.backend.<backend>.trainer`: named `Trainer` since Keras
    3.16, `TensorFlowTrainer`/`JAXTrainer`/`TorchTrainer` before), found as
    the module's own subclass of the base trainer. Imports that backend."""
    import inspect

    module = _import_first(f"keras.src.backend.{backend}.trainer")
    base = base_trainer_class()
    for _, cls in inspect.getmembers(module, inspect.isclass):
        if (
            cls.__module__ == module.__name__
            and issubclass(cls, base)
            and cls is not base
        ):
            return cls
    raise ImportError(
        f"No trainer class in {module.__name__} (Keras {keras.__version__})."
    )


def torch_ops_module(name: str):
    """One of Keras's private torch backend modules of operations (`core`,
    `nn`, `numpy`, ...): `keras.src.backend.torch.ops.<name>` since Keras
    3.16, `keras.src.backend.torch.<name>` before. Imports torch."""
    return _import_first(
        f"keras.src.backend.torch.ops.{name}", f"keras.src.backend.torch.{name}"
    )


def torch_core():
    """Keras's private torch `core` module (`Variable`, `get_device`)."""
    return torch_ops_module("core")


#: Keras's base class of data adapters (`keras.src.trainers.data_adapters`):
#: torch's lockstep adapter subclasses it, and input already wrapped in one
#: is passed through.
DataAdapter = _data_adapter.DataAdapter


# -- the trainer: step functions, losses, metrics -----------------------------
def make_function(model, step, **kwargs):
    """Keras's private `Trainer._make_function`: turns a one-batch `step`
    into the backend's train/test/predict function, as Keras's own (the loop
    over `steps_per_execution` batches; on TF also `tf.function` and
    `strategy.run`)."""
    return model._make_function(step, **kwargs)


def compute_loss(model, **kwargs):
    """Keras's private `Trainer._compute_loss`: calls the model's (maybe
    overridden) `compute_loss` with `training` only where its signature
    takes it."""
    return model._compute_loss(**kwargs)


def loss_tracker(model):
    """Keras's private `Trainer._loss_tracker`: the `Mean` metric behind the
    logged ``loss``, which the replicated steps update themselves."""
    return model._loss_tracker


def compile_loss(model):
    """Keras's private `Trainer._compile_loss` (the `CompileLoss` built by
    `compile`), or None: its per-output loss trackers and its losses."""
    return getattr(model, "_compile_loss", None)


def compiled_loss_entries(model) -> list:
    """The private `CompileLoss._flat_losses` of `model._compile_loss`: one
    entry (with `.loss` and `.name`) per compiled loss, whose reductions
    the exact TF step checks."""
    return getattr(model._compile_loss, "_flat_losses", None) or []


def compile_metrics(model):
    """Keras's private `Trainer._compile_metrics` (the `CompileMetrics` built
    by `compile`), or None: whether compiled metrics are built yet."""
    return getattr(model, "_compile_metrics", None)


def symbolic_build(model, data_batch) -> None:
    """Keras's private `Trainer._symbolic_build`: builds the model, its
    compiled metrics and losses and its optimizer from a batch's shapes."""
    model._symbolic_build(data_batch=data_batch)


def symbolic_build_pending(model) -> bool:
    """Whether Keras's `_symbolic_build` would build anything now (its own
    test: a layer, the compiled metrics or the compiled loss unbuilt)."""
    if not all(layer.built for layer in model._flatten_layers()):
        return True
    return any(
        part is not None and not part.built
        for part in (compile_metrics(model), compile_loss(model))
    )


def symbolic_build_in(model, scope) -> None:
    """Runs Keras's private `_symbolic_build` on the `model` instance inside
    `scope()` (a context manager factory): what it creates (the layers of
    a model built by its first `fit`, the optimizer's variables) is
    created there. Installed again (a recompile), it replaces the previous
    scope instead of nesting in it."""
    original = type(model)._symbolic_build.__get__(model)

    def symbolic_build(*args, **kwargs):
        with scope():
            return original(*args, **kwargs)

    model.__dict__["_symbolic_build"] = symbolic_build


def in_symbolic_scope() -> bool:
    """Keras's private `in_symbolic_scope`: whether Keras is inferring
    shapes (`compute_output_spec`), not computing values."""
    from keras.src.backend.common.symbolic_scope import in_symbolic_scope

    return in_symbolic_scope()


def current_path() -> str:
    """Keras's private `current_path`: the name scopes open now, joined by
    "/" (inside a layer's call: the path that Keras gives its output
    layout, less ``"/output"``)."""
    from keras.src.backend.common.name_scope import current_path

    return current_path()


def name_scope_owner():
    """The object whose Keras name scope is open innermost (the layer
    whose `build` or `add_weight` is making a variable, an optimizer
    making its slots, a metric), or None: Keras's private name scope
    stack (``name_scope.caller``)."""
    from keras.src.backend.common import global_state

    stack = global_state.get_global_attribute("name_scope_stack")
    return stack[-1].caller if stack else None


def remat_fresh_calls(layer) -> None:
    """Gives Keras's private `Operation.rematerialized_call` of `layer` (on
    the instance) a new function object around the call it rematerializes,
    at each call. JAX's `jax.checkpoint` caches its trace by the function
    object: a `call` set on the instance (not a method bound anew at each
    access) would reuse the first trace, whose closed-over variable values
    are tracers of an earlier step (`UnexpectedTracerError`)."""
    original = type(layer).rematerialized_call

    def rematerialized_call(fn, *args, **kwargs):
        def fresh(*inner_args, **inner_kwargs):
            return fn(*inner_args, **inner_kwargs)

        return original(layer, fresh, *args, **kwargs)

    layer.__dict__["rematerialized_call"] = rematerialized_call


def variable_layout(variable):
    """Keras's private `Variable._layout`: the backend layout the variable
    was created with under a distribution (a JAX `NamedSharding`), or
    None."""
    return getattr(variable, "_layout", None)


def set_variable_layout(variable, layout) -> None:
    """Sets Keras's private `Variable._layout` (what Keras places assigned
    values and optimizer slots made from the variable with)."""
    variable._layout = layout


def replace_maybe_symbolic_build(model, function) -> None:
    """Replaces Keras's private `_maybe_symbolic_build` (which the TF trainer
    calls before the first step) on the `model` instance with `function`
    (called with ``iterator=`` or ``data_batch=``)."""
    model.__dict__["_maybe_symbolic_build"] = function


def epoch_iterator_element_spec(iterator):
    """The element spec of the `tf.data.Dataset` behind a Keras TF epoch
    iterator (its adapter's, as passed to `_maybe_symbolic_build`): every
    shape and dtype of the input, without reading any data."""
    return iterator.data_adapter.get_tf_dataset().element_spec


def call_has_training_arg(model) -> bool:
    """Keras's private `Layer._call_has_training_arg`: whether the model's
    `call` takes a `training` argument."""
    return model._call_has_training_arg


def uses_keras_compute_loss(model) -> bool:
    """Whether `model` keeps the `compute_loss` of Keras's private base
    `Trainer` (`keras.src.trainers.trainer`), i.e. does not override it."""
    return type(model).compute_loss is base_trainer_class().compute_loss


def set_initial_epoch(model, epoch) -> None:
    """Sets Keras's private `Trainer._initial_epoch`, which `fit` uses in
    place of its `initial_epoch` argument (how Keras's BackupAndRestore
    resumes)."""
    model._initial_epoch = epoch


def initial_epoch(model):
    """Keras's private `Trainer._initial_epoch`: the epoch a
    BackupAndRestore callback restored in `on_train_begin` (None if
    none), which `fit` starts from in place of its `initial_epoch`."""
    return model._initial_epoch


def tensorflow_trainer():
    """Keras's private `TensorFlowTrainer` (`keras.src.backend.tensorflow`),
    imported here (it imports TensorFlow): its steps tell whether a model
    overrides them, and its `make_predict_function` is the TF predict."""
    return backend_trainer_class("tensorflow")


def tensorflow_predict_helpers():
    """Keras's private TF predict pieces: `concat` (of per-replica or
    per-step outputs: sparse, scalar or dense) and
    `TensorFlowTrainer._autoconvert_optionals` (an empty `tf.Optional` in
    the data read as None), for a predict function built like Keras's."""
    from keras.src.backend.tensorflow import trainer

    return (
        trainer.concat,
        backend_trainer_class("tensorflow")._autoconvert_optionals,
    )


def torch_trainer():
    """Keras's private `TorchTrainer` (`keras.src.backend.torch`), imported
    here (it imports torch): its steps tell whether a model overrides
    them."""
    return backend_trainer_class("torch")


def torch_device_name() -> str:
    """The device Keras's torch backend creates tensors on now (its default,
    or the innermost ``keras.device`` scope's)."""
    return str(torch_core().get_device())


def _keras_torch_trainer_reduces() -> bool:
    """Whether Keras's torch trainer does data parallelism itself when
    `torch.distributed` is initialized (Keras 3.16 and later: the private
    `_initialize_ddp`, and a `get_metrics_result` that all-reduces)."""
    return hasattr(backend_trainer_class("torch"), "_initialize_ddp")


def torch_local_metrics_result(model):
    """The model's metric results from this process's metric variables
    alone: its class's `get_metrics_result`, except that of Keras's torch
    trainer (Keras 3.16 and later), which all-reduces every metric
    variable over the default process group; keras_dist sums the metrics
    of its models itself, so that one would count every sample twice."""
    method = type(model).get_metrics_result
    if _keras_torch_trainer_reduces():
        trainer = backend_trainer_class("torch")
        own = trainer.__dict__.get("get_metrics_result")
        if getattr(method, "__keras_dist_original__", None) is own or (
            method is own
        ):
            method = base_trainer_class().get_metrics_result
    return method(model)


def keep_keras_torch_trainer_local(owned) -> None:
    """Keras 3.16's torch trainer wraps every model in
    `DistributedDataParallel` and all-reduces its metrics whenever
    `torch.distributed` is initialized (its private `_initialize_ddp` and
    `get_metrics_result`). While ``owned()`` holds (keras_dist started the
    process group), a model keras_dist does not train (a reference model
    evaluated on the chief alone) stays a one-process model, as under
    Keras 3.15: no collective that the other processes never join; the
    models in a strategy's scope have keras_dist's own steps. Once per
    process; nothing on a Keras without those methods."""
    if not _keras_torch_trainer_reduces():
        return
    trainer = backend_trainer_class("torch")
    base = base_trainer_class()

    def make_initialize(original):
        def _initialize_ddp(self):
            if not owned():
                original(self)

        return _initialize_ddp

    def make_metrics(original):
        def get_metrics_result(self):
            if owned():
                return base.get_metrics_result(self)
            return original(self)

        get_metrics_result.__doc__ = original.__doc__
        return get_metrics_result

    replace_method_once(trainer, "_initialize_ddp", make_initialize)
    replace_method_once(trainer, "get_metrics_result", make_metrics)


# -- model.losses -------------------------------------------------------------
def own_losses_override(model, default):
    """The value of Keras's private `Layer._losses_override` set on the
    `model` instance itself (what `model.losses` returns when non-empty),
    or `default`."""
    return model.__dict__.get("_losses_override", default)


def set_losses_override(model, losses) -> None:
    """Sets Keras's private `Layer._losses_override`: `model.losses` then
    returns `losses` (when non-empty)."""
    model._losses_override = losses


def clear_losses_override(model) -> None:
    """Removes the `model` instance's own `_losses_override` (Keras's
    private attribute), if set."""
    model.__dict__.pop("_losses_override", None)


def loss_distribution_scaling():
    """Keras's private `scale_loss_for_distribution` and
    `unscale_loss_for_distribution` (`keras.src.losses.loss`): how losses
    divide by the replica count under tf.distribute (and metrics undo it)."""
    return (
        _loss_module.scale_loss_for_distribution,
        _loss_module.unscale_loss_for_distribution,
    )


def set_loss_distribution_scaling(scale, unscale) -> None:
    """Replaces Keras's private `scale_loss_for_distribution` and
    `unscale_loss_for_distribution` (`keras.src.losses.loss`)."""
    _loss_module.scale_loss_for_distribution = scale
    _loss_module.unscale_loss_for_distribution = unscale


def loss_reduction():
    """Keras's private `reduce_weighted_values` (`keras.src.losses.loss`),
    which every `Loss.__call__` ends with: mask and sample weights applied,
    then the reduction (a masked mean divides by the unmasked count)."""
    return _loss_module.reduce_weighted_values


def set_loss_reduction(function) -> None:
    """Replaces Keras's private `reduce_weighted_values` (see
    `loss_reduction`); `Loss.__call__` looks it up on every call."""
    _loss_module.reduce_weighted_values = function


def keras_mask(x):
    """The mask Keras attached to tensor `x` (its private `_keras_mask`,
    read with `keras.src.backend.common.masking.get_keras_mask`), or
    None."""
    from keras.src.backend.common.masking import get_keras_mask

    return get_keras_mask(x)


def set_keras_mask(x, mask) -> None:
    """Attaches `mask` to tensor `x` as Keras does (its private
    `_keras_mask`, set with `keras.src.backend.common.masking`)."""
    from keras.src.backend.common.masking import set_keras_mask as set_mask

    set_mask(x, mask)


def optimizer_trainable_variables(optimizer) -> list:
    """Keras's private `BaseOptimizer._trainable_variables`: the variables
    `optimizer` was built for (what `apply(grads)` without variables
    updates)."""
    return list(optimizer._trainable_variables)


# -- layers -------------------------------------------------------------------
def layer_losses(layer):
    """Keras's private `Layer._losses`: the values `add_loss` (activity
    regularizers included) collected in the layer's last call."""
    return layer._losses


def set_layer_losses(layer, losses) -> None:
    """Replaces Keras's private `Layer._losses` container of `layer`
    (without Keras's attribute tracking)."""
    object.__setattr__(layer, "_losses", losses)


def flatten_layers(model, include_self=False):
    """Keras's private `Layer._flatten_layers`: every layer of `model`,
    nested ones included (the model itself only with `include_self`)."""
    return model._flatten_layers(include_self=include_self)


def order_torch_parameters(model) -> None:
    """Registers the torch parameters of `model` and of each of its layers
    in the order of their Keras `variables`, the same on every process.

    Keras's torch layers register them from a plain dict, which torch's
    `ParameterDict` sorts by key, the variable's path: ``dense_10`` comes
    before ``dense_9``. Where a process has built more layers than another
    (a reference model on rank 0 alone), the same layer has other names
    there, and `DistributedDataParallel` (which takes the parameters in
    that order and all-reduces its buckets position by position) summed
    one rank's kernel with another's bias, silently."""
    import collections

    import keras
    import torch

    # torch's own walk: it also reaches what `_flatten_layers` does not
    # list (a `Sequential`'s inner functional model, whose dict comes first).
    for layer in list(model.modules()):
        if isinstance(layer, keras.layers.Layer) and (
            "_torch_params" in layer._modules
        ):
            layer._torch_params = torch.nn.ParameterDict(
                collections.OrderedDict(
                    (v.path, v.value) for v in layer.variables
                )
            )


def wrap_layer_calls(model, select, wrap) -> None:
    """Gives every layer of `model` for which ``select(layer)`` holds the
    call ``wrap(layer, original)``, `original` being its class's `call`
    (bound): installing twice (a recompile) wraps the class's call once,
    not the previous wrapper."""
    for layer in flatten_layers(model):
        if select(layer):
            layer.__dict__["call"] = wrap(
                layer, type(layer).call.__get__(layer)
            )


def original_batch_norm_moments(layer):
    """Keras's own private `BatchNormalization._moments(inputs, mask)` of
    `layer` (its class's method, bound), whatever the instance holds."""
    return type(layer)._moments.__get__(layer)


def replace_batch_norm_moments(layer, moments) -> None:
    """Replaces Keras's private `BatchNormalization._moments` on the `layer`
    instance with `moments(inputs, mask) -> (mean, variance)`."""
    layer.__dict__["_moments"] = moments


def restore_batch_norm_moments(layer) -> None:
    """Removes a `_moments` set on the `layer` instance (Keras's private
    `BatchNormalization._moments` applies again)."""
    layer.__dict__.pop("_moments", None)


def batch_norm_call_is_keras(layer) -> bool:
    """Whether `layer`'s class runs Keras's own `BatchNormalization.call`
    (not a subclass's override)."""
    return type(layer).call is keras.layers.BatchNormalization.call


def original_batch_norm_call(layer):
    """Keras's own `BatchNormalization.call(inputs, training, mask)` of
    `layer` (its class's method, bound), whatever the instance holds."""
    return type(layer).call.__get__(layer)


def replace_batch_norm_call(layer, call) -> None:
    """Replaces `BatchNormalization.call` on the `layer` instance with
    `call(inputs, training=None, mask=None)`."""
    layer.__dict__["call"] = call


def batch_norm_reduction_axes(layer):
    """Keras's private `BatchNormalization._reduction_axes`: the axes its
    moments reduce over (set when the layer is built)."""
    return layer._reduction_axes


def seed_generator_initial_seed(generator):
    """Keras's private `SeedGenerator._initial_seed`: the seed it was made
    with (None when unseeded), which decides Keras's dropout path."""
    return generator._initial_seed


# -- variables and optimizers -------------------------------------------------
def variable_value(variable):
    """Keras's private `Variable._value` (the backend's own value, e.g. a
    tf.distribute MirroredVariable), or None."""
    return getattr(variable, "_value", None)


def set_variable_value(variable, value) -> None:
    """Sets Keras's private `Variable._value` to a backend value as is (no
    `assign`: no copy, no conversion, the value's own placement kept)."""
    variable._value = value


def keras_torch_optimizer_name(optimizer) -> str | None:
    """The class name of one of Keras's own torch optimizers (its module
    ``keras.src.backend.torch.optimizers``; not a subclass), else None."""
    cls = type(optimizer)
    if cls.__module__.startswith("keras.src.backend.torch.optimizers."):
        return cls.__name__
    return None


def set_variable_shape(variable, shape) -> tuple:
    """Sets Keras's private `Variable._shape` (what `variable.shape` and
    `assign`'s check read); returns the previous shape."""
    previous = variable._shape
    variable._shape = tuple(shape)
    return previous


#: Private `BaseOptimizer` methods (`keras.src.optimizers.base_optimizer`)
#: whose backend-neutral versions update variables without collectives.
_LOCAL_OPTIMIZER_METHODS = (
    "_backend_update_step",
    "_backend_increment_gradient_accumulators",
    "_apply_weight_decay",
    "_overwrite_model_variables_with_average_value",
    "_backend_reset_gradient_accumulators",
)


def replica_local_optimizer_methods(optimizer) -> list:
    """``(name, method)`` pairs that, set on the `optimizer` instance, make
    Keras's TF optimizer update without tf.distribute: the private
    backend-neutral methods of Keras's `BaseOptimizer`, and for a
    `LossScaleOptimizer` its private `_common_apply` as `_tf_apply`."""
    from keras.src.optimizers.base_optimizer import BaseOptimizer

    methods = [
        (name, getattr(BaseOptimizer, name).__get__(optimizer))
        for name in _LOCAL_OPTIMIZER_METHODS
    ]
    if hasattr(type(optimizer), "_common_apply"):  # LossScaleOptimizer
        methods.append(("_tf_apply", optimizer._common_apply))
    return methods


# -- callbacks and fit's arguments --------------------------------------------
def is_default_callback_hook(method) -> bool:
    """Whether a callback hook is Keras's no-op default (marked with the
    private `_is_default` attribute, as Keras's `CallbackList` checks)."""
    return getattr(method, "_is_default", False)


def callback_model(callback):
    """Keras's private `Callback._model`: the model given to `set_model`,
    or None, read without the `model` property (which on JAX first copies
    the training state into the variables)."""
    return callback._model


def is_fit_validation(kwargs):
    """Whether an `evaluate` call's extra `kwargs` are those of `fit`'s
    validation (Keras's private ``_use_cached_eval_dataset`` argument)."""
    return kwargs.get("_use_cached_eval_dataset")


# -- input --------------------------------------------------------------------
def is_tf_dataset(x) -> bool:
    """Keras's private `data_adapters.is_tf_dataset`: whether `x` is a
    `tf.data.Dataset`, without importing TensorFlow."""
    return _data_adapters.is_tf_dataset(x)


def input_request(epoch_iterator):
    """Keras's private `EpochIterator._get_iterator` of `epoch_iterator`:
    returns what Keras iterates each epoch (on TensorFlow, the same
    distributed dataset each time)."""
    return epoch_iterator._get_iterator


def count_input_iterators(epoch_iterator, on_make) -> None:
    """Calls `on_make()` each time `epoch_iterator` (a Keras `EpochIterator`)
    asks for a new iterator of its input (`input_request`: when an epoch
    begins, and on TensorFlow once more when one ends)."""
    original = epoch_iterator._get_iterator

    def _get_iterator():
        on_make()
        return original()

    epoch_iterator.__dict__["_get_iterator"] = _get_iterator


def epoch_iterator_inputs(iterator) -> list:
    """What an epoch iterator's data adapter reads: Keras's private
    `TFDatasetAdapter._dataset` and `TorchDataLoaderAdapter._dataloader`
    (a `tf.data.Dataset`, a torch `DataLoader`), through keras_dist's
    adapters that wrap another as ``inner``."""
    adapter = getattr(iterator, "data_adapter", None)
    found, seen = [], set()
    while adapter is not None and id(adapter) not in seen:
        seen.add(id(adapter))
        for name in ("_dataset", "_dataloader"):
            source = getattr(adapter, name, None)
            if source is not None:
                found.append(source)
        adapter = getattr(adapter, "inner", None)
    return found


def keras_stacks_jax_steps() -> bool:
    """Whether Keras's JAX epoch iterator asks its data adapter for groups
    of `steps_per_execution` batches stacked on a new leading axis (the
    ``super_batch`` argument of the private `DataAdapter.get_jax_iterator`,
    Keras 3.16 and later), rather than for one batch at a time."""
    import inspect

    return (
        "super_batch"
        in inspect.signature(DataAdapter.get_jax_iterator).parameters
    )


def is_partial_step_group(item) -> bool:
    """Whether `item`, read from Keras's JAX epoch iterator, is a list of
    the batches left over at an epoch's end (Keras's private
    `data_adapter_utils.PartialBatchList`), which Keras does not stack."""
    from keras.src.trainers.data_adapters import data_adapter_utils

    partial = getattr(data_adapter_utils, "PartialBatchList", None)
    return partial is not None and isinstance(item, partial)


def stack_steps(iterator, steps: int):
    """Groups `iterator`'s batches as Keras's JAX epoch iterator expects
    them when `keras_stacks_jax_steps()`: `steps` batches stacked on a new
    leading axis, the remainder as a partial group (Keras's private
    `data_adapter_utils.super_batch_iterator`)."""
    import numpy as np
    from keras.src.trainers.data_adapters import data_adapter_utils

    return data_adapter_utils.super_batch_iterator(
        iterator, steps, stack_fn=np.stack
    )


def input_epoch_counters(iterator) -> list:
    """The data adapters behind an epoch iterator (through keras_dist's
    adapters that wrap another as ``inner``) that draw their shuffle from
    a count of epochs of their own (Keras 3.16's private
    `ArrayDataAdapter._epoch`, which `on_epoch_end` increments): a resumed
    `fit` must set the count back to draw the interrupted epoch's order."""
    adapter = getattr(iterator, "data_adapter", None)
    found, seen = [], set()
    while adapter is not None and id(adapter) not in seen:
        seen.add(id(adapter))
        if isinstance(adapter.__dict__.get("_epoch"), int):
            found.append(adapter)
        adapter = getattr(adapter, "inner", None)
    return found


def input_epoch(adapter) -> int:
    """An adapter's private epoch count (see `input_epoch_counters`)."""
    return int(adapter._epoch)


def set_input_epoch(adapter, epoch: int) -> None:
    """Sets an adapter's private epoch count (see `input_epoch_counters`)."""
    adapter._epoch = int(epoch)


def get_data_adapter(**kwargs):
    """Keras's private `data_adapters.get_data_adapter`: the adapter `fit`
    would make for these arguments."""
    return _data_adapters.get_data_adapter(**kwargs)


def can_convert_arrays(arrays) -> bool:
    """Keras's private `array_data_adapter.can_convert_arrays`: whether the
    input is arrays (that `batch_size` batches)."""
    return _array_data_adapter.can_convert_arrays(arrays)


# -- global state -------------------------------------------------------------
def layer_seed_generators(layer) -> list:
    """Keras's private `Layer._seed_generators`: the `SeedGenerator`s
    `layer` tracks (Dropout's, random augmentation's)."""
    return list(getattr(layer, "_seed_generators", None) or [])


def global_seed_generator():
    """Keras's global `SeedGenerator` (private `global_state` attribute
    ``global_seed_generator``), or None if none was made yet."""
    from keras.src.backend.common import global_state

    return global_state.get_global_attribute("global_seed_generator")


def tf_distribute_strategy(model):
    """Keras's private `TensorFlowTrainer._distribute_strategy`: the
    tf.distribute strategy whose scope `model` was created in, or None."""
    return getattr(model, "_distribute_strategy", None)


def replace_jax_distribute_tensor(make):
    """Replaces Keras's private JAX `distribution_lib.distribute_tensor`
    (`keras.src.backend.jax`, through which Keras lays out each variable
    made under a distribution) with `make(original)`.

    Returns:
        A function that puts the original back.
    """
    from keras.src.backend.jax import distribution_lib

    original = distribution_lib.distribute_tensor
    distribution_lib.distribute_tensor = make(original)

    def restore():
        distribution_lib.distribute_tensor = original

    return restore


# -- saving -------------------------------------------------------------------
def cache_saving_attr_skipsets() -> None:
    """Makes Keras's private `saving_lib.get_attr_skipset` compute each
    object type's set once per process, on a thread of its own; idempotent.

    Keras builds the set on every save and load (its cache in
    `global_state` is read under another key than it is written) from
    reference objects, an `Optimizer(1.0)` among them, whose variables a
    strategy scope makes distributed: a collective broadcast under a
    multi-worker strategy, which no other worker joins when only the chief
    saves. On a fresh thread no scope is active, the variables are plain,
    and the sets (attribute names only) are the same.
    """
    import threading

    from keras.src.saving import saving_lib

    original = saving_lib.get_attr_skipset
    if getattr(original, "__keras_dist_original__", None) is not None:
        return
    cache = {}
    lock = threading.Lock()

    def get_attr_skipset(obj_type):
        with lock:
            if obj_type not in cache:
                result = []

                def compute():
                    try:
                        result.append(original(obj_type))
                    except Exception as error:  # noqa: BLE001 - re-raised
                        result.append(error)

                thread = threading.Thread(
                    target=compute, name="keras_dist-saving-skipset"
                )
                thread.start()
                thread.join()
                if isinstance(result[0], Exception):
                    raise result[0]
                cache[obj_type] = result[0]
            return set(cache[obj_type])

    get_attr_skipset.__keras_dist_original__ = original
    saving_lib.get_attr_skipset = get_attr_skipset


def replace_variable_array(make) -> None:
    """Replaces Keras's private `Variable.__array__` (what
    `variable.numpy()` and `model.get_weights()` read through) with
    `make(original)`, once per process: JAX arrays sharded over several
    processes cannot be read by NumPy directly."""
    from keras.src.backend.common.variables import Variable

    replace_method_once(Variable, "__array__", make)


def replace_method_once(cls, name: str, make) -> None:
    """Sets ``cls.<name>`` to ``make(original)`` unless keras_dist already
    replaced it in this process (the replacement remembers the original)."""
    original = getattr(cls, name)
    if getattr(original, "__keras_dist_original__", None) is not None:
        return
    replacement = make(original)
    replacement.__keras_dist_original__ = original
    setattr(cls, name, replacement)

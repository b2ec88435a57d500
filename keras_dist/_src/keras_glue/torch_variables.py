"""Private Keras names the torch DTensor engine reaches, by name.

A Keras torch variable (`keras.src.backend.torch.core.Variable`) holds a
torch Parameter in its private `_value` (read and set with
`internals.variable_value` / `set_variable_value`); the torch DTensor
engine (`backends/torch/sharded.py`) swaps that Parameter for one that
wraps a DTensor. `Variable._initialize` (where a new variable takes its
first value) gives a variable made in a multi-rank scope the chief's
value. Three more private names are involved, each here:
`Variable._direct_assign` (where `assign` copies a value in) and
`Variable.__array__` (what `get_weights()` reads) must accept a DTensor
(and the public `assign_add`/`assign_sub` a whole value for one),
and `TorchLayer._track_variables` rebuilds a layer's `_torch_params`
(what `Module.parameters()` and `zero_grad` see) after the swap.

Kept apart from `internals.py` only so that each file has one owner; the
same rules apply (`tests/test_contract.py`). Torch's Keras modules are
imported inside the functions.
"""

from __future__ import annotations

from keras_dist._src.keras_glue.internals import (
    replace_method_once,
    torch_core,
)


def replace_torch_variable_methods(make_assign, make_array, make_update):
    """Replaces the private `_direct_assign` and `__array__` of Keras's
    torch `Variable` class with ``make_assign(original)`` and
    ``make_array(original)``, and its `assign_add` and `assign_sub` with
    ``make_update(original)``, once per process (each replacement should
    fall back to `original` for a plain tensor)."""
    Variable = torch_core().Variable

    replace_method_once(Variable, "_direct_assign", make_assign)
    replace_method_once(Variable, "__array__", make_array)
    replace_method_once(Variable, "assign_add", make_update)
    replace_method_once(Variable, "assign_sub", make_update)


def replace_torch_variable_initialize(make):
    """Replaces the private `_initialize` of Keras's torch `Variable` class
    (where every new variable takes its first value, from an initializer
    or a given value) with ``make(original)``, once per process."""
    Variable = torch_core().Variable

    replace_method_once(Variable, "_initialize", make)


def retrack_torch_parameters(layers) -> None:
    """Rebuilds each layer's private `_torch_params` (Keras's
    `TorchLayer._track_variables`) from its variables' current values, so
    that `parameters()` and `zero_grad()` see replaced Parameters."""
    for layer in layers:
        if hasattr(layer, "_torch_params"):
            layer._track_variables()

"""Keras variables on parameter servers: atomic counter updates.

Keras's `Variable.assign_add` is ``self.assign(self + value)``: a read,
then a write. Under ParameterServerStrategy several workers update the same
variable on a ps task at once, so two workers read the same value and one
update is lost (measured: 2 workers, 100 steps, `optimizer.iterations` read
78 and the loss tracker counted 1312 of 1600 samples). Here those methods
of each Keras variable whose value lives on a ps task call TensorFlow's own
`tf.Variable.assign_add` / `assign_sub` (one `AssignAddVariableOp`, run on
the ps under the variable's lock): no update is lost.
"""

from __future__ import annotations

from keras_dist._src.keras_glue.internals import variable_value

_MARK = "_keras_dist_atomic_updates"


def make_updates_atomic(variables) -> int:
    """Routes `assign_add`/`assign_sub` of each Keras variable in
    `variables` to TensorFlow's atomic update of its value (instance
    attributes; idempotent).

    Returns:
        How many variables were changed (not counting those done before).
    """
    import tensorflow as tf

    changed = 0
    for variable in variables:
        state = getattr(variable, "__dict__", None)
        if state is None or state.get(_MARK):
            continue
        value = variable_value(variable)
        if value is None or not hasattr(value, "assign_add"):
            continue

        def assign_add(delta, value=value):
            return value.assign_add(tf.cast(delta, value.dtype))

        def assign_sub(delta, value=value):
            return value.assign_sub(tf.cast(delta, value.dtype))

        state["assign_add"] = assign_add
        state["assign_sub"] = assign_sub
        state[_MARK] = True
        changed += 1
    return changed

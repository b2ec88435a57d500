"""Attributes set on one object for the length of a block, then put back.

keras_dist changes a few methods of one model, layer, metric or optimizer
while a step is traced (the class and every other instance are untouched):
each is set in the instance's ``__dict__`` and restored (or removed) on
exit, in reverse order.
"""

from __future__ import annotations

_MISSING = object()


class InstancePatches:
    """A list of instance attributes to set now and restore later."""

    def __init__(self):
        self._patched = []

    def set(self, obj, name: str, value) -> None:
        """Sets ``obj.<name>`` on the instance, remembering what it had."""
        self._patched.append(
            (obj, name, obj.__dict__.get(name, _MISSING), value)
        )
        obj.__dict__[name] = value

    def restore(self) -> None:
        """Puts every attribute back as it was, the last set first.

        Raises:
            RuntimeError: an attribute no longer held what was set (another
                thread, a tf.distribute replica's, patched it meanwhile):
                restoring would leave its patch, or undo it, silently.
        """
        clobbered = []
        for obj, name, old, value in reversed(self._patched):
            if obj.__dict__.get(name, _MISSING) is not value:
                clobbered.append(f"{type(obj).__name__}.{name}")
            if old is _MISSING:
                obj.__dict__.pop(name, None)
            else:
                obj.__dict__[name] = old
        self._patched = []
        if clobbered:
            raise RuntimeError(
                "keras_dist internal error: patched attributes "
                f"{clobbered} were changed while patched (by another "
                "replica's thread?). Please report this with the script."
            )
